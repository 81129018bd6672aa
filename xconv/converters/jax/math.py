"""JAX handler of BitShift, and the JAX kernels of the unary math, arithmetic, comparison
and logic ops (written once in :mod:`xconv.converters.ops.math`) and of the quantization ops
(:mod:`xconv.converters.ops.quant`).

Those pick numpy when every input is static (constants, folded shape arithmetic), so int64
shape data keeps its exact dtype and value even with JAX's 64-bit types off, and string
tensors (``Equal`` on strings) work; otherwise ``jax.numpy``, traceable under
``jit``/``grad``/``vmap``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from xconv.converters.jax.kernel import KERNEL
from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops import shapes
from xconv.converters.ops.arrays import namespace
from xconv.converters.ops.math import register_math_ops
from xconv.converters.ops.quant import FLOAT8, FLOAT_LOW, INT_RANGES, register_quant_ops


class _MathKernel:
    """The JAX side of :mod:`xconv.converters.ops.math`."""

    run = staticmethod(KERNEL.run)

    @staticmethod
    def erf(xp, x):
        y = jax.scipy.special.erf(x)
        return (np.asarray(y) if xp is np else y).astype(x.dtype)

    @staticmethod
    def int_div(a, b):
        return jax.lax.div(*jnp.broadcast_arrays(a, b)) if a.dtype == b.dtype else a // b

    @staticmethod
    def int_pow(a, b):
        return jnp.power(a, b.astype(a.dtype)).astype(a.dtype)


register_math_ops(builtin, _MathKernel())


@builtin("BitShift", since=11, attrs={"direction": REQUIRED})
def bit_shift(ctx, x, y, *, direction):
    """BitShift(X, Y) -> Z: shift X by Y bits; shifts outside [0, width) give 0 (or -1)."""
    if direction not in ("LEFT", "RIGHT"):
        raise ctx.error(f"direction must be 'LEFT' or 'RIGHT', got {direction!r}")
    xp = namespace(jnp, x, y)
    x, y = xp.broadcast_arrays(x, y)
    dtype = np.dtype(x.dtype)
    bits = dtype.itemsize * 8
    signed = np.issubdtype(dtype, np.signedinteger)
    valid = (y < bits) & (y >= 0) if signed else y < bits
    shift = xp.where(valid, y, xp.zeros((), dtype)).astype(dtype)
    if direction == "RIGHT":
        out = xp.right_shift(x, shift)
        fill = xp.where(x < 0, xp.asarray(-1, dtype), xp.asarray(0, dtype)) if signed else 0
        return xp.where(valid, out, fill).astype(dtype)
    with np.errstate(all="ignore"):
        out = xp.left_shift(x, shift)
    return xp.where(valid, out, xp.zeros((), dtype)).astype(dtype)


# ------------------------------------------------------------------------ quantization


def _exact_div(x, scale):
    """``x / scale`` with IEEE division.

    XLA rewrites a division by a broadcast scalar into a multiplication by its reciprocal,
    which moves ties in the rounding that follows (DynamicQuantizeLinear's -2.5 / (5/255)
    must be -127.49999, not -127.5); the barrier keeps the true division.
    """
    x, scale = jnp.broadcast_arrays(x, scale)
    return jax.lax.div(x, jax.lax.optimization_barrier(scale))


def _onnx_name(ctx, dtype) -> str:
    import onnx_ir as ir

    try:
        return ir.DataType.from_numpy(np.dtype(dtype)).name
    except (TypeError, ValueError):
        raise ctx.error(f"unsupported quantized type {dtype}") from None


def _int_conv(ctx, x, w, *, auto_pad, dilations, group, kernel_shape, pads, strides):
    """N-D integer convolution (NC..., OI...) with ONNX padding rules, int32 accumulation."""
    nd = x.ndim - 2
    if nd < 1:
        raise ctx.error(f"input must have rank >= 3 (N, C, spatial...), got {x.ndim}")
    kernel = tuple(kernel_shape) if kernel_shape else tuple(w.shape[2:])
    strides, dilations = shapes.ints(strides, nd, 1), shapes.ints(dilations, nd, 1)
    spatial = tuple(x.shape[2:])
    padding = shapes.conv_padding(ctx.node, auto_pad, spatial, kernel, strides, dilations, pads)
    return jax.lax.conv_general_dilated(
        x,
        w,
        window_strides=strides,
        padding=padding,
        rhs_dilation=dilations,
        feature_group_count=group,
        preferred_element_type=jnp.int32,
    )


class _QuantKernel:
    """The JAX side of :mod:`xconv.converters.ops.quant`: every ONNX quantized type
    (ml_dtypes), int32 accumulation."""

    quant_types = frozenset((*INT_RANGES, *FLOAT8, *FLOAT_LOW))
    acc_dtype = jnp.int32
    dtype = staticmethod(KERNEL.dtype)
    onnx_name = staticmethod(_onnx_name)
    divide = staticmethod(_exact_div)
    finfo = staticmethod(ml_dtypes.finfo)
    int_conv = staticmethod(_int_conv)

    @staticmethod
    def run(fn, *arrays):
        return fn(jnp, *(None if a is None else jnp.asarray(a) for a in arrays))

    @staticmethod
    def blocks(value, block_size, axis, length):
        value = jnp.repeat(value, block_size, axis=axis)
        return jax.lax.slice_in_dim(value, 0, length, axis=axis)

    @staticmethod
    def int_matmul(a, b):
        return jnp.matmul(a, b, preferred_element_type=jnp.int32)


register_quant_ops(builtin, _QuantKernel())
