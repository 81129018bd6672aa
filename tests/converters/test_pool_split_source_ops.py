"""Forms the source emitters used to refuse, written with the public writers and run:
MaxPool with its Indices output (both emitters; ONNX's indices are flat over the whole NCHW
input, column-major within a plane with ``storage_order``), a SegNet-like torch module
(MaxPool2d(return_indices=True) into MaxUnpool2d) through ``xconv.from_torch``, Split into
``num_outputs`` of an axis of unknown size (both), Conv with auto_pad SAME_LOWER / SAME_UPPER
(both), and in the torch source ScatterND reduction mul / max / min and ReduceMax / ReduceMin
of an empty input. Each generated module is checked against its runtime as it is written
(``example_inputs``) and its numbers against the ONNX reference here."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import xconv  # noqa: E402
from tests.generated_lint import ruff_findings  # noqa: E402
from xconv.pipeline import _load_generated  # noqa: E402

RNG = np.random.default_rng(5)


def _outputs(out) -> list[np.ndarray]:
    return [np.asarray(o) for o in (out if isinstance(out, tuple | list) else (out,))]


def _model(nodes, inputs, outputs, *, inits=(), opset=18) -> onnx.ModelProto:
    """``nodes`` over graph ``inputs`` (name -> (elem type, shape)) to ``outputs`` (names,
    their types left to inference)."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(k, t, s) for k, (t, s) in inputs.items()],
        [helper.make_value_info(o, onnx.TypeProto()) for o in outputs],
        list(inits),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run_torch_source(source: str, state, inputs) -> list[np.ndarray]:
    ns: dict = {"__name__": "generated_pool_split_source"}
    exec(compile(source, "<generated>", "exec"), ns)  # noqa: S102
    generated = ns["Model"]().eval()
    generated.load_state_dict(state)
    with torch.no_grad():
        return _outputs(generated(*(torch.as_tensor(x) for x in inputs)))


def _generated(model, inputs, tmp_path, emitters=("linen", "nnx", "torch")):
    """Each emitter's code for ``model`` (checked against its runtime on ``inputs`` as it is
    written, ruff-clean, standalone): ``{emitter: (run, text)}``, ``run(*arrays)`` -> the
    outputs as numpy arrays."""
    out = {}
    for api in ("linen", "nnx"):
        if api in emitters:
            path = xconv.to_flax(model, tmp_path / api, api=api, example_inputs=inputs)
            loaded = _load_generated(path / "model.py").load(path)
            if api == "linen":
                module, variables = loaded

                def run(*a, module=module, variables=variables):
                    return _outputs(module.apply(variables, *a))
            else:

                def run(*a, call=loaded):
                    return _outputs(call(*a))

            out[api] = (run, (path / "model.py").read_text())
    if "torch" in emitters:
        source, state = xconv.to_torch_source(model, example_inputs=inputs)
        (tmp_path / "torch_model.py").write_text(source)
        out["torch"] = (lambda *a: _run_torch_source(source, state, a), source)
    for name, (_, text) in out.items():
        path = tmp_path / f"{name}_check.py"
        path.write_text(text)
        assert not ruff_findings(path), (name, ruff_findings(path))
        assert "import xconv" not in text and "from xconv" not in text, name
    return out


def _expected(proto, inputs, oracle="reference") -> list[np.ndarray]:
    feeds = dict(zip([i.name for i in proto.graph.input], inputs, strict=True))
    if oracle == "onnxruntime":
        import onnxruntime as ort

        inferred = onnx.shape_inference.infer_shapes(proto).SerializeToString()
        sess = ort.InferenceSession(inferred, providers=["CPUExecutionProvider"])
        return sess.run(None, feeds)
    return ReferenceEvaluator(proto).run(None, feeds)


def _check(
    proto, inputs, tmp_path, emitters=("linen", "nnx", "torch"), helper_name=None,
    oracle="reference",
):  # fmt: skip
    """Every emitter's code computes the oracle's outputs exactly; returns the generated
    texts."""
    want = _expected(proto, inputs, oracle)
    out = _generated(xconv.load(proto), inputs, tmp_path, emitters)
    for name, (run, text) in out.items():
        got = run(*inputs)
        assert len(got) == len(want), name
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape, name
            np.testing.assert_array_equal(g, w, err_msg=name)
        if helper_name is not None:
            assert f"def {helper_name}(" in text, name
    return {k: v[1] for k, v in out.items()}


# ---------------------------------------------------------------- MaxPool's Indices

MAX_POOL_CASES = {
    "2d_pads": ((2, 3, 6, 5), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
    "2d_strides_column_major": (
        (2, 2, 7, 6), {"kernel_shape": [2, 2], "strides": [2, 2], "storage_order": 1}
    ),
    "2d_overlapping": ((1, 3, 5, 5), {"kernel_shape": [3, 2], "strides": [1, 2]}),
    "1d": ((2, 3, 9), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
    "3d_column_major": (
        (1, 2, 4, 4, 5), {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2], "storage_order": 1}
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", MAX_POOL_CASES)
def test_max_pool_indices_match_the_reference(name, tmp_path):
    """Indices flat over N x C x spatial (row- or column-major within each plane), equal in
    linen, nnx and torch source to onnxruntime's (the reference counts a padded input's
    indices in another frame)."""
    shape, attrs = MAX_POOL_CASES[name]
    proto = _model(
        [helper.make_node("MaxPool", ["x"], ["y", "indices"], **attrs)],
        {"x": (TensorProto.FLOAT, list(shape))},
        ["y", "indices"],
        opset=12,
    )
    x = RNG.permutation(np.arange(np.prod(shape), dtype=np.float32)).reshape(shape)
    texts = _check(
        proto, (x,), tmp_path, helper_name="_max_pool_with_indices", oracle="onnxruntime"
    )
    if attrs.get("storage_order"):
        assert "column_major=True" in texts["torch"]


def test_max_pool_indices_pick_the_first_of_equal_maxima(tmp_path):
    """Ties (a constant input) keep the first position of each window, as the runtimes and
    the reference do."""
    proto = _model(
        [helper.make_node("MaxPool", ["x"], ["y", "indices"], kernel_shape=[2, 2], strides=[1, 1])],
        {"x": (TensorProto.FLOAT, [1, 2, 4, 4])},
        ["y", "indices"],
        opset=12,
    )
    _check(proto, (np.ones((1, 2, 4, 4), np.float32),), tmp_path, oracle="onnxruntime")


def test_segnet_pool_and_unpool_through_from_torch(tmp_path):
    """Conv, MaxPool2d(return_indices=True), MaxUnpool2d, Conv: the exported indices feed the
    unpooling; the generated Flax (linen, nnx) and torch source compute torch's outputs."""
    from torch import nn

    class SegNetBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Conv2d(3, 8, 3, padding=1)
            self.pool = nn.MaxPool2d(2, return_indices=True)
            self.unpool = nn.MaxUnpool2d(2)
            self.dec = nn.Conv2d(8, 4, 3, padding=1)

        def forward(self, x):
            h, indices = self.pool(torch.relu(self.enc(x)))
            return self.dec(self.unpool(h, indices))

    torch.manual_seed(0)
    module = SegNetBlock().eval()
    x = torch.randn(2, 3, 8, 6)
    with torch.no_grad():
        want = module(x).numpy()
    model = xconv.from_torch(module, (x,))
    out = _generated(model, (x.numpy(),), tmp_path)
    for name, (run, _) in out.items():
        np.testing.assert_allclose(run(x.numpy())[0], want, rtol=1e-5, atol=1e-5, err_msg=name)


# ---------------------------------------------------------------- Split of an unknown size


@pytest.mark.parametrize(("n", "size"), [(2, 5), (3, 7), (4, 8)])
def test_split_num_outputs_of_an_unknown_size_axis(n, size, tmp_path):
    """The pieces follow ONNX's rule (ceil(size / n), the last smaller), computed from the
    run's shape: the written code also splits a longer axis as the reference does."""
    outs = [f"y{i}" for i in range(n)]
    proto = _model(
        [helper.make_node("Split", ["x"], outs, axis=1, num_outputs=n)],
        {"x": (TensorProto.FLOAT, [2, "T"])},
        outs,
    )
    x = np.arange(2 * size, dtype=np.float32).reshape(2, size)
    out = _generated(xconv.load(proto), (x,), tmp_path)
    for other in (size, size + 3):
        x = np.arange(2 * other, dtype=np.float32).reshape(2, other)
        want = ReferenceEvaluator(proto).run(None, {"x": x})
        for name, (run, _) in out.items():
            got = run(x)
            assert [g.shape for g in got] == [w.shape for w in want], (name, other)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)
    assert f"torch.chunk(x, {n}, dim=1)" in out["torch"][1]
    assert "x.shape[1]" in out["linen"][1]


# ---------------------------------------------------------------- Conv auto_pad SAME_*


@pytest.mark.parametrize("auto_pad", ["SAME_LOWER", "SAME_UPPER"])
@pytest.mark.parametrize("strides", [[1, 1], [2, 2]])
def test_conv_auto_pad_same(auto_pad, strides, tmp_path):
    """SAME padding resolved over the static input as the runtimes resolve it (an odd
    total pads the low side more with SAME_LOWER, the high side with SAME_UPPER)."""
    w = RNG.standard_normal((4, 3, 3, 2)).astype(np.float32)
    proto = _model(
        [helper.make_node("Conv", ["x", "w"], ["y"], auto_pad=auto_pad, strides=strides)],
        {"x": (TensorProto.FLOAT, [1, 3, 7, 6]), "w": (TensorProto.FLOAT, list(w.shape))},
        ["y"],
        opset=11,
    )
    x = RNG.standard_normal((1, 3, 7, 6)).astype(np.float32)
    feeds = {"x": x, "w": w}
    want = ReferenceEvaluator(proto).run(None, feeds)[0]
    out = _generated(xconv.load(proto), (x, w), tmp_path)
    for name, (run, _) in out.items():
        np.testing.assert_allclose(run(x, w)[0], want, rtol=1e-5, atol=1e-5, err_msg=name)


# ---------------------------------------------------------------- torch source only


@pytest.mark.parametrize("reduction", ["mul", "max", "min"])
def test_scatter_nd_reductions_in_torch_source(reduction, tmp_path):
    """Duplicate index tuples (the updates combined with x's own value), a negative index,
    slices of rank 1."""
    data = RNG.standard_normal((4, 3, 2)).astype(np.float32)
    indices = np.array([[0, 1], [-1, 2], [0, 1], [2, 0]], np.int64)
    updates = RNG.standard_normal((4, 2)).astype(np.float32)
    proto = _model(
        [helper.make_node("ScatterND", ["data", "indices", "updates"], ["y"],
                          reduction=reduction)],
        {"data": (TensorProto.FLOAT, [4, 3, 2]), "indices": (TensorProto.INT64, [4, 2]),
         "updates": (TensorProto.FLOAT, [4, 2])},
        ["y"],
    )  # fmt: skip
    texts = _check(proto, (data, indices, updates), tmp_path, emitters=("torch",))
    assert "_scatter_nd_reduce(" in texts["torch"]


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
@pytest.mark.parametrize(
    ("elem", "dtype"),
    [(TensorProto.FLOAT, np.float32), (TensorProto.INT32, np.int32), (TensorProto.BOOL, np.bool_)],
)
@pytest.mark.parametrize("axes_at_run_time", [True, False])
def test_reduce_extremum_of_an_empty_input_in_torch_source(
    op, elem, dtype, axes_at_run_time, tmp_path
):
    """ONNX's value over an empty set (-inf / inf, the type's lowest / highest, False / True),
    in the reduction's shape; the axes a graph input or a constant."""
    opset = 20 if dtype == np.bool_ else 18  # ReduceMax / ReduceMin take bool from 20
    data = np.zeros((2, 0, 4), dtype)
    axes = np.array([1], np.int64)
    if axes_at_run_time:
        inputs = {"data": (elem, [2, 0, 4]), "axes": (TensorProto.INT64, [1])}
        proto = _model([helper.make_node(op, ["data", "axes"], ["y"], keepdims=1)], inputs,
                       ["y"], opset=opset)  # fmt: skip
        arrays = (data, axes)
    else:
        init = numpy_helper.from_array(axes, "axes")
        proto = _model([helper.make_node(op, ["data", "axes"], ["y"], keepdims=0)],
                       {"data": (elem, [2, 0, 4])}, ["y"], inits=[init], opset=opset)  # fmt: skip
        arrays = (data,)
    texts = _check(proto, arrays, tmp_path, emitters=("torch",))
    assert "torch.full_like(" in texts["torch"]
