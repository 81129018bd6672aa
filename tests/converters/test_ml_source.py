"""The classical ML ops (ai.onnx.ml LabelEncoder, ArrayFeatureExtractor, Binarizer,
TreeEnsemble and TfIdfVectorizer) in both source emitters: hand-built models written as Flax
(linen) and torch source, against both runtimes and ONNX's reference evaluator; the numeric
Flax forms run under ``jax.jit``; the generated code ruff-clean and standalone."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import xconv  # noqa: E402
from tests.generated_lint import ruff_findings  # noqa: E402
from xconv.pipeline import _load_generated  # noqa: E402

ML = "ai.onnx.ml"


def _model(node: onnx.NodeProto, inputs, outputs) -> onnx.ModelProto:
    graph = helper.make_graph([node], "ml", inputs, outputs)
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid(ML, 5)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _value(name: str, dtype: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _same(got, want) -> None:
    """Equal shape and values (floats to float32 rounding); the reference's dtype, or JAX's
    canonical one for a jax array."""
    dtype = jax.dtypes.canonicalize_dtype(want.dtype) if isinstance(got, jax.Array) else None
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.dtype.kind in "OUS":
        assert got.tolist() == want.astype(object).tolist()
        return
    assert got.dtype == (dtype or want.dtype), (got.dtype, want.dtype)
    if want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


def _check(proto: onnx.ModelProto, inputs, tmp_path, *, jit: bool = True, want=None) -> None:
    """Flax (linen) and torch source of ``proto`` run on ``inputs`` give the reference's
    outputs (or ``want``), as both runtimes do; with ``jit`` the Flax model also runs under
    ``jax.jit``."""
    names = [i.name for i in proto.graph.input]
    if want is None:
        want = ReferenceEvaluator(proto).run(None, dict(zip(names, inputs, strict=True)))
    model = xconv.load(proto)
    fn, params = xconv.to_jax(model)
    torch_module, _ = xconv.to_torch(model)
    runtimes = [fn(params, *inputs), torch_module(*inputs)]

    out = xconv.to_flax(model, tmp_path / "flax")
    assert not ruff_findings(out / "model.py")
    module, variables = _load_generated(out / "model.py").load(out)
    source, state = xconv.to_torch_source(model)
    (tmp_path / "torch_model.py").write_text(source)
    assert not ruff_findings(tmp_path / "torch_model.py", 100)
    assert "import xconv" not in source and "from xconv" not in source
    assert "xconv" not in (out / "model.py").read_text().split('"""', 2)[-1]
    ns: dict = {"__name__": "generated_torch_source"}
    exec(compile(source, "<generated>", "exec"), ns)  # noqa: S102
    generated = ns["Model"]().eval()
    generated.load_state_dict(state)
    torch_inputs = [torch.from_numpy(i) if i.dtype != object else i for i in inputs]
    sources = [module.apply(variables, *inputs), generated(*torch_inputs)]
    if jit:
        sources.append(jax.jit(module.apply)(variables, *inputs))

    for got in runtimes + sources:
        got = got if isinstance(got, tuple | list) else (got,)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _same(g.numpy() if isinstance(g, torch.Tensor) else g, w)


# ------------------------------------------------------------------------------ LabelEncoder

LETTERS = np.array(["a", "b", "c", "d", "a"], dtype=object)


@pytest.mark.parametrize(
    ("attrs", "x", "out", "jit"),
    [
        # strings -> int64 through the numpy helper
        (
            {"keys_strings": ["a", "b", "c"], "values_int64s": [0, 1, 2], "default_int64": 42},
            LETTERS,
            TensorProto.INT64,
            False,
        ),
        # int64 -> strings
        (
            {"keys_int64s": [1, 3, 5], "values_strings": ["one", "three", "five"]},
            np.array([1, 2, 3, 5, 5], np.int64),
            TensorProto.STRING,
            False,
        ),
        # floats -> floats: compare and select, jittable (a NaN key is in the table; the
        # reference evaluator matches no NaN input, so none is given)
        (
            {"keys_floats": [0.1, 2.5, float("nan")], "values_floats": [1.0, -2.0, 7.5]},
            np.array([0.1, 2.5, -1.0, 3.0, 0.1], np.float32),
            TensorProto.FLOAT,
            True,
        ),
        # int64 -> int64, jittable
        (
            {"keys_int64s": [4, 8, 9], "values_int64s": [40, 80, 99], "default_int64": -7},
            np.array([[4, 8], [5, 4]], np.int64),
            TensorProto.INT64,
            True,
        ),
    ],
)
def test_label_encoder(tmp_path, attrs, x, out, jit):
    node = helper.make_node("LabelEncoder", ["x"], ["y"], domain=ML, **attrs)
    dtype = TensorProto.STRING if x.dtype == object else helper.np_dtype_to_tensor_dtype(x.dtype)
    proto = _model(node, [_value("x", dtype, list(x.shape))], [_value("y", out, None)])
    _check(proto, [x], tmp_path, jit=jit)


# --------------------------------------------------------------- ArrayFeatureExtractor, Binarizer


@pytest.mark.parametrize(
    "x",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.arange(5, dtype=np.int64),  # a 1-D X gives one row
        np.array([["a", "b", "c"], ["d", "e", "f"]], dtype=object),
    ],
)
def test_array_feature_extractor(tmp_path, x):
    node = helper.make_node("ArrayFeatureExtractor", ["x", "i"], ["y"], domain=ML)
    dtype = TensorProto.STRING if x.dtype == object else helper.np_dtype_to_tensor_dtype(x.dtype)
    inputs = [_value("x", dtype, list(x.shape)), _value("i", TensorProto.INT64, [2])]
    proto = _model(node, inputs, [_value("y", dtype, None)])
    _check(proto, [x, np.array([2, 0], np.int64)], tmp_path, jit=x.dtype != object)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_binarizer(tmp_path, dtype):
    """A float32 threshold off the float32 grid's shortest spelling (1.1): float64 X compares
    with its exact double, as the runtimes do."""
    x = np.array([[1.0, 1.1, 1.2], [np.float32(1.1), -3.0, 1.100000001]], dtype)
    node = helper.make_node("Binarizer", ["x"], ["y"], domain=ML, threshold=1.1)
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    proto = _model(node, [_value("x", t, [2, 3])], [_value("y", t, None)])
    _check(proto, [x], tmp_path)


# ------------------------------------------------------------------------------ TreeEnsemble


def _forest(**overrides) -> onnx.NodeProto:
    """Two sklearn-like trees over 3 features and 2 targets:

    tree 0: x0 <= 0.5 ? (x1 < 2 ? leaf 0 : leaf 1) : leaf 2
    tree 1: x2 in {1, 3} ? leaf 3 : (x0 > -1 ? leaf 4 : leaf 5), NaN x0 going true.
    """
    attrs = {
        "tree_roots": [0, 2],
        "nodes_modes": helper.make_tensor("m", TensorProto.UINT8, [4], [0, 1, 6, 3]),
        "nodes_featureids": [0, 1, 2, 0],
        "nodes_splits": helper.make_tensor("s", TensorProto.FLOAT, [4], [0.5, 2.0, 0.0, -1.0]),
        "nodes_truenodeids": [1, 0, 3, 4],
        "nodes_trueleafs": [0, 1, 1, 1],
        "nodes_falsenodeids": [2, 1, 3, 5],
        "nodes_falseleafs": [1, 1, 0, 1],
        "nodes_missing_value_tracks_true": [0, 0, 0, 1],
        "membership_values": helper.make_tensor(
            "mv", TensorProto.FLOAT, [3], [1.0, 3.0, float("nan")]
        ),
        "leaf_targetids": [0, 1, 1, 0, 1, 0],
        "leaf_weights": helper.make_tensor(
            "w", TensorProto.FLOAT, [6], [1.5, -2.0, 0.25, 3.0, 0.5, -1.25]
        ),
        "n_targets": 2,
    }
    attrs.update(overrides)
    return helper.make_node("TreeEnsemble", ["x"], ["y"], domain=ML, **attrs)


X_TREES = np.array(
    [[0.0, 1.0, 1.0], [0.0, 3.0, 2.0], [1.0, 0.0, 3.0], [-2.0, 5.0, 0.0], [np.nan, 1.0, 4.0]],
    np.float32,
)


def _softmax(y):
    e = np.exp(y - y.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _softmax_zero(y):
    e = np.where(y != 0, np.exp(y - y.max(-1, keepdims=True)), 0.0)
    return e / np.maximum(e.sum(-1, keepdims=True), np.finfo(np.float32).tiny)


@pytest.mark.parametrize(
    ("function", "transform", "post"),
    [
        (1, 0, None),
        (0, 1, _softmax),
        (2, 2, lambda y: 1 / (1 + np.exp(-y))),
        (3, 3, _softmax_zero),
    ],
    ids=["sum", "average-softmax", "min-logistic", "max-softmax_zero"],
)
def test_tree_ensemble(tmp_path, function, transform, post):
    """Every node mode but == / != (<=, <, >=, >, membership), a NaN routed by
    missing_value_tracks_true, each aggregate; the reference evaluator applies no
    post_transform, so its raw output is post-transformed here."""
    inputs = [_value("x", TensorProto.FLOAT, [5, 3])]
    outputs = [_value("y", TensorProto.FLOAT, None)]
    raw = _model(_forest(aggregate_function=function), inputs, outputs)
    (want,) = ReferenceEvaluator(raw).run(None, {"x": X_TREES})
    want = want if post is None else post(want.astype(np.float32)).astype(np.float32)
    proto = _model(_forest(aggregate_function=function, post_transform=transform), inputs, outputs)
    _check(proto, [X_TREES], tmp_path, want=[want])


# --------------------------------------------------------------------------- TfIdfVectorizer

TFIDF = {
    "min_gram_length": 1,
    "max_gram_length": 2,
    "max_skip_count": 1,
    "ngram_counts": [0, 4],
    "ngram_indexes": [0, 1, 2, 3, 4, 5, 6],
    "pool_int64s": [2, 3, 5, 4, 5, 6, 7, 8, 6, 7],
}


@pytest.mark.parametrize(
    "attrs",
    [
        {"mode": "TF"},
        {"mode": "IDF", "weights": [0.5, 1.0, 2.0, 1.5, 3.0, 0.25, 1.0]},
        {"mode": "TFIDF", "weights": [0.5, 1.0, 2.0, 1.5, 3.0, 0.25, 1.0]},
    ],
)
@pytest.mark.parametrize("shape", [(12,), (2, 6)])
def test_tfidf_vectorizer(tmp_path, attrs, shape):
    x = np.array([1, 1, 3, 3, 3, 7, 8, 6, 7, 5, 6, 8], np.int32).reshape(shape)
    node = helper.make_node("TfIdfVectorizer", ["x"], ["y"], **TFIDF, **attrs)
    proto = _model(node, [_value("x", TensorProto.INT32, list(shape))], [_value("y", 1, None)])
    _check(proto, [x], tmp_path)


def test_tfidf_vectorizer_string_pool(tmp_path):
    """A string pool: the words become pool ids through a written vocabulary."""
    words = np.array(["the", "cat", "sat", "on", "the", "cat", "mat"], dtype=object)
    attrs = {**TFIDF, "pool_strings": ["the", "cat", "sat", "mat", "the", "cat", "cat", "sat"]}
    attrs["ngram_counts"], attrs["ngram_indexes"] = [0, 4], [0, 1, 2, 3, 4, 5]
    del attrs["pool_int64s"]
    node = helper.make_node("TfIdfVectorizer", ["x"], ["y"], mode="TF", **attrs)
    proto = _model(node, [_value("x", TensorProto.STRING, [7])], [_value("y", 1, None)])
    _check(proto, [words], tmp_path, jit=False)
