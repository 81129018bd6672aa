"""PyTorch handlers: the Reduce* family and ArgMax / ArgMin.

Every Reduce* op takes its axes as an attribute in old opsets and as an (optional, static)
input in new ones (ReduceSum from 13, the others from 18); one handler per op declares the
union. Empty ``axes`` reduce over every axis, unless ``noop_with_empty_axes`` is set, in
which case only the op's elementwise part applies (``|x|`` for ReduceL1, ``x*x`` for
ReduceSumSquare, ...), as the ONNX reference does. Reductions over an empty set give the
identity element (0 for sums, 1 for products, -inf / the dtype minimum for ReduceMax, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from xconv.converters.ops.arrays import normalize_axis
from xconv.converters.torch.backend.dtypes import WIDE_UNSIGNED
from xconv.converters.torch.backend.math import as_numpy, from_numpy
from xconv.converters.torch.backend.registry import builtin

_REDUCE_ATTRS = {"axes": None, "keepdims": 1, "noop_with_empty_axes": 0}


def _lowest(dtype: torch.dtype):
    if dtype == torch.bool:
        return False
    if dtype.is_floating_point:
        return -math.inf
    return torch.iinfo(dtype).min


def _highest(dtype: torch.dtype):
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point:
        return math.inf
    return torch.iinfo(dtype).max


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


def _shape_after(x, axes, keepdims: bool) -> tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    return tuple(d for i, d in enumerate(x.shape) if i not in axes)


def _sum(x, ax, k):
    return torch.sum(x, dim=ax, keepdim=k, dtype=x.dtype if x.dtype != torch.bool else None)


def _mean(x, ax, k):
    if x.dtype.is_floating_point:
        return torch.mean(x, dim=ax, keepdim=k)
    return torch.mean(x.to(torch.float64), dim=ax, keepdim=k)


def _prod(x, axes, keepdims):
    y = x
    for a in sorted(axes, reverse=True):
        y = torch.prod(y, dim=a, keepdim=keepdims)
    return y


def _log_sum_exp(x, ax, k):
    return torch.logsumexp(x, dim=ax, keepdim=k)


def _l2(x, ax, k):
    return torch.sqrt(torch.sum(x * x, dim=ax, keepdim=k))


#: op: (first opset taking axes as an input, fn(x, axes, keepdims), empty-set identity)
_REDUCERS: dict[str, tuple[int, Callable, Callable]] = {
    "ReduceSum": (13, _sum, lambda d: 0),
    "ReduceMean": (18, _mean, lambda d: math.nan),
    "ReduceMax": (18, lambda x, a, k: torch.amax(x, dim=a, keepdim=k), _lowest),
    "ReduceMin": (18, lambda x, a, k: torch.amin(x, dim=a, keepdim=k), _highest),
    "ReduceProd": (18, _prod, lambda d: 1),
    "ReduceL1": (18, lambda x, a, k: torch.sum(torch.abs(x), dim=a, keepdim=k), lambda d: 0),
    "ReduceL2": (18, _l2, lambda d: 0),
    "ReduceLogSum": (18, lambda x, a, k: torch.log(torch.sum(x, dim=a, keepdim=k)), None),
    "ReduceLogSumExp": (18, _log_sum_exp, lambda d: -math.inf),
    "ReduceSumSquare": (18, lambda x, a, k: torch.sum(x * x, dim=a, keepdim=k), lambda d: 0),
}

#: The elementwise part each op keeps when ``noop_with_empty_axes`` skips the reduction.
_NOOP = {
    "ReduceL1": torch.abs,
    "ReduceL2": lambda x: torch.sqrt(x * x),
    "ReduceLogSum": torch.log,
    "ReduceSumSquare": lambda x: x * x,
    "ReduceLogSumExp": lambda x: torch.log(torch.exp(x)),
}


#: numpy versions of the integer-valued reductions, for uint64 data.
_NUMPY = {
    "ReduceSum": lambda a, axis, keepdims: np.sum(a, axis=axis, keepdims=keepdims, dtype=a.dtype),
    "ReduceMax": np.max,
    "ReduceMin": np.min,
    "ReduceProd": lambda a, axis, keepdims: np.prod(a, axis=axis, keepdims=keepdims, dtype=a.dtype),
    "ReduceL1": lambda a, axis, keepdims: np.sum(a, axis=axis, keepdims=keepdims, dtype=a.dtype),
    "ReduceSumSquare": lambda a, axis, keepdims: np.sum(a * a, axis=axis, keepdims=keepdims),
}


def _make(op: str, fn: Callable, identity: Callable | None) -> Callable:
    def handler(ctx, x, axes_input=None, **attrs):
        ax = _axes(ctx, x, axes_input, attrs["axes"], attrs["noop_with_empty_axes"])
        keepdims = bool(attrs["keepdims"])
        if not ax:
            return _NOOP.get(op, lambda v: v)(x).to(x.dtype)
        dtype = x.dtype
        if dtype == torch.uint64 and op in _NUMPY:
            # torch has no uint64 reduction kernels; numpy wraps around the same way.
            y = _NUMPY[op](as_numpy(x), axis=ax, keepdims=keepdims)
            return from_numpy(np.asarray(y).astype(np.uint64), x)
        if dtype in WIDE_UNSIGNED:
            x = x.to(torch.int64)
        empty = any(x.shape[a] == 0 for a in ax)
        if empty and identity is not None:
            shape = _shape_after(x, ax, keepdims)
            return torch.full(shape, identity(dtype), dtype=dtype, device=x.device)
        return fn(x, ax, keepdims).to(dtype)

    return handler


for _op, (_since_input, _fn, _identity) in _REDUCERS.items():
    _handler = _make(_op, _fn, _identity)
    _handler.__name__ = f"{_op}_handler"
    _handler.__doc__ = (
        f"{_op}(data, axes?) -> reduced: axes as an attribute before opset {_since_input}, "
        "as an input from it; keepdims and noop_with_empty_axes as in the ONNX spec."
    )
    builtin(_op, since=1, attrs=_REDUCE_ATTRS)(_handler)


# --------------------------------------------------------------------------------------
# ArgMax / ArgMin


def _arg(ctx, x, axis, keepdims, select_last_index, fn):
    ax = normalize_axis(ctx, axis, x.ndim)
    if x.dtype == torch.uint64:
        a = as_numpy(x)
        a = np.flip(a, ax) if select_last_index else a
        pick = np.argmax if fn is torch.argmax else np.argmin
        idx = pick(a, axis=ax, keepdims=bool(keepdims)).astype(np.int64)
        return from_numpy((x.shape[ax] - 1) - idx if select_last_index else idx, x)
    if x.dtype == torch.bool or x.dtype in WIDE_UNSIGNED:
        x = x.to(torch.int64)
    if select_last_index:
        n = x.shape[ax]
        return (n - 1) - fn(torch.flip(x, (ax,)), dim=ax, keepdim=bool(keepdims))
    return fn(x, dim=ax, keepdim=bool(keepdims))


_ARG_ATTRS = {"axis": 0, "keepdims": 1, "select_last_index": 0}


@builtin("ArgMax", since=1, attrs=_ARG_ATTRS)
def argmax(ctx, x, *, axis, keepdims, select_last_index):
    """ArgMax(data) -> reduced (int64): index of the first (or last) maximum along ``axis``."""
    return _arg(ctx, x, axis, keepdims, select_last_index, torch.argmax)


@builtin("ArgMin", since=1, attrs=_ARG_ATTRS)
def argmin(ctx, x, *, axis, keepdims, select_last_index):
    """ArgMin(data) -> reduced (int64): index of the first (or last) minimum along ``axis``."""
    return _arg(ctx, x, axis, keepdims, select_last_index, torch.argmin)
