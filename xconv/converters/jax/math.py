"""JAX handlers: unary math, arithmetic, comparison, logic and bitwise ops.

Every handler picks its array module with :func:`_xp`: when all inputs are numpy (constants,
folded shape arithmetic) it computes with numpy, so int64 shape data keeps its exact dtype
and value even with JAX's 64-bit types off, and string tensors (``Equal`` on strings) work;
otherwise it computes with ``jax.numpy`` and stays traceable under ``jit``/``grad``/``vmap``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xconv.converters.jax.context import is_static
from xconv.converters.jax.registry import REQUIRED, builtin

#: Attributes of the opset 1-6 binary ops (``broadcast``/``axis`` legacy broadcasting).
_LEGACY_BINARY = {"broadcast": 0, "axis": None, "consumed_inputs": None}


def _xp(*args: Any) -> Any:
    """numpy when every given input is static (numpy), else jax.numpy."""
    return np if all(is_static(a) for a in args if a is not None) else jnp


def _erf(x: Any) -> Any:
    return jax.scipy.special.erf(x) if not is_static(x) else np.asarray(jax.scipy.special.erf(x))


def _same(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Wrap a unary function so its result keeps the input dtype."""

    def wrapped(xp, x):
        return xp.asarray(fn(xp, x)).astype(x.dtype)

    return wrapped


#: Unary ops: ``fn(xp, x)`` with ``xp`` numpy or jax.numpy.
UNARY: dict[str, tuple[int, Callable[[Any, Any], Any]]] = {
    "Abs": (1, lambda xp, x: xp.abs(x)),
    "Neg": (1, lambda xp, x: xp.negative(x)),
    "Reciprocal": (1, _same(lambda xp, x: xp.reciprocal(x))),
    "Sqrt": (1, lambda xp, x: xp.sqrt(x)),
    "Exp": (1, lambda xp, x: xp.exp(x)),
    "Log": (1, lambda xp, x: xp.log(x)),
    "Ceil": (1, lambda xp, x: xp.ceil(x)),
    "Floor": (1, lambda xp, x: xp.floor(x)),
    # Round half to even, like numpy's and jax.numpy's rint.
    "Round": (11, lambda xp, x: xp.rint(x)),
    "Sign": (9, lambda xp, x: xp.sign(x)),
    "Erf": (9, lambda xp, x: _erf(x).astype(x.dtype)),
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
    "BitwiseNot": (18, lambda xp, x: xp.invert(x)),
}


def _register_unary(op_type: str, since: int, fn: Callable[[Any, Any], Any]) -> None:
    def handler(ctx, x):
        return fn(_xp(x), x)

    def legacy(ctx, x, *, consumed_inputs):
        return fn(_xp(x), x)

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
    xp = _xp(x)
    if detect_negative and detect_positive:
        return xp.isinf(x)
    if detect_negative:
        return xp.isneginf(x)
    if detect_positive:
        return xp.isposinf(x)
    return xp.zeros(x.shape, dtype=bool)


# --------------------------------------------------------------------------- binary ops


def _legacy_broadcast(ctx, a, b, broadcast, axis):
    """Opset < 7 broadcasting: B (a suffix of A's shape, or aligned at ``axis``) onto A."""
    if not broadcast or axis is None:
        return b
    xp = _xp(b)
    axis = axis % a.ndim
    return xp.reshape(b, tuple(b.shape) + (1,) * (a.ndim - axis - b.ndim))


def _int_div(xp, a, b):
    """Integer division truncating toward zero (C semantics), as ONNX Div specifies."""
    if xp is jnp:
        return jax.lax.div(*jnp.broadcast_arrays(a, b)) if a.dtype == b.dtype else a // b
    q = np.floor_divide(a, b)
    if np.issubdtype(q.dtype, np.unsignedinteger):
        return q
    adjust = (np.remainder(a, b) != 0) & ((a < 0) ^ (b < 0))
    return q + adjust.astype(q.dtype)


def _div(xp, a, b):
    if np.issubdtype(np.dtype(a.dtype), np.integer):
        with np.errstate(divide="ignore"):
            return _int_div(xp, a, b)
    return xp.divide(a, b).astype(a.dtype)


def _pow(xp, a, b):
    # Mixed types are allowed: the result has the base's dtype.
    if xp is np:
        with np.errstate(all="ignore"):
            if np.issubdtype(b.dtype, np.integer) and np.any(b < 0):
                return np.power(a.astype(np.float64), b).astype(a.dtype)
            return np.power(a, b).astype(a.dtype)
    if jnp.issubdtype(a.dtype, jnp.integer) and jnp.issubdtype(b.dtype, jnp.integer):
        return jnp.power(a, b.astype(a.dtype)).astype(a.dtype)
    return jnp.power(a, b).astype(a.dtype)


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
    "Equal": (1, lambda xp, a, b: xp.equal(a, b)),
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
        return fn(_xp(a, b), a, b)

    def legacy(ctx, a, b, *, broadcast, axis, consumed_inputs=None):
        return fn(_xp(a, b), a, _legacy_broadcast(ctx, a, b, broadcast, axis))

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


@builtin("Mod", since=10, attrs={"fmod": 0})
def mod(ctx, a, b, *, fmod):
    """Mod(A, B) -> C: remainder; sign of the divisor (fmod=0) or of the dividend (fmod=1)."""
    xp = _xp(a, b)
    with np.errstate(all="ignore"):
        if fmod:
            return xp.fmod(a, b)
        if xp is jnp and jnp.issubdtype(a.dtype, jnp.floating):
            # jnp.mod(x, inf) is nan; numpy (and ONNX's reference) keep x or return inf.
            r = jnp.mod(a, b)
            inf_b = jnp.isinf(b) & jnp.isfinite(a)
            keep = (a == 0) | ((a > 0) == (b > 0))
            return jnp.where(inf_b, jnp.where(keep, a, b), r)
        return xp.mod(a, b)


@builtin("BitShift", since=11, attrs={"direction": REQUIRED})
def bit_shift(ctx, x, y, *, direction):
    """BitShift(X, Y) -> Z: shift X by Y bits; shifts outside [0, width) give 0 (or -1)."""
    if direction not in ("LEFT", "RIGHT"):
        raise ctx.error(f"direction must be 'LEFT' or 'RIGHT', got {direction!r}")
    xp = _xp(x, y)
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


# ------------------------------------------------------------------------ variadic ops


def _variadic(ctx, inputs, fn):
    inputs = [x for x in inputs if x is not None]
    if not inputs:
        raise ctx.error("needs at least one input")
    xp = _xp(*inputs)
    return functools.reduce(lambda a, b: fn(xp, a, b), inputs[1:], xp.asarray(inputs[0]))


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
    return (total / n).astype(total.dtype)


_register_variadic("Max", _max, "Max(data_0, ...) -> max: elementwise max with broadcasting.")
_register_variadic("Min", _min, "Min(data_0, ...) -> min: elementwise min with broadcasting.")
_register_variadic("Sum", _sum, "Sum(data_0, ...) -> sum: elementwise sum with broadcasting.")
_register_variadic("Mean", _mean, "Mean(data_0, ...) -> mean: elementwise mean, broadcasting.")


@builtin("Where", since=9)
def where(ctx, condition, x, y):
    """Where(condition, X, Y) -> Z: X where condition holds, else Y (with broadcasting)."""
    return _xp(condition, x, y).where(condition, x, y)
