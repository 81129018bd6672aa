"""JAX handlers for random, signal, string, ai.onnx.ml, training ops and NonMaxSuppression.

Deterministic ops are compared with the ONNX reference evaluator (eagerly and under jit
where the op takes run-time data); random ops are checked for shape, dtype, determinism
under a fixed key and their sample statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import xconv
from xconv.errors import ConversionError

RNG = np.random.default_rng(0)
F = TensorProto.FLOAT


@dataclass
class OpCase:
    """One node: ``data`` are run-time graph inputs, ``consts`` become Constant nodes."""

    name: str
    op: str
    data: list[np.ndarray] = field(default_factory=list)
    consts: list[np.ndarray | None] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)
    n_out: int = 1
    domain: str = ""
    domain_version: int = 1
    jit: bool = True
    rtol: float = 1e-5
    atol: float = 1e-5


def build(case: OpCase) -> onnx.ModelProto:
    nodes, inputs, names = [], [], []
    for i, x in enumerate(case.data):
        elem = helper.np_dtype_to_tensor_dtype(x.dtype) if x.dtype != object else TensorProto.STRING
        inputs.append(helper.make_tensor_value_info(f"x{i}", elem, x.shape))
        names.append(f"x{i}")
    for i, c in enumerate(case.consts):
        if c is None:
            names.append("")
            continue
        nodes.append(
            helper.make_node("Constant", [], [f"c{i}"], value=numpy_helper.from_array(c, f"c{i}"))
        )
        names.append(f"c{i}")
    outs = [f"y{i}" for i in range(case.n_out)]
    nodes.append(helper.make_node(case.op, names, outs, domain=case.domain, **case.attrs))
    graph = helper.make_graph(
        nodes, case.name, inputs, [helper.make_value_info(o, onnx.TypeProto()) for o in outs]
    )
    opsets = [helper.make_opsetid("", 23)]
    if case.domain:
        opsets.append(helper.make_opsetid(case.domain, case.domain_version))
    return helper.make_model(graph, opset_imports=opsets)


def to_device(x):
    return x if x.dtype == object else jnp.asarray(x)


def compare(actual, expected, rtol, atol):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if expected.dtype.kind in "OUS":
        assert actual.tolist() == expected.astype(object).tolist()
    elif expected.dtype.kind in "biu":
        np.testing.assert_array_equal(actual, expected)
    else:
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def f32(*shape, low=-1.0, high=1.0):
    return RNG.uniform(low, high, shape).astype(np.float32)


def i64(*values):
    return np.array(values, dtype=np.int64)


def cases():
    signal = f32(2, 16, 1)
    complex_signal = f32(2, 8, 2)
    yield OpCase("hann", "HannWindow", consts=[np.array(10, np.int32)])
    yield OpCase(
        "hamming_symmetric", "HammingWindow", consts=[np.array(10, np.int64)], attrs={"periodic": 0}
    )
    yield OpCase(
        "blackman_f64",
        "BlackmanWindow",
        consts=[np.array(8, np.int64)],
        attrs={"output_datatype": TensorProto.DOUBLE},
    )
    yield OpCase("dft_real", "DFT", [signal], atol=1e-4)
    yield OpCase("dft_onesided", "DFT", [signal], attrs={"onesided": 1}, atol=1e-4)
    yield OpCase(
        "dft_complex_len", "DFT", [complex_signal], consts=[np.array(6, np.int64)], atol=1e-4
    )
    yield OpCase(
        "dft_axis0",
        "DFT",
        [f32(6, 4, 2)],
        consts=[None, np.array(0, np.int64)],
        attrs={"inverse": 1},
        atol=1e-5,
    )
    yield OpCase(
        "irfft",
        "DFT",
        [f32(2, 5, 2)],
        consts=[np.array(8, np.int64), np.array(1, np.int64)],
        attrs={"inverse": 1, "onesided": 1},
        atol=1e-5,
    )
    yield OpCase(
        "stft_window",
        "STFT",
        [signal],
        consts=[np.array(4, np.int64), np.hanning(8).astype(np.float32), np.array(8, np.int64)],
        atol=1e-4,
    )
    yield OpCase(
        "stft_complex_two_sided",
        "STFT",
        [f32(1, 12, 2)],
        consts=[np.array(3, np.int64), None, np.array(4, np.int64)],
        attrs={"onesided": 0},
        atol=1e-4,
    )
    yield OpCase(
        "mel",
        "MelWeightMatrix",
        consts=[
            np.array(v)
            for v in (
                np.int64(8),
                np.int64(64),
                np.int64(16000),
                np.float32(0.0),
                np.float32(8000.0),
            )
        ],
    )
    boxes = np.array(
        [[[0, 0, 1, 1], [0, 0.1, 1, 1.1], [0, -0.1, 1, 0.9], [0, 10, 1, 11], [0, 10.1, 1, 11.1]]],
        np.float32,
    )
    scores = np.array([[[0.9, 0.75, 0.6, 0.95, 0.5], [0.1, 0.2, 0.3, 0.4, 0.5]]], np.float32)
    yield OpCase(
        "nms",
        "NonMaxSuppression",
        [boxes, scores],
        consts=[i64(2), np.array([0.5], np.float32), np.array([0.15], np.float32)],
        jit=False,
    )
    words = np.array(["Monday", "tuesday", "and", "AND", "Friday"], dtype=object)
    yield OpCase("concat", "StringConcat", [words, np.array(["_x"], dtype=object)], jit=False)
    yield OpCase(
        "normalizer",
        "StringNormalizer",
        [words],
        attrs={"case_change_action": "UPPER", "stopwords": ["and"]},
        jit=False,
    )
    yield OpCase(
        "split",
        "StringSplit",
        [np.array(["a,b,c", "d", ""], dtype=object)],
        attrs={"delimiter": ","},
        n_out=2,
        jit=False,
    )
    yield OpCase(
        "regex",
        "RegexFullMatch",
        [np.array(["www.google.com", "www.x.org", "google"], dtype=object)],
        attrs={"pattern": r"www\.[\w.-]+\.\bcom\b"},
        jit=False,
    )
    ml = {"domain": "ai.onnx.ml"}
    yield OpCase("binarizer", "Binarizer", [f32(3, 4)], attrs={"threshold": 0.2}, **ml)
    yield OpCase(
        "feature_extractor",
        "ArrayFeatureExtractor",
        [f32(3, 5), i64(4, 0, 2)],
        **ml,
    )
    yield OpCase(
        "label_encoder_int_float",
        "LabelEncoder",
        [i64(1, 5, 2, 9)],
        attrs={"keys_int64s": [1, 2, 3], "values_floats": [0.5, 1.5, 2.5], "default_float": 7.0},
        domain_version=4,
        **ml,
    )
    yield OpCase(
        "label_encoder_string_int",
        "LabelEncoder",
        [np.array(["a", "c", "z"], dtype=object)],
        attrs={"keys_strings": ["a", "b", "c"], "values_int64s": [0, 1, 2]},
        domain_version=4,
        jit=False,
        **ml,
    )
    yield OpCase(
        "tree_ensemble",
        "TreeEnsemble",
        [f32(6, 3)],
        attrs={
            "aggregate_function": 1,
            "n_targets": 2,
            "tree_roots": [0, 3],
            "nodes_featureids": [0, 2, 1, 1, 0],
            "nodes_splits": numpy_helper.from_array(
                np.array([0.0, 0.3, -0.2, 0.1, 0.5], np.float32)
            ),
            "nodes_modes": numpy_helper.from_array(np.array([0, 1, 3, 0, 2], np.uint8)),
            "nodes_truenodeids": [1, 0, 2, 4, 3],
            "nodes_trueleafs": [0, 1, 1, 0, 1],
            "nodes_falsenodeids": [2, 1, 3, 5, 4],
            "nodes_falseleafs": [1, 1, 1, 1, 1],
            "leaf_targetids": [0, 1, 0, 1, 0, 1],
            "leaf_weights": numpy_helper.from_array(
                np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], np.float32)
            ),
        },
        domain_version=5,
        **ml,
    )
    yield OpCase(
        "tfidf",
        "TfIdfVectorizer",
        [np.array([[1, 1, 3, 3, 3, 7], [8, 6, 7, 5, 6, 8]], np.int32)],
        attrs={
            "mode": "TFIDF",
            "min_gram_length": 1,
            "max_gram_length": 2,
            "max_skip_count": 2,
            "ngram_counts": [0, 4],
            "ngram_indexes": [0, 1, 2, 3, 4, 5, 6],
            "pool_int64s": [2, 3, 5, 4, 5, 6, 7, 8, 6, 7],
            "weights": [0.5, 1, 1, 2, 1, 1, 3],
        },
    )
    training = {"domain": "ai.onnx.preview.training"}
    r, t = np.array(0.1, np.float32), np.array(3, np.int64)
    yield OpCase(
        "adagrad",
        "Adagrad",
        [r, t, f32(3), f32(3), f32(3, low=0.1)],
        attrs={"decay_factor": 0.1, "epsilon": 1e-6, "norm_coefficient": 0.01},
        n_out=2,
        **training,
    )
    yield OpCase(
        "adam_two_tensors",
        "Adam",
        [r, t, f32(3), f32(2), f32(3), f32(2), f32(3), f32(2), f32(3, low=0.1), f32(2, low=0.1)],
        attrs={"alpha": 0.9, "beta": 0.99, "epsilon": 1e-6, "norm_coefficient_post": 0.01},
        n_out=6,
        **training,
    )
    yield OpCase(
        "nesterov",
        "Momentum",
        [r, t, f32(4), f32(4), f32(4)],
        attrs={"alpha": 0.9, "beta": 0.5, "mode": "nesterov", "norm_coefficient": 0.01},
        n_out=2,
        **training,
    )


@pytest.mark.parametrize("case", list(cases()), ids=lambda c: c.name)
def test_op_matches_reference(case):
    model = build(case)
    feeds = {f"x{i}": x for i, x in enumerate(case.data)}
    expected = ReferenceEvaluator(model).run(None, feeds)
    fn, params = xconv.to_jax(xconv.load(model))
    args = [to_device(x) for x in case.data]
    runs = [fn, jax.jit(fn)] if case.jit and case.data else [fn]
    for run in runs:
        actual = run(params, *args)
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            compare(a, e, case.rtol, case.atol)


def test_dft_grad_under_jit():
    model = build(OpCase("dft", "DFT", [f32(1, 8, 1)]))
    fn, params = xconv.to_jax(xconv.load(model))
    x = jnp.asarray(f32(1, 8, 1))
    # Parseval: sum |X_k|^2 = n * sum x^2, so the gradient is 2 n x.
    g = jax.jit(jax.grad(lambda x: (fn(params, x)[0] ** 2).sum()))(x)
    np.testing.assert_allclose(g, 16 * np.asarray(x), rtol=1e-4, atol=1e-5)


def test_nms_needs_concrete_inputs():
    case = OpCase("nms", "NonMaxSuppression", [f32(1, 3, 4), f32(1, 1, 3)], consts=[i64(2)])
    fn, params = xconv.to_jax(xconv.load(build(case)))
    with pytest.raises(ConversionError, match="trace time"):
        jax.jit(fn)(params, *(jnp.asarray(x) for x in case.data))


# ----------------------------------------------------------------------------------- random


def random_model(op, data=(), **attrs):
    return build(OpCase(op, op, list(data), attrs=attrs))


@pytest.mark.parametrize(
    ("op", "attrs", "mean", "std"),
    [
        ("RandomNormal", {"shape": [200, 100], "mean": 2.0, "scale": 3.0}, 2.0, 3.0),
        ("RandomUniform", {"shape": [200, 100], "low": -1.0, "high": 3.0}, 1.0, 4 / 12**0.5),
    ],
)
def test_random_statistics_and_determinism(op, attrs, mean, std):
    fn, params = xconv.to_jax(xconv.load(random_model(op, **attrs)))
    key = jax.random.key(7)
    (a,) = fn(params, rng=key)
    (b,) = jax.jit(fn)(params, rng=key)
    (c,) = fn(params, rng=jax.random.key(8))
    assert a.shape == (200, 100) and a.dtype == jnp.float32
    # Same key, same numbers, with or without jit (XLA may fuse the scale-and-shift).
    np.testing.assert_array_equal(a, fn(params, rng=key)[0])
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert not np.array_equal(a, c)
    assert abs(float(a.mean()) - mean) < 0.05 * std * 3
    assert abs(float(a.std()) - std) < 0.05 * std
    if op == "RandomUniform":
        assert float(a.min()) >= -1.0 and float(a.max()) < 3.0


def test_random_seed_attribute_and_missing_key():
    fn, params = xconv.to_jax(
        xconv.load(random_model("RandomNormal", shape=[4], seed=3.0, dtype=TensorProto.FLOAT16))
    )
    (a,), (b,) = fn(params), fn(params)
    assert a.dtype == jnp.float16 and a.shape == (4,)
    np.testing.assert_array_equal(a, b)
    fn, params = xconv.to_jax(xconv.load(random_model("RandomUniform", shape=[4])))
    with pytest.raises(ConversionError, match="rng="):
        fn(params)


def test_random_like_bernoulli_multinomial():
    x = np.full((300, 50), 0.3, np.float32)
    fn, params = xconv.to_jax(xconv.load(random_model("Bernoulli", [x])))
    (draws,) = jax.jit(fn)(params, jnp.asarray(x), rng=jax.random.key(0))
    assert draws.shape == x.shape and draws.dtype == jnp.float32
    assert set(np.unique(np.asarray(draws)).tolist()) <= {0.0, 1.0}
    assert abs(float(draws.mean()) - 0.3) < 0.02

    fn, params = xconv.to_jax(
        xconv.load(random_model("RandomNormalLike", [x], dtype=TensorProto.DOUBLE))
    )
    (y,) = fn(params, jnp.asarray(x), rng=jax.random.key(1))
    assert y.shape == x.shape  # float64 requested; float32 when JAX runs without x64
    assert y.dtype in (jnp.float32, jnp.float64)

    probs = np.array([[0.1, 0.2, 0.7], [0.5, 0.5, 0.0]], np.float32)
    logits = np.log(np.maximum(probs, 1e-30)).astype(np.float32)
    fn, params = xconv.to_jax(xconv.load(random_model("Multinomial", [logits], sample_size=4000)))
    (idx,) = fn(params, jnp.asarray(logits), rng=jax.random.key(2))
    assert idx.shape == (2, 4000) and idx.dtype == jnp.int32
    freq = np.stack([np.bincount(np.asarray(r), minlength=3) / 4000 for r in idx])
    np.testing.assert_allclose(freq, probs, atol=0.03)


def test_gradient_op_eager_and_jit():
    training = helper.make_opsetid("ai.onnx.preview.training", 1)
    nodes = [
        helper.make_node("Add", ["a", "b"], ["c"]),
        helper.make_node("Mul", ["c", "a"], ["d"]),
        helper.make_node(
            "Gradient",
            ["a", "b"],
            ["dd_da", "dd_db"],
            domain="ai.onnx.preview.training",
            xs=["a", "b"],
            y="d",
        ),
    ]
    vi = [helper.make_tensor_value_info(n, F, [3]) for n in ("a", "b")]
    outs = [helper.make_tensor_value_info(n, F, [3]) for n in ("d", "dd_da", "dd_db")]
    model = helper.make_model(
        helper.make_graph(nodes, "grad", vi, outs),
        opset_imports=[helper.make_opsetid("", 23), training],
    )
    fn, params = xconv.to_jax(xconv.load(model))
    a, b = f32(3), f32(3)
    for run in (fn, jax.jit(fn)):
        d, da, db = run(params, jnp.asarray(a), jnp.asarray(b))
        np.testing.assert_allclose(d, (a + b) * a, rtol=1e-6)
        np.testing.assert_allclose(da, 2 * a + b, rtol=1e-6)
        np.testing.assert_allclose(db, a, rtol=1e-6)
