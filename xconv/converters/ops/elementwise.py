"""Activations, Gelu, PRelu, Clip and the float8e8m0 rounding, written once against ``xp``.

Activations compute in the input's dtype (float16 stays float16). ``xp`` is ``jax.numpy`` or
the torch backend's numpy-named namespace (numpy for what torch cannot hold); what the array
API lacks (sigmoid, Gelu, the bit views of a float) comes from a backend's
:class:`ElementwiseKernel`, and a backend may override an activation with its own primitive
(``torch.nn.functional.elu``, ...). The dtype casts stay per backend (exotic dtypes), but for
the sub-byte integers' values (:func:`sub_byte_values`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import onnx_ir as ir

from xconv.converters.ops.arrays import astype, is_float
from xconv.errors import UnsupportedAttributeError

#: fn(xp, k, x, **attrs) -> y.
Activation = Callable[..., Any]


class ElementwiseKernel(Protocol):
    """What a backend provides for the elementwise ops."""

    #: A backend's own primitive for an activation, by op name: fn(x, **attrs) -> y.
    overrides: dict[str, Callable[..., Any]]

    def run(self, fn: Callable[..., Any], *arrays: Any) -> Any:
        """``fn(xp, *arrays)`` in the namespace this backend computes ``arrays`` with."""

    def sigmoid(self, x: Any) -> Any: ...

    def gelu(self, x: Any, tanh: bool) -> Any:
        """Gelu in ``x``'s dtype: the erf form, or the tanh approximation."""

    def float32_bits(self, x: Any) -> Any:
        """The bits of ``x`` as float32, in a non-negative integer array."""

    def e8m0(self, exponent: Any) -> Any:
        """Integer exponents (0..255) viewed as float8e8m0."""


def _relu(xp, k, x):
    return xp.maximum(x, xp.zeros_like(x))


def _leaky_relu(xp, k, x, *, alpha):
    return xp.where(x >= 0, x, astype(xp, x * alpha, x.dtype))


def _elu(xp, k, x, *, alpha):
    return xp.where(x > 0, x, astype(xp, alpha * xp.expm1(x), x.dtype))


def _selu(xp, k, x, *, alpha, gamma):
    return astype(xp, gamma * xp.where(x > 0, x, alpha * xp.expm1(x)), x.dtype)


def _celu(xp, k, x, *, alpha):
    zero = xp.zeros_like(x)
    neg = xp.minimum(zero, alpha * xp.expm1(x / alpha))
    return astype(xp, xp.maximum(zero, x) + neg, x.dtype)


def _hard_sigmoid(xp, k, x, *, alpha, beta):
    return astype(xp, xp.clip(alpha * x + beta, 0, 1), x.dtype)


def _hard_swish(xp, k, x):
    return astype(xp, x * xp.clip(x / 6 + 0.5, 0, 1), x.dtype)


def _softplus(xp, k, x):
    return xp.logaddexp(x, xp.zeros_like(x))


def _shrink(xp, k, x, *, bias, lambd):
    # Shrink accepts integer tensors too: compute in float, return the input dtype.
    xf = x if is_float(xp, x.dtype) else astype(xp, x, xp.float32)
    zero = xp.zeros_like(xf)
    y = xp.where(xf < -lambd, xf + bias, xp.where(xf > lambd, xf - bias, zero))
    return astype(xp, y, x.dtype)


#: op: (fn(xp, k, x, **attrs), default attributes, opset versions where the op changed)
ACTIVATIONS: dict[str, tuple[Activation, dict[str, Any], tuple[int, ...]]] = {
    "Relu": (_relu, {}, (1, 6)),
    "LeakyRelu": (_leaky_relu, {"alpha": 0.01}, (1, 6)),
    "Elu": (_elu, {"alpha": 1.0}, (1, 6)),
    "Selu": (
        _selu,
        {"alpha": 1.67326319217681884765625, "gamma": 1.05070102214813232421875},
        (1, 6),
    ),
    "Celu": (_celu, {"alpha": 1.0}, (12,)),
    "Sigmoid": (lambda xp, k, x: k.sigmoid(x), {}, (1, 6)),
    "HardSigmoid": (_hard_sigmoid, {"alpha": 0.2, "beta": 0.5}, (1, 6)),
    "HardSwish": (_hard_swish, {}, (14,)),
    "Softplus": (_softplus, {}, (1,)),
    "Softsign": (lambda xp, k, x: x / (1 + xp.abs(x)), {}, (1,)),
    "ThresholdedRelu": (
        lambda xp, k, x, *, alpha: xp.where(x > alpha, x, xp.zeros_like(x)),
        {"alpha": 1.0},
        (10,),
    ),
    "Shrink": (_shrink, {"bias": 0.0, "lambd": 0.5}, (9,)),
    "Mish": (lambda xp, k, x: x * xp.tanh(_softplus(xp, k, x)), {}, (18,)),
    "Swish": (
        lambda xp, k, x, *, alpha: astype(xp, x * k.sigmoid(alpha * x), x.dtype),
        {"alpha": 1.0},
        (24,),
    ),
    "Tanh": (lambda xp, k, x: xp.tanh(x), {}, (1, 6)),
}


def _register_activation(builtin, k: ElementwiseKernel, op: str) -> None:
    """Register one activation for every opset; opset 1 also took ``consumed_inputs``."""
    fn, attrs, versions = ACTIVATIONS[op]
    own = k.overrides.get(op)

    def handler(ctx, x, consumed_inputs=None, **kwargs):
        if own is not None:
            return own(x, **kwargs)
        return k.run(lambda xp, x: fn(xp, k, x, **kwargs), x)

    handler.__name__ = op.lower()
    handler.__doc__ = f"{op}(X) -> Y, elementwise activation."
    first = versions[0]
    if first == 1:
        builtin(op, since=1, until=5, attrs={**attrs, "consumed_inputs": None})(handler)
        first = 6
    builtin(op, since=first, attrs=attrs)(handler)


def prelu_slope_shape(x_shape, slope_shape) -> tuple[int, ...] | None:
    """The shape to give PRelu's slope so it broadcasts to X, or None where it does as it
    is. Opset < 7 models put a per-channel slope of shape [C] against NC...: it is aligned
    with the one dimension of X that has C elements. Raises ValueError where neither holds.
    The runtimes reshape the slope by it; the source emitters write the reshape."""
    try:
        np.broadcast_shapes(tuple(slope_shape), tuple(x_shape))
        return None
    except ValueError:
        size = math.prod(slope_shape)
        matches = [i for i, d in enumerate(x_shape) if d == size]
        if len(slope_shape) != 1 or len(matches) != 1:
            raise ValueError(
                f"slope of shape {tuple(slope_shape)} does not broadcast to {tuple(x_shape)}"
            ) from None
        shape = [1] * len(x_shape)
        shape[matches[0]] = size
        return tuple(shape)


def _prelu(ctx, xp, x, slope):
    slope = astype(xp, slope, x.dtype)
    try:
        shape = prelu_slope_shape(x.shape, slope.shape)
    except ValueError as e:
        raise ctx.error(str(e)) from None
    if shape is not None:
        slope = xp.reshape(slope, shape)
    return xp.where(x < 0, x * slope, x)


def _clip(xp, x, lo, hi):
    if lo is not None:
        x = xp.maximum(x, astype(xp, lo, x.dtype))
    if hi is not None:
        x = xp.minimum(x, astype(xp, hi, x.dtype))
    return x


def register_elementwise_ops(builtin: Callable[..., Any], k: ElementwiseKernel) -> None:
    """Register the activations, Gelu, PRelu and Clip with a backend's ``builtin``."""
    for op in ACTIVATIONS:
        _register_activation(builtin, k, op)

    @builtin("Gelu", since=20, attrs={"approximate": "none"})
    def gelu(ctx, x, *, approximate):
        """Gelu(X) -> Y: exact erf form (approximate="none") or the tanh approximation."""
        if approximate not in ("none", "tanh"):
            raise UnsupportedAttributeError(
                f"approximate={approximate!r}; supported: 'none' (erf), 'tanh'",
                op=ctx.node.op_type,
                node=ctx.node.name,
            )
        return k.gelu(x, approximate == "tanh")

    @builtin("PRelu", since=7)
    def prelu(ctx, x, slope):
        """PRelu(X, slope) -> Y: x if x >= 0 else slope * x; slope broadcasts to X."""
        return k.run(lambda xp, x, slope: _prelu(ctx, xp, x, slope), x, slope)

    @builtin("PRelu", since=1, until=6, attrs={"consumed_inputs": None})
    def prelu_legacy(ctx, x, slope, *, consumed_inputs):
        """PRelu(X, slope) -> Y (opset 1-6)."""
        return k.run(lambda xp, x, slope: _prelu(ctx, xp, x, slope), x, slope)

    @builtin("Clip", since=11)
    def clip(ctx, x, lo=None, hi=None):
        """Clip(input, min?, max?) -> output; min > max gives max everywhere."""
        return k.run(_clip, x, lo, hi)

    @builtin("Clip", since=1, until=10, attrs={"min": None, "max": None, "consumed_inputs": None})
    def clip_legacy(ctx, x, *, min, max, consumed_inputs):  # noqa: A002 - ONNX attribute names
        """Clip(input) -> output (opset < 11: bounds are the min/max attributes)."""
        lo = -3.4028234663852886e38 if min is None else min
        hi = 3.4028234663852886e38 if max is None else max
        return k.run(lambda xp, x: astype(xp, xp.clip(x, lo, hi), x.dtype), x)


# ------------------------------------------------------------------------- dtype casts

FLOAT8 = {
    ir.DataType.FLOAT8E4M3FN,
    ir.DataType.FLOAT8E4M3FNUZ,
    ir.DataType.FLOAT8E5M2,
    ir.DataType.FLOAT8E5M2FNUZ,
}


#: Sub-byte integer types: (bits, signed).
SUB_BYTE_INTS = {
    ir.DataType.INT4: (4, True),
    ir.DataType.UINT4: (4, False),
    ir.DataType.INT2: (2, True),
    ir.DataType.UINT2: (2, False),
}


@functools.cache
def float_out_of_range_is_zero() -> bool:
    """Whether the installed ml_dtypes (the ONNX reference's cast) maps an out-of-range float
    to 0 in a sub-byte integer cast (recent releases do), rather than wrapping it around."""
    import ml_dtypes

    with np.errstate(all="ignore"):
        return int(np.array([9.0], np.float32).astype(ml_dtypes.int4)[0]) == 0


def sub_byte_values(xp, x, to: ir.DataType):
    """``x`` cast to sub-byte integer type ``to``, as int32 values in its range.

    ONNX leaves an out-of-range float -> int4/int2 cast undefined; its reference (ml_dtypes'
    cast) truncates, and gives 0 out of range and for NaN, so this does too. Integers wrap
    around (two's complement), like the wider integer casts.
    """
    bits, signed = SUB_BYTE_INTS[to]
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    if is_float(xp, x.dtype) and float_out_of_range_is_zero():
        t = xp.trunc(x)
        return astype(xp, xp.where((t >= lo) & (t <= hi), t, xp.zeros_like(t)), xp.int32)
    v = astype(xp, x, xp.int32)
    half = 1 << (bits - 1)
    return ((v + half) & ((1 << bits) - 1)) - half if signed else v & ((1 << bits) - 1)


def data_type(ctx, to: int | str) -> ir.DataType:
    """Cast's ``to`` attribute as an ONNX type (Cast-1 named it with a string, "FLOAT")."""
    try:
        return ir.DataType[to] if isinstance(to, str) else ir.DataType(to)
    except (KeyError, ValueError):
        raise ctx.error(f"unknown target data type {to!r}") from None


def to_e8m0(xp, k: ElementwiseKernel, x, saturate: bool, round_mode: str):
    """float -> float8e8m0 (a bare power-of-two exponent), as the ONNX spec rounds it."""
    bits = k.float32_bits(x)
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
        round_up = xp.zeros_like(special)
    else:
        raise ValueError(f"round_mode must be 'up', 'down' or 'nearest', got {round_mode!r}")
    if saturate:
        round_up = round_up & (exponent != 0xFE)
    exponent = xp.where(
        special, xp.full_like(exponent, 0xFF), exponent + astype(xp, round_up, exponent.dtype)
    )
    return k.e8m0(exponent)


_CAST_ATTRS = {"saturate": 1, "round_mode": "up"}


def register_cast_ops(
    builtin: Callable[..., Any],
    required: Any,
    cast: Callable[..., Any],
    type_of: Callable[[Any], ir.DataType],
) -> None:
    """Register Cast and CastLike: ``cast(ctx, x, to: ir.DataType, saturate, round_mode)`` is
    the backend's cast, ``type_of(array)`` the ONNX type of a backend array (for a CastLike
    target whose IR value declares none)."""

    @builtin("Cast", since=1, attrs={"to": required, **_CAST_ATTRS})
    def cast_op(ctx, x, *, to, saturate, round_mode):
        """Cast(input) -> output of type ``to`` (saturate: float8 overflow clamps; round_mode:
        e8m0)."""
        return cast(ctx, x, data_type(ctx, to), saturate, round_mode)

    @builtin("CastLike", since=15, attrs=_CAST_ATTRS)
    def cast_like(ctx, x, target_type, *, saturate, round_mode):
        """CastLike(input, target_type) -> input cast to target_type's element type."""
        value = ctx.node.inputs[1]
        declared = value.dtype if value is not None else None
        if declared is None:
            declared = type_of(target_type)
        return cast(ctx, x, declared, saturate, round_mode)
