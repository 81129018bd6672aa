"""PyTorch handlers for indexing ops: Slice, Gather*, Scatter*, OneHot, NonZero, Unique, ...

Run-time indices stay tensors (negative ones wrap with ``torch.where``); slice bounds are
read with ``ctx.static`` and clamped with Python's ``slice.indices``. Scatters with a
reduction go through ``index_add_`` / ``index_reduce_`` over the flattened addressed rows,
so duplicates accumulate as ONNX specifies. Data-dependent shapes (NonZero, Unique,
Compress) need concrete inputs, as they do in eager torch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from xconv.converters.ops import indexing
from xconv.converters.ops.arrays import normalize_axis
from xconv.converters.torch.runtime.dtypes import needs_numpy
from xconv.converters.torch.runtime.registry import builtin
from xconv.converters.torch.runtime.shape import back, check_choice, take, to_np
from xconv.converters.torch.runtime.xp import KERNEL

_REDUCTIONS = ("none", "add", "mul", "max", "min")


def _wrap(idx: torch.Tensor, dim: int) -> torch.Tensor:
    """ONNX index semantics: negative indices count from the end of the axis."""
    idx = idx.to(torch.int64)
    return torch.where(idx < 0, idx + dim, idx)


def _grid(shape: tuple[int, ...], axis: int, device) -> torch.Tensor:
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return torch.arange(shape[axis], device=device).reshape(view)


def _scatter_rows(x: Any, rows: torch.Tensor, updates: Any, k_shape, reduction: str) -> Any:
    """Scatter ``updates`` (n, *rest) into the rows of x viewed as (prod(k_shape), *rest)."""
    rest = tuple(x.shape[len(k_shape) :])
    n = rows.numel()
    if needs_numpy(x, updates):
        out = np.array(to_np(x), copy=True)
        flat = out.reshape((math.prod(k_shape), *rest))
        upd = np.asarray(to_np(updates), dtype=out.dtype).reshape((n, *rest))
        r = to_np(rows).reshape(-1)
        if reduction == "none":
            flat[r] = upd
        else:
            ufunc = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}
            ufunc[reduction].at(flat, r, upd)
        return back(out, x if isinstance(x, torch.Tensor) else None)
    out = x.clone().reshape((math.prod(k_shape), *rest))
    upd = updates.to(x.dtype).reshape((n, *rest))
    r = rows.reshape(-1)
    if reduction == "none":
        out = out.index_put((r,), upd)
    elif reduction == "add":
        out = out.index_add(0, r, upd) if x.dtype != torch.bool else out.index_put((r,), upd, True)
    elif x.dtype == torch.bool:
        op = {"mul": torch.logical_and, "max": torch.logical_or, "min": torch.logical_and}
        for i in range(n):
            out[r[i]] = op[reduction](out[r[i]], upd[i])
    else:
        mode = {"mul": "prod", "max": "amax", "min": "amin"}[reduction]
        out = out.index_reduce(0, r, upd, mode, include_self=True)
    return out.reshape(x.shape)


def _linear(comps: list[torch.Tensor], dims) -> torch.Tensor:
    lin = torch.zeros_like(comps[0])
    for c, d in zip(comps, dims, strict=True):
        lin = lin * d + c
    return lin


# -- slicing and gathering ------------------------------------------------------------------


def _apply_slices(x, plan):
    y = x
    for a, start, stop, step in plan:
        if step > 0:
            index = [slice(None)] * len(x.shape)
            index[a] = slice(start, stop, step)
            y = y[tuple(index)]
        else:
            y = take(y, np.arange(start, stop, step, dtype=np.int64), a)
    return y


indexing.register_slice(builtin, _apply_slices)


def _elements_index(x, indices, axis):
    shape = tuple(indices.shape)
    dev = indices.device
    return tuple(
        _wrap(indices, x.shape[axis]) if d == axis else _grid(shape, d, dev)
        for d in range(len(x.shape))
    )


# -- scattering ----------------------------------------------------------------------------


def _scatter_elements(ctx, x, indices, updates, axis, reduction):
    check_choice(ctx, "reduction", reduction, _REDUCTIONS)
    axis = normalize_axis(ctx, axis, len(x.shape))
    indices = torch.as_tensor(to_np(indices)) if not isinstance(indices, torch.Tensor) else indices
    index = _elements_index(x, indices, axis)
    index = torch.broadcast_tensors(*index)
    rows = _linear(list(index), tuple(x.shape))
    return _scatter_rows(x, rows, updates, tuple(x.shape), reduction)


def _scatter_nd(ctx, x, indices, updates, reduction):
    check_choice(ctx, "reduction", reduction, _REDUCTIONS)
    k = indices.shape[-1]
    d_shape = tuple(x.shape)
    comps = [_wrap(indices[..., j], d_shape[j]) for j in range(k)]
    rows = _linear(comps, d_shape[:k])
    return _scatter_rows(x, rows, updates, d_shape[:k], reduction)


indexing.register_scatter_ops(builtin, _scatter_elements, _scatter_nd)


# -- construction from indices --------------------------------------------------------------


@builtin("NonZero", since=9)
def non_zero(ctx, x):
    """NonZero(X) -> Y: int64 indices (rank, count) of the non-zero elements."""
    if needs_numpy(x):
        value = to_np(x)
        return back(np.array(np.nonzero(value), dtype=np.int64).reshape(value.ndim, -1), x)
    if x.ndim == 0:
        return torch.zeros((0, int(bool(x))), dtype=torch.int64, device=x.device)
    return torch.nonzero(x).T.contiguous()


@builtin("Unique", since=11, attrs={"axis": None, "sorted": 1})
def unique(ctx, x, *, axis, sorted):  # noqa: A002 - the ONNX attribute name
    """Unique(X) -> (Y, indices, inverse_indices, counts): unique values or slices."""
    low = isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16)
    value = ctx.static(x.float() if low else x, "Unique input (its output depends on the data)")
    y, *rest = indexing.unique(ctx, value, axis, sorted)
    y_out = back(y, x).to(x.dtype) if low else back(y, x)
    return (y_out, *(back(v, x) for v in rest))


# Gather, GatherElements, GatherND, OneHot, Compress, ReverseSequence: written once in converters/ops/indexing.py.
indexing.register_indexing_ops(builtin, KERNEL)
