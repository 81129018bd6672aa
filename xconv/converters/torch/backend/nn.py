"""PyTorch handlers for the neural-network ops: convolution, pooling, normalisation, dropout and
the sampling ops (GridSample, AffineGrid, MaxUnpool, Col2Im).

All spatial ops keep ONNX's channels-first layout. Explicit (possibly asymmetric) padding is
applied with ``F.pad``; pooling windows come from ``Tensor.unfold`` so dilations, ceil mode
and MaxPool's Indices follow ONNX exactly. In a module in training mode, BatchNormalization
nodes of a recognised ``batch_norm`` layer use batch statistics and update the running
buffers in place (torch's momentum convention), and ``dropout`` layers drop.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
import torch.nn.functional as F

from xconv.converters.ops import shapes
from xconv.converters.ops.attrs import CONV_ATTRS
from xconv.converters.ops.normalization import register_batch_norm, register_normalization_ops
from xconv.converters.torch.backend.registry import REQUIRED, builtin
from xconv.converters.torch.backend.shape import check_choice
from xconv.converters.torch.backend.xp import KERNEL
from xconv.ir.metadata import MODULE


def _pad_spatial(x, lo_hi, value=0.0):
    """F.pad with per-spatial-dim (low, high) widths (negative widths crop)."""
    flat = [p for pair in reversed(lo_hi) for p in pair]
    if not any(flat):
        return x
    return F.pad(x, flat, value=value)


def _bias(b, ndim: int, dtype):
    return b.reshape((1, -1) + (1,) * (ndim - 2)).to(dtype)


def _conv_nd(x, w, stride, dilation, groups):
    n = x.ndim - 2
    if n not in (1, 2, 3):
        raise ValueError(f"convolution supports 1 to 3 spatial dims, got {n}")
    fn = (F.conv1d, F.conv2d, F.conv3d)[n - 1]
    return fn(x, w, stride=stride, dilation=dilation, groups=groups)


@builtin("Conv", attrs=CONV_ATTRS)
def conv(ctx, x, w, b=None, *, auto_pad, dilations, group, kernel_shape, pads, strides):
    """Conv(X, W, B?) -> Y: N-d cross-correlation, NC[spatial] layout, grouped."""
    n = x.ndim - 2
    kernel = tuple(w.shape[2:])
    s, d = shapes.ints(strides, n, 1), shapes.ints(dilations, n, 1)
    padding = shapes.conv_padding(ctx.node, auto_pad, x.shape[2:], kernel, s, d, pads)
    y = _conv_nd(_pad_spatial(x, padding), w.to(x.dtype), s, d, int(group))
    if b is not None:
        y = y + _bias(b, y.ndim, y.dtype)
    return y


@builtin("ConvTranspose", attrs={**CONV_ATTRS, "output_padding": None, "output_shape": None})
def conv_transpose(
    ctx,
    x,
    w,
    b=None,
    *,
    auto_pad,
    dilations,
    group,
    kernel_shape,
    output_padding,
    output_shape,
    pads,
    strides,
):
    """ConvTranspose(X, W, B?) -> Y: the gradient of Conv; W is (C_in, C_out/group, k...)."""
    w = w.to(x.dtype)
    n = x.ndim - 2
    g = int(group)
    spatial = tuple(x.shape[2:])
    kernel = tuple(w.shape[2:])
    s, d = shapes.ints(strides, n, 1), shapes.ints(dilations, n, 1)
    op = shapes.ints(output_padding, n, 0)
    padding = shapes.conv_transpose_padding(
        ctx.node, auto_pad, spatial, kernel, s, d, op, output_shape, pads
    )
    c_in, c_out_g = w.shape[0], w.shape[1]
    wt = w.reshape((g, c_in // g, c_out_g) + kernel).transpose(1, 2)
    wt = wt.reshape((g * c_out_g, c_in // g) + kernel).flip(tuple(range(2, n + 2)))
    # Dilate the input by the strides (zeros between samples), then a plain convolution.
    if any(si > 1 for si in s):
        dil_shape = tuple(x.shape[:2]) + tuple(
            (i - 1) * si + 1 for i, si in zip(spatial, s, strict=True)
        )
        xd = x.new_zeros(dil_shape)
        xd[(slice(None), slice(None), *(slice(None, None, si) for si in s))] = x
    else:
        xd = x
    y = _conv_nd(_pad_spatial(xd, padding), wt, (1,) * n, d, g)
    if b is not None:
        y = y + _bias(b, y.ndim, y.dtype)
    return y


@builtin("Col2Im", attrs={"dilations": None, "pads": None, "strides": None})
def col2im(ctx, x, image_shape, block_shape, *, dilations, pads, strides):
    """Col2Im(input, image_shape, block_shape) -> output: sum sliding blocks into an image."""
    image = [int(v) for v in ctx.static(image_shape, "image_shape")]
    block = [int(v) for v in ctx.static(block_shape, "block_shape")]
    n = len(image)
    s, d = shapes.ints(strides, n, 1), shapes.ints(dilations, n, 1)
    p = shapes.ints(pads, 2 * n, 0)
    counts = [
        (image[i] + p[i] + p[i + n] - ((block[i] - 1) * d[i] + 1)) // s[i] + 1 for i in range(n)
    ]
    total = int(np.prod(image))
    index = np.zeros((int(np.prod(block)), int(np.prod(counts))), dtype=np.int64)
    valid = np.ones_like(index, dtype=bool)
    kgrid = np.stack(np.meshgrid(*[np.arange(b) for b in block], indexing="ij"), 0)
    lgrid = np.stack(np.meshgrid(*[np.arange(c) for c in counts], indexing="ij"), 0)
    for i in range(n):
        pos = lgrid[i].reshape(1, -1) * s[i] - p[i] + kgrid[i].reshape(-1, 1) * d[i]
        valid &= (pos >= 0) & (pos < image[i])
        index = index * image[i] + np.clip(pos, 0, image[i] - 1)
    index = torch.as_tensor(np.where(valid, index, total).reshape(-1), device=x.device)
    nb, ck, _ = x.shape
    c = ck // int(np.prod(block))
    vals = x.reshape(nb, c, -1)
    out = x.new_zeros((nb, c, total + 1)).index_add(2, index, vals)
    return out[:, :, :total].reshape((nb, c, *image))


# --------------------------------------------------------------------------- pooling


def _windows(x, kernel, strides, dilations, lo_hi, extra, out, fill):
    """(N, C, out..., k...) windows of x padded with ``fill`` (ONNX pads + ceil-mode extra)."""
    pad = [(lo, hi + e) for (lo, hi), e in zip(lo_hi, extra, strict=True)]
    flat = [p for pair in reversed(pad) for p in pair]
    if any(flat):
        x = F.pad(x, flat, value=fill)
    n = len(kernel)
    for i, (k, s, d, o) in enumerate(zip(kernel, strides, dilations, out, strict=True)):
        eff = (k - 1) * d + 1
        x = x.narrow(2 + i, 0, (o - 1) * s + eff).unfold(2 + i, eff, s)
        if d > 1:
            x = x[..., ::d]
    # unfold appends kernel dims at the end in order.
    return x.reshape(tuple(x.shape[: 2 + n]) + tuple(kernel))


def _lowest(dtype):
    if dtype == torch.bool:
        return False
    if dtype.is_floating_point:
        return -math.inf
    return torch.iinfo(dtype).min


def _pool_setup(x, kernel_shape, strides, dilations):
    n = x.ndim - 2
    return (
        n,
        shapes.ints(kernel_shape, n, 1),
        shapes.ints(strides, n, 1),
        shapes.ints(dilations, n, 1),
    )


_POOL_ATTRS = {
    "auto_pad": "NOTSET",
    "ceil_mode": 0,
    "dilations": None,
    "kernel_shape": REQUIRED,
    "pads": None,
    "strides": None,
}


@builtin("MaxPool", attrs={**_POOL_ATTRS, "storage_order": 0})
def max_pool(ctx, x, *, auto_pad, ceil_mode, dilations, kernel_shape, pads, storage_order, strides):
    """MaxPool(X) -> (Y, Indices?): Indices are flat over N x C x D1 x ... (row- or column-major)."""
    n, kernel, s, d = _pool_setup(x, kernel_shape, strides, dilations)
    spatial = tuple(x.shape[2:])
    out, lo_hi, extra = shapes.pool_geometry(
        ctx.node, auto_pad, spatial, kernel, s, d, pads, ceil_mode
    )
    xc = x.to(torch.int32) if x.dtype in (torch.int8, torch.uint8) else x
    win = _windows(xc, kernel, s, d, lo_hi, extra, out, _lowest(xc.dtype))
    win = win.reshape(tuple(win.shape[: 2 + n]) + (-1,))
    y, arg = win.max(dim=-1)
    y = y.to(x.dtype)
    if len(ctx.node.outputs) < 2 or not ctx.node.outputs[1].name:
        return y
    size = int(np.prod(spatial))
    if storage_order:
        coords = np.unravel_index(np.arange(size), spatial)
        strides_cm = np.cumprod((1,) + spatial[:-1])
        flat_np = sum(c * st for c, st in zip(coords, strides_cm, strict=True)).reshape(spatial)
    else:
        flat_np = np.arange(size).reshape(spatial)
    flat = torch.as_tensor(flat_np, dtype=torch.int64, device=x.device)
    flat = flat.reshape((1, 1) + spatial).expand(x.shape[:2] + spatial)
    iwin = _windows(flat, kernel, s, d, lo_hi, extra, out, -1)
    iwin = iwin.reshape(tuple(iwin.shape[: 2 + n]) + (-1,))
    idx = torch.gather(iwin, -1, arg.unsqueeze(-1)).squeeze(-1)
    base = (torch.arange(x.shape[0] * x.shape[1], device=x.device) * size).reshape(
        tuple(x.shape[:2]) + (1,) * n
    )
    return y, (idx + base).to(ctx.output_dtype(1) or torch.int64)


def _window_sum(x, kernel, s, d, lo_hi, extra, out):
    win = _windows(x, kernel, s, d, lo_hi, extra, out, 0.0)
    return win.sum(dim=tuple(range(-len(kernel), 0)))


@builtin("AveragePool", attrs={**_POOL_ATTRS, "count_include_pad": 0})
def average_pool(
    ctx, x, *, auto_pad, ceil_mode, count_include_pad, dilations, kernel_shape, pads, strides
):
    """AveragePool(X) -> Y; padding counts in the divisor only with count_include_pad."""
    n, kernel, s, d = _pool_setup(x, kernel_shape, strides, dilations)
    spatial = tuple(x.shape[2:])
    out, lo_hi, extra = shapes.pool_geometry(
        ctx.node, auto_pad, spatial, kernel, s, d, pads, ceil_mode
    )
    total = _window_sum(x, kernel, s, d, lo_hi, extra, out)
    counts = shapes.window_counts(spatial, kernel, s, d, lo_hi, out, bool(count_include_pad))
    return total / torch.as_tensor(counts, dtype=x.dtype, device=x.device)


@builtin("LpPool", attrs={**_POOL_ATTRS, "p": 2})
def lp_pool(ctx, x, *, auto_pad, ceil_mode, dilations, kernel_shape, p, pads, strides):
    """LpPool(X) -> Y = (sum over the window of |x|^p)^(1/p)."""
    n, kernel, s, d = _pool_setup(x, kernel_shape, strides, dilations)
    out, lo_hi, extra = shapes.pool_geometry(
        ctx.node, auto_pad, tuple(x.shape[2:]), kernel, s, d, pads, ceil_mode
    )
    p = float(p)
    total = _window_sum(x.abs() ** p, kernel, s, d, lo_hi, extra, out)
    return (total ** (1.0 / p)).to(x.dtype)


@builtin("GlobalAveragePool")
def global_average_pool(ctx, x):
    """GlobalAveragePool(X) -> Y: mean over all spatial axes, kept as size 1."""
    return x.mean(dim=tuple(range(2, x.ndim)), keepdim=True)


@builtin("GlobalMaxPool")
def global_max_pool(ctx, x):
    """GlobalMaxPool(X) -> Y: max over all spatial axes, kept as size 1."""
    return x.amax(dim=tuple(range(2, x.ndim)), keepdim=True)


@builtin("GlobalLpPool", attrs={"p": 2})
def global_lp_pool(ctx, x, *, p):
    """GlobalLpPool(X) -> Y: the p-norm over all spatial axes, kept as size 1."""
    p = float(p)
    total = (x.abs() ** p).sum(dim=tuple(range(2, x.ndim)), keepdim=True)
    return (total ** (1.0 / p)).to(x.dtype)


@builtin("MaxUnpool", attrs={"kernel_shape": REQUIRED, "pads": None, "strides": None})
def max_unpool(ctx, x, indices, output_shape=None, *, kernel_shape, pads, strides):
    """MaxUnpool(X, I, output_shape?) -> Y: scatter X to the flat positions I, zeros elsewhere."""
    n = x.ndim - 2
    s = shapes.ints(strides, n, 1)
    p = shapes.ints(pads, 2 * n, 0)
    inferred = list(x.shape[:2]) + [
        (x.shape[i + 2] - 1) * s[i] - (p[i] + p[i + n]) + int(kernel_shape[i]) for i in range(n)
    ]
    total = int(np.prod(inferred))
    idx = indices.reshape(-1).to(torch.int64)
    keep = (idx >= 0) & (idx < total)
    flat = x.new_zeros((total,)).index_put((idx[keep],), x.reshape(-1)[keep])
    y = flat.reshape(inferred)
    if output_shape is None:
        return y
    shape = [int(v) for v in ctx.static(output_shape, "output_shape")]
    pad = [(0, max(0, t - i)) for t, i in zip(shape, inferred, strict=True)]
    flat_pad = [q for pair in reversed(pad) for q in pair]
    y = F.pad(y, flat_pad) if any(flat_pad) else y
    return y[tuple(slice(0, t) for t in shape)]


# --------------------------------------------------------------------------- normalisation


def _module_batch_norm(ctx, x, scale, b, mean, var, epsilon, momentum):
    """A recognised ``batch_norm`` layer of a module in training mode: normalise with batch
    statistics and update the running buffers in place (torch's rule for torch layers)."""
    layer = ctx.layer or {}
    if not (ctx.training and layer.get("kind") == "batch_norm"):
        return None
    axes = (0,) + tuple(range(2, x.ndim))
    batch_mean = x.mean(dim=axes)
    batch_var = x.var(dim=axes, unbiased=False)
    torch_momentum = layer.get("momentum", 1.0 - momentum)
    count = x.numel() // x.shape[1]
    with torch.no_grad():
        if torch_momentum is None:  # cumulative moving average
            torch_momentum = 0.0
        # torch updates running_var with the unbiased batch variance; Flax, Keras and
        # ONNX with the biased one.
        update = batch_var
        if ctx.node.metadata_props.get(MODULE, "").startswith("torch."):
            update = batch_var * (count / max(count - 1, 1))
        mean.mul_(1 - torch_momentum).add_(batch_mean.detach().to(mean.dtype) * torch_momentum)
        var.mul_(1 - torch_momentum).add_(update.detach().to(var.dtype) * torch_momentum)
    inv = torch.rsqrt(_bias(batch_var, x.ndim, x.dtype) + epsilon)
    return (x - _bias(batch_mean, x.ndim, x.dtype)) * inv * _bias(scale, x.ndim, x.dtype) + _bias(
        b, x.ndim, x.dtype
    )


register_batch_norm(builtin, KERNEL, _module_batch_norm)


# Instance/Layer/Group/RMS/Lp/MeanVariance normalisation: written once in
# converters/ops/normalization.py.
register_normalization_ops(builtin, KERNEL, REQUIRED)


@builtin("LRN", attrs={"alpha": 1e-4, "beta": 0.75, "bias": 1.0, "size": REQUIRED})
def lrn(ctx, x, *, alpha, beta, bias, size):
    """LRN(X) -> Y = X / (bias + alpha / size * sum of X^2 over nearby channels)^beta."""
    size = int(size)
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = (x * x).transpose(1, -1)
    sq = F.pad(sq, (lo, hi)).unfold(-1, size, 1).sum(-1).transpose(1, -1)
    return x / (bias + alpha / size * sq) ** beta


# --------------------------------------------------------------------------- dropout


def seeded_generator(ctx, seed) -> torch.Generator | None:
    """A generator seeded from the node's ``seed`` attribute, else the module's (or None)."""
    if seed is None:
        return ctx.generator
    gen = torch.Generator()
    gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


@builtin("Dropout", attrs={"seed": None, "ratio": 0.5, "is_test": 0, "consumed_inputs": None})
def dropout(ctx, x, *inputs, seed, ratio, is_test, consumed_inputs):
    """Dropout(data, ratio?, training_mode?) -> (output, mask?): identity unless training.

    Opset 12+ takes ratio and training_mode as inputs; older opsets carry ratio as an
    attribute and train only when is_test=0 (opset < 7). A recognised ``dropout`` layer drops
    when the module is in training mode.
    """
    if ctx.opset >= 12:
        rate = inputs[0] if inputs and inputs[0] is not None else 0.5
        flag = inputs[1] if len(inputs) > 1 else None
        training = flag is not None and bool(ctx.static(flag, "training_mode"))
    else:
        rate = ratio
        training = ctx.opset < 7 and not is_test
    layer = ctx.layer or {}
    if ctx.training and layer.get("kind") == "dropout":
        training = True
    n_out = len(ctx.node.outputs)
    mask_dtype = (ctx.output_dtype(1) if n_out > 1 else None) or torch.bool
    if not training:
        return (x, torch.ones(x.shape, dtype=mask_dtype)) if n_out > 1 else x
    rate = float(ctx.static(rate, "ratio")) if isinstance(rate, torch.Tensor) else float(rate)
    gen = seeded_generator(ctx, seed)
    keep = torch.rand(x.shape, generator=gen, device="cpu").to(x.device) >= rate
    scale = 1.0 / (1.0 - rate) if rate < 1 else 0.0
    y = torch.where(keep, x * scale, torch.zeros((), dtype=x.dtype))
    return (y, keep.to(mask_dtype)) if n_out > 1 else y


# --------------------------------------------------------------------------- sampling


def _reflect(c, lo: float, hi: float):
    span = hi - lo
    if span <= 0:
        return torch.full_like(c, lo)
    below = lo - c
    nb = torch.floor(below / span)
    rb = below - nb * span
    refl_lo = torch.where(torch.remainder(nb, 2) == 0, lo + rb, hi - rb)
    above = c - hi
    na = torch.floor(above / span)
    ra = above - na * span
    refl_hi = torch.where(torch.remainder(na, 2) == 0, hi - ra, lo + ra)
    return torch.where(c < lo, refl_lo, torch.where(c > hi, refl_hi, c))


def _cubic_coeffs(t):
    a = -0.75
    t1, t2 = t + 1, 1 - t
    return [
        ((a * t1 - 5 * a) * t1 + 8 * a) * t1 - 4 * a,
        ((a + 2) * t - (a + 3)) * t * t + 1,
        ((a + 2) * t2 - (a + 3)) * t2 * t2 + 1,
        ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a,
    ]


def _gather_points(data, coords, dims):
    """data (N, C, P) at integer points (list of (N, M)); outside reads 0 -> (N, C, M)."""
    valid = None
    flat = 0
    for c, size in zip(coords, dims, strict=True):
        inside = (c >= 0) & (c < size)
        valid = inside if valid is None else valid & inside
        flat = flat * size + c.clamp(0, size - 1)
    idx = flat[:, None, :].expand(data.shape[0], data.shape[1], flat.shape[-1])
    vals = torch.gather(data, 2, idx)
    return torch.where(valid[:, None, :], vals, torch.zeros((), dtype=data.dtype))


@builtin("GridSample", attrs={"align_corners": 0, "mode": "linear", "padding_mode": "zeros"})
def grid_sample(ctx, x, grid, *, align_corners, mode, padding_mode):
    """GridSample(X, grid) -> Y: sample X at normalised grid points ([-1, 1], last axis x, y, ...)."""
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    check_choice(ctx, "mode", mode, ("linear", "nearest", "cubic"))
    check_choice(ctx, "padding_mode", padding_mode, ("zeros", "border", "reflection"))
    n = x.ndim - 2
    nb, c = x.shape[:2]
    dims = tuple(x.shape[2:])
    out_sp = tuple(grid.shape[1:-1])
    m = int(np.prod(out_sp))
    g = grid.reshape(nb, m, n).to(x.dtype)
    coords, borders = [], []
    for i, size in enumerate(dims):
        u = g[:, :, n - 1 - i]
        if align_corners:
            coords.append((u + 1) / 2 * (size - 1))
            borders.append((0.0, size - 1.0))
        else:
            coords.append(((u + 1) * size - 1) / 2)
            borders.append((-0.5, size - 0.5))
    if mode == "nearest":
        coords = [torch.round(q) for q in coords]
    if padding_mode == "border":
        coords = [q.clamp(0, size - 1) for q, size in zip(coords, dims, strict=True)]
    elif padding_mode == "reflection":
        coords = [_reflect(q, *bd) for q, bd in zip(coords, borders, strict=True)]
    data = x.reshape(nb, c, -1)

    def fetch(index):
        fixed = []
        for q, size, bd in zip(index, dims, borders, strict=True):
            if padding_mode == "border":
                q = q.clamp(0, size - 1)
            elif padding_mode == "reflection":
                q = torch.trunc(_reflect(q.to(x.dtype), *bd)).to(torch.int64).clamp(0, size - 1)
            fixed.append(q)
        return _gather_points(data, fixed, dims)

    if mode == "nearest":
        y = fetch([q.to(torch.int64) for q in coords])
    else:
        taps = (0, 1) if mode == "linear" else (-1, 0, 1, 2)
        base = [torch.floor(q) for q in coords]
        frac = [q - b0 for q, b0 in zip(coords, base, strict=True)]
        weights = (
            [[1 - f, f] for f in frac] if mode == "linear" else [_cubic_coeffs(f) for f in frac]
        )
        base = [b0.to(torch.int64) for b0 in base]
        y = 0
        for combo in itertools.product(range(len(taps)), repeat=n):
            w = 1
            for i, t in enumerate(combo):
                w = w * weights[i][t]
            y = y + w[:, None, :] * fetch([b0 + taps[t] for b0, t in zip(base, combo, strict=True)])
    return y.reshape((nb, c) + out_sp).to(x.dtype)


@builtin("AffineGrid", attrs={"align_corners": 0})
def affine_grid(ctx, theta, size, *, align_corners):
    """AffineGrid(theta, size) -> grid: normalised sampling points theta @ (x, y[, z], 1)."""
    shape = [int(v) for v in ctx.static(size, "size")]
    spatial = shape[2:]
    axes = []
    for s in spatial:
        if align_corners:
            axes.append(np.linspace(-1.0, 1.0, s) if s > 1 else np.zeros(1))
        else:
            axes.append((np.arange(s) * 2.0 + 1.0) / s - 1.0)
    mesh = np.meshgrid(*axes, indexing="ij")
    pts = np.stack([*mesh[::-1], np.ones_like(mesh[0])], axis=-1).reshape(-1, len(spatial) + 1)
    pts = torch.as_tensor(pts, dtype=theta.dtype, device=theta.device)
    grid = torch.einsum("pk,njk->npj", pts, theta)
    return grid.reshape((theta.shape[0], *spatial, len(spatial)))
