"""RoiAlign, MaxRoiPool and DeformConv written once against ``xp``: the ops that read a
feature map at points computed from the data (regions of interest, learned offsets).

Each point reads all its channels at once: the map is laid out channels-last as a table of
pixel rows and read with ``xp.take`` (one row gather, not one gather per channel), the bins,
bilinear weights and the grouped product with the kernel written here. Of the backend's
:class:`~xconv.converters.ops.nn.NnKernel` they take ``sample`` (the whole computation jitted
on JAX with its geometry static; called directly on torch), ``constant`` and ``index``. The
points come from run-time data, so gradients reach the feature map (and DeformConv's offsets,
mask, weight and bias) on both backends.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from xconv.converters.ops import shapes
from xconv.converters.ops.arrays import astype
from xconv.converters.ops.attrs import check_choice
from xconv.converters.ops.nn import NnKernel

# ---------------------------------------------------------------------------- DeformConv


def deform_conv(kern, x, w, offset, b, mask, *, s, d, p, og: int, g: int):
    """DeformConv: each kernel tap reads X bilinearly at its regular position plus a learned
    offset (per offset group), optionally scaled by ``mask``; then a grouped product with W."""
    xp = kern.xp
    n = x.ndim - 2
    nb, c = x.shape[:2]
    spatial = tuple(x.shape[2:])
    out_sp = tuple(offset.shape[2:])
    kernel = tuple(w.shape[2:])
    kk, mo, size = int(np.prod(kernel)), int(np.prod(out_sp)), int(np.prod(spatial))
    rows, cg = nb * og, c // og  # one row per (batch, offset group)
    off = astype(xp, xp.reshape(offset, (rows, kk, n, mo)), x.dtype)
    kpos = np.stack(np.meshgrid(*[np.arange(k) for k in kernel], indexing="ij"), 0)
    opos = np.stack(np.meshgrid(*[np.arange(o) for o in out_sp], indexing="ij"), 0)
    kpos, opos = kpos.reshape(n, kk), opos.reshape(n, mo)
    pos = []  # per dimension: (rows, K, M)
    for i in range(n):
        base = opos[i][None, :] * s[i] - p[i] + kpos[i][:, None] * d[i]
        pos.append(kern.constant(base, x.dtype, x) + off[:, :, i, :])
    # X channels-last, one table row per (row, pixel): each point reads its Cg channels.
    table = xp.reshape(xp.moveaxis(xp.reshape(x, (rows, cg, size)), 1, -1), (rows * size, cg))
    start = kern.index(kern.asarray(np.arange(rows, dtype=np.int32) * size))[:, None, None]
    low = [xp.floor(q) for q in pos]
    frac = [q - f for q, f in zip(pos, low, strict=True)]
    low = [kern.index(f) for f in low]
    scale = None if mask is None else astype(xp, xp.reshape(mask, (rows, kk, mo)), x.dtype)
    cols = 0
    for corner in itertools.product((0, 1), repeat=n):
        weight = 1 if scale is None else scale
        flat = 0
        for i, bit in enumerate(corner):
            q = low[i] + bit
            inside = (q >= 0) & (q < spatial[i])
            weight = xp.where(inside, weight * (frac[i] if bit else 1 - frac[i]), 0.0)
            flat = flat * spatial[i] + xp.clip(q, 0, spatial[i] - 1)
        cols = cols + xp.take(table, start + flat, axis=0) * weight[..., None]
    # (rows, K, M, Cg) -> (N, K, M, group, C / group): channels grouped as W groups them.
    cols = xp.reshape(cols, (nb, og, kk, mo, cg))
    cols = xp.reshape(xp.transpose(cols, (0, 2, 3, 1, 4)), (nb, kk, mo, g, c // g))
    wg = astype(xp, xp.reshape(w, (g, w.shape[0] // g, c // g, kk)), x.dtype)
    y = xp.reshape(xp.einsum("nkmgc,gock->ngom", cols, wg), (nb, w.shape[0]) + out_sp)
    if b is not None:
        y = y + astype(xp, xp.reshape(b, (1, -1) + (1,) * n), y.dtype)
    return y


# ---------------------------------------------------------------------------- MaxRoiPool


def _round_half_away(xp, v):
    """C's ``round``: halves away from zero (``xp.rint`` rounds them to even)."""
    return xp.sign(v) * xp.floor(xp.abs(v) + 0.5)


def max_roi_pool(kern, x, rois, *, ph: int, pw: int, spatial_scale: float):
    """MaxRoiPool: each (batch, x1, y1, x2, y2) roi, scaled and rounded to whole pixels, split
    into ``ph x pw`` bins (Caffe's floor / ceil bounds); the max of each bin, 0 when empty."""
    xp = kern.xp
    _, _, h, w = x.shape
    box = _round_half_away(xp, astype(xp, rois[:, 1:], x.dtype) * spatial_scale)
    x1, y1, x2, y2 = box[:, 0], box[:, 1], box[:, 2], box[:, 3]

    def bins(start, end, pooled: int, size: int):
        """(R, pooled, size) membership of each pixel, and (R, pooled) empty bins."""
        step = xp.maximum(end - start + 1, 1.0) / pooled
        k = kern.constant(np.arange(pooled), x.dtype, x)[None]
        lo = xp.clip(xp.floor(k * step[:, None]) + start[:, None], 0, size)
        hi = xp.clip(xp.ceil((k + 1) * step[:, None]) + start[:, None], 0, size)
        r = kern.constant(np.arange(size), x.dtype, x)[None, None]
        return (r >= lo[..., None]) & (r < hi[..., None]), hi <= lo

    (mh, empty_h), (mw, empty_w) = bins(y1, y2, ph, h), bins(x1, x2, pw, w)
    xb = xp.take(x, kern.index(rois[:, 0]), axis=0)  # (R, C, H, W)
    t = xp.max(xp.where(mw[:, None, None], xb[:, :, :, None, :], -np.inf), axis=-1)
    y = xp.max(xp.where(mh[:, None, :, :, None], t[:, :, None, :, :], -np.inf), axis=-2)
    empty = empty_h[:, :, None] | empty_w[:, None, :]
    return xp.where(empty[:, None], 0.0, y)


# ------------------------------------------------------------------------------ RoiAlign


def _axis_samples(kern, x, start, bin_size, grid, pooled: int, g: int, size: int):
    """Along one axis, each roi's (R, pooled, g) sample points: low and high pixel (backend
    indices), their bilinear weights (0 outside the map), and which of the ``g`` are in use
    (None when all are: a fixed sampling ratio)."""
    xp = kern.xp
    k = kern.constant(np.arange(pooled), x.dtype, x)[None, :, None]
    i = kern.constant(np.arange(g), x.dtype, x)[None, None, :]
    step = bin_size[:, None, None]
    if grid is None:
        c = start[:, None, None] + k * step + (i + 0.5) * step / g
        used = None
    else:
        gr = grid[:, None, None]
        c = start[:, None, None] + k * step + (i + 0.5) * step / xp.maximum(gr, 1.0)
        used = i < gr
    outside = (c < -1.0) | (c > size)
    c = xp.maximum(c, 0.0)
    low = xp.floor(c)
    at_end = low >= size - 1
    low = xp.where(at_end, size - 1.0, low)
    high = xp.where(at_end, size - 1.0, low + 1)
    frac = xp.where(at_end, 0.0, c - low)
    wl = xp.where(outside, 0.0, 1 - frac)
    wh = xp.where(outside, 0.0, frac)
    return kern.index(low), kern.index(high), wl, wh, used


def roi_align(kern, x, rois, batch_indices, *, ph, pw, gh, gw, fixed, spatial_scale, half, mode):
    """RoiAlign: each roi split into ``ph x pw`` bins, each bin sampled on a grid of bilinear
    points (``fixed`` per axis, else ``ceil(bin size)`` per roi, at most ``gh x gw``), the
    samples averaged (or, ``max``, the largest weighted corner taken)."""
    xp = kern.xp
    nb, c, h, w = x.shape
    box = astype(xp, rois, x.dtype) * spatial_scale - (0.5 if half else 0.0)
    start_w, start_h = box[:, 0], box[:, 1]
    roi_w, roi_h = box[:, 2] - start_w, box[:, 3] - start_h
    if not half:
        roi_w, roi_h = xp.maximum(roi_w, 1.0), xp.maximum(roi_h, 1.0)
    bin_h, bin_w = roi_h / ph, roi_w / pw
    grid_h = grid_w = None
    if not fixed:
        grid_h = xp.minimum(xp.ceil(bin_h), float(gh))
        grid_w = xp.minimum(xp.ceil(bin_w), float(gw))
    yl, yh, wyl, wyh, uy = _axis_samples(kern, x, start_h, bin_h, grid_h, ph, gh, h)
    xl, xh, wxl, wxh, ux = _axis_samples(kern, x, start_w, bin_w, grid_w, pw, gw, w)

    # X channels-last, one table row per pixel: each sample reads its C channels.
    r = rois.shape[0]
    table = xp.reshape(xp.moveaxis(x, 1, -1), (nb * h * w, c))
    start = xp.reshape(kern.index(batch_indices), (r, 1, 1, 1, 1)) * (h * w)

    def at(yi, xi):  # -> (R, ph, pw, gh, gw, C)
        return xp.take(table, start + yi[:, :, None, :, None] * w + xi[:, None, :, None, :], axis=0)

    def wt(wy, wx):
        return (wy[:, :, None, :, None] * wx[:, None, :, None, :])[..., None]

    terms = [
        wt(wyl, wxl) * at(yl, xl),
        wt(wyl, wxh) * at(yl, xh),
        wt(wyh, wxl) * at(yh, xl),
        wt(wyh, wxh) * at(yh, xh),
    ]
    used = None if fixed else (uy[:, :, None, :, None] & ux[:, None, :, None, :])[..., None]
    if mode == "avg":
        total = terms[0] + terms[1] + terms[2] + terms[3]
        if fixed:
            y = xp.sum(total, axis=(3, 4)) / float(gh * gw)
        else:
            count = xp.maximum(grid_h * grid_w, 1.0)[:, None, None, None]
            y = xp.sum(xp.where(used, total, 0.0), axis=(3, 4)) / count
    else:
        best = xp.maximum(xp.maximum(terms[0], terms[1]), xp.maximum(terms[2], terms[3]))
        if fixed:
            y = xp.max(best, axis=(3, 4))
        else:
            y = xp.max(xp.where(used, best, -np.inf), axis=(3, 4))
            y = xp.where((grid_h * grid_w > 0)[:, None, None, None], y, 0.0)  # no sample: 0
    return astype(xp, xp.moveaxis(y, -1, 1), x.dtype)


def _numpy_float(dtype) -> Any:
    """A float dtype (numpy's, JAX's or torch's) as numpy's, float32 when numpy lacks it."""
    try:
        return np.dtype(dtype)
    except TypeError:
        name = str(dtype).removeprefix("torch.")
        return np.dtype(name) if name in ("float16", "float32", "float64") else np.float32


def roi_grid(rois: np.ndarray, dtype, spatial_scale: float, half: bool, pooled) -> tuple:
    """An adaptive sampling grid's largest size over static ``rois``: the (h, w) of the padded
    grid every roi's samples fit in (its own grid is ``ceil(bin size)``, at least 1)."""
    dt = _numpy_float(dtype)
    box = rois.astype(dt) * np.asarray(spatial_scale, dt) - np.asarray(0.5 if half else 0, dt)
    rh, rw = box[:, 3] - box[:, 1], box[:, 2] - box[:, 0]
    if not half:
        rh, rw = np.maximum(rh, dt.type(1)), np.maximum(rw, dt.type(1))
    gh = int(np.max(np.ceil(rh / dt.type(pooled[0])), initial=1))
    gw = int(np.max(np.ceil(rw / dt.type(pooled[1])), initial=1))
    return max(1, gh), max(1, gw)


# ----------------------------------------------------------------------------- handlers

ROI_ALIGN_ATTRS = {
    "coordinate_transformation_mode": "half_pixel",
    "mode": "avg",
    "output_height": 1,
    "output_width": 1,
    "sampling_ratio": 0,
    "spatial_scale": 1.0,
}

DEFORM_CONV_ATTRS = {
    "dilations": None,
    "group": 1,
    "kernel_shape": None,
    "offset_group": 1,
    "pads": None,
    "strides": None,
}


def register_detection_ops(builtin: Callable[..., Any], kern: NnKernel, required: Any) -> None:
    """Register RoiAlign, MaxRoiPool and DeformConv on a backend's ``NnKernel``."""

    @builtin("RoiAlign", attrs=ROI_ALIGN_ATTRS)
    def roi_align_op(
        ctx, x, rois, batch_indices, *, coordinate_transformation_mode, mode, output_height,
        output_width, sampling_ratio, spatial_scale,
    ):  # fmt: skip
        """RoiAlign(X, rois, batch_indices) -> Y: bilinear samples averaged (or maxed) per bin;
        the adaptive grid (sampling_ratio 0) needs the rois' values when tracing."""
        check_choice(ctx, "mode", mode, ("avg", "max"))
        check_choice(
            ctx,
            "coordinate_transformation_mode",
            coordinate_transformation_mode,
            ("half_pixel", "output_half_pixel"),
        )
        # The adaptive grid reads the rois before they become arrays (under jax.jit, an array
        # made of a constant is traced).
        box = None if sampling_ratio > 0 else ctx.static(rois, "rois (with sampling_ratio=0)")
        x, rois = kern.asarray(x), kern.asarray(rois)
        ph, pw = int(output_height), int(output_width)
        half = coordinate_transformation_mode == "half_pixel"
        if ctx.opset < 16 and "coordinate_transformation_mode" not in ctx.node.attributes:
            half = False  # before opset 16 the only mode was output_half_pixel
        scale = float(spatial_scale)
        if box is None:
            gh = gw = int(sampling_ratio)
        else:
            gh, gw = roi_grid(box, x.dtype, scale, half, (ph, pw))
        return kern.sample(
            roi_align,
            x,
            rois,
            kern.asarray(batch_indices),
            ph=ph,
            pw=pw,
            gh=gh,
            gw=gw,
            fixed=sampling_ratio > 0,
            spatial_scale=scale,
            half=half,
            mode=mode,
        )

    @builtin("MaxRoiPool", attrs={"pooled_shape": required, "spatial_scale": 1.0})
    def max_roi_pool_op(ctx, x, rois, *, pooled_shape, spatial_scale):
        """MaxRoiPool(X, rois) -> Y: Caffe-style max pooling over each (batch, x1, y1, x2, y2)
        roi."""
        ph, pw = (int(v) for v in pooled_shape)
        return kern.sample(
            max_roi_pool,
            kern.asarray(x),
            kern.asarray(rois),
            ph=ph,
            pw=pw,
            spatial_scale=float(spatial_scale),
        )

    @builtin("DeformConv", attrs=DEFORM_CONV_ATTRS)
    def deform_conv_op(
        ctx, x, w, offset, b=None, mask=None, *, dilations, group, kernel_shape, offset_group,
        pads, strides,
    ):  # fmt: skip
        """DeformConv(X, W, offset, B?, mask?) -> Y: conv sampling at learned offsets
        (bilinear)."""
        x = kern.asarray(x)
        n = x.ndim - 2
        return kern.sample(
            deform_conv,
            x,
            kern.asarray(w),
            kern.asarray(offset),
            None if b is None else kern.asarray(b),
            None if mask is None else kern.asarray(mask),
            s=shapes.ints(strides, n, 1),
            d=shapes.ints(dilations, n, 1),
            p=shapes.ints(pads, 2 * n, 0),
            og=int(offset_group),
            g=int(group),
        )
