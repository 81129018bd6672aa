"""JAX handlers: activations, Clip, PRelu, and the dtype conversions Cast, CastLike, BitCast.

Activations compute in the input's dtype (float16 stays float16). Cast covers every ONNX
tensor type JAX holds through ``ml_dtypes`` (bfloat16, the float8 family, float8e8m0, int4,
uint4, int2, uint2, float4e2m1); casts to or from strings need static (numpy) inputs.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import onnx_ir as ir

from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops.arrays import is_static
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


def _arr(x):
    return jnp.asarray(x)


def _relu(x):
    x = _arr(x)
    return jnp.maximum(x, jnp.zeros((), x.dtype))


def _leaky_relu(x, *, alpha):
    x = _arr(x)
    return jnp.where(x >= 0, x, (x * alpha).astype(x.dtype))


def _elu(x, *, alpha):
    x = _arr(x)
    return jnp.where(x > 0, x, (alpha * jnp.expm1(x)).astype(x.dtype))


def _selu(x, *, alpha, gamma):
    x = _arr(x)
    return (gamma * jnp.where(x > 0, x, alpha * jnp.expm1(x))).astype(x.dtype)


def _celu(x, *, alpha):
    x = _arr(x)
    neg = jnp.minimum(jnp.zeros((), x.dtype), alpha * jnp.expm1(x / alpha))
    return (jnp.maximum(jnp.zeros((), x.dtype), x) + neg).astype(x.dtype)


def _hard_sigmoid(x, *, alpha, beta):
    x = _arr(x)
    return jnp.clip(alpha * x + beta, 0, 1).astype(x.dtype)


def _hard_swish(x):
    x = _arr(x)
    return (x * jnp.clip(x / 6 + 0.5, 0, 1)).astype(x.dtype)


def _softplus(x):
    x = _arr(x)
    return jnp.logaddexp(x, jnp.zeros((), x.dtype))


def _softsign(x):
    x = _arr(x)
    return x / (1 + jnp.abs(x))


def _thresholded_relu(x, *, alpha):
    x = _arr(x)
    return jnp.where(x > alpha, x, jnp.zeros((), x.dtype))


def _shrink(x, *, bias, lambd):
    x = _arr(x)
    # Shrink accepts integer tensors too: compute in float, return the input dtype.
    xf = x.astype(jnp.float32) if not jnp.issubdtype(x.dtype, jnp.floating) else x
    y = jnp.where(xf < -lambd, xf + bias, jnp.where(xf > lambd, xf - bias, 0))
    return y.astype(x.dtype)


def _mish(x):
    x = _arr(x)
    return x * jnp.tanh(_softplus(x))


def _swish(x, *, alpha):
    x = _arr(x)
    return (x * jax.nn.sigmoid(alpha * x)).astype(x.dtype)


_activation("Relu", _relu, {})
_activation("LeakyRelu", _leaky_relu, {"alpha": 0.01})
_activation("Elu", _elu, {"alpha": 1.0})
_activation("Selu", _selu, {"alpha": 1.67326319217681884765625, "gamma": 1.05070102214813232421875})
_activation("Celu", _celu, {"alpha": 1.0}, versions=(12,))
_activation("Sigmoid", lambda x: jax.nn.sigmoid(_arr(x)), {})
_activation("HardSigmoid", _hard_sigmoid, {"alpha": 0.2, "beta": 0.5})
_activation("HardSwish", _hard_swish, {}, versions=(14,))
_activation("Softplus", _softplus, {}, versions=(1,))
_activation("Softsign", _softsign, {}, versions=(1,))
_activation("ThresholdedRelu", _thresholded_relu, {"alpha": 1.0}, versions=(10,))
_activation("Shrink", _shrink, {"bias": 0.0, "lambd": 0.5}, versions=(9,))
_activation("Mish", _mish, {}, versions=(18,))
_activation("Swish", _swish, {"alpha": 1.0}, versions=(24,))
_activation("Tanh", lambda x: jnp.tanh(_arr(x)), {})


@builtin("Gelu", since=20, attrs={"approximate": "none"})
def gelu(ctx, x, *, approximate):
    """Gelu(X) -> Y: exact erf form (approximate="none") or the tanh approximation."""
    if approximate not in ("none", "tanh"):
        raise UnsupportedAttributeError(
            f"approximate={approximate!r}; supported: 'none' (erf), 'tanh'",
            op=ctx.node.op_type,
            node=ctx.node.name,
        )
    x = _arr(x)
    return jax.nn.gelu(x, approximate=approximate == "tanh").astype(x.dtype)


def _prelu(ctx, x, slope):
    x = _arr(x)
    slope = _arr(slope).astype(x.dtype)
    try:
        np.broadcast_shapes(tuple(slope.shape), tuple(x.shape))
    except ValueError:
        # Opset < 7 models put a per-channel slope of shape [C] against NC...: align it
        # with the one dimension of x that has C elements.
        matches = [i for i, d in enumerate(x.shape) if d == slope.size]
        if slope.ndim != 1 or len(matches) != 1:
            raise ctx.error(
                f"slope of shape {tuple(slope.shape)} does not broadcast to {tuple(x.shape)}"
            ) from None
        shape = [1] * x.ndim
        shape[matches[0]] = slope.size
        slope = slope.reshape(shape)
    return jnp.where(x < 0, x * slope, x)


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
    x = _arr(x)
    if lo is not None:
        x = jnp.maximum(x, _arr(lo).astype(x.dtype))
    if hi is not None:
        x = jnp.minimum(x, _arr(hi).astype(x.dtype))
    return x


@builtin("Clip", since=1, until=10, attrs={"min": None, "max": None, "consumed_inputs": None})
def clip_legacy(ctx, x, *, min, max, consumed_inputs):  # noqa: A002 - ONNX attribute names
    """Clip(input) -> output (opset < 11: bounds are the min/max attributes)."""
    lo = -3.4028234663852886e38 if min is None else min
    hi = 3.4028234663852886e38 if max is None else max
    x = _arr(x)
    return jnp.minimum(jnp.maximum(x, lo), hi).astype(x.dtype)


# ------------------------------------------------------------------------- dtype casts

_FLOAT8 = {
    ir.DataType.FLOAT8E4M3FN,
    ir.DataType.FLOAT8E4M3FNUZ,
    ir.DataType.FLOAT8E5M2,
    ir.DataType.FLOAT8E5M2FNUZ,
}


def _data_type(ctx, to: int | str) -> ir.DataType:
    try:
        # Cast-1 named the type with a string ("FLOAT").
        return ir.DataType[to] if isinstance(to, str) else ir.DataType(to)
    except (KeyError, ValueError):
        raise ctx.error(f"unknown target data type {to!r}") from None


def _to_e8m0(x, saturate: bool, round_mode: str):
    """float -> float8e8m0 (a bare power-of-two exponent), as the ONNX spec rounds it."""
    x = jnp.asarray(x).astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
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
        round_up = jnp.zeros(x.shape, bool)
    else:
        raise ValueError(f"round_mode must be 'up', 'down' or 'nearest', got {round_mode!r}")
    if saturate:
        round_up = round_up & (exponent != 0xFE)
    exponent = jnp.where(special, 0xFF, exponent + round_up.astype(jnp.uint32))
    return jax.lax.bitcast_convert_type(exponent.astype(jnp.uint8), ml_dtypes.float8_e8m0fnu)


_SUB_BYTE_INTS = {
    ir.DataType.INT4: (4, True),
    ir.DataType.UINT4: (4, False),
    ir.DataType.INT2: (2, True),
    ir.DataType.UINT2: (2, False),
}


@functools.cache
def _float_out_of_range_is_zero() -> bool:
    """Whether the installed ml_dtypes (the ONNX reference's cast) maps an out-of-range float
    to 0 in a sub-byte integer cast (recent releases do), rather than wrapping it around."""
    with np.errstate(all="ignore"):
        return int(np.array([9.0], np.float32).astype(ml_dtypes.int4)[0]) == 0


def _is_builtin_numpy(dtype: np.dtype) -> bool:
    """A dtype numpy itself implements (not one of ml_dtypes' extension types)."""
    return dtype.kind in "biuf" and dtype.type.__module__ == "numpy"


def cast_array(ctx, x, to: ir.DataType, saturate: int, round_mode: str):
    """Cast ``x`` to ONNX type ``to``; static inputs give numpy (strings need numpy)."""
    if to == ir.DataType.STRING:
        return np.asarray(ctx.static(x, "Cast input (to string)")).astype(np.str_)
    target = np.dtype(to.numpy())
    if is_static(x):
        x = np.asarray(x)
        if x.dtype.kind in "OSUT":
            x = x.astype(target if _is_builtin_numpy(target) else np.float32)
        if _is_builtin_numpy(target) and _is_builtin_numpy(x.dtype):
            with np.errstate(all="ignore"):
                return x.astype(target)
    x = jnp.asarray(x)
    if to == ir.DataType.FLOAT8E8M0:
        return _to_e8m0(x, bool(saturate), round_mode)
    if to in _FLOAT8 and saturate and jnp.issubdtype(x.dtype, jnp.floating):
        info = ml_dtypes.finfo(target)
        x = jnp.clip(x, float(info.min), float(info.max))
    if to in _SUB_BYTE_INTS:
        bits, signed = _SUB_BYTE_INTS[to]
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        if jnp.issubdtype(x.dtype, jnp.floating) and _float_out_of_range_is_zero():
            # ONNX leaves an out-of-range float -> int4/int2 cast undefined; its reference
            # (ml_dtypes' cast) gives 0 there and NaN -> 0, so this does too.
            t = jnp.trunc(x)
            return jnp.where((t >= lo) & (t <= hi), t, 0).astype(jnp.int32).astype(target)
        # Integers wrap around (two's complement), like the wider integer casts.
        v = x.astype(jnp.int32)
        half = 1 << (bits - 1)
        v = ((v + half) & ((1 << bits) - 1)) - half if signed else v & ((1 << bits) - 1)
        return v.astype(target)
    return x.astype(target)


_CAST_ATTRS = {"to": REQUIRED, "saturate": 1, "round_mode": "up"}


@builtin("Cast", since=1, attrs=_CAST_ATTRS)
def cast(ctx, x, *, to, saturate, round_mode):
    """Cast(input) -> output of type ``to`` (saturate: float8 overflow clamps; round_mode: e8m0)."""
    return cast_array(ctx, x, _data_type(ctx, to), saturate, round_mode)


@builtin("CastLike", since=15, attrs={"saturate": 1, "round_mode": "up"})
def cast_like(ctx, x, target_type, *, saturate, round_mode):
    """CastLike(input, target_type) -> input cast to target_type's element type."""
    declared = ctx.input_values[1].dtype if ctx.input_values[1] is not None else None
    if declared is None:
        dtype = np.dtype(target_type.dtype)
        declared = ir.DataType.STRING if dtype.kind in "OSUT" else ir.DataType.from_numpy(dtype)
    return cast_array(ctx, x, declared, saturate, round_mode)


@builtin("BitCast", since=26, attrs={"to": REQUIRED})
def bit_cast(ctx, x, *, to):
    """BitCast(input) -> output: the same bits reinterpreted as type ``to`` (same width)."""
    target = _data_type(ctx, to)
    if target == ir.DataType.STRING or np.dtype(x.dtype).kind in "OSUT":
        raise ctx.error("BitCast supports numeric and bool types, not strings")
    source = np.dtype(x.dtype)
    dtype = np.dtype(target.numpy())
    if source.itemsize != dtype.itemsize:
        raise ctx.error(
            f"BitCast needs types of one width; {source} is {source.itemsize * 8} bits, "
            f"{dtype} is {dtype.itemsize * 8}"
        )
    if is_static(x):
        return np.asarray(x).view(dtype)
    if source == np.bool_:
        return jnp.asarray(x).astype(dtype)
    if dtype == np.bool_:
        return jnp.asarray(x) != 0
    return jax.lax.bitcast_convert_type(x, dtype)
