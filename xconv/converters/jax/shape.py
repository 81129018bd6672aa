"""JAX handlers for shape, layout and construction ops (Reshape, Concat, Pad, Resize, ...).

Shape-like inputs (shapes, axes, pads, repeats, sizes) are read with ``ctx.static`` so they
are known at trace time under ``jax.jit``. When every input of a node is numpy (constants,
folded shape arithmetic) the handlers compute with numpy, so 64-bit shape values keep their
dtype and their value even with JAX's 64-bit types off.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import onnx_ir as ir

from xconv.converters.jax.kernel import KERNEL
from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops import resize as resizing
from xconv.converters.ops.arrays import namespace, normalize_axis
from xconv.converters.ops.attrs import check_choice, static_ints, unsupported
from xconv.converters.ops.shape import pad_widths, register_constant_ops, register_shape_ops


def _onnx_dtype(code: int) -> np.dtype:
    return np.dtype(ir.DataType(code).numpy())


# Shape, Size, Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Concat, Split, Expand, Tile:
# written once in converters/ops/shape.py.
register_shape_ops(builtin, KERNEL, REQUIRED)
# Identity, Constant, ConstantOfShape: converters/ops/shape.py too.
register_constant_ops(builtin, KERNEL)


_PAD_MODES = ("constant", "reflect", "edge", "wrap")


@builtin("Pad", since=1, attrs={"mode": "constant", "pads": None, "paddings": None, "value": 0.0})
def pad(ctx, x, pads_in=None, constant_value=None, axes=None, *, mode, pads, paddings, value):
    """Pad(data, pads, constant_value?, axes?) -> output: pads (or crops, when negative)."""
    check_choice(ctx, "mode", mode, _PAD_MODES)
    src = pads_in if pads_in is not None else (pads if pads is not None else paddings)
    xp = namespace(jnp, x, constant_value)
    # Negative pads crop first; the rest pads.
    crop, pos = pad_widths(ctx, tuple(np.shape(x)), src, axes)
    y = x if crop is None else x[crop]
    if not any(b or e for b, e in pos):
        return y
    if mode == "constant":
        if constant_value is not None and np.size(constant_value) > 0:
            fill = constant_value.reshape(()) if np.ndim(constant_value) else constant_value
        else:
            fill = value
        if xp is np:
            return np.pad(y, pos, mode="constant", constant_values=np.asarray(fill))
        return jnp.pad(y, pos, mode="constant", constant_values=jnp.asarray(fill, y.dtype))
    return xp.pad(y, pos, mode=mode)


@builtin("Range", since=11, attrs={"stash_type": 1})
def range_(ctx, start, limit, delta, *, stash_type):
    """Range(start, limit, delta) -> output: start + i*delta while before limit."""
    # Scalars, though some exporters hand over 1-element vectors.
    s = np.asarray(ctx.static(start, "start")).reshape(())
    lim = np.asarray(ctx.static(limit, "limit")).reshape(())
    d = np.asarray(ctx.static(delta, "delta")).reshape(())
    dtype = s.dtype
    if ctx.opset >= 27 and dtype.itemsize == 2 and dtype.kind not in "iu" and stash_type != 0:
        # Range-27 accumulates 16-bit floats in the stash type (float by default).
        stash = _onnx_dtype(stash_type)
        return np.arange(s.astype(stash), lim.astype(stash), d.astype(stash)).astype(dtype)
    return np.arange(s, lim, d, dtype=dtype)


@builtin("EyeLike", since=9, attrs={"dtype": None, "k": 0})
def eye_like(ctx, x, *, dtype, k):
    """EyeLike(input) -> output: a 2-D identity-like tensor with ones on diagonal k."""
    if np.ndim(x) != 2:
        raise ctx.error(f"EyeLike needs a 2-D input, got rank {np.ndim(x)}")
    out_dtype = _onnx_dtype(dtype) if dtype is not None else np.dtype(x.dtype)
    n, m = np.shape(x)
    return np.eye(n, m, k, dtype=out_dtype)


@builtin("Trilu", since=14, attrs={"upper": 1})
def trilu(ctx, x, k=None, *, upper):
    """Trilu(input, k?) -> output: the upper (or lower) triangle from diagonal k."""
    kk = static_ints(ctx, k, "k")[0] if k is not None else 0
    xp = namespace(jnp, x)
    return xp.triu(x, kk) if upper else xp.tril(x, kk)


@builtin("DepthToSpace", since=1, attrs={"blocksize": REQUIRED, "mode": "DCR"})
def depth_to_space(ctx, x, *, blocksize, mode):
    """DepthToSpace(input) -> output: moves depth blocks into spatial blocks (DCR or CRD)."""
    n, c, h, w = np.shape(x)
    b = blocksize
    xp = namespace(jnp, x)
    if mode == "DCR":
        y = xp.reshape(x, (n, b, b, c // (b * b), h, w))
        y = xp.transpose(y, (0, 3, 4, 1, 5, 2))
    elif mode == "CRD":
        y = xp.reshape(x, (n, c // (b * b), b, b, h, w))
        y = xp.transpose(y, (0, 1, 4, 2, 5, 3))
    else:
        raise unsupported(ctx, f"mode {mode!r} not supported; use 'DCR' or 'CRD'")
    return xp.reshape(y, (n, c // (b * b), h * b, w * b))


@builtin("SpaceToDepth", since=1, attrs={"blocksize": REQUIRED, "mode": "DCR"})
def space_to_depth(ctx, x, *, blocksize, mode):
    """SpaceToDepth(input) -> output: moves spatial blocks into depth (DCR or CRD order)."""
    n, c, h, w = np.shape(x)
    b = blocksize
    perms = {"DCR": (0, 3, 5, 1, 2, 4), "CRD": (0, 1, 3, 5, 2, 4)}
    check_choice(ctx, "mode", mode, sorted(perms))
    xp = namespace(jnp, x)
    y = xp.reshape(x, (n, c, h // b, b, w // b, b))
    y = xp.transpose(y, perms[mode])
    return xp.reshape(y, (n, c * b * b, h // b, w // b))


@builtin("CenterCropPad", since=18, attrs={"axes": None})
def center_crop_pad(ctx, x, shape, *, axes):
    """CenterCropPad(input_data, shape) -> output_data: center crop or zero-pad to shape."""
    target = static_ints(ctx, shape, "shape")
    rank = np.ndim(x)
    ax = [normalize_axis(ctx, a, rank) for a in axes] if axes is not None else range(rank)
    crop = [slice(None)] * rank
    width = [(0, 0)] * rank
    for a, t in zip(ax, target, strict=False):
        dim = np.shape(x)[a]
        if t < dim:
            start = (dim - t) // 2
            crop[a] = slice(start, start + t)
        elif t > dim:
            before = (t - dim) // 2
            width[a] = (before, t - dim - before)
    y = x[tuple(crop)]
    return namespace(jnp, x).pad(y, width) if any(b or e for b, e in width) else y


# -- Resize / Upsample --------------------------------------------------------------------


def _resize(
    ctx,
    x,
    *,
    scales: list[float],
    sizes: list[int],
    roi: list[float] | None,
    mode: str,
    coord_mode: str,
    nearest_mode: str,
    cubic_a: float,
    antialias: bool,
    exclude_outside: bool,
    extrapolation_value: float,
):
    """Separable resize: one static gather (nearest) or weight matrix (linear/cubic) per axis."""
    xp = namespace(jnp, x)
    dtype = np.dtype(x.dtype)
    if mode != "nearest":
        compute = dtype if dtype in (np.float32, np.float64) else np.dtype(np.float32)
        y = x.astype(compute)
    else:
        y = x
    steps, outside_any = resizing.resize_steps(
        np.shape(x),
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
            y = xp.take(y, idx.astype(np.int32), axis=axis)
        else:
            # A static gather of n taps per output, then their weighted sum: O(out * n).
            taps = xp.take(y, idx.reshape(-1).astype(np.int32), axis=axis)
            lead, trail = np.shape(y)[:axis], np.shape(y)[axis + 1 :]
            taps = xp.reshape(taps, (*lead, *idx.shape, *trail))
            w = coeffs.reshape((1,) * axis + coeffs.shape + (1,) * len(trail)).astype(y.dtype)
            y = xp.sum(taps * w, axis=axis + 1)
    if outside_any is not None:
        y = xp.where(outside_any, xp.asarray(extrapolation_value, y.dtype), y)
    if y.dtype != dtype:
        if np.issubdtype(dtype, np.integer):
            info = np.iinfo(dtype)
            y = xp.clip(xp.round(y), info.min, info.max)
        y = y.astype(dtype)
    return y


@builtin("Resize", since=10, attrs=resizing.RESIZE_ATTRS)
def resize(ctx, x, roi=None, scales=None, sizes=None, **attrs):
    """Resize(X, roi?, scales?, sizes?) -> Y: nearest, linear or cubic resampling."""
    kwargs = resizing.resize_arguments(
        ctx,
        np.shape(x),
        roi,
        scales,
        sizes,
        attrs,
        present=lambda v: np.size(v) > 0,
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
    size_v = [int(s * d) for s, d in zip(scale_v, np.shape(x), strict=True)]
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
