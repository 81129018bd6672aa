from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import xconv
from xconv.converters.onnx import io
from xconv.ir import OPSET


def _old_model(opset: int = 11) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Unsqueeze", ["x"], ["u"], axes=[0]),  # attribute form before 13
        helper.make_node("ReduceSum", ["u"], ["y"], axes=[2], keepdims=0),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _run(path_or_bytes, x):
    sess = ort.InferenceSession(path_or_bytes, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_load_upgrades_to_ir_opset_and_keeps_semantics(tmp_path):
    old = _old_model()
    model = xconv.load(old)
    assert model.opset_imports[""] == OPSET
    path = xconv.save(model, tmp_path / "m.onnx")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(_run(str(path), x), _run(old.SerializeToString(), x))
    onnx.checker.check_model(str(path))


def test_load_from_path_bytes_and_ir(tmp_path):
    p = tmp_path / "m.onnx"
    p.write_bytes(_old_model().SerializeToString())
    a = xconv.load(p)
    b = xconv.load(p.read_bytes())
    c = xconv.load(a)
    assert (
        [n.op_type for n in a.graph] == [n.op_type for n in b.graph] == [n.op_type for n in c.graph]
    )


def test_newer_opsets_are_kept_not_downgraded():
    m = _old_model(OPSET + 2)
    m.graph.node[0].ClearField("attribute")
    m.graph.node[0].input.append("axes")
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([0], np.int64), "axes"))
    m.graph.node[1].ClearField("attribute")
    m.graph.node[1].input.append("raxes")
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.array([2], np.int64), "raxes"))
    assert xconv.load(m).opset_imports[""] == OPSET + 2


@pytest.mark.parametrize("content", [b"", b"\x08\x07garbage\xff\xff" * 3, b"not an onnx file"])
def test_corrupt_input_raises_invalid_model(tmp_path, content):
    p = tmp_path / "bad.onnx"
    p.write_bytes(content)
    with pytest.raises(xconv.InvalidModelError):
        xconv.load(p)


def test_truncated_file_raises_invalid_model(tmp_path):
    data = _old_model().SerializeToString()
    p = tmp_path / "cut.onnx"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(xconv.InvalidModelError):
        xconv.load(p)


def test_missing_file_raises_invalid_model(tmp_path):
    with pytest.raises(xconv.InvalidModelError, match="no such model file"):
        xconv.load(tmp_path / "nope.onnx")


def test_save_leaves_nothing_when_the_checker_fails(tmp_path):
    model = xconv.load(_old_model())
    node = next(iter(model.graph))
    node.op_type = "NoSuchOp"  # the checker rejects an unknown default-domain op
    target = tmp_path / "out.onnx"
    with pytest.raises(xconv.InvalidModelError):
        xconv.save(model, target)
    assert list(tmp_path.iterdir()) == []


def test_save_writes_external_data_for_large_models(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 64)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        initializer=[onnx.numpy_helper.from_array(w, "w")],
    )
    model = xconv.load(helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)]))
    monkeypatch.setattr(io, "_PROTO_LIMIT", 1000)  # pretend 16 KB of weights is over 2 GB
    path = xconv.save(model, tmp_path / "big.onnx")
    assert (tmp_path / "big.onnx.data").stat().st_size >= w.nbytes
    assert path.stat().st_size < w.nbytes
    x = rng.normal(size=(1, 64)).astype(np.float32)
    np.testing.assert_allclose(_run(str(path), x), x @ w, rtol=1e-5, atol=1e-5)
    reloaded = xconv.load(path)
    np.testing.assert_array_equal(reloaded.graph.initializers["w"].const_value.numpy(), w)
