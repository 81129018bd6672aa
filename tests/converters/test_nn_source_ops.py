"""FlexAttention, TensorScatter, Col2Im, MaxUnpool and the grouped / output_shape forms of
ConvTranspose in both source emitters: hand-built ONNX models written as Flax (linen) and
torch source, run against the ONNX reference evaluator (against numpy for FlexAttention,
which it lacks), and a torch ``nn.ConvTranspose2d(groups=2, output_padding=1)`` traced by
``xconv.from_torch`` against torch; the generated code ruff-clean."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import xconv  # noqa: E402
from tests.generated_lint import ruff_findings  # noqa: E402
from xconv.pipeline import _load_generated  # noqa: E402


def _run_sources(model, inputs, tmp_path):
    """Both generated sources of ``model`` (each checked against its runtime on ``inputs``)
    run on ``inputs``: ``(flax outputs, torch outputs, texts)``."""
    out = xconv.to_flax(model, tmp_path / "flax", example_inputs=inputs)
    assert not ruff_findings(out / "model.py"), ruff_findings(out / "model.py")
    module, variables = _load_generated(out / "model.py").load(out)
    flax_out = module.apply(variables, *inputs)
    source, state = xconv.to_torch_source(model, example_inputs=inputs)
    (tmp_path / "torch_model.py").write_text(source)
    assert not ruff_findings(tmp_path / "torch_model.py"), ruff_findings(
        tmp_path / "torch_model.py"
    )
    assert "import xconv" not in source and "from xconv" not in source
    ns: dict = {"__name__": "generated_torch_source"}
    exec(compile(source, "<generated>", "exec"), ns)  # noqa: S102
    generated = ns["Model"]().eval()
    generated.load_state_dict(state)
    with torch.no_grad():
        torch_out = generated(*(torch.as_tensor(x) for x in inputs))
    flat = lambda o: [np.asarray(v) for v in (o if isinstance(o, (tuple, list)) else (o,))]  # noqa: E731
    return flat(flax_out), flat(torch_out), (out / "model.py").read_text() + source


def _model(nodes, inputs, outputs, opsets=(("", 24),)):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    ids = [helper.make_opsetid(d, v) for d, v in opsets]
    return ir.from_proto(helper.make_model(graph, opset_imports=ids))


def _t(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


# ---------------------------------------------------------------- FlexAttention


def _flex_reference(q, k, v, cap, weight):
    """FlexAttention with a soft-cap score_mod and a scaling prob_mod, in numpy (float64)."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = (q.astype(np.float64) @ np.swapaxes(k, -1, -2)) / np.sqrt(q.shape[-1])
    s = np.tanh(s / cap) * cap
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True) * weight) @ v


def test_flex_attention_modifiers_as_nested_functions(tmp_path):
    """A GQA FlexAttention whose score_mod (a soft cap) and prob_mod (a scale) subgraphs
    become functions nested in ``__call__`` / ``forward``, passed to ``_flex_attention``."""
    cap = helper.make_tensor("cap", TensorProto.FLOAT, [], [5.0])
    score_mod = helper.make_graph(
        [
            helper.make_node("Constant", [], ["c"], value=cap),
            helper.make_node("Div", ["s", "c"], ["d"]),
            helper.make_node("Tanh", ["d"], ["t"]),
            helper.make_node("Mul", ["t", "c"], ["s_out"]),
        ],
        "score_mod",
        [_t("s", TensorProto.FLOAT, None)],
        [_t("s_out", TensorProto.FLOAT, None)],
    )
    half = helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])
    prob_mod = helper.make_graph(
        [
            helper.make_node("Constant", [], ["h"], value=half),
            helper.make_node("Mul", ["p", "h"], ["p_out"]),
        ],
        "prob_mod",
        [_t("p", TensorProto.FLOAT, None)],
        [_t("p_out", TensorProto.FLOAT, None)],
    )
    node = helper.make_node(
        "FlexAttention", ["Q", "K", "V"], ["Y"], domain="ai.onnx.preview",
        score_mod=score_mod, prob_mod=prob_mod,
    )  # fmt: skip
    model = _model(
        [node],
        [
            _t("Q", TensorProto.FLOAT, [2, 4, 3, 8]),
            _t("K", TensorProto.FLOAT, [2, 2, 5, 8]),
            _t("V", TensorProto.FLOAT, [2, 2, 5, 8]),
        ],  # fmt: skip
        [_t("Y", TensorProto.FLOAT, [2, 4, 3, 8])],
        opsets=(("", 24), ("ai.onnx.preview", 1)),
    )
    rng = np.random.default_rng(0)
    q, k, v = (
        rng.standard_normal(s).astype(np.float32) for s in ((2, 4, 3, 8), *[(2, 2, 5, 8)] * 2)
    )
    flax_out, torch_out, text = _run_sources(model, (q, k, v), tmp_path)
    want = _flex_reference(q, k, v, 5.0, 0.5)
    np.testing.assert_allclose(flax_out[0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(torch_out[0], want, rtol=1e-5, atol=1e-5)
    assert "def score_mod(" in text and "def prob_mod(" in text
    assert "score_mod=score_mod, prob_mod=prob_mod" in text


# ---------------------------------------------------------------- ConvTranspose


def test_grouped_conv_transpose_from_torch_matches_torch(tmp_path):
    """``nn.ConvTranspose2d(groups=2, output_padding=1)`` traced by from_torch: both sources
    give torch's numbers (the Flax one a grouped lax.conv_general_dilated)."""
    torch.manual_seed(0)
    layer = torch.nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
    x = np.random.default_rng(0).standard_normal((2, 4, 5, 5)).astype(np.float32)
    model = xconv.from_torch(layer.eval(), (torch.as_tensor(x),))
    assert "ConvTranspose" in {n.op_type for n in model.graph}
    with torch.no_grad():
        want = layer(torch.as_tensor(x)).numpy()
    flax_out, torch_out, _ = _run_sources(model, (x,), tmp_path)
    assert flax_out[0].shape == want.shape == (2, 6, 10, 10)
    np.testing.assert_allclose(flax_out[0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(torch_out[0], want, rtol=1e-5, atol=1e-5)


def _runtime(model, inputs):
    """The torch runtime's outputs (``xconv.to_torch``): the oracle where the ONNX reference
    evaluator lacks the op or the form."""
    module, _ = xconv.to_torch(model)
    with torch.no_grad():
        got = module(*(torch.as_tensor(x) for x in inputs))
    return [np.asarray(g) for g in (got if isinstance(got, (tuple, list)) else (got,))]


@pytest.mark.parametrize(
    ("attrs", "reference"),
    [
        ({"strides": [3, 2], "output_shape": [10, 8]}, True),
        ({"strides": [2, 2], "auto_pad": "SAME_LOWER"}, True),
        # the reference evaluator fails on these two forms: the torch runtime is the oracle
        ({"strides": [3, 2], "output_shape": [10, 8], "group": 2}, False),
        ({"strides": [3, 2], "output_shape": [7, 5], "pads": [1, 0, 0, 0]}, False),
    ],
    ids=["output_shape", "same_lower", "output_shape_grouped", "output_shape_cropped"],
)
def test_conv_transpose_output_shape_and_same(tmp_path, attrs, reference):
    from onnx.reference import ReferenceEvaluator

    g = attrs.get("group", 1)
    node = helper.make_node("ConvTranspose", ["X", "W", "B"], ["Y"], **attrs)
    model = _model(
        [node],
        [
            _t("X", TensorProto.FLOAT, [1, 2, 3, 3]),
            _t("W", TensorProto.FLOAT, [2, 2, 3, 3]),
            _t("B", TensorProto.FLOAT, [2 * g]),
        ],  # fmt: skip
        [_t("Y", TensorProto.FLOAT, None)],
    )
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 3, 3)).astype(np.float32)
    w = rng.standard_normal((2, 2, 3, 3)).astype(np.float32)
    b = rng.standard_normal(2 * g).astype(np.float32)
    if reference:
        want = ReferenceEvaluator(ir.to_proto(model)).run(None, {"X": x, "W": w, "B": b})[0]
    else:
        want = _runtime(model, (x, w, b))[0]
    if "output_shape" in attrs:
        assert want.shape[2:] == tuple(attrs["output_shape"])
    flax_out, torch_out, _ = _run_sources(model, (x, w, b), tmp_path)
    np.testing.assert_allclose(flax_out[0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(torch_out[0], want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- scatters


def _against_reference(model, feeds, tmp_path):
    from onnx.reference import ReferenceEvaluator

    want = ReferenceEvaluator(ir.to_proto(model)).run(None, feeds)
    flax_out, torch_out, text = _run_sources(model, tuple(feeds.values()), tmp_path)
    for got in (flax_out, torch_out):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    return text


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter_writes_the_cache(tmp_path, mode):
    """A KV-cache write at per-batch positions (the last one running past the end: dropped
    when linear, wrapped when circular)."""
    node = helper.make_node("TensorScatter", ["cache", "update", "at"], ["out"], mode=mode)
    model = _model(
        [node],
        [
            _t("cache", TensorProto.FLOAT, [3, 2, 6, 4]),
            _t("update", TensorProto.FLOAT, [3, 2, 3, 4]),
            _t("at", TensorProto.INT64, [3]),
        ],  # fmt: skip
        [_t("out", TensorProto.FLOAT, [3, 2, 6, 4])],
    )
    rng = np.random.default_rng(2)
    cache = rng.standard_normal((3, 2, 6, 4)).astype(np.float32)
    update = rng.standard_normal((3, 2, 3, 4)).astype(np.float32)
    at = np.array([0, 2, 3] if mode == "linear" else [1, 4, 5], dtype=np.int64)
    text = _against_reference(model, {"cache": cache, "update": update, "at": at}, tmp_path)
    assert "_tensor_scatter(" in text


def test_col2im_with_pads_strides_and_dilations(tmp_path):
    """Col2Im with image_shape and block_shape as run-time inputs, pads, strides, dilations."""
    node = helper.make_node(
        "Col2Im",
        ["x", "image", "block"],
        ["y"],
        pads=[1, 0, 1, 2],
        strides=[2, 1],
        dilations=[1, 2],
    )
    image, block = np.array([5, 6], np.int64), np.array([2, 3], np.int64)
    counts = [(5 + 2 - 2) // 2 + 1, (6 + 2 - 5) // 1 + 1]
    model = _model(
        [node],
        [
            _t("x", TensorProto.FLOAT, [2, 3 * 6, counts[0] * counts[1]]),
            _t("image", TensorProto.INT64, [2]),
            _t("block", TensorProto.INT64, [2]),
        ],  # fmt: skip
        [_t("y", TensorProto.FLOAT, None)],
    )
    x = np.random.default_rng(3).standard_normal((2, 18, counts[0] * counts[1])).astype(np.float32)
    text = _against_reference(model, {"x": x, "image": image, "block": block}, tmp_path)
    assert "_col2im_index(" in text


@pytest.mark.parametrize("output_shape", [None, (1, 2, 6, 4)])
def test_max_unpool_of_max_pool_indices(tmp_path, output_shape):
    """MaxPool's values and Indices (from the ONNX reference) fed to MaxUnpool, with and
    without an output_shape input."""
    from onnx.reference import ReferenceEvaluator

    pool = helper.make_node("MaxPool", ["x"], ["v", "i"], kernel_shape=[2, 2], strides=[2, 2])
    pooled = _model(
        [pool],
        [_t("x", TensorProto.FLOAT, [1, 2, 6, 4])],
        [_t("v", TensorProto.FLOAT, None), _t("i", TensorProto.INT64, None)],
    )
    x = np.random.default_rng(4).standard_normal((1, 2, 6, 4)).astype(np.float32)
    v, i = ReferenceEvaluator(ir.to_proto(pooled)).run(None, {"x": x})
    ins = ["v", "i"] + (["shape"] if output_shape else [])
    unpool = helper.make_node("MaxUnpool", ins, ["y"], kernel_shape=[2, 2], strides=[2, 2])
    inputs = [_t("v", TensorProto.FLOAT, [1, 2, 3, 2]), _t("i", TensorProto.INT64, [1, 2, 3, 2])]
    feeds = {"v": v, "i": i}
    if output_shape:
        inputs.append(_t("shape", TensorProto.INT64, [4]))
        feeds["shape"] = np.array(output_shape, np.int64)
    model = _model([unpool], inputs, [_t("y", TensorProto.FLOAT, None)])
    text = _against_reference(model, feeds, tmp_path)
    assert "_max_unpool(" in text
