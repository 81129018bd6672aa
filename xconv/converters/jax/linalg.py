"""JAX handlers: matrix products, cumulative ops, TopK, the softmax family and losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from xconv.converters.jax.kernel import index_dtype, reference_sum
from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops.arrays import normalize_axis
from xconv.converters.ops.linalg import register_softmax_ops

#: Types whose products accumulate in float32 (as the ONNX reference does for Einsum).
_LOW_PRECISION = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


def _static_int(ctx, value, what: str) -> int:
    arr = ctx.static(value, what)
    if arr.size != 1:
        raise ctx.error(f"{what} must hold a single integer, got shape {arr.shape}")
    return int(arr.reshape(()))


# --------------------------------------------------------------------------------------
# Matrix products


@builtin("MatMul", since=1)
def matmul(ctx, a, b):
    """MatMul(A, B) -> Y: numpy.matmul semantics (1-D operands promoted, batch broadcast)."""
    return jnp.matmul(a, b)


@builtin(
    "Gemm", since=1, attrs={"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0, "broadcast": 0}
)
def gemm(ctx, a, b, c=None, *, alpha, beta, transA, transB, broadcast):
    """Gemm(A, B, C?) -> Y = alpha * A' @ B' + beta * C, C unidirectionally broadcast.

    ``broadcast`` (opset < 7) is accepted: later opsets always broadcast C.
    """
    dtype = jnp.result_type(a)
    a = a.T if transA else a
    b = b.T if transB else b
    y = jnp.matmul(a, b)
    if np.dtype(dtype).kind in "iu" and (alpha != 1.0 or (c is not None and beta != 1.0)):
        # Integer Gemm with fractional alpha / beta: scale in floating point, then truncate
        # back to the integer type (as the reference's numpy arithmetic does).
        real = jax.dtypes.canonicalize_dtype(np.float64)
        y = y.astype(real) * alpha
        if c is not None and beta != 0.0:
            y = y + jnp.asarray(c).astype(real) * beta
        return y.astype(dtype)
    if alpha != 1.0:
        y = y * jnp.asarray(alpha, dtype)
    if c is not None and beta != 0.0:
        c = jnp.asarray(c, dtype)
        y = y + (c if beta == 1.0 else c * jnp.asarray(beta, dtype))
    return y.astype(dtype)


@builtin("Einsum", since=12, attrs={"equation": REQUIRED})
def einsum(ctx, *inputs, equation):
    """Einsum(Inputs...) -> Output, by Einstein summation over ``equation``."""
    eq = equation.decode() if isinstance(equation, bytes) else equation
    eq = eq.replace(" ", "")
    dtype = jnp.result_type(*inputs)
    if np.dtype(dtype) in _LOW_PRECISION:
        out = jnp.einsum(eq, *inputs, preferred_element_type=jnp.float32)
        return out.astype(dtype)
    return jnp.einsum(eq, *inputs)


@builtin("Det", since=11)
def det(ctx, x):
    """Det(X) -> Y: determinant of the square matrices in the last two dimensions."""
    dtype = jnp.result_type(x)
    if np.dtype(dtype) in _LOW_PRECISION:
        return jnp.linalg.det(x.astype(jnp.float32)).astype(dtype)
    return jnp.linalg.det(x)


# --------------------------------------------------------------------------------------
# Cumulative ops


def _cumulative(ctx, x, axis, exclusive, reverse, op, identity):
    x = jnp.asarray(x)
    ax = normalize_axis(ctx, _static_int(ctx, axis, "axis"), x.ndim)
    if reverse:
        x = jnp.flip(x, ax)
    if exclusive:
        # Shift right by one along the axis, filling with the identity.
        pad = [(0, 0)] * x.ndim
        pad[ax] = (1, 0)
        shifted = jnp.pad(x, pad, constant_values=identity)
        x = lax.slice_in_dim(shifted, 0, x.shape[ax], axis=ax)
    y = op(x, axis=ax, dtype=x.dtype)
    if reverse:
        y = jnp.flip(y, ax)
    return y


@builtin("CumSum", since=11, attrs={"exclusive": 0, "reverse": 0})
def cumsum(ctx, x, axis, *, exclusive, reverse):
    """CumSum(x, axis) -> y: running sum along ``axis`` (optionally exclusive / reversed)."""
    return _cumulative(ctx, x, axis, exclusive, reverse, jnp.cumsum, 0)


@builtin("CumProd", since=26, attrs={"exclusive": 0, "reverse": 0})
def cumprod(ctx, x, axis, *, exclusive, reverse):
    """CumProd(x, axis) -> y: running product along ``axis`` (optionally exclusive / reversed)."""
    return _cumulative(ctx, x, axis, exclusive, reverse, jnp.cumprod, 1)


# --------------------------------------------------------------------------------------
# TopK


def _order_key(x, largest: bool):
    """A key whose descending order is the requested order, without overflow."""
    if largest:
        return x
    dtype = np.dtype(jnp.result_type(x))
    if dtype.kind in "iu":
        return ~x  # order-reversing and overflow-free for signed and unsigned integers
    if dtype == np.bool_:
        return ~x
    return -x


def _topk(ctx, x, k: int, axis: int, largest: int):
    x = jnp.asarray(x)
    ax = normalize_axis(ctx, axis, x.ndim)
    n = x.shape[ax]
    if not 0 <= k <= n:
        raise ctx.error(f"k={k} is out of range for an axis of size {n}")
    moved = jnp.moveaxis(x, ax, -1)
    key = _order_key(moved, bool(largest))
    # lax.top_k keeps the lower index first among equal keys.
    _, idx = lax.top_k(key, k)
    values = jnp.take_along_axis(moved, idx, axis=-1)
    values = jnp.moveaxis(values, -1, ax)
    idx = jnp.moveaxis(idx, -1, ax).astype(index_dtype())
    return values, idx


@builtin("TopK", since=1, until=9, attrs={"axis": -1, "k": REQUIRED})
def topk_1(ctx, x, *, axis, k):
    """TopK-1(X) -> (Values, Indices): the k largest along ``axis`` (k an attribute)."""
    return _topk(ctx, x, int(k), axis, 1)


@builtin("TopK", since=10, until=10, attrs={"axis": -1})
def topk_10(ctx, x, k, *, axis):
    """TopK-10(X, K) -> (Values, Indices): the k largest along ``axis``."""
    return _topk(ctx, x, _static_int(ctx, k, "k"), axis, 1)


@builtin("TopK", since=11, attrs={"axis": -1, "largest": 1, "sorted": 1})
def topk(ctx, x, k, *, axis, largest, sorted):  # noqa: A002 - the ONNX attribute name
    """TopK(X, K) -> (Values, Indices): the k largest (or smallest) along ``axis``.

    Equal values keep the lower index first, as ONNX specifies; ``k`` must be static. The
    output is always sorted (``sorted=0`` leaves the order unspecified).
    """
    return _topk(ctx, x, _static_int(ctx, k, "k"), axis, largest)


# --------------------------------------------------------------------------------------
# Softmax family


def _softmax(x, axis: int):
    e = jnp.exp(x - lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True)))
    return e / reference_sum(e, axis)


def _hardmax(x, axis: int):
    idx = jnp.argmax(x, axis=axis)
    return jax.nn.one_hot(idx, x.shape[axis], axis=axis, dtype=x.dtype)


register_softmax_ops(
    builtin,
    {
        "Softmax": _softmax,
        "LogSoftmax": lambda v, ax: jax.nn.log_softmax(v, axis=ax),
        "Hardmax": _hardmax,
    },
    jnp.asarray,
)


# --------------------------------------------------------------------------------------
# Losses

_REDUCTIONS = ("none", "sum", "mean")


def _nll(ctx, logp, target, weight, reduction, ignore_index):
    """Negative log-likelihood of ``logp`` (N, C, d...) at ``target`` (N, d...)."""
    if reduction not in _REDUCTIONS:
        raise ctx.error(f"reduction {reduction!r} is not one of {list(_REDUCTIONS)}")
    logp = jnp.asarray(logp)
    target = jnp.asarray(target)
    if logp.ndim < 2:
        raise ctx.error(f"input must have shape (N, C, ...), got rank {logp.ndim}")
    num_classes = logp.shape[1]
    dtype = logp.dtype
    valid = None if ignore_index is None else target != ignore_index
    safe = jnp.clip(target if valid is None else jnp.where(valid, target, 0), 0, num_classes - 1)
    picked = jnp.take_along_axis(logp, jnp.expand_dims(safe, 1).astype(index_dtype()), axis=1)
    loss = -jnp.squeeze(picked, 1)
    w = None
    if weight is not None:
        w = jnp.take(jnp.asarray(weight, dtype), safe, axis=0)
    if valid is not None:
        w = jnp.where(valid, jnp.ones((), dtype) if w is None else w, jnp.zeros((), dtype))
        loss = jnp.where(valid, loss, jnp.zeros((), dtype))
    if w is not None:
        loss = loss * w
    if reduction == "none":
        return loss.astype(dtype)
    total = jnp.sum(loss)
    if reduction == "sum":
        return total.astype(dtype)
    if w is None:
        return (total / loss.size).astype(dtype)
    return (total / jnp.sum(w)).astype(dtype)


@builtin("NegativeLogLikelihoodLoss", since=12, attrs={"reduction": "mean", "ignore_index": None})
def negative_log_likelihood_loss(ctx, x, target, weight=None, *, reduction, ignore_index):
    """NegativeLogLikelihoodLoss(input, target, weight?) -> loss = -input[n, target[n], ...]
    (weighted, ``ignore_index`` entries excluded), reduced by ``reduction``."""
    return _nll(ctx, x, target, weight, reduction, ignore_index)


@builtin("SoftmaxCrossEntropyLoss", since=12, attrs={"reduction": "mean", "ignore_index": None})
def softmax_cross_entropy_loss(ctx, scores, labels, weights=None, *, reduction, ignore_index):
    """SoftmaxCrossEntropyLoss(scores, labels, weights?) -> (output, log_prob?):
    NegativeLogLikelihoodLoss of LogSoftmax(scores, axis=1)."""
    scores = jnp.asarray(scores)
    if scores.ndim < 2:
        raise ctx.error(f"scores must have shape (N, C, ...), got rank {scores.ndim}")
    log_prob = jax.nn.log_softmax(scores, axis=1)
    loss = _nll(ctx, log_prob, labels, weights, reduction, ignore_index)
    wants_log_prob = len(ctx.output_values) > 1 and ctx.output_values[1].name != ""
    return (loss, log_prob) if wants_log_prob else loss
