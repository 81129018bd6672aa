"""PyTorch handlers: activations, Clip, PRelu, and the dtype conversions Cast, CastLike, BitCast.

Activations compute in the input's dtype (float16 stays float16) and use
``torch.nn.functional`` where its definition is ONNX's (``F.gelu(approximate=...)``,
``F.elu``, ``F.celu``, ``F.mish``, ...). Cast covers every ONNX type torch holds (the float8
family and float8e8m0 included); the sub-byte types (int4, uint4, int2, uint2, float4e2m1)
raise an error naming the supported ones. Strings are numpy arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
import torch
import torch.nn.functional as F

from xconv.converters.torch.backend.dtypes import _BY_NAME, WIDE_UNSIGNED
from xconv.converters.torch.backend.math import as_numpy, from_numpy
from xconv.converters.torch.backend.registry import REQUIRED, builtin
from xconv.errors import UnsupportedAttributeError


def _consumed(since: int) -> dict[str, Any]:
    return {"consumed_inputs": None} if since == 1 else {}


def _activation(op_type: str, fn, attrs: dict[str, Any], versions=(1, 6)) -> None:
    """Register ``fn(x, **attrs)`` for every opset; opset 1 also took ``consumed_inputs``."""

    def handler(ctx, x, consumed_inputs=None, **kwargs):
        return fn(x, **kwargs)

    handler.__name__ = op_type.lower()
    handler.__doc__ = f"{op_type}(X) -> Y, elementwise activation."
    first = versions[0]
    if first == 1:
        builtin(op_type, since=1, until=5, attrs={**attrs, **_consumed(1)})(handler)
        first = 6
    builtin(op_type, since=first, attrs=attrs)(handler)


def _zero(x):
    return torch.zeros((), dtype=x.dtype, device=x.device)


def _relu(x):
    if x.dtype.is_floating_point:
        return torch.relu(x)
    return torch.maximum(x, _zero(x))


def _leaky_relu(x, *, alpha):
    return torch.where(x >= 0, x, (x * alpha).to(x.dtype))


def _selu(x, *, alpha, gamma):
    return (gamma * torch.where(x > 0, x, alpha * torch.expm1(x))).to(x.dtype)


def _hard_sigmoid(x, *, alpha, beta):
    return torch.clamp(alpha * x + beta, 0, 1).to(x.dtype)


def _thresholded_relu(x, *, alpha):
    return torch.where(x > alpha, x, _zero(x))


def _shrink(x, *, bias, lambd):
    # Shrink accepts integer tensors too: compute in float, return the input dtype.
    xf = x if x.dtype.is_floating_point else x.to(torch.float32)
    zero = torch.zeros((), dtype=xf.dtype, device=x.device)
    y = torch.where(xf < -lambd, xf + bias, torch.where(xf > lambd, xf - bias, zero))
    return y.to(x.dtype)


def _swish(x, *, alpha):
    return (x * torch.sigmoid(alpha * x)).to(x.dtype)


_activation("Relu", _relu, {})
_activation("LeakyRelu", _leaky_relu, {"alpha": 0.01})
_activation("Elu", lambda x, *, alpha: F.elu(x, alpha), {"alpha": 1.0})
_activation("Selu", _selu, {"alpha": 1.67326319217681884765625, "gamma": 1.05070102214813232421875})
_activation("Celu", lambda x, *, alpha: F.celu(x, alpha), {"alpha": 1.0}, versions=(12,))
_activation("Sigmoid", torch.sigmoid, {})
_activation("HardSigmoid", _hard_sigmoid, {"alpha": 0.2, "beta": 0.5})
_activation("HardSwish", F.hardswish, {}, versions=(14,))
_activation("Softplus", F.softplus, {}, versions=(1,))
_activation("Softsign", F.softsign, {}, versions=(1,))
_activation("ThresholdedRelu", _thresholded_relu, {"alpha": 1.0}, versions=(10,))
_activation("Shrink", _shrink, {"bias": 0.0, "lambd": 0.5}, versions=(9,))
_activation("Mish", F.mish, {}, versions=(18,))
_activation("Swish", _swish, {"alpha": 1.0}, versions=(24,))
_activation("Tanh", torch.tanh, {})


@builtin("Gelu", since=20, attrs={"approximate": "none"})
def gelu(ctx, x, *, approximate):
    """Gelu(X) -> Y: exact erf form (approximate="none") or the tanh approximation."""
    if approximate not in ("none", "tanh"):
        raise UnsupportedAttributeError(
            f"approximate={approximate!r}; supported: 'none' (erf), 'tanh'",
            op=ctx.node.op_type,
            node=ctx.node.name,
        )
    return F.gelu(x, approximate=approximate)


def _prelu(ctx, x, slope):
    slope = slope.to(x.dtype)
    try:
        torch.broadcast_shapes(tuple(slope.shape), tuple(x.shape))
    except RuntimeError:
        # Opset < 7 models put a per-channel slope of shape [C] against NC...: align it
        # with the one dimension of x that has C elements.
        matches = [i for i, d in enumerate(x.shape) if d == slope.numel()]
        if slope.ndim != 1 or len(matches) != 1:
            raise ctx.error(
                f"slope of shape {tuple(slope.shape)} does not broadcast to {tuple(x.shape)}"
            ) from None
        shape = [1] * x.ndim
        shape[matches[0]] = slope.numel()
        slope = slope.reshape(shape)
    return torch.where(x < 0, x * slope, x)


@builtin("PRelu", since=7)
def prelu(ctx, x, slope):
    """PRelu(X, slope) -> Y: x if x >= 0 else slope * x; slope broadcasts to X."""
    return _prelu(ctx, x, slope)


@builtin("PRelu", since=1, until=6, attrs={"consumed_inputs": None})
def prelu_legacy(ctx, x, slope, *, consumed_inputs):
    """PRelu(X, slope) -> Y (opset 1-6)."""
    return _prelu(ctx, x, slope)


@builtin("Clip", since=11)
def clip(ctx, x, lo=None, hi=None):
    """Clip(input, min?, max?) -> output; min > max gives max everywhere."""
    if x.dtype in WIDE_UNSIGNED:
        y = as_numpy(x)
        if lo is not None:
            y = np.maximum(y, as_numpy(lo))
        if hi is not None:
            y = np.minimum(y, as_numpy(hi))
        return from_numpy(y.astype(as_numpy(x).dtype), x)
    if lo is not None:
        x = torch.maximum(x, lo.to(x.dtype))
    if hi is not None:
        x = torch.minimum(x, hi.to(x.dtype))
    return x


@builtin("Clip", since=1, until=10, attrs={"min": None, "max": None, "consumed_inputs": None})
def clip_legacy(ctx, x, *, min, max, consumed_inputs):  # noqa: A002 - ONNX attribute names
    """Clip(input) -> output (opset < 11: bounds are the min/max attributes)."""
    lo = -3.4028234663852886e38 if min is None else min
    hi = 3.4028234663852886e38 if max is None else max
    return torch.clamp(x, lo, hi).to(x.dtype)


# ------------------------------------------------------------------------- dtype casts

_FLOAT8 = {
    ir.DataType.FLOAT8E4M3FN,
    ir.DataType.FLOAT8E4M3FNUZ,
    ir.DataType.FLOAT8E5M2,
    ir.DataType.FLOAT8E5M2FNUZ,
}

#: ONNX types torch holds, beyond the interpreter's table.
_EXTRA = {"FLOAT8E8M0": torch.float8_e8m0fnu}


def _data_type(ctx, to: int | str) -> ir.DataType:
    try:
        # Cast-1 named the type with a string ("FLOAT").
        return ir.DataType[to] if isinstance(to, str) else ir.DataType(to)
    except (KeyError, ValueError):
        raise ctx.error(f"unknown target data type {to!r}") from None


def _torch_type(ctx, dtype: ir.DataType) -> torch.dtype:
    found = _BY_NAME.get(dtype.name) or _EXTRA.get(dtype.name)
    if found is None:
        supported = sorted([*_BY_NAME, *_EXTRA, "STRING"])
        raise ctx.error(f"ONNX type {dtype.name} has no torch equivalent; supported: {supported}")
    return found


def _to_e8m0(x, saturate: bool, round_mode: str):
    """float -> float8e8m0 (a bare power-of-two exponent), as the ONNX spec rounds it."""
    bits = x.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    exponent = (bits >> 23) & 0xFF
    special = exponent == 0xFF
    if round_mode == "nearest":
        g = (bits & 0x400000) > 0
        r = (bits & 0x200000) > 0
        s = (bits & 0x1FFFFF) > 0
        round_up = g & (r | s | (exponent > 0)) & ~special
    elif round_mode == "up":
        round_up = ((bits & 0x7FFFFF) > 0) & ~special
    elif round_mode == "down":
        round_up = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    else:
        raise ValueError(f"round_mode must be 'up', 'down' or 'nearest', got {round_mode!r}")
    if saturate:
        round_up = round_up & (exponent != 0xFE)
    exponent = torch.where(special, torch.full_like(exponent, 0xFF), exponent + round_up.long())
    return exponent.to(torch.uint8).view(torch.float8_e8m0fnu)


def _from_strings(ctx, x, target: torch.dtype):
    """String tensor -> numbers, parsed by numpy (``"1e-3"``, ``"NaN"``, ``"-INF"``...)."""
    x = np.asarray(x)
    if target.is_floating_point or target == torch.bool:
        parsed = x.astype(np.float64)
        if target == torch.bool:
            return torch.from_numpy(parsed != 0)
        return torch.from_numpy(parsed).to(target)
    return torch.from_numpy(x.astype(np.int64)).to(target)


def _to_strings(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x.astype(np.str_).astype(object)
    if x.dtype == torch.bfloat16 or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = x.to(torch.float32)
    return as_numpy(x).astype(np.str_).astype(object)


def cast_tensor(ctx, x, to: ir.DataType, saturate: int, round_mode: str):
    """Cast ``x`` to ONNX type ``to`` (torch tensors; strings are numpy arrays)."""
    if to == ir.DataType.STRING:
        return _to_strings(x)
    target = _torch_type(ctx, to)
    if isinstance(x, np.ndarray):
        return _from_strings(ctx, x, target)
    if to == ir.DataType.FLOAT8E8M0:
        return _to_e8m0(x, bool(saturate), round_mode)
    if to in _FLOAT8 and x.dtype.is_floating_point:
        if saturate:
            info = torch.finfo(target)
            x = torch.clamp(x.to(torch.float32), info.min, info.max)
        elif to in (
            ir.DataType.FLOAT8E4M3FN,
            ir.DataType.FLOAT8E4M3FNUZ,
            ir.DataType.FLOAT8E5M2FNUZ,
        ):
            # Types without infinities: overflow (and infinities) become NaN.
            info = torch.finfo(target)
            xf = x.to(torch.float32)
            overflow = xf.abs() > info.max
            nan = torch.full_like(xf, float("nan"))
            rounded = xf.to(target).to(torch.float32)
            x = torch.where(overflow | rounded.isnan(), nan, xf)
    if (x.dtype in WIDE_UNSIGNED) != (target in WIDE_UNSIGNED) and not x.dtype.is_floating_point:
        # Conversions between the wide unsigned types and others wrap like numpy's.
        y = as_numpy(x).astype(as_numpy(torch.zeros((), dtype=target)).dtype)
        return from_numpy(y, x)
    return x.to(target)


_CAST_ATTRS = {"to": REQUIRED, "saturate": 1, "round_mode": "up"}


@builtin("Cast", since=1, attrs=_CAST_ATTRS)
def cast(ctx, x, *, to, saturate, round_mode):
    """Cast(input) -> output of type ``to`` (saturate: float8 overflow clamps; round_mode: e8m0)."""
    return cast_tensor(ctx, x, _data_type(ctx, to), saturate, round_mode)


@builtin("CastLike", since=15, attrs={"saturate": 1, "round_mode": "up"})
def cast_like(ctx, x, target_type, *, saturate, round_mode):
    """CastLike(input, target_type) -> input cast to target_type's element type."""
    declared = ctx.node.inputs[1].dtype if ctx.node.inputs[1] is not None else None
    if declared is None:
        if isinstance(target_type, np.ndarray):
            declared = ir.DataType.STRING
        else:
            names = {v: k for k, v in {**_BY_NAME, **_EXTRA}.items()}
            declared = ir.DataType[names[target_type.dtype]]
    return cast_tensor(ctx, x, declared, saturate, round_mode)


@builtin("BitCast", since=26, attrs={"to": REQUIRED})
def bit_cast(ctx, x, *, to):
    """BitCast(input) -> output: the same bits reinterpreted as type ``to`` (same width)."""
    target = _data_type(ctx, to)
    if target == ir.DataType.STRING or isinstance(x, np.ndarray):
        raise ctx.error("BitCast supports numeric and bool types, not strings")
    dtype = _torch_type(ctx, target)
    source_bits = x.element_size() * 8
    target_bits = torch.empty((), dtype=dtype).element_size() * 8
    if source_bits != target_bits:
        raise ctx.error(
            f"BitCast needs types of one width; {x.dtype} is {source_bits} bits, "
            f"{dtype} is {target_bits}"
        )
    if x.dtype == torch.bool:
        return x.to(dtype)
    if dtype == torch.bool:
        return x.view(torch.uint8) != 0
    return x.view(dtype)
