"""PyTorch handlers for shape, layout and construction ops (Reshape, Concat, Pad, Resize, ...).

Shape-like inputs (shapes, axes, pads, repeats, sizes) are read with ``ctx.static``. String
tensors stay numpy arrays, and so do the wide unsigned types torch barely computes with: the
handlers below work on both (``reshape``, indexing) or branch on numpy explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from xconv.converters.ops.attrs import check_choice
from xconv.converters.ops.resize import register_resize_ops
from xconv.converters.ops.shape import (
    register_constant_ops,
    register_construction_ops,
    register_shape_ops,
)
from xconv.converters.torch.runtime.dtypes import (
    WIDE_UNSIGNED,
    is_numpy,
    needs_numpy,
    to_tensor,
)
from xconv.converters.torch.runtime.registry import REQUIRED, builtin
from xconv.converters.torch.runtime.xp import KERNEL


def to_np(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def back(y: np.ndarray, like: Any = None) -> Any:
    """A numpy result back to a tensor (strings stay numpy), on ``like``'s device."""
    out = to_tensor(np.asarray(y))
    if isinstance(out, torch.Tensor) and isinstance(like, torch.Tensor):
        out = out.to(like.device)
    return out


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(x.shape)


def take(x: Any, idx: np.ndarray, axis: int) -> Any:
    """Static gather of ``idx`` (numpy ints) along ``axis``, numpy or torch."""
    if is_numpy(x):
        return np.take(x, idx, axis=axis)
    index = torch.as_tensor(np.asarray(idx, np.int64), device=x.device)
    if x.dtype in WIDE_UNSIGNED:
        return back(np.take(to_np(x), idx, axis=axis), x)
    return torch.index_select(x, axis, index.reshape(-1)).reshape(
        (*x.shape[:axis], *np.shape(idx), *x.shape[axis + 1 :])
    )


def concatenate(arrays: Sequence[Any], axis: int) -> Any:
    if needs_numpy(*arrays):
        like = next((a for a in arrays if isinstance(a, torch.Tensor)), None)
        return back(np.concatenate([to_np(a) for a in arrays], axis=axis), like)
    return torch.cat(list(arrays), dim=axis)


# Shape, Size, Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Concat, Split, Expand, Tile:
# written once in converters/ops/shape.py.
register_shape_ops(builtin, KERNEL, REQUIRED)
# Identity, Constant, ConstantOfShape; Pad, Range, EyeLike, Trilu, DepthToSpace,
# SpaceToDepth, CenterCropPad: converters/ops/shape.py too; Resize, Upsample: ops/resize.py.
register_constant_ops(builtin, KERNEL)
register_construction_ops(builtin, KERNEL, REQUIRED)
register_resize_ops(builtin, KERNEL)


def _pad_index(size: int, before: int, after: int, mode: str) -> np.ndarray:
    pos = np.arange(-before, size + after)
    if mode == "edge":
        return np.clip(pos, 0, size - 1)
    if mode == "wrap":
        return np.mod(pos, size)
    # reflect (no edge repeat), period 2*(size-1)
    if size == 1:
        return np.zeros_like(pos)
    period = 2 * (size - 1)
    p = np.mod(pos, period)
    return np.where(p < size, p, period - p)


def pad_tensor(x: Any, pos: list[tuple[int, int]], mode: str, fill: Any) -> Any:
    """Pad ``x`` by non-negative (before, after) widths per axis."""
    if mode == "constant":
        out_shape = tuple(d + b + e for d, (b, e) in zip(shape_of(x), pos, strict=True))
        inner = tuple(slice(b, b + d) for d, (b, _) in zip(shape_of(x), pos, strict=True))
        if is_numpy(x):
            out = np.full(out_shape, fill, dtype=x.dtype)
        else:
            if isinstance(fill, torch.Tensor):
                fill = fill.reshape(()).item()
            out = torch.full(out_shape, fill, dtype=x.dtype, device=x.device)
        out[inner] = x
        return out
    y = x
    for axis, (b, e) in enumerate(pos):
        if b or e:
            y = take(y, _pad_index(shape_of(y)[axis], b, e, mode), axis)
    return y


def pad(y: Any, pos: list[tuple[int, int]], mode: str, fill: Any) -> Any:
    """The kernel's padding: ``y`` by non-negative widths, filled with ``fill`` (a number or
    a 0-d array) in constant mode; numpy for what torch cannot hold."""
    if needs_numpy(y):
        if not isinstance(fill, float | int):
            fill = to_np(fill).reshape(())
        return back(pad_tensor(to_np(y), pos, mode, fill), y)
    return pad_tensor(y, pos, mode, fill)


#: check_choice: imported from here by nn and indexing.
__all__ = ["check_choice", "back", "concatenate", "pad", "take", "to_np"]
