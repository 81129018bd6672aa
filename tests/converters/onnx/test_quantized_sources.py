"""A model onnxruntime's own dynamic quantization wrote (DynamicQuantizeLinear,
MatMulInteger, the rescale), and its statically quantized twin (QLinearMatMul), through the
generated Flax and torch source, against onnxruntime on the same file."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import xconv
from tests.converters.jax.generated import run_generated
from tests.torch_source import load_generated


def _float_mlp(path):
    rng = np.random.default_rng(0)
    w1 = nh.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w1")
    w2 = nh.from_array(rng.standard_normal((32, 8)).astype(np.float32), "w2")
    nodes = [
        h.make_node("MatMul", ["x", "w1"], ["a"]),
        h.make_node("Relu", ["a"], ["r"]),
        h.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    graph = h.make_graph(
        nodes,
        "mlp",
        [h.make_tensor_value_info("x", T.FLOAT, [4, 16])],
        [h.make_tensor_value_info("y", T.FLOAT, [4, 8])],
        initializer=[w1, w2],
    )
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), path)


def _dynamic(tmp_path):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    _float_mlp(tmp_path / "float.onnx")
    quantize_dynamic(tmp_path / "float.onnx", tmp_path / "q.onnx", weight_type=QuantType.QUInt8)
    return tmp_path / "q.onnx"


def _static(tmp_path):
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(1)
            self.batches = iter([{"x": rng.standard_normal((4, 16)).astype(np.float32)}] * 4)

        def get_next(self):
            return next(self.batches, None)

    _float_mlp(tmp_path / "float.onnx")
    quantize_static(
        tmp_path / "float.onnx",
        tmp_path / "q.onnx",
        Reader(),
        quant_format=QuantFormat.QOperator,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
    )
    return tmp_path / "q.onnx"


@pytest.mark.parametrize(
    ("build", "op"),
    [(_dynamic, "MatMulInteger"), (_static, "QLinearMatMul")],
    ids=["dynamic", "static"],
)
def test_quantized_model_through_generated_sources_matches_onnxruntime(tmp_path, build, op):
    pytest.importorskip("torch")
    path = build(tmp_path)
    assert op in {n.op_type for n in onnx.load(path).graph.node}
    x = np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (want,) = session.run(None, {"x": x})
    model = xconv.load(path)
    got, _ = run_generated(xconv.to_flax(model, tmp_path / "flax"), "linen", x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    import torch

    module, _ = load_generated(model, tmp_path)
    with torch.no_grad():
        got = module(torch.from_numpy(x))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-4)
