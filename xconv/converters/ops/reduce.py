"""The Reduce* family and ArgMax / ArgMin, written once against an array namespace ``xp``.

Every Reduce* op takes its axes as an attribute in old opsets and as an (optional, static)
input in new ones (ReduceSum from 13, the others from 18); one handler per op declares the
union. Empty ``axes`` reduce over every axis, unless ``noop_with_empty_axes`` is set, in
which case only the op's elementwise part applies (``|x|`` for ReduceL1, ``x*x`` for
ReduceSumSquare, ...), as the ONNX reference does. Reductions over an empty set give the
identity element (0 for sums, 1 for products, -inf / the dtype minimum for ReduceMax, ...).

``xp`` is numpy, ``jax.numpy`` or the torch backend's numpy-named namespace; a backend's
:class:`ReduceKernel` picks it per call and may override a reduction with a better primitive.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

from xconv.converters.ops.arrays import astype, is_float, normalize_axis

_REDUCE_ATTRS = {"axes": None, "keepdims": 1, "noop_with_empty_axes": 0}
_ARG_ATTRS = {"axis": 0, "keepdims": 1, "select_last_index": 0}

#: fn(xp, x, axes, keepdims) over a non-empty tuple of axes.
Reducer = Callable[[Any, Any, tuple[int, ...], bool], Any]


class ReduceKernel(Protocol):
    """What a backend provides for the reductions."""

    #: Better primitives by op name (e.g. torch's ``logsumexp``), used instead of the table's.
    overrides: dict[str, Reducer]

    def run(self, fn: Callable[..., Any], *arrays: Any) -> Any:
        """``fn(xp, *arrays)`` in the namespace this backend picks for ``arrays`` (numpy when
        every one is static or one is of a type the backend cannot reduce), the result
        returned as the backend returns values."""

    def index_dtype(self, xp: Any) -> Any:
        """The dtype of ArgMax/ArgMin's output in ``xp`` (int64, or int32 without x64)."""


def bound(xp: Any, dtype: Any, *, low: bool) -> Any:
    """The lowest (``low``) or highest value of ``dtype``: the identity of ReduceMax/Min."""
    if dtype == xp.bool_:
        return not low
    try:
        info = xp.iinfo(dtype)
    except (TypeError, ValueError):  # floating point
        return -math.inf if low else math.inf
    return info.min if low else info.max


def _sum(xp, x, a, k):
    return xp.sum(x, axis=a, keepdims=k)


def mean(xp, x, a, k):
    """The mean of ``x`` over axes ``a``; a float array's one axis at a time.

    Successive means over each axis are the mean over all of them, and each sums only its own
    axis's values: XLA:CPU sums every reduced element of an output in one running sum, whose
    rounding error on a near-constant feature map (what a zero image makes) grows with the
    count. A global pool of a 12x12 map was off by 3.0e-6 there, torch's by 2.0e-7; axis by
    axis, 8.2e-8 (``tests/converters/test_reduce_accuracy.py``).
    """
    if len(a) < 2 or not is_float(xp, x.dtype):
        return xp.mean(x, axis=a, keepdims=k)
    y = x
    for axis in sorted(a, reverse=True):
        y = xp.mean(y, axis=axis, keepdims=True)
    return y if k else xp.squeeze(y, axis=tuple(a))


def log_sum_exp(xp, x, a, k):
    # Shift by the (finite) maximum for stability; an all -inf set gives -inf.
    mx = xp.max(x, axis=a, keepdims=True)
    mx = xp.where(xp.isfinite(mx), mx, xp.zeros_like(mx))
    out = xp.log(xp.sum(xp.exp(x - mx), axis=a, keepdims=True)) + mx
    return out if k else xp.squeeze(out, axis=a)


#: op: (first opset taking axes as an input, reducer, empty-set identity(xp, dtype) or None
#: where the reducer itself gives it, the elementwise part kept by noop_with_empty_axes)
_REDUCERS: dict[str, tuple[int, Reducer, Callable | None, Callable]] = {
    "ReduceSum": (13, _sum, lambda xp, d: 0, lambda xp, x: x),
    "ReduceMean": (18, mean, None, lambda xp, x: x),
    "ReduceMax": (
        18,
        lambda xp, x, a, k: xp.max(x, axis=a, keepdims=k),
        lambda xp, d: bound(xp, d, low=True),
        lambda xp, x: x,
    ),
    "ReduceMin": (
        18,
        lambda xp, x, a, k: xp.min(x, axis=a, keepdims=k),
        lambda xp, d: bound(xp, d, low=False),
        lambda xp, x: x,
    ),
    "ReduceProd": (
        18,
        lambda xp, x, a, k: xp.prod(x, axis=a, keepdims=k),
        lambda xp, d: 1,
        lambda xp, x: x,
    ),
    "ReduceL1": (
        18,
        lambda xp, x, a, k: _sum(xp, xp.abs(x), a, k),
        lambda xp, d: 0,
        lambda xp, x: xp.abs(x),
    ),
    "ReduceL2": (
        18,
        lambda xp, x, a, k: xp.sqrt(_sum(xp, x * x, a, k)),
        lambda xp, d: 0,
        lambda xp, x: xp.sqrt(x * x),
    ),
    "ReduceLogSum": (
        18,
        lambda xp, x, a, k: xp.log(_sum(xp, x, a, k)),
        None,
        lambda xp, x: xp.log(x),
    ),
    "ReduceLogSumExp": (
        18,
        log_sum_exp,
        lambda xp, d: -math.inf,
        lambda xp, x: xp.log(xp.exp(x)),
    ),
    "ReduceSumSquare": (
        18,
        lambda xp, x, a, k: _sum(xp, x * x, a, k),
        lambda xp, d: 0,
        lambda xp, x: x * x,
    ),
}


def _axes(ctx, x, axes_input, axes_attr, noop: int) -> tuple[int, ...]:
    """The normalised axes to reduce (``()`` with ``noop`` set means no reduction)."""
    if axes_input is not None:
        axes = [int(a) for a in ctx.static(axes_input, "axes").reshape(-1)]
    elif axes_attr is not None:
        axes = [int(a) for a in axes_attr]
    else:
        axes = []
    if not axes:
        return () if noop else tuple(range(x.ndim))
    return tuple(sorted({normalize_axis(ctx, a, x.ndim) for a in axes}))


def _reduce(xp, reducer: Reducer, identity, elementwise, x, ax, keepdims: bool):
    dtype = x.dtype
    if not ax:
        return astype(xp, elementwise(xp, x), dtype)
    if identity is not None and any(x.shape[a] == 0 for a in ax):
        # A sum over the empty set is 0 in every namespace: shift it to the identity.
        return astype(xp, xp.sum(x, axis=ax, keepdims=keepdims) + identity(xp, dtype), dtype)
    return astype(xp, reducer(xp, x, ax, keepdims), dtype)


def register_reduce_ops(builtin: Callable[..., Any], k: ReduceKernel) -> None:
    """Register Reduce*, ArgMax and ArgMin with a backend's ``builtin`` and its kernel ``k``."""
    for op, (since_input, reducer, identity, elementwise) in _REDUCERS.items():
        handler = _reduce_handler(k, op, k.overrides.get(op, reducer), identity, elementwise)
        handler.__name__ = f"{op}_handler"
        handler.__doc__ = (
            f"{op}(data, axes?) -> reduced: axes as an attribute before opset {since_input}, "
            "as an input from it; keepdims and noop_with_empty_axes as in the ONNX spec."
        )
        builtin(op, since=1, attrs=_REDUCE_ATTRS)(handler)

    @builtin("ArgMax", since=1, attrs=_ARG_ATTRS)
    def argmax(ctx, x, *, axis, keepdims, select_last_index):
        """ArgMax(data) -> reduced (int64): index of the first (or last) maximum along ``axis``."""
        return k.run(lambda xp, x: _arg(ctx, k, xp, x, axis, keepdims, select_last_index, "max"), x)

    @builtin("ArgMin", since=1, attrs=_ARG_ATTRS)
    def argmin(ctx, x, *, axis, keepdims, select_last_index):
        """ArgMin(data) -> reduced (int64): index of the first (or last) minimum along ``axis``."""
        return k.run(lambda xp, x: _arg(ctx, k, xp, x, axis, keepdims, select_last_index, "min"), x)


def _reduce_handler(k: ReduceKernel, op: str, reducer, identity, elementwise):
    def handler(ctx, x, axes_input=None, **attrs):
        ax = _axes(ctx, x, axes_input, attrs["axes"], attrs["noop_with_empty_axes"])
        keepdims = bool(attrs["keepdims"])
        return k.run(lambda xp, x: _reduce(xp, reducer, identity, elementwise, x, ax, keepdims), x)

    return handler


def _arg(ctx, k: ReduceKernel, xp, x, axis: int, keepdims: int, select_last: int, which: str):
    ax = normalize_axis(ctx, axis, x.ndim)
    fn = xp.argmax if which == "max" else xp.argmin
    if select_last:
        idx = (x.shape[ax] - 1) - fn(xp.flip(x, axis=ax), axis=ax, keepdims=bool(keepdims))
    else:
        idx = fn(x, axis=ax, keepdims=bool(keepdims))
    return astype(xp, idx, k.index_dtype(xp))
