"""PyTorch handler of BitShift, and the torch kernels of the unary math, arithmetic,
comparison and logic ops (written once in :mod:`xconv.converters.ops.math`) and of the
quantization ops (:mod:`xconv.converters.ops.quant`).

Those run with torch under numpy's names (:mod:`xconv.converters.torch.runtime.xp`), which
keeps autograd, except when an input is a numpy array (string tensors) or a tensor of a wide
unsigned type (uint16/32/64), for which torch implements few CPU kernels: those run with
numpy and come back as tensors.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from xconv.converters.ops import shapes
from xconv.converters.ops.math import register_math_ops
from xconv.converters.ops.quant import FLOAT8, INT_RANGES, register_quant_ops
from xconv.converters.torch.runtime import xp
from xconv.converters.torch.runtime.dtypes import (
    FLOAT4,
    float4_values,
    needs_numpy,
    onnx_type_name,
    widen,
)
from xconv.converters.torch.runtime.registry import REQUIRED, builtin
from xconv.converters.torch.runtime.xp import KERNEL, as_numpy, from_numpy, run

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


def _onnx_name(ctx, dtype) -> str:
    name = onnx_type_name(dtype)
    if name is None:
        raise ctx.error(f"quantized type {dtype} has no torch equivalent")
    return name


def _int_conv(ctx, x, w, *, auto_pad, dilations, group, kernel_shape, pads, strides):
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
    return conv(x, w, stride=strides, dilation=dilations, groups=group).to(torch.int32)


class _QuantKernel:
    """The torch side of :mod:`xconv.converters.ops.quant`: the 2/4/8/16-bit integer, float8
    and float4e2m1 types (int4 and int2 held one value per byte, computed in the byte type;
    float4 in float32), products
    in float64 (exact for that data; integer matmul/conv kernels are missing on most
    devices)."""

    quant_types = frozenset(INT_RANGES) | frozenset(FLOAT8) | {"FLOAT4E2M1"}
    acc_dtype = torch.float64
    dtype = staticmethod(KERNEL.dtype)
    onnx_name = staticmethod(_onnx_name)
    finfo = staticmethod(torch.finfo)
    int_conv = staticmethod(_int_conv)

    @staticmethod
    def run(fn, *arrays):
        def values(a):
            is_float4 = isinstance(a, torch.Tensor) and a.dtype == FLOAT4
            return float4_values(a) if is_float4 else widen(a)

        return fn(xp, *(values(a) for a in arrays))

    @staticmethod
    def divide(x, scale):
        return x / scale

    @staticmethod
    def blocks(value, block_size, axis, length):
        return torch.repeat_interleave(value, block_size, dim=axis).narrow(axis, 0, length)

    @staticmethod
    def int_matmul(a, b):
        return torch.matmul(a, b).to(torch.int32)


register_quant_ops(builtin, _QuantKernel())
