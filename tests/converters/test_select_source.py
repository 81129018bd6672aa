"""Unique and NonMaxSuppression in both source emitters: hand-built models written as Flax
and torch source (each checked against its runtime), against the ONNX reference; the numpy
text both write equals the runtimes' core on the same inputs; the Flax source under jax.jit
raises the named error (the output shapes depend on the numbers); the generated code
ruff-clean and standalone."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from xconv.converters import expressions_structured as exs

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import xconv  # noqa: E402
from tests.generated_lint import ruff_findings  # noqa: E402
from xconv.pipeline import _load_generated  # noqa: E402


def _outputs(out) -> list[np.ndarray]:
    return [np.asarray(o) for o in (out if isinstance(out, tuple | list) else (out,))]


def _both_sources(proto: onnx.ModelProto, inputs, tmp_path):
    """Flax (linen) and torch source of ``proto``, each checked against its runtime on
    ``inputs``, run on them: (flax outputs, torch outputs, the Flax module and variables)."""
    model = xconv.load(proto)
    out = xconv.to_flax(model, tmp_path / "flax", example_inputs=inputs)
    text = (out / "model.py").read_text()
    assert not ruff_findings(out / "model.py", 100), ruff_findings(out / "model.py", 100)
    module, variables = _load_generated(out / "model.py").load(out)
    flax_out = _outputs(module.apply(variables, *inputs))
    source, state = xconv.to_torch_source(model, example_inputs=inputs)
    (tmp_path / "torch_model.py").write_text(source)
    # the torch source keeps a statement on one line (the Flax source folds long calls)
    found = ruff_findings(tmp_path / "torch_model.py")
    assert not found, found
    for t in (text, source):
        assert "import xconv" not in t and "from xconv" not in t
    ns: dict = {"__name__": "generated_torch_source"}
    exec(compile(source, "<generated>", "exec"), ns)  # noqa: S102
    generated = ns["Model"]().eval()
    generated.load_state_dict(state)
    with torch.no_grad():
        torch_out = _outputs(generated(*(torch.as_tensor(x) for x in inputs)))
    return flax_out, torch_out, (module, variables)


def _unique_model(shape, **attrs) -> onnx.ModelProto:
    outs = ["y", "indices", "inverse", "counts"]
    graph = helper.make_graph(
        [helper.make_node("Unique", ["x"], outs, **attrs)],
        "unique",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
        + [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in outs[1:]],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])


@pytest.mark.parametrize(
    ("shape", "attrs"),
    [((12,), {}), ((12,), {"sorted": 0}), ((4, 3), {"axis": 0, "sorted": 0}),
     ((3, 4, 2), {"axis": -2}), ((4, 3, 2), {"axis": 0, "sorted": 0})],
)  # fmt: skip
def test_unique_matches_the_reference(shape, attrs, tmp_path):
    """Elements and slices, sorted and in order of first occurrence (the reference's unsorted
    slices along another axis than 0 are wrong: ``test_the_numpy_text...`` covers them)."""
    from onnx.reference import ReferenceEvaluator

    proto = _unique_model(shape, **attrs)
    x = np.random.default_rng(0).integers(0, 3, shape).astype(np.float32)
    if len(shape) > 1:  # repeated slices along the axis
        axis = attrs.get("axis", 0) % len(shape)
        x = np.take(x, np.array([2, 0, 2, 1] * 2)[: shape[axis]] % shape[axis], axis=axis)
    want = ReferenceEvaluator(proto).run(None, {"x": x})
    flax_out, torch_out, (module, variables) = _both_sources(proto, (x,), tmp_path)
    for got in (flax_out, torch_out):
        assert len(got) == 4
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    with pytest.raises(ValueError, match="Unique x is computed at run time"):
        jax.jit(module.apply)(variables, x)


def _nms_model(n_boxes: int, n_classes: int, batch: int, **attrs) -> onnx.ModelProto:
    inits = [
        helper.make_tensor("max_out", TensorProto.INT64, [1], [2]),
        helper.make_tensor("iou", TensorProto.FLOAT, [1], [0.4]),
        helper.make_tensor("score_min", TensorProto.FLOAT, [1], [0.2]),
    ]
    graph = helper.make_graph(
        [helper.make_node(
            "NonMaxSuppression", ["boxes", "scores", "max_out", "iou", "score_min"], ["sel"],
            **attrs,
        )],
        "nms",
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [batch, n_boxes, 4]),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, [batch, n_classes, n_boxes])],
        [helper.make_tensor_value_info("sel", TensorProto.INT64, None)],
        inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])


@pytest.mark.parametrize("center_point_box", [0, 1])
def test_non_max_suppression_matches_the_reference(center_point_box, tmp_path):
    """Several batches and classes, overlapping boxes (corners or centres), a score threshold
    and at most two boxes per class."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(3)
    centre = rng.uniform(0, 4, (2, 8, 2))
    size = rng.uniform(1, 3, (2, 8, 2))
    if center_point_box:
        boxes = np.concatenate([centre, size], axis=-1)
    else:  # (y1, x1, y2, x2), some corners given in the other order
        lo, hi = centre - size / 2, centre + size / 2
        boxes = np.concatenate([lo[..., ::-1], hi[..., ::-1]], axis=-1)
        boxes[:, ::3] = boxes[:, ::3][..., [2, 3, 0, 1]]
    boxes = boxes.astype(np.float32)
    scores = rng.uniform(0, 1, (2, 3, 8)).astype(np.float32)
    proto = _nms_model(8, 3, 2, center_point_box=center_point_box)
    (want,) = ReferenceEvaluator(proto).run(None, {"boxes": boxes, "scores": scores})
    assert len(want) > 6 and len(set(want[:, 0])) == 2 and len(set(want[:, 1])) == 3
    flax_out, torch_out, (module, variables) = _both_sources(proto, (boxes, scores), tmp_path)
    np.testing.assert_array_equal(flax_out[0], want)
    np.testing.assert_array_equal(torch_out[0], want)
    with pytest.raises(ValueError, match="NonMaxSuppression boxes is computed at run time"):
        jax.jit(module.apply)(variables, boxes, scores)


def test_the_numpy_text_equals_the_runtimes_core():
    """``_unique`` and ``_non_max_suppression`` as written in the sources give
    ``ops/indexing.unique``'s and ``ops/nms.non_max_suppression``'s arrays."""
    from types import SimpleNamespace

    from xconv.converters.ops import indexing, nms

    ns: dict = {"np": np}
    exec(exs.UNIQUE + exs.NON_MAX_SUPPRESSION, ns)  # noqa: S102
    rng = np.random.default_rng(5)
    x = rng.integers(0, 4, (6, 3)).astype(np.float32)[[0, 1, 0, 2, 1, 5]]
    for axis in (None, 0, -1):
        for ordered in (0, 1):
            ctx = SimpleNamespace(node=SimpleNamespace(outputs=[0] * 4))
            want = indexing.unique(ctx, x, axis, ordered)
            got = ns["_unique"](x, axis, bool(ordered))
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)
                assert g.dtype == w.dtype
    boxes = rng.uniform(0, 4, (2, 10, 4)).astype(np.float32)
    scores = rng.uniform(0, 1, (2, 3, 10)).astype(np.float32)
    for center in (0, 1):
        for args in ((None, None, None), (np.array([3]), np.array([0.3]), np.array([0.5]))):
            want = nms.non_max_suppression(boxes, scores, *args, center)
            got = ns["_non_max_suppression"](boxes, scores, *args, center=bool(center))
            np.testing.assert_array_equal(got, want)
