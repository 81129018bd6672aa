"""RoiAlign, MaxRoiPool and DeformConv written by both source emitters: hand-built
``onnx.helper`` models through ``xconv.to_flax`` (linen and nnx) and
``xconv.to_torch_source``, the generated code's numbers against ONNX's reference evaluator
(onnxruntime for MaxRoiPool, which the reference lacks); the generated Flax also under
``jax.jit`` where RoiAlign's grid is static, and a named ValueError where it is read from
rois computed at run time."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import xconv  # noqa: E402
from tests.generated_lint import ruff_findings  # noqa: E402
from xconv.pipeline import _load_generated  # noqa: E402

RNG = np.random.default_rng(11)


def rand(*shape: int, lo: float = -2.0, hi: float = 2.0) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(np.float32)


# Three images; rois over all of them, some leaving the map, one under a pixel.
X = rand(3, 4, 10, 12)
ROIS = np.array(
    [[0.5, 1.2, 8.4, 9.1], [2.0, 0.0, 11.5, 7.5], [-3.0, -2.0, 4.0, 3.0],
     [6.2, 5.1, 6.4, 5.3], [1.0, 3.0, 14.0, 12.5]],
    np.float32,
)  # fmt: skip
BATCH = np.array([2, 0, 1, 0, 2], np.int64)
MAX_ROIS = np.array(
    [[2, 1, 0.5, 8, 9], [0, 3, 2, 11, 7.5], [1, -3, -2.5, 5, 4], [0, 6, 5, 6, 5],
     [2, 1, 3, 18, 14]],
    np.float32,
)  # fmt: skip


def _model(op, inputs, attrs, *, consts=None, opset=22) -> onnx.ModelProto:
    """One ``op`` node over run-time ``inputs`` (name -> array; None: omitted) and ``consts``
    (Constant nodes: a float initializer would be a trainable weight)."""
    consts = consts or {}
    names = [k if k in consts or inputs[k] is not None else "" for k in [*inputs, *consts]]
    graph_inputs = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for k, v in inputs.items()
        if v is not None
    ]
    nodes = [
        helper.make_node("Constant", [], [k], value=numpy_helper.from_array(v, k))
        for k, v in consts.items()
    ]
    nodes.append(helper.make_node(op, names, ["y"], **attrs))
    out = [helper.make_value_info("y", onnx.TypeProto())]
    graph = helper.make_graph(nodes, op.lower(), graph_inputs, out)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _expected(proto, feeds, oracle="reference") -> np.ndarray:
    if oracle == "onnxruntime":
        import onnxruntime as ort

        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(None, feeds)[0]
    return ReferenceEvaluator(proto).run(None, feeds)[0]


def _generated(proto, inputs, tmp_path):
    """Each emitter's output (checked against its runtime on ``inputs`` as it is written):
    ``{"linen": (apply, text), "nnx": (call, text), "torch": (forward, text)}``."""
    model = xconv.load(proto)
    out = {}
    linen = xconv.to_flax(model, tmp_path / "linen", example_inputs=inputs)
    module, variables = _load_generated(linen / "model.py").load(linen)
    out["linen"] = (
        lambda *a: module.apply(variables, *a),
        (linen / "model.py").read_text(),
        (module, variables),
    )
    nnx = xconv.to_flax(model, tmp_path / "nnx", api="nnx", example_inputs=inputs)
    out["nnx"] = (_load_generated(nnx / "model.py").load(nnx), (nnx / "model.py").read_text())
    source, state = xconv.to_torch_source(model, example_inputs=inputs)
    (tmp_path / "torch_model.py").write_text(source)
    for path in (linen / "model.py", nnx / "model.py", tmp_path / "torch_model.py"):
        assert not ruff_findings(path), ruff_findings(path)
    ns: dict = {"__name__": "generated_detection_source"}
    exec(compile(source, "<generated>", "exec"), ns)  # noqa: S102
    generated = ns["Model"]().eval()
    generated.load_state_dict(state)

    def forward(*a):
        with torch.no_grad():
            return generated(*(torch.as_tensor(v) for v in a)).numpy()

    out["torch"] = (forward, source)
    return out


def _check(proto, inputs, tmp_path, helper_name, *, jit, oracle="reference", tol=1e-5):
    """Every emitter's code computes the oracle's values; the Flax also jitted when ``jit``.
    Returns the generated texts."""
    want = _expected(proto, dict(zip([i.name for i in proto.graph.input], inputs, strict=True)),
                     oracle)  # fmt: skip
    assert np.any(want != 0)
    out = _generated(proto, inputs, tmp_path)
    for name, (run, text, *_) in out.items():
        assert f"def {helper_name}(" in text and "from xconv" not in text, name
        assert "import xconv" not in text, name
        np.testing.assert_allclose(np.asarray(run(*inputs)), want, rtol=tol, atol=tol)
    if jit:
        module, variables = out["linen"][2]
        got = jax.jit(module.apply)(variables, *inputs)
        np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol)
    return {k: v[1] for k, v in out.items()}


ROI_CASES = {
    "half_adaptive_avg": {"output_height": 3, "output_width": 2},
    "output_half_ratio2_avg": {
        "output_height": 2, "output_width": 4, "sampling_ratio": 2, "spatial_scale": 0.75,
        "coordinate_transformation_mode": "output_half_pixel",
    },
    "half_adaptive_max": {"output_height": 2, "output_width": 3, "mode": "max"},
    "output_half_ratio2_max": {
        "output_height": 3, "output_width": 3, "sampling_ratio": 2, "spatial_scale": 0.5,
        "mode": "max", "coordinate_transformation_mode": "output_half_pixel",
    },
}  # fmt: skip


@pytest.mark.parametrize("name", ROI_CASES)
def test_roi_align_over_runtime_rois(name, tmp_path):
    """Rois computed at run time: a fixed sampling ratio jits; the adaptive grid is read
    eagerly (``_static``) in Flax, as Python ints in torch."""
    attrs = ROI_CASES[name]
    proto = _model("RoiAlign", {"x": X, "rois": ROIS, "batch_indices": BATCH}, attrs)
    fixed = "sampling_ratio" in attrs
    texts = _check(proto, (X, ROIS, BATCH), tmp_path, "_roi_align", jit=fixed)
    assert all(("ratio=2" in t) is fixed and "grid=(" not in t for t in texts.values())
    if not fixed:
        module, variables = _generated(proto, (X, ROIS, BATCH), tmp_path / "again")["linen"][2]
        with pytest.raises(ValueError, match="RoiAlign rois"):
            jax.jit(module.apply)(variables, X, ROIS, BATCH)


@pytest.mark.parametrize("mode", ["avg", "max"])
def test_roi_align_adaptive_over_constant_rois_jits(mode, tmp_path):
    """Constant rois: the adaptive grid is computed when the code is written (``grid=``)."""
    proto = _model(
        "RoiAlign",
        {"x": X},
        {"output_height": 2, "output_width": 2, "mode": mode},
        consts={"rois": ROIS, "batch_indices": BATCH},
    )
    texts = _check(proto, (X,), tmp_path, "_roi_align", jit=True)
    assert all("grid=(" in t for t in texts.values())


@pytest.mark.parametrize(
    "attrs", [{"pooled_shape": [3, 2], "spatial_scale": 0.5}, {"pooled_shape": [2, 4]}],
    ids=["scaled", "unscaled"],
)  # fmt: skip
def test_max_roi_pool(attrs, tmp_path):
    proto = _model("MaxRoiPool", {"x": X, "rois": MAX_ROIS}, attrs, opset=21)
    _check(proto, (X, MAX_ROIS), tmp_path, "_max_roi_pool", jit=True, oracle="onnxruntime")


DEFORM_CASES = {
    "groups_offset_groups_mask_bias_strided_dilated": (
        {"x": rand(2, 4, 9, 8), "w": rand(6, 2, 3, 2), "offset": rand(2, 24, 4, 8, lo=-3, hi=3),
         "b": rand(6), "mask": rand(2, 12, 4, 8, lo=0, hi=1)},
        {"group": 2, "offset_group": 2, "strides": [2, 1], "dilations": [1, 2],
         "pads": [1, 0, 0, 2]},
    ),
    "offset_groups_mask_no_bias": (
        {"x": rand(1, 4, 7, 7), "w": rand(3, 4, 3, 3), "offset": rand(1, 72, 4, 4, lo=-4, hi=4),
         "b": None, "mask": rand(1, 36, 4, 4, lo=0, hi=1)},
        {"offset_group": 4, "dilations": [2, 2], "pads": [2, 2, 2, 2], "strides": [2, 2]},
    ),
    "plain_bias": (
        {"x": rand(2, 3, 5, 6), "w": rand(4, 3, 2, 2), "offset": rand(2, 8, 4, 5, lo=-7, hi=7),
         "b": rand(4)},
        {},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", DEFORM_CASES)
def test_deform_conv(name, tmp_path):
    inputs, attrs = DEFORM_CASES[name]
    proto = _model("DeformConv", inputs, attrs)
    values = tuple(v for v in inputs.values() if v is not None)
    texts = _check(proto, values, tmp_path, "_deform_conv", jit=True, tol=1e-4)
    if attrs.get("group"):
        assert all("offset_groups=2" in t for t in texts.values())
