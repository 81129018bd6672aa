"""PyTorch handlers: BitShift and the quantization ops, and the torch kernel of the unary
math, arithmetic, comparison and logic ops (written once in :mod:`xconv.converters.ops.math`).

Those run with torch under numpy's names (:mod:`xconv.converters.torch.backend.xp`), which
keeps autograd, except when an input is a numpy array (string tensors) or a tensor of a wide
unsigned type (uint16/32/64), for which torch implements few CPU kernels: those run with
numpy and come back as tensors.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from xconv.converters.ops import shapes
from xconv.converters.ops.attrs import CONV_ATTRS
from xconv.converters.ops.math import quant_param, register_math_ops
from xconv.converters.torch.backend.dtypes import (
    needs_numpy,
)
from xconv.converters.torch.backend.registry import REQUIRED, builtin
from xconv.converters.torch.backend.xp import as_numpy, from_numpy, run

#: Attributes of the opset 1-6 binary ops (``broadcast``/``axis`` legacy broadcasting).
_LEGACY_BINARY = {"broadcast": 0, "axis": None, "consumed_inputs": None}


class _MathKernel:
    """The torch side of :mod:`xconv.converters.ops.math`."""

    run = staticmethod(run)

    @staticmethod
    def erf(xp, x):
        if xp is np:
            return torch.erf(torch.from_numpy(np.asarray(x, np.float64))).numpy().astype(x.dtype)
        return torch.erf(x)

    @staticmethod
    def int_div(a, b):
        return torch.div(a, b, rounding_mode="trunc").to(a.dtype)

    @staticmethod
    def int_pow(a, b):
        if bool((b < 0).any()):
            return torch.pow(a.double(), b.double()).to(a.dtype)
        return torch.pow(a, b.to(a.dtype))


register_math_ops(builtin, _MathKernel())


def _bit_shift_np(x, y, direction: str):
    x, y = np.broadcast_arrays(x, y)
    dtype = x.dtype
    bits = dtype.itemsize * 8
    signed = np.issubdtype(dtype, np.signedinteger)
    valid = (y < bits) & (y >= 0) if signed else y < bits
    shift = np.where(valid, y, 0).astype(dtype)
    if direction == "RIGHT":
        fill = np.where(x < 0, -1, 0).astype(dtype) if signed else 0
        return np.where(valid, np.right_shift(x, shift), fill).astype(dtype)
    return np.where(valid, np.left_shift(x, shift), 0).astype(dtype)


@builtin("BitShift", since=11, attrs={"direction": REQUIRED})
def bit_shift(ctx, x, y, *, direction):
    """BitShift(X, Y) -> Z: shift X by Y bits; shifts outside [0, width) give 0 (or -1)."""
    if direction not in ("LEFT", "RIGHT"):
        raise ctx.error(f"direction must be 'LEFT' or 'RIGHT', got {direction!r}")
    if needs_numpy(x, y) or x.dtype == torch.uint8:
        # uint8 shifts go through numpy too: torch's shift kernels promote oddly for it.
        return from_numpy(_bit_shift_np(as_numpy(x), as_numpy(y), direction), x)
    x, y = torch.broadcast_tensors(x, y)
    bits = x.element_size() * 8
    valid = (y < bits) & (y >= 0)
    shift = torch.where(valid, y, torch.zeros((), dtype=y.dtype, device=y.device)).to(x.dtype)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if direction == "RIGHT":
        fill = torch.where(x < 0, torch.full_like(x, -1), zero)
        return torch.where(valid, torch.bitwise_right_shift(x, shift), fill)
    return torch.where(valid, torch.bitwise_left_shift(x, shift), zero)


# ------------------------------------------------------------------------ quantization

#: Integer quantized types torch holds, with their ranges.
_INT_RANGES = {
    torch.uint8: (0, 255),
    torch.int8: (-128, 127),
    torch.uint16: (0, 65535),
    torch.int16: (-32768, 32767),
}
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)


def _onnx_to_torch(ctx, data_type: int) -> torch.dtype:
    import onnx_ir as ir

    from xconv.converters.torch.backend.dtypes import torch_dtype

    try:
        return torch_dtype(ir.DataType(data_type))
    except KeyError as e:
        raise ctx.error(str(e.args[0])) from None


def _blocks(value, block_size, axis, length):
    return torch.repeat_interleave(value, block_size, dim=axis).narrow(axis, 0, length)


def _quant_param(ctx, value, shape, axis: int, block_size: int, what: str):
    """Scale or zero point, broadcastable to ``shape``: per tensor, per axis or blocked."""
    return quant_param(ctx, value, shape, axis, block_size, what, _blocks)


def _quant_supported() -> list[str]:
    return sorted(str(t).removeprefix("torch.") for t in (*_INT_RANGES, *_FLOAT8))


def quantize(
    ctx, x, scale, zero_point, target, *, axis=1, block_size=0, saturate=1, precision=None
):
    """x / scale (+ zero point), rounded half to even and saturated into ``target``."""
    shape = tuple(x.shape)
    scale = _quant_param(ctx, scale, shape, axis, block_size, "scale")
    if precision is not None:
        x, scale = x.to(precision), scale.to(precision)
    dtype = torch.promote_types(x.dtype, scale.dtype)
    y = x.to(dtype) / scale.to(dtype)
    if target in _INT_RANGES:
        lo, hi = _INT_RANGES[target]
        y = torch.round(y)
        if zero_point is not None:
            zp = _quant_param(ctx, zero_point, shape, axis, block_size, "zero point")
            y = y.to(torch.float32) + zp.to(torch.float32)
        return torch.clamp(y, lo, hi).to(target)
    if target in _FLOAT8:
        if saturate:
            info = torch.finfo(target)
            y = torch.clamp(y.to(torch.float32), info.min, info.max)
        return y.to(target)
    raise ctx.error(f"cannot quantize to {target}; torch supports {_quant_supported()}")


_QUANTIZE_ATTRS = {"axis": 1, "saturate": 1, "block_size": 0, "output_dtype": 0, "precision": 0}


@builtin("QuantizeLinear", since=10, attrs=_QUANTIZE_ATTRS)
def quantize_linear(
    ctx, x, y_scale, y_zero_point=None, *, axis, saturate, block_size, output_dtype, precision
):
    """QuantizeLinear(x, y_scale, y_zero_point?) -> y = saturate(round(x / y_scale) + zp)."""
    declared = ctx.node.inputs[2].dtype if len(ctx.node.inputs) > 2 and ctx.node.inputs[2] else None
    if y_zero_point is not None:
        if declared is not None and not isinstance(y_zero_point, torch.Tensor):
            raise ctx.error(f"zero point type {declared.name} has no torch equivalent")
        target = y_zero_point.dtype
        if output_dtype and _onnx_to_torch(ctx, output_dtype) != target:
            raise ctx.error("output_dtype differs from the zero point's type")
    elif output_dtype:
        target = _onnx_to_torch(ctx, output_dtype)
    else:
        target = torch.uint8
    prec = _onnx_to_torch(ctx, precision) if precision else None
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
    shape = tuple(x.shape)
    y = x.to(torch.float32)
    # Float8 zero points must be zero: the spec ignores them.
    if x_zero_point is not None and x.dtype not in _FLOAT8:
        zp = _quant_param(ctx, x_zero_point, shape, axis, block_size, "zero point")
        y = y - zp.to(torch.float32)
    scale = _quant_param(ctx, x_scale, shape, axis, block_size, "scale")
    y = y * scale
    dtype = _onnx_to_torch(ctx, output_dtype) if output_dtype else scale.dtype
    return y.to(dtype)


@builtin("DynamicQuantizeLinear", since=11)
def dynamic_quantize_linear(ctx, x):
    """DynamicQuantizeLinear(x) -> (y: uint8, y_scale, y_zero_point) over x's range and 0."""
    xf = x.to(torch.float32)
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    hi = torch.maximum(zero, xf.max()) if xf.numel() else zero
    lo = torch.minimum(zero, xf.min()) if xf.numel() else zero
    scale = torch.where(hi == lo, torch.ones_like(hi), hi - lo) / 255.0
    zp = torch.round(torch.clamp(0.0 - lo / scale, 0, 255))
    y = torch.clamp(torch.round(xf / scale) + zp, 0, 255)
    return y.to(torch.uint8), scale.to(x.dtype), zp.to(torch.uint8)


def _minus_zero_point(x, zero_point, row_axis: int | None = None):
    """``x - zero_point`` in float64 (exact for 8/16-bit data; float matmul runs everywhere)."""
    x = x.to(torch.float64)
    if zero_point is None:
        return x
    zp = zero_point.to(torch.float64)
    if row_axis is not None and zp.ndim == 1 and zp.numel() > 1:
        # A per-row zero point of A has shape [M]: align it with A's row axis.
        zp = zp.reshape((-1,) + (1,) * (x.ndim - 1 - (row_axis % x.ndim)))
    return x - zp


@builtin("MatMulInteger", since=10)
def matmul_integer(ctx, a, b, a_zero_point=None, b_zero_point=None):
    """MatMulInteger(A, B, a_zero_point?, b_zero_point?) -> int32 (A - a_zp) @ (B - b_zp)."""
    acc = torch.matmul(
        _minus_zero_point(a, a_zero_point, row_axis=-2), _minus_zero_point(b, b_zero_point)
    )
    return acc.to(torch.int32)


def _requantize(acc, factor, y_zero_point, out_dtype):
    y = torch.round(acc.to(torch.float32) * factor.to(torch.float32))
    if y_zero_point is not None:
        y = y + y_zero_point.to(torch.float32)
    info = torch.iinfo(out_dtype)
    return torch.clamp(y, info.min, info.max).to(out_dtype)


@builtin("QLinearMatMul", since=10)
def qlinear_matmul(ctx, a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point):
    """QLinearMatMul(a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp) -> quantized a @ b."""
    acc = torch.matmul(
        _minus_zero_point(a, a_zero_point, row_axis=-2), _minus_zero_point(b, b_zero_point)
    ).to(torch.int32)
    factor = a_scale * b_scale / y_scale
    out = y_zero_point.dtype if y_zero_point is not None else a.dtype
    if out.is_floating_point:
        raise ctx.error(f"QLinearMatMul supports 8-bit integer outputs, got {out}")
    return _requantize(acc, factor, y_zero_point, out)


def _conv_exact(ctx, x, w, *, auto_pad, dilations, group, kernel_shape, pads, strides):
    """N-D convolution (NC..., OI...) of float64 integer data with ONNX padding rules."""
    nd = x.ndim - 2
    if nd not in (1, 2, 3):
        raise ctx.error(f"input must have rank 3 to 5 (N, C, spatial...), got {x.ndim}")
    kernel = tuple(kernel_shape) if kernel_shape else tuple(w.shape[2:])
    strides, dilations = shapes.ints(strides, nd, 1), shapes.ints(dilations, nd, 1)
    spatial = tuple(x.shape[2:])
    padding = shapes.conv_padding(ctx.node, auto_pad, spatial, kernel, strides, dilations, pads)
    flat = [p for pair in reversed(padding) for p in pair]
    x = F.pad(x, flat) if any(flat) else x
    conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    return conv(x, w, stride=strides, dilation=dilations, groups=group)


def _per_channel(value, rank: int):
    """A per-output-channel (1-D) parameter reshaped to broadcast over (M, ...)."""
    if value.ndim == 1 and value.numel() > 1:
        return value.reshape((-1,) + (1,) * (rank - 1))
    return value.reshape(()) if value.numel() == 1 else value


@builtin("ConvInteger", since=10, attrs=CONV_ATTRS)
def conv_integer(ctx, x, w, x_zero_point=None, w_zero_point=None, **attrs):
    """ConvInteger(x, w, x_zero_point?, w_zero_point?) -> int32 conv of zero-shifted inputs."""
    x = _minus_zero_point(x, x_zero_point)
    w = w.to(torch.float64)
    if w_zero_point is not None:
        w = w - _per_channel(w_zero_point, w.ndim).to(torch.float64)
    return _conv_exact(ctx, x, w, **attrs).to(torch.int32)


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
    wq = w.to(torch.float64)
    if w_zero_point is not None:
        wq = wq - _per_channel(w_zero_point, wq.ndim).to(torch.float64)
    acc = _conv_exact(ctx, x, wq, **attrs).to(torch.int32)
    if b is not None:
        acc = acc + b.to(torch.int32).reshape((-1,) + (1,) * (acc.ndim - 2))
    if w_scale.ndim == 1 and w_scale.numel() > 1:
        w_scale = w_scale.reshape((-1,) + (1,) * (acc.ndim - 2))
    factor = x_scale * w_scale / y_scale
    out = y_zero_point.dtype if y_zero_point is not None else w.dtype
    return _requantize(acc, factor, y_zero_point, out)
