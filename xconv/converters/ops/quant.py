"""The quantization ops written once against ``xp``: QuantizeLinear, DequantizeLinear,
DynamicQuantizeLinear, MatMulInteger, QLinearMatMul, ConvInteger, QLinearConv.

The handlers always run in the backend's namespace (``jax.numpy``; torch under numpy's
names). What differs per backend comes from its :class:`QuantKernel`: which quantized types
it holds, an IEEE division XLA cannot rewrite, the float8 limits, the repeat of blocked
parameters, and the integer products (JAX accumulates in int32; torch in float64, exact for
8/16-bit data, since it lacks integer kernels on most devices).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

from xconv.converters.ops.arrays import astype, is_integer
from xconv.converters.ops.attrs import CONV_ATTRS
from xconv.converters.ops.math import quant_param

#: Integer quantized types and their ranges (ONNX names).
INT_RANGES = {
    "UINT8": (0, 255),
    "INT8": (-128, 127),
    "UINT16": (0, 65535),
    "INT16": (-32768, 32767),
    "UINT4": (0, 15),
    "INT4": (-8, 7),
    "UINT2": (0, 3),
    "INT2": (-2, 1),
}
FLOAT8 = ("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ")
#: Narrow float types whose zero point, when given, is added (and ignored on dequantize).
FLOAT_LOW = ("FLOAT4E2M1", "FLOAT6E2M3", "FLOAT6E3M2")


class QuantKernel(Protocol):
    """What a backend provides for the quantization ops."""

    #: The ONNX names of the quantized types this backend holds.
    quant_types: frozenset[str]
    #: The dtype zero-shifted integer data is multiplied and convolved in.
    acc_dtype: Any

    def run(self, fn: Callable[..., Any], *arrays: Any) -> Any:
        """``fn(xp, *arrays)`` in the backend's namespace (never numpy)."""

    def dtype(self, ctx, code: int, like: Any = None) -> Any:
        """The backend dtype of ONNX type ``code``."""

    def onnx_name(self, ctx, dtype: Any) -> str:
        """The ONNX name of a backend dtype; an error naming the node where it has none."""

    def divide(self, x: Any, scale: Any) -> Any:
        """``x / scale`` by IEEE division (no reciprocal multiplication)."""

    def finfo(self, dtype: Any) -> Any:
        """``min``/``max`` of a float8 dtype."""

    def blocks(self, value: Any, block_size: int, axis: int, length: int) -> Any:
        """Each entry repeated ``block_size`` times along ``axis``, the first ``length``."""

    def int_matmul(self, a: Any, b: Any) -> Any:
        """``a @ b`` of ``acc_dtype`` integer data, as int32."""

    def int_conv(self, ctx, x: Any, w: Any, **attrs: Any) -> Any:
        """The N-D convolution (NC..., OI...) of ``acc_dtype`` integer data with ONNX padding
        rules, as int32."""


def _param(ctx, k: QuantKernel, value, shape, axis: int, block_size: int, what: str):
    return quant_param(ctx, value, shape, axis, block_size, what, k.blocks)


def quantize(ctx, k: QuantKernel, xp, x, scale, zero_point, target, attrs: dict) -> Any:
    """x / scale (+ zero point), rounded half to even and saturated into ``target``.

    ``attrs``: ``axis``, ``block_size``, ``saturate`` and ``precision`` (a dtype or None).
    """
    name = k.onnx_name(ctx, target)
    if name not in k.quant_types:
        raise ctx.error(f"cannot quantize to {name}; supported: {sorted(k.quant_types)}")
    shape, axis, block = tuple(x.shape), attrs["axis"], attrs["block_size"]
    scale = _param(ctx, k, scale, shape, axis, block, "scale")
    if attrs["precision"] is not None:
        x, scale = astype(xp, x, attrs["precision"]), astype(xp, scale, attrs["precision"])
    dtype = xp.promote_types(x.dtype, scale.dtype)
    y = k.divide(astype(xp, x, dtype), astype(xp, scale, dtype))
    if name in INT_RANGES:
        lo, hi = INT_RANGES[name]
        y = xp.rint(y)
        if zero_point is not None:
            zp = _param(ctx, k, zero_point, shape, axis, block, "zero point")
            y = astype(xp, y, xp.float32) + astype(xp, zp, xp.float32)
        return astype(xp, xp.clip(y, lo, hi), target)
    if name in FLOAT8:
        if attrs["saturate"]:
            info = k.finfo(target)
            y = xp.clip(astype(xp, y, xp.float32), float(info.min), float(info.max))
        return astype(xp, y, target)
    if zero_point is not None:  # FLOAT_LOW
        zp = _param(ctx, k, zero_point, shape, axis, block, "zero point")
        y = y + astype(xp, zp, y.dtype)
    return astype(xp, y, target)


def _target(ctx, k: QuantKernel, zero_point, output_dtype: int) -> Any:
    if zero_point is not None:
        target = zero_point.dtype
        k.onnx_name(ctx, target)  # the backend holds the type
        if output_dtype and k.dtype(ctx, output_dtype) != target:
            raise ctx.error(
                f"output_dtype {k.onnx_name(ctx, k.dtype(ctx, output_dtype))} differs from "
                f"the zero point's type {k.onnx_name(ctx, target)}"
            )
        return target
    return k.dtype(ctx, output_dtype or 2)  # UINT8 by default


def _dynamic_quantize(k: QuantKernel, xp, x):
    """(y: uint8, y_scale, y_zero_point) over x's range and 0."""
    xf = astype(xp, x, xp.float32)
    zero = xp.sum(xp.reshape(xf, (-1,))[:0])  # 0.0 where x lives
    hi = xp.maximum(xp.max(xf), zero) if math.prod(x.shape) else zero
    lo = xp.minimum(xp.min(xf), zero) if math.prod(x.shape) else zero
    scale = xp.where(hi == lo, xp.ones_like(hi), hi - lo) / 255.0
    zp = xp.rint(xp.clip(0.0 - k.divide(lo, scale), 0, 255))
    y = xp.clip(xp.rint(k.divide(xf, scale)) + zp, 0, 255)
    return astype(xp, y, xp.uint8), astype(xp, scale, x.dtype), astype(xp, zp, xp.uint8)


def _minus_zero_point(k: QuantKernel, xp, x, zero_point, row_axis: int | None = None):
    """``x - zero_point`` in ``k.acc_dtype``; a per-row zero point of A has shape [M]."""
    x = astype(xp, x, k.acc_dtype)
    if zero_point is None:
        return x
    zp = astype(xp, zero_point, k.acc_dtype)
    if row_axis is not None and zp.ndim == 1 and math.prod(zp.shape) > 1:
        zp = xp.reshape(zp, (-1,) + (1,) * (x.ndim - 1 - (row_axis % x.ndim)))
    return x - zp


def _per_channel(xp, value, rank: int):
    """A per-output-channel (1-D) parameter reshaped to broadcast over (M, ...)."""
    if value.ndim == 1 and math.prod(value.shape) > 1:
        return xp.reshape(value, (-1,) + (1,) * (rank - 1))
    return xp.reshape(value, ()) if math.prod(value.shape) == 1 else value


def _requantize(xp, acc, factor, y_zero_point, out_dtype):
    y = xp.rint(astype(xp, acc, xp.float32) * astype(xp, factor, xp.float32))
    if y_zero_point is not None:
        y = y + astype(xp, y_zero_point, xp.float32)
    info = xp.iinfo(out_dtype)
    return astype(xp, xp.clip(y, info.min, info.max), out_dtype)


def _int_conv(ctx, k: QuantKernel, xp, x, x_zero_point, w, w_zero_point, attrs):
    x = _minus_zero_point(k, xp, x, x_zero_point)
    wq = astype(xp, w, k.acc_dtype)
    if w_zero_point is not None:
        wq = wq - astype(xp, _per_channel(xp, w_zero_point, wq.ndim), k.acc_dtype)
    return k.int_conv(ctx, x, wq, **attrs)


_QUANTIZE_ATTRS = {"axis": 1, "saturate": 1, "block_size": 0, "output_dtype": 0, "precision": 0}


def register_quant_ops(builtin: Callable[..., Any], k: QuantKernel) -> None:
    """Register the quantization ops with a backend's ``builtin`` and kernel ``k``."""

    @builtin("QuantizeLinear", since=10, attrs=_QUANTIZE_ATTRS)
    def quantize_linear(ctx, x, y_scale, y_zero_point=None, *, output_dtype, precision, **attrs):
        """QuantizeLinear(x, y_scale, y_zero_point?) -> y = saturate(round(x / y_scale) +
        zp)."""
        target = _target(ctx, k, y_zero_point, output_dtype)
        attrs["precision"] = k.dtype(ctx, precision) if precision else None
        return k.run(
            lambda xp, x, s, zp: quantize(ctx, k, xp, x, s, zp, target, attrs),
            x,
            y_scale,
            y_zero_point,
        )

    @builtin("DequantizeLinear", since=10, attrs={"axis": 1, "block_size": 0, "output_dtype": 0})
    def dequantize_linear(ctx, x, x_scale, x_zero_point=None, *, axis, block_size, output_dtype):
        """DequantizeLinear(x, x_scale, x_zero_point?) -> y = (x - x_zero_point) * x_scale."""
        name = k.onnx_name(ctx, x.dtype)
        out = k.dtype(ctx, output_dtype) if output_dtype else None

        def fn(xp, x, scale, zero_point):
            shape = tuple(x.shape)
            y = astype(xp, x, xp.float32)
            # Float8 and float4 zero points must be zero: the spec ignores them.
            if zero_point is not None and name not in FLOAT8 and name not in FLOAT_LOW:
                zp = _param(ctx, k, zero_point, shape, axis, block_size, "zero point")
                y = y - astype(xp, zp, xp.float32)
            scale = _param(ctx, k, scale, shape, axis, block_size, "scale")
            return astype(xp, y * scale, scale.dtype if out is None else out)

        return k.run(fn, x, x_scale, x_zero_point)

    @builtin("DynamicQuantizeLinear", since=11)
    def dynamic_quantize_linear(ctx, x):
        """DynamicQuantizeLinear(x) -> (y: uint8, y_scale, y_zero_point) over x's range and
        0."""
        return k.run(lambda xp, x: _dynamic_quantize(k, xp, x), x)

    @builtin("MatMulInteger", since=10)
    def matmul_integer(ctx, a, b, a_zero_point=None, b_zero_point=None):
        """MatMulInteger(A, B, a_zero_point?, b_zero_point?) -> int32 (A - a_zp) @ (B -
        b_zp)."""

        def fn(xp, a, b, azp, bzp):
            a = _minus_zero_point(k, xp, a, azp, row_axis=-2)
            return k.int_matmul(a, _minus_zero_point(k, xp, b, bzp))

        return k.run(fn, a, b, a_zero_point, b_zero_point)

    @builtin("QLinearMatMul", since=10)
    def qlinear_matmul(ctx, a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp):
        """QLinearMatMul(a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp) -> quantized a @
        b."""
        out = y_zp.dtype if y_zp is not None else a.dtype
        if not is_integer(out):
            raise ctx.error(f"QLinearMatMul supports 8-bit integer outputs, got {out}")

        def fn(xp, a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp):
            a = _minus_zero_point(k, xp, a, a_zp, row_axis=-2)
            acc = k.int_matmul(a, _minus_zero_point(k, xp, b, b_zp))
            return _requantize(xp, acc, a_scale * b_scale / y_scale, y_zp, out)

        return k.run(fn, a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp)

    _register_conv(builtin, k)


def _register_conv(builtin: Callable[..., Any], k: QuantKernel) -> None:
    """ConvInteger and QLinearConv."""

    @builtin("ConvInteger", since=10, attrs=CONV_ATTRS)
    def conv_integer(ctx, x, w, x_zero_point=None, w_zero_point=None, **attrs):
        """ConvInteger(x, w, x_zero_point?, w_zero_point?) -> int32 conv of zero-shifted
        inputs."""
        return k.run(
            lambda xp, x, xzp, w, wzp: _int_conv(ctx, k, xp, x, xzp, w, wzp, attrs),
            x,
            x_zero_point,
            w,
            w_zero_point,
        )

    @builtin("QLinearConv", since=10, attrs=CONV_ATTRS)
    def qlinear_conv(ctx, x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, b=None, **attrs):
        """QLinearConv(x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, B?) -> quantized
        conv."""
        out = y_zp.dtype if y_zp is not None else w.dtype

        def fn(xp, x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, b):
            acc = _int_conv(ctx, k, xp, x, x_zp, w, w_zp, attrs)
            if b is not None:
                acc = acc + xp.reshape(astype(xp, b, xp.int32), (-1,) + (1,) * (acc.ndim - 2))
            if w_scale.ndim == 1 and math.prod(w_scale.shape) > 1:
                w_scale = xp.reshape(w_scale, (-1,) + (1,) * (acc.ndim - 2))
            return _requantize(xp, acc, x_scale * w_scale / y_scale, y_zp, out)

        return k.run(fn, x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, b)
