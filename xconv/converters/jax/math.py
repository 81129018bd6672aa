"""JAX handlers: BitShift and the quantization ops, and the JAX kernel of the unary math,
arithmetic, comparison and logic ops (written once in :mod:`xconv.converters.ops.math`).

Those pick numpy when every input is static (constants, folded shape arithmetic), so int64
shape data keeps its exact dtype and value even with JAX's 64-bit types off, and string
tensors (``Equal`` on strings) work; otherwise ``jax.numpy``, traceable under
``jit``/``grad``/``vmap``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from xconv.converters.jax.kernel import KERNEL
from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops import shapes
from xconv.converters.ops.arrays import namespace
from xconv.converters.ops.attrs import CONV_ATTRS
from xconv.converters.ops.math import quant_param, register_math_ops


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

#: Integer quantized types and their ranges (ONNX names).
_INT_RANGES = {
    "UINT8": (0, 255),
    "INT8": (-128, 127),
    "UINT16": (0, 65535),
    "INT16": (-32768, 32767),
    "UINT4": (0, 15),
    "INT4": (-8, 7),
    "UINT2": (0, 3),
    "INT2": (-2, 1),
}
_FLOAT8 = {"FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ"}
_FLOAT_LOW = {"FLOAT4E2M1", "FLOAT6E2M3", "FLOAT6E3M2"}


def _onnx_type(ctx, dtype) -> Any:
    import onnx_ir as ir

    try:
        return ir.DataType.from_numpy(np.dtype(dtype))
    except (TypeError, ValueError):
        raise ctx.error(f"unsupported quantized type {dtype}") from None


def _blocks(value, block_size, axis, length):
    value = jnp.repeat(value, block_size, axis=axis)
    return jax.lax.slice_in_dim(value, 0, length, axis=axis)


def _quant_param(ctx, value, shape, axis: int, block_size: int, what: str):
    """Scale or zero point, broadcastable to ``shape``: per tensor, per axis or blocked."""
    return quant_param(ctx, jnp.asarray(value), shape, axis, block_size, what, _blocks)


def _exact_div(x, scale):
    """``x / scale`` with IEEE division.

    XLA rewrites a division by a broadcast scalar into a multiplication by its reciprocal,
    which moves ties in the rounding that follows (DynamicQuantizeLinear's -2.5 / (5/255)
    must be -127.49999, not -127.5); the barrier keeps the true division.
    """
    x, scale = jnp.broadcast_arrays(x, scale)
    return jax.lax.div(x, jax.lax.optimization_barrier(scale))


def quantize(
    ctx, x, scale, zero_point, target, *, axis=1, block_size=0, saturate=1, precision=None
):
    """x / scale (+ zero point), rounded half to even and saturated into ``target``."""
    name = _onnx_type(ctx, target).name
    x = jnp.asarray(x)
    shape = tuple(x.shape)
    scale = _quant_param(ctx, scale, shape, axis, block_size, "scale")
    if precision is not None:
        x, scale = x.astype(precision), scale.astype(precision)
    dtype = jnp.promote_types(x.dtype, scale.dtype)
    y = _exact_div(x.astype(dtype), scale.astype(dtype))
    if name in _INT_RANGES:
        lo, hi = _INT_RANGES[name]
        y = jnp.rint(y)
        if zero_point is not None:
            zp = _quant_param(ctx, zero_point, shape, axis, block_size, "zero point")
            y = y.astype(jnp.float32) + zp.astype(jnp.float32)
        return jnp.clip(y, lo, hi).astype(target)
    if name in _FLOAT8:
        if saturate:
            info = ml_dtypes.finfo(target)
            y = jnp.clip(y, float(info.min), float(info.max))
        return y.astype(target)
    if name in _FLOAT_LOW:
        if zero_point is not None:
            zp = _quant_param(ctx, zero_point, shape, axis, block_size, "zero point")
            y = y + zp.astype(y.dtype)
        return y.astype(target)
    raise ctx.error(
        f"cannot quantize to {name}; supported: {sorted(_INT_RANGES) + sorted(_FLOAT8)} "
        f"and {sorted(_FLOAT_LOW)}"
    )


def _target_dtype(ctx, zero_point, output_dtype: int):
    import onnx_ir as ir

    if zero_point is not None:
        zp_type = np.dtype(zero_point.dtype)
        if output_dtype and ir.DataType(output_dtype).numpy() != zp_type:
            raise ctx.error(
                f"output_dtype {ir.DataType(output_dtype).name} differs from the zero point's "
                f"type {zp_type}"
            )
        return zp_type
    if output_dtype:
        return np.dtype(ir.DataType(output_dtype).numpy())
    return np.dtype(np.uint8)


_QUANTIZE_ATTRS = {"axis": 1, "saturate": 1, "block_size": 0, "output_dtype": 0, "precision": 0}


@builtin("QuantizeLinear", since=10, attrs=_QUANTIZE_ATTRS)
def quantize_linear(
    ctx, x, y_scale, y_zero_point=None, *, axis, saturate, block_size, output_dtype, precision
):
    """QuantizeLinear(x, y_scale, y_zero_point?) -> y = saturate(round(x / y_scale) + zp)."""
    import onnx_ir as ir

    target = _target_dtype(ctx, y_zero_point, output_dtype)
    prec = np.dtype(ir.DataType(precision).numpy()) if precision else None
    return quantize(
        ctx,
        x,
        y_scale,
        y_zero_point,
        target,
        axis=axis,
        block_size=block_size,
        saturate=saturate,
        precision=prec,
    )


@builtin("DequantizeLinear", since=10, attrs={"axis": 1, "block_size": 0, "output_dtype": 0})
def dequantize_linear(ctx, x, x_scale, x_zero_point=None, *, axis, block_size, output_dtype):
    """DequantizeLinear(x, x_scale, x_zero_point?) -> y = (x - x_zero_point) * x_scale."""
    import onnx_ir as ir

    x = jnp.asarray(x)
    shape = tuple(x.shape)
    name = _onnx_type(ctx, x.dtype).name
    y = x.astype(jnp.float32)
    # Float8 and float4 zero points must be zero: the spec ignores them.
    if x_zero_point is not None and name not in _FLOAT8 and name not in _FLOAT_LOW:
        zp = _quant_param(ctx, x_zero_point, shape, axis, block_size, "zero point")
        y = y - zp.astype(jnp.float32)
    scale = _quant_param(ctx, x_scale, shape, axis, block_size, "scale")
    y = y * scale
    dtype = np.dtype(ir.DataType(output_dtype).numpy()) if output_dtype else scale.dtype
    return y.astype(dtype)


@builtin("DynamicQuantizeLinear", since=11)
def dynamic_quantize_linear(ctx, x):
    """DynamicQuantizeLinear(x) -> (y: uint8, y_scale, y_zero_point) over x's range and 0."""
    x = jnp.asarray(x)
    xf = x.astype(jnp.float32)
    hi = jnp.maximum(0.0, jnp.max(xf))
    lo = jnp.minimum(0.0, jnp.min(xf))
    scale = jnp.where(hi == lo, 1.0, hi - lo) / jnp.float32(255)
    zp = jnp.rint(jnp.clip(0.0 - _exact_div(lo, scale), 0, 255))
    y = jnp.clip(jnp.rint(_exact_div(xf, scale)) + zp, 0, 255)
    return y.astype(jnp.uint8), scale.astype(x.dtype), zp.astype(jnp.uint8)


def _minus_zero_point(x, zero_point, row_axis: int | None = None):
    x = jnp.asarray(x).astype(jnp.int32)
    if zero_point is None:
        return x
    zp = jnp.asarray(zero_point).astype(jnp.int32)
    if row_axis is not None and zp.ndim == 1 and zp.size > 1:
        # A per-row zero point of A has shape [M]: align it with A's row axis.
        zp = zp.reshape((-1,) + (1,) * (x.ndim - 1 - (row_axis % x.ndim)))
    return x - zp


@builtin("MatMulInteger", since=10)
def matmul_integer(ctx, a, b, a_zero_point=None, b_zero_point=None):
    """MatMulInteger(A, B, a_zero_point?, b_zero_point?) -> int32 (A - a_zp) @ (B - b_zp)."""
    a = _minus_zero_point(a, a_zero_point, row_axis=-2)
    b = _minus_zero_point(b, b_zero_point)
    return jnp.matmul(a, b, preferred_element_type=jnp.int32)


def _requantize(acc, factor, y_zero_point, out_dtype):
    y = jnp.rint(acc.astype(jnp.float32) * factor.astype(jnp.float32))
    if y_zero_point is not None:
        y = y + jnp.asarray(y_zero_point).astype(jnp.float32)
    info = np.iinfo(out_dtype)
    return jnp.clip(y, info.min, info.max).astype(out_dtype)


@builtin("QLinearMatMul", since=10)
def qlinear_matmul(ctx, a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point):
    """QLinearMatMul(a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp) -> quantized a @ b."""
    acc = jnp.matmul(
        _minus_zero_point(a, a_zero_point, row_axis=-2),
        _minus_zero_point(b, b_zero_point),
        preferred_element_type=jnp.int32,
    )
    factor = jnp.asarray(a_scale) * jnp.asarray(b_scale) / jnp.asarray(y_scale)
    out = np.dtype(y_zero_point.dtype) if y_zero_point is not None else np.dtype(a.dtype)
    if out.kind not in "iu":
        raise ctx.error(f"QLinearMatMul supports 8-bit integer outputs, got {out}")
    return _requantize(acc, factor, y_zero_point, out)


def _conv_int32(ctx, x, w, *, auto_pad, dilations, group, kernel_shape, pads, strides):
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


def _per_channel(value, rank: int):
    """A per-output-channel (1-D) parameter reshaped to broadcast over (M, ...)."""
    value = jnp.asarray(value)
    if value.ndim == 1 and value.size > 1:
        return value.reshape((-1,) + (1,) * (rank - 1))
    return value.reshape(()) if value.size == 1 else value


@builtin("ConvInteger", since=10, attrs=CONV_ATTRS)
def conv_integer(ctx, x, w, x_zero_point=None, w_zero_point=None, **attrs):
    """ConvInteger(x, w, x_zero_point?, w_zero_point?) -> int32 conv of zero-shifted inputs."""
    x = _minus_zero_point(x, x_zero_point)
    w = jnp.asarray(w).astype(jnp.int32)
    if w_zero_point is not None:
        w = w - _per_channel(w_zero_point, w.ndim).astype(jnp.int32)
    return _conv_int32(ctx, x, w, **attrs)


@builtin("QLinearConv", since=10, attrs=CONV_ATTRS)
def qlinear_conv(
    ctx,
    x,
    x_scale,
    x_zero_point,
    w,
    w_scale,
    w_zero_point,
    y_scale,
    y_zero_point,
    b=None,
    **attrs,
):
    """QLinearConv(x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, B?) -> quantized conv."""
    x = _minus_zero_point(x, x_zero_point)
    wq = jnp.asarray(w).astype(jnp.int32)
    if w_zero_point is not None:
        wq = wq - _per_channel(w_zero_point, wq.ndim).astype(jnp.int32)
    acc = _conv_int32(ctx, x, wq, **attrs)
    if b is not None:
        acc = acc + jnp.asarray(b).astype(jnp.int32).reshape((-1,) + (1,) * (acc.ndim - 2))
    w_scale = jnp.asarray(w_scale)
    if w_scale.ndim == 1 and w_scale.size > 1:
        w_scale = w_scale.reshape((-1,) + (1,) * (acc.ndim - 2))
    factor = jnp.asarray(x_scale) * w_scale.reshape(w_scale.shape) / jnp.asarray(y_scale)
    out = np.dtype(y_zero_point.dtype) if y_zero_point is not None else np.dtype(w.dtype)
    return _requantize(acc, factor, y_zero_point, out)
