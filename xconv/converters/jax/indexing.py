"""JAX handlers for indexing ops: Slice, Gather*, Scatter*, OneHot, NonZero, Unique, ...

Indices that are run-time data stay traced (negative ones wrap with ``jnp.where``); slice
bounds and other shape-like values are read with ``ctx.static`` and clamped with numpy, so
INT64_MAX-style sentinels never pass through JAX (which would wrap them with x64 off).
Ops whose output shape depends on data (NonZero, Unique, Compress) need concrete inputs.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from xconv.converters.jax.kernel import KERNEL
from xconv.converters.jax.registry import builtin
from xconv.converters.ops import indexing
from xconv.converters.ops.arrays import namespace, normalize_axis
from xconv.converters.ops.attrs import check_choice

_REDUCTIONS = ("none", "add", "mul", "max", "min")


def _wrap(xp: Any, idx: Any, dim: int) -> Any:
    """ONNX index semantics: negative indices count from the end of the axis."""
    if xp is np:
        idx = np.asarray(idx)
        return np.where(idx < 0, idx + dim, idx).astype(np.int64)
    idx = jnp.asarray(idx)
    return jnp.where(idx < 0, idx + dim, idx)


def _grid(xp: Any, shape: tuple[int, ...], axis: int) -> Any:
    """An arange along ``axis``, shaped to broadcast against ``shape``."""
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return xp.arange(shape[axis]).reshape(view)


def _scatter(xp: Any, x: Any, index: tuple, updates: Any, reduction: str) -> Any:
    if xp is np:
        out = np.array(x, copy=True)
        updates = np.asarray(updates, dtype=out.dtype)
        if reduction == "none":
            out[index] = updates
        else:
            ufunc = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}[
                reduction
            ]
            ufunc.at(out, index, updates)
        return out
    data = jnp.asarray(x)
    ref = data.at[index]
    updates = jnp.asarray(updates, dtype=data.dtype)
    if reduction == "none":
        return ref.set(updates)
    return {"add": ref.add, "mul": ref.multiply, "max": ref.max, "min": ref.min}[reduction](updates)


def _check_reduction(ctx, reduction: str) -> None:
    check_choice(ctx, "reduction", reduction, _REDUCTIONS)


# -- slicing and gathering ------------------------------------------------------------------


def _apply_slices(x, plan):
    index = [slice(None)] * np.ndim(x)
    for a, start, stop, step in plan:
        index[a] = slice(start, stop if stop >= 0 else None, step)
    return x[tuple(index)]


indexing.register_slice(builtin, _apply_slices)


# -- scattering ----------------------------------------------------------------------------


def _scatter_elements(ctx, x, indices, updates, axis, reduction):
    _check_reduction(ctx, reduction)
    rank = np.ndim(x)
    axis = normalize_axis(ctx, axis, rank)
    xp = namespace(jnp, x, indices, updates)
    shape = tuple(np.shape(indices))
    index = tuple(
        _wrap(xp, indices, np.shape(x)[axis]) if d == axis else _grid(xp, shape, d)
        for d in range(rank)
    )
    return _scatter(xp, x, index, updates, reduction)


def _scatter_nd(ctx, x, indices, updates, reduction):
    _check_reduction(ctx, reduction)
    xp = namespace(jnp, x, indices, updates)
    k = np.shape(indices)[-1]
    d_shape = np.shape(x)
    index = tuple(_wrap(xp, indices[..., j], d_shape[j]) for j in range(k))
    return _scatter(xp, x, index, updates, reduction)


indexing.register_scatter_ops(builtin, _scatter_elements, _scatter_nd)


# -- construction from indices --------------------------------------------------------------


@builtin("NonZero", since=9)
def non_zero(ctx, x):
    """NonZero(X) -> Y: int64 indices (rank, count) of the non-zero elements."""
    value = ctx.static(x, "NonZero input (its output shape depends on the data)")
    return np.array(np.nonzero(value), dtype=np.int64).reshape(np.ndim(value), -1)


@builtin("Unique", since=11, attrs={"axis": None, "sorted": 1})
def unique(ctx, x, *, axis, sorted):  # noqa: A002 - the ONNX attribute name
    """Unique(X) -> (Y, indices, inverse_indices, counts): unique values or slices."""
    value = ctx.static(x, "Unique input (its output shape depends on the data)")
    return indexing.unique(ctx, value, axis, sorted)


# Gather, GatherElements, GatherND, OneHot, Compress, ReverseSequence: written once in converters/ops/indexing.py.
indexing.register_indexing_ops(builtin, KERNEL)
