"""JAX handlers: matrix products, cumulative ops, TopK, the softmax family and losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from xconv.converters.jax.kernel import (
    KERNEL,
    bf16_dots,
    bf16_einsum,
    index_dtype,
    one_row,
    reference_sum,
    row_product,
    weight_major,
    weight_product,
)
from xconv.converters.jax.kernel import matmul as kernel_matmul
from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops.linalg import (
    register_cumulative_ops,
    register_loss_ops,
    register_softmax_ops,
    register_topk,
)
from xconv.ir.passes.layout import transpose_of

#: Types whose products accumulate in float32 (as the ONNX reference does for Einsum).
_LOW_PRECISION = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


# --------------------------------------------------------------------------------------
# Matrix products


@builtin("MatMul", since=1)
def matmul(ctx, a, b):
    """MatMul(A, B) -> Y: numpy.matmul semantics (1-D operands promoted, batch broadcast)."""
    transposed = transpose_of(ctx.node.inputs[1])  # an exported Linear: MatMul(x, W^T)
    if transposed is not None and transposed[1] == [1, 0]:
        if weight_major(a, b):
            return weight_product(a, b)
        if one_row(a, b):
            return row_product(a, b)
    return kernel_matmul(a, b)


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
    y = kernel_matmul(a, b)
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


def _transposable(eq: str) -> bool:
    """Whether the two-operand einsum ``eq`` is one :func:`bf16_einsum` takes: an explicit
    output, no ellipsis, no index twice in an operand, every index of each operand in the
    other or in the output (so each gradient is an einsum too)."""
    if "->" not in eq or "." in eq or eq.count(",") != 1:
        return False
    ins, out = eq.split("->")
    a, b = ins.split(",")
    if any(len(set(s)) != len(s) for s in (a, b, out)):
        return False
    return set(a) <= set(b) | set(out) and set(b) <= set(a) | set(out) and set(out) <= set(a + b)


@builtin("Einsum", since=12, attrs={"equation": REQUIRED})
def einsum(ctx, *inputs, equation):
    """Einsum(Inputs...) -> Output, by Einstein summation over ``equation``."""
    eq = equation.decode() if isinstance(equation, bytes) else equation
    eq = eq.replace(" ", "")
    dtype = jnp.result_type(*inputs)
    if len(inputs) == 2 and bf16_dots(*inputs) and _transposable(eq):
        return bf16_einsum(eq, *inputs)
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


# CumSum, CumProd: converters/ops/linalg.py.
register_cumulative_ops(builtin, KERNEL)


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


def _top_k(x, k: int, ax: int, largest: bool):
    """TopK along ``ax`` with ``lax.top_k`` on an order key."""
    moved = jnp.moveaxis(jnp.asarray(x), ax, -1)
    # lax.top_k keeps the lower index first among equal keys.
    _, idx = lax.top_k(_order_key(moved, largest), k)
    values = jnp.moveaxis(jnp.take_along_axis(moved, idx, axis=-1), -1, ax)
    return values, jnp.moveaxis(idx, -1, ax).astype(index_dtype())


# TopK-1, -10, -11: converters/ops/linalg.py.
register_topk(builtin, _top_k, REQUIRED)


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

# NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss: converters/ops/linalg.py.
register_loss_ops(builtin, KERNEL, lambda x, axis: jax.nn.log_softmax(jnp.asarray(x), axis=axis))
