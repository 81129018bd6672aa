"""JAX handlers for the linalg family (MatMul, Gemm, Einsum, Det, CumSum/CumProd, TopK, the
softmax family, NLL / softmax cross-entropy losses): parity with the ONNX reference
evaluator (onnxruntime where noted), plus jit and grad checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx_ir as ir
import pytest

import xconv
from tests.converters.jax.linalg_cases import (
    OpCase,
    assert_close,
    build_model,
    expected_outputs,
    feeds,
    rand,
    run_both,
)

I64 = np.int64
A34, B45 = rand(3, 4), rand(4, 5)
X234 = rand(2, 3, 4)
TIES = np.array([[3, 1, 3, 2, 1, 3], [0, 0, 5, 5, 1, 1]], np.float32)
LOGITS = rand(4, 5, 3)
TARGET = np.array([[0, 4, 2], [1, 1, 3], [2, 0, 4], [3, 2, 1]], I64)
WEIGHT = np.abs(rand(5)) + 0.1

CASES = [
    OpCase("matmul_2d", "MatMul", [A34, B45]),
    OpCase("matmul_bcast", "MatMul", [rand(2, 1, 3, 4), rand(5, 4, 2)]),
    OpCase("matmul_1d_3d", "MatMul", [rand(4), rand(2, 4, 3)]),
    OpCase(
        "matmul_int32",
        "MatMul",
        [np.arange(12, dtype=np.int32).reshape(3, 4), np.arange(8, dtype=np.int32).reshape(4, 2)],
    ),
    OpCase("gemm_default", "Gemm", [A34, B45]),
    OpCase(
        "gemm_all_attrs",
        "Gemm",
        [rand(4, 3), rand(5, 4), rand(1, 5)],
        {"transA": 1, "transB": 1, "alpha": 0.25, "beta": 0.35},
    ),
    OpCase("gemm_scalar_c", "Gemm", [A34, B45, np.array(3.0, np.float32)], {"beta": 2.0}),
    OpCase(
        "gemm_int32_fractional",
        "Gemm",
        [
            np.arange(12, dtype=np.int32).reshape(3, 4),
            np.arange(8, dtype=np.int32).reshape(4, 2),
            np.array([1, -3], np.int32),
        ],
        {"alpha": 0.5, "beta": 1.5},
    ),
    OpCase(
        "einsum_batch_matmul",
        "Einsum",
        [rand(2, 3, 4), rand(2, 4, 5)],
        {"equation": "bij, bjk -> bik"},
    ),
    OpCase("einsum_ellipsis_diag", "Einsum", [rand(2, 3, 3)], {"equation": "...ii->...i"}),
    OpCase("einsum_implicit_sum", "Einsum", [rand(3, 4)], {"equation": "ij"}),
    OpCase("det_batched", "Det", [rand(2, 3, 3, 3)], rtol=1e-4, atol=1e-5),
    OpCase("cumsum_axis1", "CumSum", [X234], consts={1: np.array(1, I64)}),
    OpCase(
        "cumsum_exclusive_reverse",
        "CumSum",
        [X234],
        {"exclusive": 1, "reverse": 1},
        consts={1: np.array(-1, np.int32)},
    ),
    OpCase(
        "cumsum_int32",
        "CumSum",
        [np.arange(6, dtype=np.int32).reshape(2, 3)],
        {"exclusive": 1},
        consts={1: np.array(0, I64)},
    ),
    OpCase(
        "cumprod_reverse", "CumProd", [X234], {"reverse": 1}, consts={1: np.array(2, I64)}, opset=26
    ),
    OpCase(
        "cumprod_exclusive",
        "CumProd",
        [X234],
        {"exclusive": 1},
        consts={1: np.array(0, I64)},
        opset=26,
    ),
    OpCase("topk_largest_ties", "TopK", [TIES], consts={1: np.array([4], I64)}, n_out=2),
    OpCase(
        "topk_smallest_ties",
        "TopK",
        [TIES],
        {"largest": 0},
        consts={1: np.array([3], I64)},
        n_out=2,
    ),
    OpCase(
        "topk_axis0_int32",
        "TopK",
        [np.array([[5, -7], [5, 2], [-7, 9]], np.int32)],
        {"axis": 0, "largest": 0},
        consts={1: np.array([2], I64)},
        n_out=2,
    ),
    OpCase("softmax_axis1", "Softmax", [X234], {"axis": 1}),
    OpCase("softmax_default", "Softmax", [X234 * 100]),
    OpCase(
        "softmax_opset11_coerce", "Softmax", [X234], {"axis": 1}, opset=11, oracle="onnxruntime"
    ),
    OpCase("log_softmax_axis0", "LogSoftmax", [X234], {"axis": 0}),
    OpCase("log_softmax_opset11", "LogSoftmax", [X234], opset=11, oracle="onnxruntime"),
    OpCase("hardmax_ties", "Hardmax", [TIES], {"axis": 1}),
    OpCase("hardmax_opset11", "Hardmax", [X234], {"axis": 1}, opset=11, oracle="onnxruntime"),
    OpCase("nll_mean", "NegativeLogLikelihoodLoss", [LOGITS, TARGET]),
    OpCase(
        "nll_weight_ii", "NegativeLogLikelihoodLoss", [LOGITS, TARGET, WEIGHT], {"ignore_index": 2}
    ),
    OpCase(
        "nll_none_ii",
        "NegativeLogLikelihoodLoss",
        [LOGITS, TARGET],
        {"reduction": "none", "ignore_index": 4},
    ),
    OpCase(
        "sce_sum_log_prob",
        "SoftmaxCrossEntropyLoss",
        [LOGITS, TARGET],
        {"reduction": "sum"},
        n_out=2,
    ),
    OpCase(
        "sce_mean_weight_ii",
        "SoftmaxCrossEntropyLoss",
        [LOGITS, TARGET, WEIGHT],
        {"ignore_index": 1},
    ),
    OpCase(
        "sce_2d_none",
        "SoftmaxCrossEntropyLoss",
        [rand(3, 4), np.array([0, 3, 1], I64)],
        {"reduction": "none"},
        n_out=2,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case: OpCase):
    _, _, actual, expected = run_both(case)
    assert_close(actual, expected, case.rtol, case.atol)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
def test_opset11_coerce_to_2d_in_handler(op):
    """The handler's own opset < 13 path (xconv.load would rewrite it with Flatten)."""
    case = OpCase(op, op, [X234], {"axis": 1}, opset=11, oracle="onnxruntime")
    model = build_model(case)
    fn, params = xconv.to_jax(ir.from_proto(model))
    assert fn.model.opset_imports[""] == 11
    actual = fn(params, *feeds(case))
    assert_close(actual, expected_outputs(case, model), 1e-5, 1e-6)


@pytest.mark.parametrize(
    "name",
    [
        "matmul_bcast",
        "gemm_all_attrs",
        "softmax_axis1",
        "topk_smallest_ties",
        "sce_mean_weight_ii",
        "cumsum_exclusive_reverse",
        "einsum_batch_matmul",
    ],
)
def test_under_jit(name):
    case = next(c for c in CASES if c.name == name)
    fn, params, eager, expected = run_both(case)
    jitted = jax.jit(fn)(params, *(jnp.asarray(x) for x in feeds(case)))
    assert_close(jitted, expected, case.rtol, case.atol)
    assert_close(jitted, eager, 1e-6, 1e-6)


def _grad_of_sum(case: OpCase, argnum: int = 0):
    model = build_model(case)
    fn, params = xconv.to_jax(xconv.load(model))
    args = [jnp.asarray(x) for x in feeds(case)]

    def loss(x):
        call = list(args)
        call[argnum] = x
        y = fn(params, *call)[0]
        return jnp.sum(y * (1 + jnp.arange(y.size, dtype=y.dtype).reshape(y.shape)))

    return jax.jit(jax.grad(loss))(args[argnum])


def test_grad_matmul_and_gemm():
    a, b = A34, B45
    w = 1 + np.arange(15, dtype=np.float32).reshape(3, 5)
    g = _grad_of_sum(OpCase("matmul", "MatMul", [a, b]))
    np.testing.assert_allclose(g, w @ b.T, rtol=1e-5)
    g = _grad_of_sum(OpCase("gemm", "Gemm", [a, b, rand(5)], {"alpha": 2.0}))
    np.testing.assert_allclose(g, 2.0 * (w @ b.T), rtol=1e-5)


def test_grad_softmax():
    x = X234
    g = _grad_of_sum(OpCase("softmax", "Softmax", [x], {"axis": 1}))
    w = 1 + jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape)
    want = jax.grad(lambda v: jnp.sum(jax.nn.softmax(v, axis=1) * w))(jnp.asarray(x))
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(g))


def test_grad_softmax_cross_entropy():
    case = OpCase("sce", "SoftmaxCrossEntropyLoss", [LOGITS, TARGET], {"ignore_index": 1})
    g = _grad_of_sum(case)
    # d(mean NLL)/dx = (softmax - onehot) / count over non-ignored entries.
    p = jax.nn.softmax(jnp.asarray(LOGITS), axis=1)
    onehot = jax.nn.one_hot(jnp.asarray(TARGET), 5, axis=1)
    valid = (TARGET != 1)[:, None, :]
    want = np.where(valid, p - onehot, 0) / valid.sum()
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


def test_topk_k_must_be_static_under_jit():
    case = OpCase("topk_dynamic_k", "TopK", [TIES, np.array([2], I64)], n_out=2)
    model = build_model(case)
    fn, params = xconv.to_jax(xconv.load(model))
    eager = fn(params, *(jnp.asarray(x) for x in feeds(case)))
    assert eager[0].shape == (2, 2)
    with pytest.raises(xconv.errors.StaticValueError, match="k must be known"):
        jax.jit(fn)(params, *(jnp.asarray(x) for x in feeds(case)))
