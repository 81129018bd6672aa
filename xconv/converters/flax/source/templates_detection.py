"""Flax source templates: RoiAlign, MaxRoiPool and DeformConv.

The generated ``_roi_align``, ``_max_roi_pool`` and ``_deform_conv`` compute as the JAX
runtime does (``ops/detection``): each sample point reads all its channels from a
channels-last table of pixel rows (``jnp.take``), bilinear weights, bins and the grouped
product with the kernel written out. RoiAlign's adaptive grid (sampling_ratio 0) fixes a
shape from the rois' values: computed when writing the code for constant rois, else read
eagerly (``_static``), as ``to_jax`` reads it.
"""

from __future__ import annotations

from xconv.converters import expressions_structured as exs
from xconv.converters.flax.source.templates import OpCall, registry, template
from xconv.converters.ops.detection import DEFORM_CONV_ATTRS, ROI_ALIGN_ATTRS
from xconv.converters.registry import REQUIRED

registry.helpers["roi_align"] = '''
def _roi_align(x, rois, batch_indices, size, ratio=0, scale=1.0, half=True, mode="avg",
               grid=None):
    """ONNX RoiAlign: each (x1, y1, x2, y2) roi of image batch_indices[r] of x (N, C, H, W),
    scaled by ``scale`` (less half a pixel when ``half``), split into ``size`` (ph, pw) bins;
    each bin sampled on a ratio x ratio grid of bilinear points (ratio 0: ceil(bin size) per
    axis and roi, at most ``grid``, which is read from the rois when not given), the samples
    averaged ("avg") or the largest weighted corner taken ("max"): (R, C, ph, pw)."""
    nb, c, h, w = x.shape
    ph, pw = size
    if ratio > 0:
        gh = gw = ratio
    elif grid is None:
        gh, gw = _roi_grid(_static(rois, "RoiAlign rois (sampling_ratio 0)"), x.dtype, scale,
                           half, size)
    else:
        gh, gw = grid
    box = rois.astype(x.dtype) * scale - (0.5 if half else 0.0)
    roi_w, roi_h = box[:, 2] - box[:, 0], box[:, 3] - box[:, 1]
    if not half:
        roi_w, roi_h = jnp.maximum(roi_w, 1.0), jnp.maximum(roi_h, 1.0)
    bin_h, bin_w = roi_h / ph, roi_w / pw
    grid_h = grid_w = None
    if ratio <= 0:
        grid_h = jnp.minimum(jnp.ceil(bin_h), float(gh))
        grid_w = jnp.minimum(jnp.ceil(bin_w), float(gw))
    yl, yh, wyl, wyh, uy = _roi_axis(box[:, 1], bin_h, grid_h, ph, gh, h)
    xl, xh, wxl, wxh, ux = _roi_axis(box[:, 0], bin_w, grid_w, pw, gw, w)
    table = jnp.reshape(jnp.moveaxis(x, 1, -1), (nb * h * w, c))
    start = jnp.reshape(batch_indices.astype(jnp.int32), (-1, 1, 1, 1, 1)) * (h * w)

    def corner(yi, xi, wy, wx):  # -> (R, ph, pw, gh, gw, C)
        at = jnp.take(table, start + yi[:, :, None, :, None] * w + xi[:, None, :, None, :], axis=0)
        return (wy[:, :, None, :, None] * wx[:, None, :, None, :])[..., None] * at

    terms = [corner(yl, xl, wyl, wxl), corner(yl, xh, wyl, wxh),
             corner(yh, xl, wyh, wxl), corner(yh, xh, wyh, wxh)]
    used = None if ratio > 0 else (uy[:, :, None, :, None] & ux[:, None, :, None, :])[..., None]
    if mode == "avg":
        total = terms[0] + terms[1] + terms[2] + terms[3]
        if used is None:
            y = jnp.sum(total, axis=(3, 4)) / float(gh * gw)
        else:
            count = jnp.maximum(grid_h * grid_w, 1.0)[:, None, None, None]
            y = jnp.sum(jnp.where(used, total, 0.0), axis=(3, 4)) / count
    else:
        best = jnp.maximum(jnp.maximum(terms[0], terms[1]), jnp.maximum(terms[2], terms[3]))
        if used is None:
            y = jnp.max(best, axis=(3, 4))
        else:
            y = jnp.max(jnp.where(used, best, -jnp.inf), axis=(3, 4))
            y = jnp.where((grid_h * grid_w > 0)[:, None, None, None], y, 0.0)  # no sample: 0
    return jnp.moveaxis(y, -1, 1).astype(x.dtype)


def _roi_axis(start, bin_size, grid, pooled, g, size):
    """Along one axis of _roi_align, each roi's (R, pooled, g) sample points: low and high
    pixel, their bilinear weights (0 outside the map), and which of the g are in use (None
    when all are: a fixed sampling ratio)."""
    k, i = np.arange(pooled)[None, :, None], np.arange(g)[None, None, :]
    step = bin_size[:, None, None]
    if grid is None:
        c = start[:, None, None] + k * step + (i + 0.5) * step / g
        used = None
    else:
        gr = grid[:, None, None]
        c = start[:, None, None] + k * step + (i + 0.5) * step / jnp.maximum(gr, 1.0)
        used = i < gr
    outside = (c < -1.0) | (c > size)
    c = jnp.maximum(c, 0.0)
    low = jnp.floor(c)
    at_end = low >= size - 1
    low = jnp.where(at_end, size - 1.0, low)
    high = jnp.where(at_end, size - 1.0, low + 1)
    frac = jnp.where(at_end, 0.0, c - low)
    wl, wh = jnp.where(outside, 0.0, 1 - frac), jnp.where(outside, 0.0, frac)
    return low.astype(jnp.int32), high.astype(jnp.int32), wl, wh, used


def _roi_grid(rois, dtype, scale, half, size):
    """The adaptive grid _roi_align pads every roi's samples to: the largest ceil(bin size)
    over the rois (numpy values), per axis, at least 1."""
    dt = np.dtype(dtype)
    box = rois.reshape(-1, 4).astype(dt) * np.asarray(scale, dt) - np.asarray(0.5 * half, dt)
    rh, rw = box[:, 3] - box[:, 1], box[:, 2] - box[:, 0]
    if not half:
        rh, rw = np.maximum(rh, dt.type(1)), np.maximum(rw, dt.type(1))
    gh = int(np.max(np.ceil(rh / dt.type(size[0])), initial=1))
    gw = int(np.max(np.ceil(rw / dt.type(size[1])), initial=1))
    return max(1, gh), max(1, gw)
'''

registry.helpers["max_roi_pool"] = '''
def _max_roi_pool(x, rois, size, scale=1.0):
    """ONNX MaxRoiPool: each (batch, x1, y1, x2, y2) roi, scaled and rounded to whole pixels
    (halves away from zero), split into ``size`` (ph, pw) bins (Caffe's floor / ceil bounds);
    the max of each bin of x (N, C, H, W), 0 when empty: (R, C, ph, pw)."""
    h, w = x.shape[2:]
    box = rois[:, 1:].astype(x.dtype) * scale
    box = jnp.sign(box) * jnp.floor(jnp.abs(box) + 0.5)
    x1, y1, x2, y2 = box[:, 0], box[:, 1], box[:, 2], box[:, 3]

    def bins(start, end, pooled, n):  # (R, pooled, n) pixels in each bin, (R, pooled) empty
        step = jnp.maximum(end - start + 1, 1.0) / pooled
        k = np.arange(pooled).astype(x.dtype)[None]
        lo = jnp.clip(jnp.floor(k * step[:, None]) + start[:, None], 0, n)
        hi = jnp.clip(jnp.ceil((k + 1) * step[:, None]) + start[:, None], 0, n)
        r = np.arange(n).astype(x.dtype)[None, None]
        return (r >= lo[..., None]) & (r < hi[..., None]), hi <= lo

    (mh, empty_h), (mw, empty_w) = bins(y1, y2, size[0], h), bins(x1, x2, size[1], w)
    xb = jnp.take(x, rois[:, 0].astype(jnp.int32), axis=0)  # (R, C, H, W)
    t = jnp.max(jnp.where(mw[:, None, None], xb[:, :, :, None, :], -jnp.inf), axis=-1)
    y = jnp.max(jnp.where(mh[:, None, :, :, None], t[:, :, None, :, :], -jnp.inf), axis=-2)
    empty = empty_h[:, :, None] | empty_w[:, None, :]
    return jnp.where(empty[:, None], 0.0, y).astype(x.dtype)
'''

registry.helpers["deform_conv"] = '''
def _deform_conv(x, w, offset, b=None, mask=None, strides=None, pads=None, dilations=None,
                 groups=1, offset_groups=1):
    """ONNX DeformConv of x (N, C, *D) by w (O, C / groups, *K): each kernel tap reads x
    bilinearly (0 outside) at its regular position plus its learned offset (one per offset
    group of channels), times ``mask`` when given; then the grouped product with w, plus b."""
    n = x.ndim - 2
    (nb, c), spatial = x.shape[:2], x.shape[2:]
    out_sp, kernel = offset.shape[2:], w.shape[2:]
    strides, dilations = strides or (1,) * n, dilations or (1,) * n
    pads = pads or (0,) * (2 * n)
    kk, mo, size = math.prod(kernel), math.prod(out_sp), math.prod(spatial)
    rows, cg = nb * offset_groups, c // offset_groups  # one row per (batch, offset group)
    off = jnp.reshape(offset, (rows, kk, n, mo)).astype(x.dtype)
    kpos = np.stack(np.meshgrid(*[np.arange(k) for k in kernel], indexing="ij")).reshape(n, kk)
    opos = np.stack(np.meshgrid(*[np.arange(o) for o in out_sp], indexing="ij")).reshape(n, mo)
    pos = []  # per dimension: (rows, K, M)
    for i in range(n):
        base = opos[i][None, :] * strides[i] - pads[i] + kpos[i][:, None] * dilations[i]
        pos.append(base.astype(x.dtype) + off[:, :, i, :])
    # x channels-last, one table row per (row, pixel): each point reads its cg channels.
    table = jnp.reshape(jnp.moveaxis(jnp.reshape(x, (rows, cg, size)), 1, -1), (-1, cg))
    start = (np.arange(rows, dtype=np.int32) * size)[:, None, None]
    low = [jnp.floor(q) for q in pos]
    frac = [q - f for q, f in zip(pos, low, strict=True)]
    low = [f.astype(jnp.int32) for f in low]
    scale = None if mask is None else jnp.reshape(mask, (rows, kk, mo)).astype(x.dtype)
    cols = 0
    for corner in range(2**n):  # the 2^n bilinear corners, the last dimension's bit lowest
        weight, flat = 1 if scale is None else scale, 0
        for i in range(n):
            bit = (corner >> (n - 1 - i)) & 1
            q = low[i] + bit
            inside = (q >= 0) & (q < spatial[i])
            weight = jnp.where(inside, weight * (frac[i] if bit else 1 - frac[i]), 0.0)
            flat = flat * spatial[i] + jnp.clip(q, 0, spatial[i] - 1)
        cols = cols + jnp.take(table, start + flat, axis=0) * weight[..., None]
    # (rows, K, M, cg) -> (N, K, M, groups, C / groups): channels grouped as w groups them.
    cols = jnp.reshape(cols, (nb, offset_groups, kk, mo, cg))
    cols = jnp.reshape(jnp.transpose(cols, (0, 2, 3, 1, 4)), (nb, kk, mo, groups, c // groups))
    wg = jnp.reshape(w, (groups, w.shape[0] // groups, c // groups, kk)).astype(x.dtype)
    y = jnp.reshape(jnp.einsum("nkmgc,gock->ngom", cols, wg), (nb, w.shape[0], *out_sp))
    if b is not None:
        y = y + jnp.reshape(b, (1, -1) + (1,) * n).astype(y.dtype)
    return y
'''


def _roi_align(c: OpCall, since16: bool) -> str:
    """``_roi_align``, whose adaptive grid over rois computed at run time is read eagerly
    (``_static``)."""
    c.helpers.add("static_ints")
    return exs.roi_align_call(c, since16)


@registry.builtin("RoiAlign", since=10, until=15, attrs=ROI_ALIGN_ATTRS)
def _roi_align_10(c: OpCall) -> str:
    """Opsets 10 to 15: output_half_pixel unless the node names a mode."""
    return _roi_align(c, since16=False)


@registry.builtin("RoiAlign", since=16, attrs=ROI_ALIGN_ATTRS)
def _roi_align_16(c: OpCall) -> str:
    return _roi_align(c, since16=True)


template("MaxRoiPool", pooled_shape=REQUIRED, spatial_scale=1.0)(exs.max_roi_pool_call)
template("DeformConv", **DEFORM_CONV_ATTRS)(exs.deform_conv_call)
