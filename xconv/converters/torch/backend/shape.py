"""PyTorch handlers for shape, layout and construction ops (Reshape, Concat, Pad, Resize, ...).

Shape-like inputs (shapes, axes, pads, repeats, sizes) are read with ``ctx.static``. String
tensors stay numpy arrays, and so do the wide unsigned types torch barely computes with: the
handlers below work on both (``reshape``, indexing) or branch on numpy explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from xconv.converters.ops import resize as resizing
from xconv.converters.ops.arrays import normalize_axis
from xconv.converters.ops.attrs import check_choice, static_ints, unsupported
from xconv.converters.ops.shape import pad_widths, register_constant_ops, register_shape_ops
from xconv.converters.torch.backend.dtypes import (
    WIDE_UNSIGNED,
    is_numpy,
    needs_numpy,
    to_tensor,
    torch_dtype,
)
from xconv.converters.torch.backend.registry import REQUIRED, builtin
from xconv.converters.torch.backend.xp import KERNEL


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


def onnx_torch_dtype(ctx, code: int) -> torch.dtype:
    try:
        return torch_dtype(ir.DataType(code))
    except KeyError as e:
        raise unsupported(ctx, str(e)) from None


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
# Identity, Constant, ConstantOfShape: converters/ops/shape.py too.
register_constant_ops(builtin, KERNEL)


_PAD_MODES = ("constant", "reflect", "edge", "wrap")


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


@builtin("Pad", since=1, attrs={"mode": "constant", "pads": None, "paddings": None, "value": 0.0})
def pad(ctx, x, pads_in=None, constant_value=None, axes=None, *, mode, pads, paddings, value):
    """Pad(data, pads, constant_value?, axes?) -> output: pads (or crops, when negative)."""
    check_choice(ctx, "mode", mode, _PAD_MODES)
    src = pads_in if pads_in is not None else (pads if pads is not None else paddings)
    crop, pos = pad_widths(ctx, tuple(np.shape(x)), src, axes)
    y = x if crop is None else x[crop]
    if not any(b or e for b, e in pos):
        return y
    fill: Any = value
    if constant_value is not None and np.size(to_np(constant_value)) > 0:
        fill = constant_value
        if is_numpy(y):
            fill = to_np(fill).reshape(())
    if needs_numpy(y):
        fill = to_np(fill).reshape(()) if not isinstance(fill, float) else fill
        return back(pad_tensor(to_np(y), pos, mode, fill), y)
    return pad_tensor(y, pos, mode, fill)


@builtin("Range", since=11, attrs={"stash_type": 1})
def range_(ctx, start, limit, delta, *, stash_type):
    """Range(start, limit, delta) -> output: start + i*delta while before limit."""
    s = np.asarray(ctx.static(start, "start")).reshape(())
    lim = np.asarray(ctx.static(limit, "limit")).reshape(())
    d = np.asarray(ctx.static(delta, "delta")).reshape(())
    dtype = s.dtype
    if ctx.opset >= 27 and dtype.itemsize == 2 and dtype.kind not in "iu" and stash_type != 0:
        stash = np.dtype(ir.DataType(stash_type).numpy())
        out = np.arange(s.astype(stash), lim.astype(stash), d.astype(stash)).astype(dtype)
    else:
        out = np.arange(s, lim, d, dtype=dtype)
    return back(out, start)


@builtin("EyeLike", since=9, attrs={"dtype": None, "k": 0})
def eye_like(ctx, x, *, dtype, k):
    """EyeLike(input) -> output: a 2-D identity-like tensor with ones on diagonal k."""
    if len(shape_of(x)) != 2:
        raise ctx.error(f"EyeLike needs a 2-D input, got rank {len(shape_of(x))}")
    n, m = shape_of(x)
    out = np.eye(n, m, k, dtype=np.float64)
    target = onnx_torch_dtype(ctx, dtype) if dtype is not None else x.dtype
    return torch.from_numpy(out).to(target)


@builtin("Trilu", since=14, attrs={"upper": 1})
def trilu(ctx, x, k=None, *, upper):
    """Trilu(input, k?) -> output: the upper (or lower) triangle from diagonal k."""
    kk = static_ints(ctx, k, "k")[0] if k is not None else 0
    if needs_numpy(x):
        xn = to_np(x)
        return back(np.triu(xn, kk) if upper else np.tril(xn, kk), x)
    n, m = x.shape[-2:]
    kk = max(min(kk, m + 1), -n - 1)
    return torch.triu(x, kk) if upper else torch.tril(x, kk)


@builtin("DepthToSpace", since=1, attrs={"blocksize": REQUIRED, "mode": "DCR"})
def depth_to_space(ctx, x, *, blocksize, mode):
    """DepthToSpace(input) -> output: moves depth blocks into spatial blocks (DCR or CRD)."""
    n, c, h, w = shape_of(x)
    b = blocksize
    if mode == "DCR":
        y = x.reshape((n, b, b, c // (b * b), h, w)).permute(0, 3, 4, 1, 5, 2)
    elif mode == "CRD":
        y = x.reshape((n, c // (b * b), b, b, h, w)).permute(0, 1, 4, 2, 5, 3)
    else:
        raise unsupported(ctx, f"mode {mode!r} not supported; use 'DCR' or 'CRD'")
    return y.reshape((n, c // (b * b), h * b, w * b))


@builtin("SpaceToDepth", since=1, attrs={"blocksize": REQUIRED, "mode": "DCR"})
def space_to_depth(ctx, x, *, blocksize, mode):
    """SpaceToDepth(input) -> output: moves spatial blocks into depth (DCR or CRD order)."""
    n, c, h, w = shape_of(x)
    b = blocksize
    perms = {"DCR": (0, 3, 5, 1, 2, 4), "CRD": (0, 1, 3, 5, 2, 4)}
    check_choice(ctx, "mode", mode, sorted(perms))
    y = x.reshape((n, c, h // b, b, w // b, b)).permute(perms[mode])
    return y.reshape((n, c * b * b, h // b, w // b))


@builtin("CenterCropPad", since=18, attrs={"axes": None})
def center_crop_pad(ctx, x, shape, *, axes):
    """CenterCropPad(input_data, shape) -> output_data: center crop or zero-pad to shape."""
    target = static_ints(ctx, shape, "shape")
    rank = len(shape_of(x))
    ax = [normalize_axis(ctx, a, rank) for a in axes] if axes is not None else range(rank)
    crop = [slice(None)] * rank
    width = [(0, 0)] * rank
    for a, t in zip(ax, target, strict=False):
        dim = shape_of(x)[a]
        if t < dim:
            start = (dim - t) // 2
            crop[a] = slice(start, start + t)
        elif t > dim:
            before = (t - dim) // 2
            width[a] = (before, t - dim - before)
    y = x[tuple(crop)]
    return pad_tensor(y, width, "constant", 0) if any(b or e for b, e in width) else y


# -- Resize / Upsample --------------------------------------------------------------------


def _resize(
    ctx,
    x,
    *,
    scales,
    sizes,
    roi,
    mode,
    coord_mode,
    nearest_mode,
    cubic_a,
    antialias,
    exclude_outside,
    extrapolation_value,
):
    """Separable resize: one static gather (nearest) or weighted taps (linear/cubic) per axis."""
    dtype = x.dtype
    if mode != "nearest":
        compute = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        y = x.to(compute)
    else:
        y = x
    steps, outside_any = resizing.resize_steps(
        shape_of(x),
        scales=scales,
        sizes=sizes,
        roi=roi,
        mode=mode,
        coord_mode=coord_mode,
        nearest_mode=nearest_mode,
        cubic_a=cubic_a,
        antialias=antialias,
        exclude_outside=exclude_outside,
        fail=ctx.error,
    )
    for axis, idx, coeffs in steps:
        if coeffs is None:
            y = take(y, idx, axis)
        else:
            taps = take(y, idx, axis)
            trail = len(shape_of(y)) - axis - 1
            w = torch.as_tensor(
                coeffs.reshape(coeffs.shape + (1,) * trail), dtype=y.dtype, device=y.device
            )
            y = (taps * w).sum(dim=axis + 1)
    if outside_any is not None:
        mask = torch.as_tensor(outside_any, device=y.device)
        y = torch.where(mask, torch.tensor(extrapolation_value, dtype=y.dtype), y)
    if y.dtype != dtype:
        if not dtype.is_floating_point:
            info = torch.iinfo(dtype)
            y = torch.clamp(torch.round(y), info.min, info.max)
        y = y.to(dtype)
    return y


@builtin("Resize", since=10, attrs=resizing.RESIZE_ATTRS)
def resize(ctx, x, roi=None, scales=None, sizes=None, **attrs):
    """Resize(X, roi?, scales?, sizes?) -> Y: nearest, linear or cubic resampling."""
    kwargs = resizing.resize_arguments(
        ctx,
        shape_of(x),
        roi,
        scales,
        sizes,
        attrs,
        present=lambda v: np.size(to_np(v)) > 0,
    )
    return _resize(ctx, x, **kwargs)


@builtin(
    "Upsample",
    since=1,
    attrs={"mode": "nearest", "scales": None, "height_scale": None, "width_scale": None},
)
def upsample(ctx, x, scales_in=None, *, mode, scales, height_scale, width_scale):
    """Upsample(X, scales) -> Y: nearest or (bi)linear upsampling, asymmetric coordinates."""
    check_choice(ctx, "mode", mode, ("nearest", "linear", "bilinear"))
    src = scales_in if scales_in is not None else scales
    if src is None and height_scale is not None and width_scale is not None:
        src = (1.0, 1.0, height_scale, width_scale)  # Upsample-1: NCHW only.
    if src is None:
        raise ctx.error("Upsample needs scales")
    scale_v = [float(v) for v in np.asarray(ctx.static(src, "scales")).reshape(-1)]
    size_v = [int(s * d) for s, d in zip(scale_v, shape_of(x), strict=True)]
    return _resize(
        ctx,
        x,
        scales=scale_v,
        sizes=size_v,
        roi=None,
        mode="nearest" if mode == "nearest" else "linear",
        coord_mode="asymmetric",
        nearest_mode="simple",
        cubic_a=-0.75,
        antialias=False,
        exclude_outside=False,
        extrapolation_value=0.0,
    )
