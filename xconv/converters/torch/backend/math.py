"""PyTorch handlers: unary math, arithmetic, comparison, logic, bitwise and quantization ops.

Every table entry is written once against names numpy and torch share (``xp.add``,
``xp.logical_and``, ...). Handlers run it with torch, which keeps autograd, except when an
input is a numpy array (string tensors) or a tensor of a wide unsigned type (uint16/32/64),
for which torch implements few CPU kernels: those run with numpy and come back as tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from xconv.converters.ops.arrays import namespace
from xconv.converters.ops.attrs import CONV_ATTRS
from xconv.converters.torch.backend.dtypes import (
    needs_numpy,
    numpy_only,
    to_tensor,
)
from xconv.converters.torch.backend.registry import REQUIRED, builtin

#: Attributes of the opset 1-6 binary ops (``broadcast``/``axis`` legacy broadcasting).
_LEGACY_BINARY = {"broadcast": 0, "axis": None, "consumed_inputs": None}


def as_numpy(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def from_numpy(y: Any, like: Any = None) -> Any:
    """A numpy result back to a tensor (on ``like``'s device); strings stay numpy."""
    y = np.asarray(y)
    out = to_tensor(y)
    if isinstance(out, torch.Tensor) and isinstance(like, torch.Tensor):
        out = out.to(like.device)
    return out


def run_xp(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(xp, *args)`` with torch, or with numpy for inputs torch cannot compute with."""
    if namespace(torch, *args, numpy_for=numpy_only) is np:
        like = next((a for a in args if isinstance(a, torch.Tensor)), None)
        with np.errstate(all="ignore"):
            return from_numpy(fn(np, *(None if a is None else as_numpy(a) for a in args)), like)
    return fn(torch, *args)


def _astype(xp, y, dtype):
    return y.astype(dtype) if xp is np else y.to(dtype)


def _same(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Wrap a unary function so its result keeps the input dtype."""

    def wrapped(xp, x):
        return _astype(xp, xp.asarray(fn(xp, x)), x.dtype)

    return wrapped


def _erf(xp, x):
    if xp is np:
        return np.asarray(torch.erf(torch.from_numpy(np.asarray(x, np.float64))).numpy()).astype(
            x.dtype
        )
    return torch.erf(x)


def _round(xp, x):
    return np.rint(x) if xp is np else torch.round(x)  # both round half to even


#: Unary ops: ``(since, fn(xp, x))``.
UNARY: dict[str, tuple[int, Callable[[Any, Any], Any]]] = {
    "Abs": (1, lambda xp, x: xp.abs(x)),
    "Neg": (1, lambda xp, x: xp.negative(x)),
    "Reciprocal": (1, _same(lambda xp, x: xp.reciprocal(x))),
    "Sqrt": (1, lambda xp, x: xp.sqrt(x)),
    "Exp": (1, lambda xp, x: xp.exp(x)),
    "Log": (1, lambda xp, x: xp.log(x)),
    "Ceil": (1, lambda xp, x: xp.ceil(x)),
    "Floor": (1, lambda xp, x: xp.floor(x)),
    "Round": (11, _round),
    "Sign": (9, lambda xp, x: xp.sign(x)),
    "Erf": (9, _erf),
    "Sin": (7, lambda xp, x: xp.sin(x)),
    "Cos": (7, lambda xp, x: xp.cos(x)),
    "Tan": (7, lambda xp, x: xp.tan(x)),
    "Asin": (7, lambda xp, x: xp.arcsin(x)),
    "Acos": (7, lambda xp, x: xp.arccos(x)),
    "Atan": (7, lambda xp, x: xp.arctan(x)),
    "Sinh": (9, lambda xp, x: xp.sinh(x)),
    "Cosh": (9, lambda xp, x: xp.cosh(x)),
    "Asinh": (9, lambda xp, x: xp.arcsinh(x)),
    "Acosh": (9, lambda xp, x: xp.arccosh(x)),
    "Atanh": (9, lambda xp, x: xp.arctanh(x)),
    "IsNaN": (9, lambda xp, x: xp.isnan(x)),
    "Not": (1, lambda xp, x: xp.logical_not(x)),
    "BitwiseNot": (18, lambda xp, x: xp.bitwise_not(x)),
}


def _register_unary(op_type: str, since: int, fn: Callable[[Any, Any], Any]) -> None:
    def handler(ctx, x):
        return run_xp(fn, x)

    def legacy(ctx, x, *, consumed_inputs):
        return run_xp(fn, x)

    handler.__name__ = legacy.__name__ = op_type.lower()
    handler.__doc__ = f"{op_type}(X) -> Y, elementwise."
    legacy.__doc__ = handler.__doc__
    if since == 1:
        builtin(op_type, since=1, until=5, attrs={"consumed_inputs": None})(legacy)
        since = 6
    builtin(op_type, since=since)(handler)


for _op, (_since, _fn) in UNARY.items():
    _register_unary(_op, _since, _fn)


@builtin("IsInf", since=10, attrs={"detect_negative": 1, "detect_positive": 1})
def is_inf(ctx, x, *, detect_negative, detect_positive):
    """IsInf(X) -> Y: bool, which elements are infinite (of the signs asked for)."""
    if detect_negative and detect_positive:
        return torch.isinf(x)
    if detect_negative:
        return torch.isneginf(x)
    if detect_positive:
        return torch.isposinf(x)
    return torch.zeros(x.shape, dtype=torch.bool, device=x.device)


# --------------------------------------------------------------------------- binary ops


def _legacy_broadcast(a, b, broadcast, axis):
    """Opset < 7 broadcasting: B (a suffix of A's shape, or aligned at ``axis``) onto A."""
    if not broadcast or axis is None:
        return b
    axis = axis % a.ndim
    return b.reshape(tuple(b.shape) + (1,) * (a.ndim - axis - b.ndim))


def _is_int(dtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    return np.dtype(dtype).kind in "iu"


def _div(xp, a, b):
    if _is_int(a.dtype):
        if xp is torch:
            return torch.div(a, b, rounding_mode="trunc").to(a.dtype)
        q = np.floor_divide(a, b)
        if np.issubdtype(q.dtype, np.unsignedinteger):
            return q
        adjust = (np.remainder(a, b) != 0) & ((a < 0) ^ (b < 0))
        return q + adjust.astype(q.dtype)
    return _astype(xp, xp.divide(a, b), a.dtype)


def _pow(xp, a, b):
    # Mixed types are allowed: the result has the base's dtype.
    if xp is np:
        if np.issubdtype(b.dtype, np.integer) and np.any(b < 0):
            return np.power(a.astype(np.float64), b).astype(a.dtype)
        return np.power(a, b).astype(a.dtype)
    if _is_int(a.dtype) and _is_int(b.dtype):
        if bool((b < 0).any()):
            return torch.pow(a.double(), b.double()).to(a.dtype)
        return torch.pow(a, b.to(a.dtype))
    return torch.pow(a, b).to(a.dtype)


#: Binary ops with numpy broadcasting: ``(since, fn(xp, a, b))``.
BINARY: dict[str, tuple[int, Callable[[Any, Any, Any], Any]]] = {
    "Add": (1, lambda xp, a, b: xp.add(a, b)),
    "Sub": (1, lambda xp, a, b: xp.subtract(a, b)),
    "Mul": (1, lambda xp, a, b: xp.multiply(a, b)),
    "Div": (1, _div),
    "Pow": (1, _pow),
    "And": (1, lambda xp, a, b: xp.logical_and(a, b)),
    "Or": (1, lambda xp, a, b: xp.logical_or(a, b)),
    "Xor": (1, lambda xp, a, b: xp.logical_xor(a, b)),
    "Equal": (1, lambda xp, a, b: xp.eq(a, b) if xp is torch else np.equal(a, b)),
    "Greater": (1, lambda xp, a, b: xp.greater(a, b)),
    "Less": (1, lambda xp, a, b: xp.less(a, b)),
    "GreaterOrEqual": (12, lambda xp, a, b: xp.greater_equal(a, b)),
    "LessOrEqual": (12, lambda xp, a, b: xp.less_equal(a, b)),
    "BitwiseAnd": (18, lambda xp, a, b: xp.bitwise_and(a, b)),
    "BitwiseOr": (18, lambda xp, a, b: xp.bitwise_or(a, b)),
    "BitwiseXor": (18, lambda xp, a, b: xp.bitwise_xor(a, b)),
}

#: Ops whose opset 1 version carried ``consumed_inputs`` besides ``broadcast``/``axis``.
_CONSUMED = {"Add", "Sub", "Mul", "Div"}


def _register_binary(op_type: str, since: int, fn: Callable[[Any, Any, Any], Any]) -> None:
    def handler(ctx, a, b):
        return run_xp(fn, a, b)

    def legacy(ctx, a, b, *, broadcast, axis, consumed_inputs=None):
        return run_xp(fn, a, _legacy_broadcast(a, b, broadcast, axis))

    handler.__name__ = legacy.__name__ = op_type.lower()
    handler.__doc__ = f"{op_type}(A, B) -> C, elementwise with numpy broadcasting."
    legacy.__doc__ = handler.__doc__
    if since == 1:
        attrs = dict(_LEGACY_BINARY)
        if op_type not in _CONSUMED:
            del attrs["consumed_inputs"]
        builtin(op_type, since=1, until=6, attrs=attrs)(legacy)
        since = 7
    builtin(op_type, since=since)(handler)


for _op, (_since, _fn) in BINARY.items():
    _register_binary(_op, _since, _fn)


def _mod(xp, a, b):
    if xp is np:
        return np.mod(a, b)
    if not a.dtype.is_floating_point:
        return torch.remainder(a, b)
    # remainder(x, inf) is nan in torch; numpy (and ONNX's reference) keep x or return inf.
    r = torch.remainder(a, b)
    inf_b = torch.isinf(b) & torch.isfinite(a)
    keep = (a == 0) | ((a > 0) == (b > 0))
    return torch.where(inf_b, torch.where(keep, a, b), r)


@builtin("Mod", since=10, attrs={"fmod": 0})
def mod(ctx, a, b, *, fmod):
    """Mod(A, B) -> C: remainder; sign of the divisor (fmod=0) or of the dividend (fmod=1)."""
    if fmod:
        return run_xp(lambda xp, a, b: xp.fmod(a, b), a, b)
    return run_xp(_mod, a, b)


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


# ------------------------------------------------------------------------ variadic ops


def _variadic(ctx, inputs, fn):
    inputs = [x for x in inputs if x is not None]
    if not inputs:
        raise ctx.error("needs at least one input")
    return run_xp(lambda xp, *xs: functools.reduce(lambda a, b: fn(xp, a, b), xs), *inputs)


def _register_variadic(op_type: str, fn: Callable[..., Any], doc: str) -> None:
    def handler(ctx, *inputs):
        return fn(ctx, inputs)

    def legacy(ctx, *inputs, consumed_inputs):
        return fn(ctx, inputs)

    handler.__name__ = legacy.__name__ = op_type.lower()
    handler.__doc__ = legacy.__doc__ = doc
    builtin(op_type, since=1, until=5, attrs={"consumed_inputs": None})(legacy)
    builtin(op_type, since=6)(handler)


def _max(ctx, inputs):
    return _variadic(ctx, inputs, lambda xp, a, b: xp.maximum(a, b))


def _min(ctx, inputs):
    return _variadic(ctx, inputs, lambda xp, a, b: xp.minimum(a, b))


def _sum(ctx, inputs):
    return _variadic(ctx, inputs, lambda xp, a, b: xp.add(a, b))


def _mean(ctx, inputs):
    total = _sum(ctx, inputs)
    n = sum(x is not None for x in inputs)
    return (total / n).to(total.dtype)


_register_variadic("Max", _max, "Max(data_0, ...) -> max: elementwise max with broadcasting.")
_register_variadic("Min", _min, "Min(data_0, ...) -> min: elementwise min with broadcasting.")
_register_variadic("Sum", _sum, "Sum(data_0, ...) -> sum: elementwise sum with broadcasting.")
_register_variadic("Mean", _mean, "Mean(data_0, ...) -> mean: elementwise mean, broadcasting.")


@builtin("Where", since=9)
def where(ctx, condition, x, y):
    """Where(condition, X, Y) -> Z: X where condition holds, else Y (with broadcasting)."""
    return run_xp(lambda xp, c, a, b: xp.where(c, a, b), condition, x, y)


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


def _quant_param(ctx, value, shape, axis: int, block_size: int, what: str):
    """Scale or zero point, broadcastable to ``shape``: per tensor, per axis or blocked."""
    if value.ndim == 0:
        return value
    if value.numel() == 1:
        return value.reshape(())
    rank = len(shape)
    if not -rank <= axis < rank:
        raise ctx.error(f"axis {axis} is out of range for an input of rank {rank}")
    axis %= rank
    if not block_size:
        if value.ndim != 1 or value.shape[0] != shape[axis]:
            raise ctx.error(
                f"per-axis {what} must be 1-D with {shape[axis]} elements (axis {axis}), "
                f"got shape {tuple(value.shape)}"
            )
        dims = [1] * rank
        dims[axis] = value.shape[0]
        return value.reshape(dims)
    if block_size < 0:
        raise ctx.error(f"block_size must be positive, got {block_size}")
    value = torch.repeat_interleave(value, block_size, dim=axis)
    value = value.narrow(axis, 0, shape[axis])
    if tuple(value.shape) != tuple(shape):
        raise ctx.error(
            f"blocked {what} of shape {tuple(value.shape)} does not match the input "
            f"{tuple(shape)} outside the blocked axis"
        )
    return value


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
    strides = tuple(strides) if strides else (1,) * nd
    dilations = tuple(dilations) if dilations else (1,) * nd
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        padding = []
        for size, k, s, d in zip(x.shape[2:], kernel, strides, dilations, strict=True):
            out = -(-size // s)
            total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
            small, big = total // 2, total - total // 2
            padding.append((small, big) if auto_pad == "SAME_UPPER" else (big, small))
    elif auto_pad == "VALID":
        padding = [(0, 0)] * nd
    elif auto_pad == "NOTSET":
        pads = tuple(pads) if pads else (0,) * (2 * nd)
        padding = [(pads[i], pads[i + nd]) for i in range(nd)]
    else:
        raise ctx.error(f"auto_pad={auto_pad!r}; supported: NOTSET, SAME_UPPER, SAME_LOWER, VALID")
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
