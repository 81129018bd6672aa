"""The ai.onnx.ml ops and TfIdfVectorizer (written once in ``xconv.converters.ops.ml``) on
both runtimes, against ONNX's reference evaluator.

Each case is one node built with ``onnx.helper``; the JAX function (eagerly, and under
``jax.jit`` where the op takes numeric data) and the torch module must give the reference's
numbers. The reference ignores TreeEnsemble's ``post_transform``, so those cases apply the
transform, as the ONNX spec defines it, to the reference's raw scores. Where the reference
departs from the spec or fails, onnxruntime is the oracle (``Case.ort`` says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import xconv
from xconv.errors import ConversionError

RNG = np.random.default_rng(0)
ML = "ai.onnx.ml"
RUNTIMES = ["jax", "torch"]


@dataclass
class Case:
    """One node over run-time inputs ``data`` (strings as numpy object arrays)."""

    name: str
    op: str
    data: list[np.ndarray]
    attrs: dict[str, Any] = field(default_factory=dict)
    domain: str = ML
    jit: bool = True
    post_transform: int = 0  # applied to the reference's output (which ignores it)
    atol: float = 1e-6
    ort: str = ""  # why onnxruntime, not the reference evaluator, gives the expected output


def build(case: Case) -> onnx.ModelProto:
    inputs = []
    for i, x in enumerate(case.data):
        elem = TensorProto.STRING if x.dtype == object else helper.np_dtype_to_tensor_dtype(x.dtype)
        inputs.append(helper.make_tensor_value_info(f"x{i}", elem, x.shape))
    attrs = dict(case.attrs)
    if case.post_transform:
        attrs["post_transform"] = case.post_transform
    node = helper.make_node(
        case.op, [f"x{i}" for i in range(len(case.data))], ["y"], domain=case.domain, **attrs
    )
    out = helper.make_value_info("y", onnx.TypeProto())
    graph = helper.make_graph([node], case.name, inputs, [out])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(ML, 5 if "Tree" in case.op else 4)]
    return helper.make_model(graph, opset_imports=opsets)


def reference(case: Case) -> np.ndarray:
    model = build(Case(case.name, case.op, case.data, case.attrs, case.domain))
    feeds = {f"x{i}": x for i, x in enumerate(case.data)}
    if case.ort:
        ort = pytest.importorskip("onnxruntime")
        session = ort.InferenceSession(model.SerializeToString())
        (y,) = session.run(None, feeds)
    else:
        (y,) = ReferenceEvaluator(model).run(None, feeds)
    return transformed(np.asarray(y), case.post_transform)


def transformed(y: np.ndarray, kind: int) -> np.ndarray:
    """TreeEnsemble's post_transform per the ONNX spec, in float64."""
    if kind == 0:
        return y
    y = y.astype(np.float64)
    if kind == 1:
        e = np.exp(y - y.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    if kind == 2:
        return 1 / (1 + np.exp(-y))
    if kind == 3:
        e = np.where(y != 0, np.exp(y - y.max(-1, keepdims=True)), 0)
        return e / np.maximum(e.sum(-1, keepdims=True), np.finfo(np.float32).tiny)
    if kind == 4:
        from scipy.special import erfinv

        return np.sqrt(2) * erfinv(2 * y - 1)
    raise ValueError(kind)


def run(runtime: str, case: Case) -> list[np.ndarray]:
    """The case's output from ``runtime`` (JAX: eagerly, then under jit where numeric)."""
    model = xconv.load(build(case))
    if runtime == "jax":
        import jax
        import jax.numpy as jnp

        fn, params = xconv.to_jax(model)
        args = [x if x.dtype == object else jnp.asarray(x) for x in case.data]
        runs = [fn, jax.jit(fn)] if case.jit else [fn]
        return [np.asarray(r(params, *args)[0]) for r in runs]
    import torch

    from xconv.converters.torch.runtime.dtypes import to_tensor

    module, _ = xconv.to_torch(model)
    with torch.no_grad():
        y = module(*(to_tensor(x) for x in case.data))
    y = y[0] if isinstance(y, tuple | list) else y
    return [y.numpy() if isinstance(y, torch.Tensor) else np.asarray(y)]


def compare(actual: np.ndarray, expected: np.ndarray, atol: float) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if expected.dtype.kind in "OSU":
        assert actual.astype(str).tolist() == expected.astype(str).tolist()
    elif expected.dtype.kind in "iub":
        # JAX without x64 computes int64 as int32; the values must match exactly.
        assert actual.dtype.kind == expected.dtype.kind, (actual.dtype, expected.dtype)
        np.testing.assert_array_equal(actual, expected)
    else:
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=atol)


def strings(*values: str) -> np.ndarray:
    return np.array(values, dtype=object)


def f32(*shape: int) -> np.ndarray:
    return RNG.uniform(-1, 1, shape).astype(np.float32)


# ------------------------------------------------------------------------------------ cases


def label_encoder_cases():
    words = np.array([["a", "zz", "c"], ["b", "", "a"]], dtype=object)
    yield Case(
        "le_string_int_default",
        "LabelEncoder",
        [words],
        {"keys_strings": ["a", "b", "c"], "values_int64s": [7, 8, 9], "default_int64": 42},
        jit=False,
    )
    yield Case(
        "le_string_string",
        "LabelEncoder",
        [strings("x", "y", "w")],
        {"keys_strings": ["x", "y"], "values_strings": ["ex", "why"], "default_string": "?"},
        jit=False,
    )
    yield Case(
        "le_int_string",
        "LabelEncoder",
        [np.array([3, 1, 4, 1, 5], np.int64)],
        {"keys_int64s": [1, 3, 5], "values_strings": ["one", "three", "five"]},
        jit=False,
    )
    yield Case(
        "le_int_float_missing_keys",
        "LabelEncoder",
        [np.array([[0, 2, 9], [-4, 2, 0]], np.int64)],
        {"keys_int64s": [0, 2, -4], "values_floats": [0.5, -1.25, 3.0], "default_float": 9.5},
    )
    yield Case(
        "le_float_int_nan_key",
        "LabelEncoder",
        [np.array([0.5, np.nan, 2.0, -1.0], np.float32)],
        {"keys_floats": [0.5, np.nan, 2.0], "values_int64s": [10, 20, 30]},
        ort="the spec compares keys bitwise, so a NaN key maps NaN; the reference misses it",
    )
    yield Case(
        "le_tensor_int_int_default_tensor",
        "LabelEncoder",
        [np.array([5, 6, 7, 8], np.int64)],
        {
            "keys_tensor": numpy_helper.from_array(np.array([5, 7], np.int64)),
            "values_tensor": numpy_helper.from_array(np.array([50, 70], np.int64)),
            "default_tensor": numpy_helper.from_array(np.array([-9], np.int64)),
        },
    )


def feature_cases():
    yield Case(
        "afe_3d",
        "ArrayFeatureExtractor",
        [f32(2, 3, 5), np.array([4, 0, 4], np.int64)],
    )
    yield Case(
        "afe_1d",
        "ArrayFeatureExtractor",
        [f32(6), np.array([[1, 3]], np.int64)],
    )
    yield Case(
        "afe_strings",
        "ArrayFeatureExtractor",
        [np.array([["a", "b", "c"], ["d", "e", "f"]], dtype=object), np.array([2, 0], np.int64)],
        jit=False,
    )
    yield Case("binarizer_f32", "Binarizer", [f32(3, 4)], {"threshold": 0.25})
    yield Case("binarizer_f64", "Binarizer", [f32(5).astype(np.float64)], {"threshold": -0.1})


def forest(**extra):
    """Three trees over features 0..2, three targets (target 2 only at tree 2's last leaf).

    tree 0: node 0 (f0 <= 0.1) -> node 1 (f1 < -0.2) -> leaves 1 / 2, else leaf 0;
    tree 1: node 2 (f2 in {1, 2, -1}) -> node 3 (f0 >= 0.6) -> leaves 4 / 5, else leaf 3;
    tree 2: node 4 (f0 > 0.3, NaN true) -> node 5 (f1 == 0.5) -> leaves 6 / 7,
            else node 6 (f2 != 0) -> leaves 8 / 9.
    """
    attrs = {
        "n_targets": 3,
        "tree_roots": [0, 2, 4],
        "nodes_featureids": [0, 1, 2, 0, 0, 1, 2],
        "nodes_splits": numpy_helper.from_array(
            np.array([0.1, -0.2, 0.0, 0.6, 0.3, 0.5, 0.0], np.float32)
        ),
        "nodes_modes": numpy_helper.from_array(np.array([0, 1, 6, 2, 3, 4, 5], np.uint8)),
        "membership_values": numpy_helper.from_array(
            np.array([1.0, 2.0, -1.0, np.nan], np.float32)
        ),
        "nodes_missing_value_tracks_true": [0, 0, 0, 0, 1, 0, 0],
        "nodes_truenodeids": [1, 1, 3, 4, 5, 6, 8],
        "nodes_trueleafs": [0, 1, 0, 1, 0, 1, 1],
        "nodes_falsenodeids": [0, 2, 3, 5, 6, 7, 9],
        "nodes_falseleafs": [1, 1, 1, 1, 0, 1, 1],
        "leaf_targetids": [0, 1, 0, 1, 0, 1, 0, 1, 0, 2],
        "leaf_weights": numpy_helper.from_array(
            np.array([1.0, -2.0, 0.5, 3.0, -1.5, 2.5, 0.25, -0.75, 4.0, 1.5], np.float32)
        ),
    }
    return {**attrs, **extra}


def forest_input() -> np.ndarray:
    x = RNG.choice([-1.0, 0.0, 0.5, 1.0, 2.0, -0.5], size=(16, 3)).astype(np.float32)
    x[:4] += f32(4, 3) * 0.1
    x[5, 0] = np.nan  # tree 2's root sends NaN to its true branch
    x[7, 2] = np.nan
    return x


def tree_cases():
    x = forest_input()
    for function, name in enumerate(("average", "sum", "min", "max")):
        yield Case(f"trees_{name}", "TreeEnsemble", [x], forest(aggregate_function=function))
    yield Case(
        "trees_f64_sum", "TreeEnsemble", [x.astype(np.float64)], forest(aggregate_function=1)
    )
    # Tree 1 is one leaf: its root's branches are the same leaf.
    degenerate = {
        "n_targets": 2,
        "tree_roots": [0, 1],
        "nodes_featureids": [0, 0],
        "nodes_splits": numpy_helper.from_array(np.array([0.1, 0.0], np.float32)),
        "nodes_modes": numpy_helper.from_array(np.array([0, 0], np.uint8)),
        "nodes_truenodeids": [0, 2],
        "nodes_trueleafs": [1, 1],
        "nodes_falsenodeids": [1, 2],
        "nodes_falseleafs": [1, 1],
        "leaf_targetids": [0, 1, 1],
        "leaf_weights": numpy_helper.from_array(np.array([1.0, 2.0, 5.0], np.float32)),
    }
    yield Case(
        "tree_degenerate_root",
        "TreeEnsemble",
        [x],
        degenerate,
        ort="the reference takes the root's node index (1) as the leaf's, not the leaf (2)",
    )
    for kind, name in enumerate(("softmax", "logistic", "softmax_zero"), start=1):
        yield Case(
            f"trees_{name}",
            "TreeEnsemble",
            [x],
            forest(aggregate_function=0),
            post_transform=kind,
            atol=1e-6,
        )
    probit = forest(
        aggregate_function=0,
        leaf_weights=numpy_helper.from_array(np.linspace(0.05, 0.95, 10).astype(np.float32)),
    )
    yield Case("trees_probit", "TreeEnsemble", [x], probit, post_transform=4, atol=1e-5)


def tfidf(mode, **extra):
    attrs = {
        "mode": mode,
        "min_gram_length": 1,
        "max_gram_length": 3,
        "max_skip_count": 1,
        "ngram_counts": [0, 4, 8],
        "ngram_indexes": [6, 0, 3, 1, 5, 2, 4],
        "pool_int64s": [2, 3, 5, 4, 5, 6, 7, 8, 6, 7, 2],
    }
    return {**attrs, **extra}


def tfidf_cases():
    rows = np.array([[2, 5, 6, 7, 2, 3, 5, 6, 7, 4], [4, 4, 5, 6, 6, 7, 8, 5, 2, 9]], np.int32)
    weights = [0.5, 2.0, 1.0, 3.0, 0.25, 1.5, 4.0]
    yield Case("tfidf_tf", "TfIdfVectorizer", [rows], tfidf("TF"), domain="")
    yield Case(
        "tfidf_idf",
        "TfIdfVectorizer",
        [rows],
        tfidf("IDF"),
        domain="",
        ort="the reference fails on IDF without weights (len(None))",
    )
    yield Case(
        "tfidf_idf_weights", "TfIdfVectorizer", [rows], tfidf("IDF", weights=weights), domain=""
    )
    yield Case(
        "tfidf_tfidf_weights_1d_int64",
        "TfIdfVectorizer",
        [rows[0].astype(np.int64)],
        tfidf("TFIDF", weights=weights),
        domain="",
    )
    yield Case(
        "tfidf_bigrams_only_skip2",
        "TfIdfVectorizer",
        [rows],
        tfidf("TF", min_gram_length=2, max_gram_length=2, max_skip_count=2),
        domain="",
    )
    words = np.array([["the", "cat", "sat", "on", "the", "mat"]], dtype=object)
    yield Case(
        "tfidf_strings",
        "TfIdfVectorizer",
        [words],
        {
            "mode": "TFIDF",
            "min_gram_length": 1,
            "max_gram_length": 2,
            "max_skip_count": 0,
            "ngram_counts": [0, 3],
            "ngram_indexes": [0, 1, 2, 3, 4],
            "pool_strings": ["the", "cat", "dog", "the", "cat", "on", "the"],
            "weights": [1.0, 2.0, 3.0, 0.5, 4.0],
        },
        domain="",
        jit=False,
    )


CASES = [
    *label_encoder_cases(),
    *feature_cases(),
    *tree_cases(),
    *tfidf_cases(),
]


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_reference(runtime, case):
    pytest.importorskip(runtime)
    expected = reference(case)
    for actual in run(runtime, case):
        compare(actual, expected, case.atol)


# ----------------------------------------------------------------------------------- errors


def run_error(runtime: str, case: Case):
    pytest.importorskip(runtime)
    with pytest.raises(ConversionError) as info:
        run(runtime, case)
    return str(info.value)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_unknown_aggregate_function_is_named(runtime):
    case = Case("bad", "TreeEnsemble", [forest_input()], forest(aggregate_function=7))
    message = run_error(runtime, case)
    assert "aggregate_function must be 0..3 (AVERAGE, SUM, MIN, MAX), got 7" in message
    # The same forest with a valid aggregate gives the reference's numbers.
    good = Case("good", "TreeEnsemble", [forest_input()], forest(aggregate_function=3))
    compare(run(runtime, good)[0], reference(good), 1e-6)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_tfidf_mode_and_pool_are_checked(runtime):
    rows = np.array([[2, 3, 5]], np.int64)
    assert "mode must be TF, IDF or TFIDF" in run_error(
        runtime, Case("bad", "TfIdfVectorizer", [rows], tfidf("BM25"), domain="")
    )
    assert "pool_strings needs a string input" in run_error(
        runtime,
        Case(
            "bad",
            "TfIdfVectorizer",
            [rows],
            {**tfidf("TF"), "pool_int64s": None, "pool_strings": ["a", "b"]},
            domain="",
        ),
    )
    good = Case("good", "TfIdfVectorizer", [rows], tfidf("TF"), domain="")
    compare(run(runtime, good)[0], reference(good), 0.0)
