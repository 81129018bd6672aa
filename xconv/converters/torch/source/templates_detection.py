"""PyTorch source templates: RoiAlign, MaxRoiPool and DeformConv.

The generated ``_roi_align``, ``_max_roi_pool`` and ``_deform_conv`` compute as the torch
runtime does (``ops/detection``): each sample point reads all its channels from a
channels-last table of pixel rows, bilinear weights, bins and the grouped product with the
kernel written out (torchvision's kernels are not assumed). RoiAlign's adaptive grid
(sampling_ratio 0) fixes a shape from the rois' values: computed when writing the code for
constant rois, else read as Python ints from the tensor.
"""

from __future__ import annotations

from xconv.converters import expressions_structured as exs
from xconv.converters.ops.detection import DEFORM_CONV_ATTRS, ROI_ALIGN_ATTRS
from xconv.converters.registry import REQUIRED
from xconv.converters.torch.source.templates import OpCall, registry, template

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
        gh, gw = _roi_grid(rois, x.dtype, scale, half, size)
    else:
        gh, gw = grid
    box = rois.to(x.dtype) * scale - (0.5 if half else 0.0)
    roi_w, roi_h = box[:, 2] - box[:, 0], box[:, 3] - box[:, 1]
    if not half:
        roi_w, roi_h = torch.clamp(roi_w, min=1.0), torch.clamp(roi_h, min=1.0)
    bin_h, bin_w = roi_h / ph, roi_w / pw
    grid_h = grid_w = None
    if ratio <= 0:
        grid_h = torch.clamp(torch.ceil(bin_h), max=float(gh))
        grid_w = torch.clamp(torch.ceil(bin_w), max=float(gw))
    yl, yh, wyl, wyh, uy = _roi_axis(box[:, 1], bin_h, grid_h, ph, gh, h)
    xl, xh, wxl, wxh, ux = _roi_axis(box[:, 0], bin_w, grid_w, pw, gw, w)
    table = x.movedim(1, -1).reshape(nb * h * w, c)
    start = batch_indices.long().reshape(-1, 1, 1, 1, 1) * (h * w)

    def corner(yi, xi, wy, wx):  # -> (R, ph, pw, gh, gw, C)
        at = table[start + yi[:, :, None, :, None] * w + xi[:, None, :, None, :]]
        return (wy[:, :, None, :, None] * wx[:, None, :, None, :])[..., None] * at

    terms = [corner(yl, xl, wyl, wxl), corner(yl, xh, wyl, wxh),
             corner(yh, xl, wyh, wxl), corner(yh, xh, wyh, wxh)]
    used = None if ratio > 0 else (uy[:, :, None, :, None] & ux[:, None, :, None, :])[..., None]
    if mode == "avg":
        total = terms[0] + terms[1] + terms[2] + terms[3]
        if used is None:
            y = total.sum(dim=(3, 4)) / float(gh * gw)
        else:
            count = torch.clamp(grid_h * grid_w, min=1.0)[:, None, None, None]
            y = torch.where(used, total, 0.0).sum(dim=(3, 4)) / count
    else:
        best = torch.maximum(torch.maximum(terms[0], terms[1]), torch.maximum(terms[2], terms[3]))
        if used is None:
            y = best.amax(dim=(3, 4))
        else:
            y = torch.where(used, best, -torch.inf).amax(dim=(3, 4))
            y = torch.where((grid_h * grid_w > 0)[:, None, None, None], y, 0.0)  # no sample: 0
    return y.movedim(-1, 1).to(x.dtype)


def _roi_axis(start, bin_size, grid, pooled, g, size):
    """Along one axis of _roi_align, each roi's (R, pooled, g) sample points: low and high
    pixel, their bilinear weights (0 outside the map), and which of the g are in use (None
    when all are: a fixed sampling ratio)."""
    k = torch.arange(pooled, dtype=start.dtype, device=start.device)[None, :, None]
    i = torch.arange(g, dtype=start.dtype, device=start.device)[None, None, :]
    step = bin_size[:, None, None]
    if grid is None:
        c = start[:, None, None] + k * step + (i + 0.5) * step / g
        used = None
    else:
        gr = grid[:, None, None]
        c = start[:, None, None] + k * step + (i + 0.5) * step / torch.clamp(gr, min=1.0)
        used = i < gr
    outside = (c < -1.0) | (c > size)
    c = torch.clamp(c, min=0.0)
    low = torch.floor(c)
    at_end = low >= size - 1
    low = torch.where(at_end, size - 1.0, low)
    high = torch.where(at_end, size - 1.0, low + 1)
    frac = torch.where(at_end, 0.0, c - low)
    wl, wh = torch.where(outside, 0.0, 1 - frac), torch.where(outside, 0.0, frac)
    return low.long(), high.long(), wl, wh, used


def _roi_grid(rois, dtype, scale, half, size):
    """The adaptive grid _roi_align pads every roi's samples to: the largest ceil(bin size)
    over the rois, per axis, at least 1 (Python ints: it fixes the samples' shape)."""
    box = rois.detach().to(dtype) * scale - (0.5 if half else 0.0)
    rh, rw = box[:, 3] - box[:, 1], box[:, 2] - box[:, 0]
    if not half:
        rh, rw = torch.clamp(rh, min=1.0), torch.clamp(rw, min=1.0)
    if rois.shape[0] == 0:
        return 1, 1
    gh = int(torch.ceil(rh / size[0]).max())
    gw = int(torch.ceil(rw / size[1]).max())
    return max(1, gh), max(1, gw)
'''

registry.helpers["max_roi_pool"] = '''
def _max_roi_pool(x, rois, size, scale=1.0):
    """ONNX MaxRoiPool: each (batch, x1, y1, x2, y2) roi, scaled and rounded to whole pixels
    (halves away from zero), split into ``size`` (ph, pw) bins (Caffe's floor / ceil bounds);
    the max of each bin of x (N, C, H, W), 0 when empty: (R, C, ph, pw)."""
    h, w = x.shape[2:]
    box = rois[:, 1:].to(x.dtype) * scale
    box = torch.sign(box) * torch.floor(torch.abs(box) + 0.5)
    x1, y1, x2, y2 = box[:, 0], box[:, 1], box[:, 2], box[:, 3]

    def bins(start, end, pooled, n):  # (R, pooled, n) pixels in each bin, (R, pooled) empty
        step = torch.clamp(end - start + 1, min=1.0) / pooled
        k = torch.arange(pooled, dtype=x.dtype, device=x.device)[None]
        lo = torch.clamp(torch.floor(k * step[:, None]) + start[:, None], 0, n)
        hi = torch.clamp(torch.ceil((k + 1) * step[:, None]) + start[:, None], 0, n)
        r = torch.arange(n, dtype=x.dtype, device=x.device)[None, None]
        return (r >= lo[..., None]) & (r < hi[..., None]), hi <= lo

    (mh, empty_h), (mw, empty_w) = bins(y1, y2, size[0], h), bins(x1, x2, size[1], w)
    xb = x[rois[:, 0].long()]  # (R, C, H, W)
    t = torch.where(mw[:, None, None], xb[:, :, :, None, :], -torch.inf).amax(dim=-1)
    y = torch.where(mh[:, None, :, :, None], t[:, :, None, :, :], -torch.inf).amax(dim=-2)
    empty = empty_h[:, :, None] | empty_w[:, None, :]
    return torch.where(empty[:, None], 0.0, y).to(x.dtype)
'''

registry.helpers["deform_conv"] = '''
def _deform_conv(x, w, offset, b=None, mask=None, strides=None, pads=None, dilations=None,
                 groups=1, offset_groups=1):
    """ONNX DeformConv of x (N, C, *D) by w (O, C / groups, *K): each kernel tap reads x
    bilinearly (0 outside) at its regular position plus its learned offset (one per offset
    group of channels), times ``mask`` when given; then the grouped product with w, plus b."""
    n = x.dim() - 2
    (nb, c), spatial = x.shape[:2], x.shape[2:]
    out_sp, kernel = offset.shape[2:], w.shape[2:]
    strides, dilations = strides or (1,) * n, dilations or (1,) * n
    pads = pads or (0,) * (2 * n)
    kk, mo, size = math.prod(kernel), math.prod(out_sp), math.prod(spatial)
    rows, cg = nb * offset_groups, c // offset_groups  # one row per (batch, offset group)
    off = offset.reshape(rows, kk, n, mo).to(x.dtype)
    grids = [torch.arange(k, device=x.device) for k in kernel]
    kpos = torch.stack(torch.meshgrid(*grids, indexing="ij")).reshape(n, kk)
    grids = [torch.arange(o, device=x.device) for o in out_sp]
    opos = torch.stack(torch.meshgrid(*grids, indexing="ij")).reshape(n, mo)
    pos = []  # per dimension: (rows, K, M)
    for i in range(n):
        base = opos[i][None, :] * strides[i] - pads[i] + kpos[i][:, None] * dilations[i]
        pos.append(base.to(x.dtype) + off[:, :, i, :])
    # x channels-last, one table row per (row, pixel): each point reads its cg channels.
    table = x.reshape(rows, cg, size).movedim(1, -1).reshape(-1, cg)
    start = (torch.arange(rows, device=x.device) * size)[:, None, None]
    low = [torch.floor(q) for q in pos]
    frac = [q - f for q, f in zip(pos, low, strict=True)]
    low = [f.long() for f in low]
    scale = None if mask is None else mask.reshape(rows, kk, mo).to(x.dtype)
    cols = 0
    for corner in range(2**n):  # the 2^n bilinear corners, the last dimension's bit lowest
        weight, flat = 1 if scale is None else scale, 0
        for i in range(n):
            bit = (corner >> (n - 1 - i)) & 1
            q = low[i] + bit
            inside = (q >= 0) & (q < spatial[i])
            weight = torch.where(inside, weight * (frac[i] if bit else 1 - frac[i]), 0.0)
            flat = flat * spatial[i] + torch.clamp(q, 0, spatial[i] - 1)
        cols = cols + table[start + flat] * weight[..., None]
    # (rows, K, M, cg) -> (N, K, M, groups, C / groups): channels grouped as w groups them.
    cols = cols.reshape(nb, offset_groups, kk, mo, cg).permute(0, 2, 3, 1, 4)
    cols = cols.reshape(nb, kk, mo, groups, c // groups)
    wg = w.reshape(groups, w.shape[0] // groups, c // groups, kk).to(x.dtype)
    y = torch.einsum("nkmgc,gock->ngom", cols, wg).reshape(nb, w.shape[0], *out_sp)
    if b is not None:
        y = y + b.reshape((1, -1) + (1,) * n).to(y.dtype)
    return y
'''


@registry.builtin("RoiAlign", since=10, until=15, attrs=ROI_ALIGN_ATTRS)
def _roi_align_10(c: OpCall) -> str:
    """Opsets 10 to 15: output_half_pixel unless the node names a mode."""
    return exs.roi_align_call(c, since16=False)


@registry.builtin("RoiAlign", since=16, attrs=ROI_ALIGN_ATTRS)
def _roi_align_16(c: OpCall) -> str:
    return exs.roi_align_call(c)


template("MaxRoiPool", pooled_shape=REQUIRED, spatial_scale=1.0)(exs.max_roi_pool_call)
template("DeformConv", **DEFORM_CONV_ATTRS)(exs.deform_conv_call)
