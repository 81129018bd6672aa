"""Unary math, arithmetic, comparison, logic, the variadic ops and Where, written once
against ``xp``.

Every handler runs through the backend kernel's ``run``: numpy when every input is static
(constants, folded shape arithmetic, string tensors), so int64 shape data keeps its exact
dtype and value, else the backend's namespace (``jax.numpy``, or torch under numpy's names),
which stays traceable. What the namespaces do not share (erf, integer division truncating
toward zero, integer powers) comes from the backend's :class:`MathKernel`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from xconv.converters.ops.arrays import astype, is_float, is_integer


class MathKernel(Protocol):
    """What a backend provides for the math ops."""

    def run(self, fn: Callable[..., Any], *arrays: Any) -> Any:
        """``fn(xp, *arrays)`` in the namespace this backend picks for ``arrays``."""

    def erf(self, xp: Any, x: Any) -> Any:
        """The error function of ``x`` in ``x``'s dtype."""

    def int_div(self, a: Any, b: Any) -> Any:
        """Integer division of backend arrays truncating toward zero, in ``a``'s dtype."""

    def int_pow(self, a: Any, b: Any) -> Any:
        """``a ** b`` for integer backend arrays, in ``a``'s dtype."""


#: Attributes of the opset 1-6 binary ops (``broadcast``/``axis`` legacy broadcasting).
_LEGACY_BINARY = {"broadcast": 0, "axis": None, "consumed_inputs": None}
#: Ops whose opset 1 version carried ``consumed_inputs`` besides ``broadcast``/``axis``.
_CONSUMED = {"Add", "Sub", "Mul", "Div"}


#: Unary ops: ``(since, fn(k, xp, x))``.
UNARY: dict[str, tuple[int, Callable[[Any, Any, Any], Any]]] = {
    "Abs": (1, lambda k, xp, x: xp.abs(x)),
    "Neg": (1, lambda k, xp, x: xp.negative(x)),
    "Reciprocal": (1, lambda k, xp, x: astype(xp, xp.reciprocal(x), x.dtype)),
    "Sqrt": (1, lambda k, xp, x: xp.sqrt(x)),
    "Exp": (1, lambda k, xp, x: xp.exp(x)),
    "Log": (1, lambda k, xp, x: xp.log(x)),
    "Ceil": (1, lambda k, xp, x: xp.ceil(x)),
    "Floor": (1, lambda k, xp, x: xp.floor(x)),
    # Round half to even, like numpy's rint (and jax.numpy's, and torch.round).
    "Round": (11, lambda k, xp, x: xp.rint(x)),
    "Sign": (9, lambda k, xp, x: xp.sign(x)),
    "Erf": (9, lambda k, xp, x: k.erf(xp, x)),
    "Sin": (7, lambda k, xp, x: xp.sin(x)),
    "Cos": (7, lambda k, xp, x: xp.cos(x)),
    "Tan": (7, lambda k, xp, x: xp.tan(x)),
    "Asin": (7, lambda k, xp, x: xp.arcsin(x)),
    "Acos": (7, lambda k, xp, x: xp.arccos(x)),
    "Atan": (7, lambda k, xp, x: xp.arctan(x)),
    "Sinh": (9, lambda k, xp, x: xp.sinh(x)),
    "Cosh": (9, lambda k, xp, x: xp.cosh(x)),
    "Asinh": (9, lambda k, xp, x: xp.arcsinh(x)),
    "Acosh": (9, lambda k, xp, x: xp.arccosh(x)),
    "Atanh": (9, lambda k, xp, x: xp.arctanh(x)),
    "IsNaN": (9, lambda k, xp, x: xp.isnan(x)),
    "Not": (1, lambda k, xp, x: xp.logical_not(x)),
    "BitwiseNot": (18, lambda k, xp, x: xp.bitwise_not(x)),
}


def _div(k, xp, a, b):
    if not is_integer(a.dtype):
        return astype(xp, xp.divide(a, b), a.dtype)
    if xp is not np:
        return k.int_div(a, b)
    # Integer division truncating toward zero (C semantics), as ONNX Div specifies.
    q = np.floor_divide(a, b)
    if np.issubdtype(q.dtype, np.unsignedinteger):
        return q
    adjust = (np.remainder(a, b) != 0) & ((a < 0) ^ (b < 0))
    return q + adjust.astype(q.dtype)


def _pow(k, xp, a, b):
    # Mixed types are allowed: the result has the base's dtype.
    if xp is np:
        if np.issubdtype(b.dtype, np.integer) and np.any(b < 0):
            return np.power(a.astype(np.float64), b).astype(a.dtype)
        return np.power(a, b).astype(a.dtype)
    if is_integer(a.dtype) and is_integer(b.dtype):
        return k.int_pow(a, b)
    return astype(xp, xp.power(a, b), a.dtype)


def _mod(xp, a, b):
    r = xp.remainder(a, b)
    if xp is np or not is_float(xp, a.dtype):
        return r
    # remainder(x, inf) is nan in JAX and torch; numpy (and ONNX's reference) keep x or
    # return inf.
    inf_b = xp.isinf(b) & xp.isfinite(a)
    keep = (a == 0) | ((a > 0) == (b > 0))
    return xp.where(inf_b, xp.where(keep, a, b), r)


#: Binary ops with numpy broadcasting: ``(since, fn(k, xp, a, b))``.
BINARY: dict[str, tuple[int, Callable[[Any, Any, Any, Any], Any]]] = {
    "Add": (1, lambda k, xp, a, b: xp.add(a, b)),
    "Sub": (1, lambda k, xp, a, b: xp.subtract(a, b)),
    "Mul": (1, lambda k, xp, a, b: xp.multiply(a, b)),
    "Div": (1, _div),
    "Pow": (1, _pow),
    "And": (1, lambda k, xp, a, b: xp.logical_and(a, b)),
    "Or": (1, lambda k, xp, a, b: xp.logical_or(a, b)),
    "Xor": (1, lambda k, xp, a, b: xp.logical_xor(a, b)),
    "Equal": (1, lambda k, xp, a, b: xp.equal(a, b)),
    "Greater": (1, lambda k, xp, a, b: xp.greater(a, b)),
    "Less": (1, lambda k, xp, a, b: xp.less(a, b)),
    "GreaterOrEqual": (12, lambda k, xp, a, b: xp.greater_equal(a, b)),
    "LessOrEqual": (12, lambda k, xp, a, b: xp.less_equal(a, b)),
    "BitwiseAnd": (18, lambda k, xp, a, b: xp.bitwise_and(a, b)),
    "BitwiseOr": (18, lambda k, xp, a, b: xp.bitwise_or(a, b)),
    "BitwiseXor": (18, lambda k, xp, a, b: xp.bitwise_xor(a, b)),
}


def _legacy_broadcast(xp, a, b, broadcast, axis):
    """Opset < 7 broadcasting: B (a suffix of A's shape, or aligned at ``axis``) onto A."""
    if not broadcast or axis is None:
        return b
    axis = axis % a.ndim
    return xp.reshape(b, tuple(b.shape) + (1,) * (a.ndim - axis - b.ndim))


def _variadic(ctx, k, inputs, fn):
    inputs = [x for x in inputs if x is not None]
    if not inputs:
        raise ctx.error("needs at least one input")
    return k.run(lambda xp, *xs: fn(xp, xs), *inputs)


def _fold(op: str) -> Callable[[Any, Any], Any]:
    return lambda xp, xs: functools.reduce(getattr(xp, op), xs)


def _mean(xp, xs):
    total = functools.reduce(xp.add, xs)
    return astype(xp, total / len(xs), total.dtype)


#: The variadic ops: ``(fn(xp, arrays), docstring)``.
VARIADIC = {
    "Max": (_fold("maximum"), "Max(data_0, ...) -> max: elementwise max with broadcasting."),
    "Min": (_fold("minimum"), "Min(data_0, ...) -> min: elementwise min with broadcasting."),
    "Sum": (_fold("add"), "Sum(data_0, ...) -> sum: elementwise sum with broadcasting."),
    "Mean": (_mean, "Mean(data_0, ...) -> mean: elementwise mean, broadcasting."),
}


def _register_unary(builtin, k, op_type: str, since: int, fn) -> None:
    def handler(ctx, x):
        return k.run(lambda xp, x: fn(k, xp, x), x)

    def legacy(ctx, x, *, consumed_inputs):
        return handler(ctx, x)

    handler.__name__ = legacy.__name__ = op_type.lower()
    handler.__doc__ = f"{op_type}(X) -> Y, elementwise."
    legacy.__doc__ = handler.__doc__
    if since == 1:
        builtin(op_type, since=1, until=5, attrs={"consumed_inputs": None})(legacy)
        since = 6
    builtin(op_type, since=since)(handler)


def _register_binary(builtin, k, op_type: str, since: int, fn) -> None:
    def handler(ctx, a, b):
        return k.run(lambda xp, a, b: fn(k, xp, a, b), a, b)

    def legacy(ctx, a, b, *, broadcast, axis, consumed_inputs=None):
        return k.run(
            lambda xp, a, b: fn(k, xp, a, _legacy_broadcast(xp, a, b, broadcast, axis)), a, b
        )

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


def _register_variadic(builtin, k, op_type: str, fn, doc: str) -> None:
    def handler(ctx, *inputs):
        return _variadic(ctx, k, inputs, fn)

    def legacy(ctx, *inputs, consumed_inputs):
        return _variadic(ctx, k, inputs, fn)

    handler.__name__ = legacy.__name__ = op_type.lower()
    handler.__doc__ = legacy.__doc__ = doc
    builtin(op_type, since=1, until=5, attrs={"consumed_inputs": None})(legacy)
    builtin(op_type, since=6)(handler)


def quant_param(ctx, value, shape, axis: int, block_size: int, what: str, blocks):
    """Scale or zero point, broadcastable to ``shape``: per tensor, per axis or blocked.

    ``blocks(value, block_size, axis, length)`` repeats each entry ``block_size`` times along
    ``axis`` and keeps the first ``length`` (the backend's repeat and slice).
    """
    if value.ndim == 0:
        return value
    if int(np.prod(value.shape)) == 1:
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
    value = blocks(value, block_size, axis, shape[axis])
    if tuple(value.shape) != tuple(shape):
        raise ctx.error(
            f"blocked {what} of shape {tuple(value.shape)} does not match the input "
            f"{tuple(shape)} outside the blocked axis"
        )
    return value


def register_math_ops(builtin: Callable[..., Any], k: MathKernel) -> None:
    """Register the unary, binary and variadic ops, IsInf, Mod and Where with a backend's
    ``builtin`` and kernel ``k``."""
    for op, (since, fn) in UNARY.items():
        _register_unary(builtin, k, op, since, fn)
    for op, (since, fn) in BINARY.items():
        _register_binary(builtin, k, op, since, fn)
    for op, (fn, doc) in VARIADIC.items():
        _register_variadic(builtin, k, op, fn, doc)

    @builtin("IsInf", since=10, attrs={"detect_negative": 1, "detect_positive": 1})
    def is_inf(ctx, x, *, detect_negative, detect_positive):
        """IsInf(X) -> Y: bool, which elements are infinite (of the signs asked for)."""

        def fn(xp, x):
            if detect_negative and detect_positive:
                return xp.isinf(x)
            if detect_negative:
                return xp.isneginf(x)
            if detect_positive:
                return xp.isposinf(x)
            return xp.zeros_like(x, dtype=bool)

        return k.run(fn, x)

    @builtin("Mod", since=10, attrs={"fmod": 0})
    def mod(ctx, a, b, *, fmod):
        """Mod(A, B) -> C: remainder; sign of the divisor (fmod=0) or of the dividend
        (fmod=1)."""
        if fmod:
            return k.run(lambda xp, a, b: xp.fmod(a, b), a, b)
        return k.run(_mod, a, b)

    @builtin("Where", since=9)
    def where(ctx, condition, x, y):
        """Where(condition, X, Y) -> Z: X where condition holds, else Y (with broadcasting)."""
        return k.run(lambda xp, c, a, b: xp.where(c, a, b), condition, x, y)
