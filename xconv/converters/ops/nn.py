"""Convolution, pooling and sampling written once against ``xp``.

The geometry (auto_pad, pads, ceil mode, output sizes) is :mod:`xconv.converters.ops.shapes`;
here are the ops over it. A backend's :class:`NnKernel` supplies the primitives the array API
lacks: the convolution, the pooling windows (``lax.reduce_window``; ``Tensor.unfold`` on torch),
gathering points for GridSample and the scatter-adds of Col2Im and MaxUnpool. GridSample's
coordinate math (unnormalising, border/reflection padding, nearest/linear/cubic taps) and
AffineGrid's points are shared. RoiAlign, MaxRoiPool and DeformConv, which read the map at
points computed from the data, are :mod:`xconv.converters.ops.detection` (on the same kernel).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from xconv.converters.ops import shapes
from xconv.converters.ops.arrays import astype
from xconv.converters.ops.attrs import CONV_ATTRS, check_choice
from xconv.converters.ops.reduce import mean


class NnKernel(Protocol):
    """What a backend provides for convolution, pooling and sampling."""

    xp: Any

    def asarray(self, x: Any) -> Any: ...

    def constant(self, a: np.ndarray, dtype: Any, like: Any) -> Any:
        """numpy ``a`` as a backend array of ``dtype`` on ``like``'s device."""

    def index(self, x: Any) -> Any:
        """``x`` as the backend's gather index type."""

    def conv(self, x, w, strides, padding, dilations, groups, lhs_dilation) -> Any:
        """N-d grouped cross-correlation, ``padding`` per-dimension ``(low, high)`` (negative
        crops), the input dilated by ``lhs_dilation`` (ConvTranspose)."""

    def pool(self, kind: str, x, kernel, strides, dilations, lo_hi, extra, out, indices=False):
        """``max`` (Y, or with ``indices`` (Y, the row-major flat spatial index of each max))
        or ``sum`` over the windows padded with ``lo_hi`` and ceil mode's ``extra``."""

    def gather_points(self, data, coords, dims) -> Any:
        """``data`` (N, C, P) at integer points (a list of (N, M), one per dimension of
        ``dims``); outside reads 0. Returns (N, C, M)."""

    def sample(self, fn: Callable[..., Any], *arrays, **static) -> Any:
        """``fn(kernel, *arrays, **static)`` (JAX: jitted, ``static`` static; GridSample,
        RoiAlign, MaxRoiPool, DeformConv)."""

    def scatter_add(self, x, index, total: int) -> Any:
        """Col2Im: (N, C, total) zeros with ``x`` (N, C, K) added at numpy ``index`` (K,)."""

    def scatter(self, flat_len: int, index, values) -> Any:
        """MaxUnpool: (flat_len,) zeros with ``values`` set at the backend's integer
        ``index`` (out of range dropped)."""

    def pad_crop(self, y, shape) -> Any:
        """``y`` zero-padded at the end (or cropped) to ``shape``."""


def _bias(xp, b, ndim: int, dtype):
    return astype(xp, xp.reshape(b, (1, -1) + (1,) * (ndim - 2)), dtype)


# ---------------------------------------------------------------------------- convolution


def conv_transpose_weight(xp, w, g: int, n: int):
    """ConvTranspose's (C_in, C_out/g, k...) weight as a convolution's (C_out, C_in/g, k...),
    spatially flipped."""
    kernel = tuple(w.shape[2:])
    c_in, c_out_g = w.shape[0], w.shape[1]
    wt = xp.swapaxes(xp.reshape(w, (g, c_in // g, c_out_g) + kernel), 1, 2)
    wt = xp.reshape(wt, (g * c_out_g, c_in // g) + kernel)
    return xp.flip(wt, axis=tuple(range(2, n + 2)))


def col2im_index(image, block, strides, dilations, pads) -> np.ndarray:
    """Flat image index of every (kernel offset, block position); out of the image: a dump
    slot ``prod(image)``."""
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
    return np.where(valid, index, total).reshape(-1)


def register_conv_ops(builtin: Callable[..., Any], kern: NnKernel) -> None:
    """Register Conv, ConvTranspose and Col2Im."""
    xp = kern.xp

    @builtin("Conv", attrs=CONV_ATTRS)
    def conv(ctx, x, w, b=None, *, auto_pad, dilations, group, kernel_shape, pads, strides):
        """Conv(X, W, B?) -> Y: N-d cross-correlation, NC[spatial] layout, grouped."""
        x, w = kern.asarray(x), kern.asarray(w)
        n = x.ndim - 2
        kernel = tuple(w.shape[2:])
        s, d = shapes.ints(strides, n, 1), shapes.ints(dilations, n, 1)
        padding = shapes.conv_padding(ctx.node, auto_pad, tuple(x.shape[2:]), kernel, s, d, pads)
        y = kern.conv(x, astype(xp, w, x.dtype), s, padding, d, int(group), (1,) * n)
        return y if b is None else y + _bias(xp, kern.asarray(b), y.ndim, y.dtype)

    @builtin("ConvTranspose", attrs={**CONV_ATTRS, "output_padding": None, "output_shape": None})
    def conv_transpose(
        ctx, x, w, b=None, *, auto_pad, dilations, group, kernel_shape, output_padding,
        output_shape, pads, strides,
    ):  # fmt: skip
        """ConvTranspose(X, W, B?) -> Y: the gradient of Conv; W is (C_in, C_out/group, k...),
        run as a stride-1 convolution of the stride-dilated input."""
        x = kern.asarray(x)
        w = astype(xp, kern.asarray(w), x.dtype)
        n = x.ndim - 2
        kernel = tuple(w.shape[2:])
        s, d = shapes.ints(strides, n, 1), shapes.ints(dilations, n, 1)
        op = shapes.ints(output_padding, n, 0)
        padding = shapes.conv_transpose_padding(
            ctx.node, auto_pad, tuple(x.shape[2:]), kernel, s, d, op, output_shape, pads
        )
        wt = conv_transpose_weight(xp, w, int(group), n)
        y = kern.conv(x, wt, (1,) * n, padding, d, int(group), s)
        return y if b is None else y + _bias(xp, kern.asarray(b), y.ndim, y.dtype)

    @builtin("Col2Im", attrs={"dilations": None, "pads": None, "strides": None})
    def col2im(ctx, x, image_shape, block_shape, *, dilations, pads, strides):
        """Col2Im(input, image_shape, block_shape) -> output: sum sliding blocks into an
        image."""
        x = kern.asarray(x)
        image = [int(v) for v in ctx.static(image_shape, "image_shape")]
        block = [int(v) for v in ctx.static(block_shape, "block_shape")]
        index = col2im_index(image, block, strides, dilations, pads)
        nb, ck, _ = x.shape
        c = ck // int(np.prod(block))
        total = int(np.prod(image))
        out = kern.scatter_add(xp.reshape(x, (nb, c, -1)), index, total + 1)
        return xp.reshape(out[:, :, :total], (nb, c, *image))


# ------------------------------------------------------------------------------- pooling

POOL_ATTRS = {
    "auto_pad": "NOTSET",
    "ceil_mode": 0,
    "dilations": None,
    "kernel_shape": None,
    "pads": None,
    "strides": None,
}


def column_major(spatial) -> np.ndarray:
    """For each row-major flat spatial position, its column-major one (first axis fastest)."""
    size = int(np.prod(spatial))
    coords = np.unravel_index(np.arange(size), spatial)
    strides_cm = np.cumprod((1,) + tuple(spatial[:-1]))
    return sum(c * st for c, st in zip(coords, strides_cm, strict=True))


def register_pool_ops(builtin: Callable[..., Any], kern: NnKernel, required: Any) -> None:
    """Register MaxPool, AveragePool, LpPool, the global pools and MaxUnpool."""
    xp = kern.xp
    attrs = {**POOL_ATTRS, "kernel_shape": required}

    def setup(ctx, x, auto_pad, ceil_mode, dilations, kernel_shape, pads, strides):
        x = kern.asarray(x)
        n = x.ndim - 2
        kernel = shapes.ints(kernel_shape, n, 1)
        s, d = shapes.ints(strides, n, 1), shapes.ints(dilations, n, 1)
        spatial = tuple(x.shape[2:])
        out, lo_hi, extra = shapes.pool_geometry(
            ctx.node, auto_pad, spatial, kernel, s, d, pads, ceil_mode
        )
        return x, (kernel, s, d, lo_hi, extra, out)

    @builtin("MaxPool", attrs={**attrs, "storage_order": 0})
    def max_pool(ctx, x, *, storage_order, **a):
        """MaxPool(X) -> (Y, Indices?): Indices are flat over N x C x D1 x ... (row- or
        column-major)."""
        x, geo = setup(ctx, x, **a)
        if len(ctx.node.outputs) < 2 or not ctx.node.outputs[1].name:
            return kern.pool("max", x, *geo)
        y, idx = kern.pool("max", x, *geo, indices=True)
        spatial = tuple(x.shape[2:])
        size = int(np.prod(spatial))
        if storage_order:
            # A padding cell's index (-1 on torch) stays as it is.
            col = kern.constant(column_major(spatial), idx.dtype, idx)[idx]
            idx = xp.where(idx < 0, idx, col)
        out_dtype = ctx.output_dtype(1) or xp.int64
        base = kern.constant(np.arange(x.shape[0] * x.shape[1]) * size, out_dtype, x)
        base = xp.reshape(base, tuple(x.shape[:2]) + (1,) * (x.ndim - 2))
        return y, astype(xp, idx, out_dtype) + base

    @builtin("AveragePool", attrs={**attrs, "count_include_pad": 0})
    def average_pool(ctx, x, *, count_include_pad, **a):
        """AveragePool(X) -> Y; padding counts in the divisor only with count_include_pad."""
        x, geo = setup(ctx, x, **a)
        total = kern.pool("sum", x, *geo)
        kernel, s, d, lo_hi, _, out = geo
        counts = shapes.window_counts(
            tuple(x.shape[2:]), kernel, s, d, lo_hi, out, bool(count_include_pad)
        )
        return total / kern.constant(counts, x.dtype, x)

    @builtin("LpPool", attrs={**attrs, "p": 2})
    def lp_pool(ctx, x, *, p, **a):
        """LpPool(X) -> Y = (sum over the window of |x|^p)^(1/p)."""
        x, geo = setup(ctx, x, **a)
        p = float(p)
        total = kern.pool("sum", xp.abs(x) ** p, *geo)
        return astype(xp, total ** (1.0 / p), x.dtype)

    _register_global_pools(builtin, kern, required)


def _register_global_pools(builtin: Callable[..., Any], kern: NnKernel, required: Any) -> None:
    """Register GlobalAveragePool, GlobalMaxPool, GlobalLpPool and MaxUnpool."""
    xp = kern.xp

    def spatial_axes(x):
        return tuple(range(2, x.ndim))

    @builtin("GlobalAveragePool")
    def global_average_pool(ctx, x):
        """GlobalAveragePool(X) -> Y: mean over all spatial axes, kept as size 1."""
        x = kern.asarray(x)
        return mean(xp, x, spatial_axes(x), True)

    @builtin("GlobalMaxPool")
    def global_max_pool(ctx, x):
        """GlobalMaxPool(X) -> Y: max over all spatial axes, kept as size 1."""
        x = kern.asarray(x)
        return xp.max(x, axis=spatial_axes(x), keepdims=True)

    @builtin("GlobalLpPool", attrs={"p": 2})
    def global_lp_pool(ctx, x, *, p):
        """GlobalLpPool(X) -> Y: the p-norm over all spatial axes, kept as size 1."""
        x = kern.asarray(x)
        p = float(p)
        total = xp.sum(xp.abs(x) ** p, axis=spatial_axes(x), keepdims=True)
        return astype(xp, total ** (1.0 / p), x.dtype)

    @builtin("MaxUnpool", attrs={"kernel_shape": required, "pads": None, "strides": None})
    def max_unpool(ctx, x, indices, output_shape=None, *, kernel_shape, pads, strides):
        """MaxUnpool(X, I, output_shape?) -> Y: scatter X to the flat positions I, zeros
        elsewhere."""
        x = kern.asarray(x)
        n = x.ndim - 2
        s = shapes.ints(strides, n, 1)
        p = shapes.ints(pads, 2 * n, 0)
        inferred = list(x.shape[:2]) + [
            (x.shape[i + 2] - 1) * s[i] - (p[i] + p[i + n]) + int(kernel_shape[i]) for i in range(n)
        ]
        index = xp.reshape(kern.asarray(indices), (-1,))
        flat = kern.scatter(int(np.prod(inferred)), index, xp.reshape(x, (-1,)))
        y = xp.reshape(flat, tuple(inferred))
        if output_shape is None:
            return y
        shape = [int(v) for v in ctx.static(output_shape, "output_shape")]
        return kern.pad_crop(y, shape)


# ------------------------------------------------------------------------------- dropout


DROPOUT_ATTRS = {"seed": None, "ratio": 0.5, "is_test": 0, "consumed_inputs": None}


def dropout_mode(ctx, inputs, ratio, is_test) -> tuple[Any, bool]:
    """Dropout's (ratio, training): opset 12+ takes ratio and training_mode as inputs (ratio
    0.5 when absent); older opsets carry ratio as an attribute and train only when is_test=0
    (opset < 7). The drawing stays per backend (JAX keys, torch generators)."""
    if ctx.opset >= 12:
        rate = inputs[0] if inputs and inputs[0] is not None else 0.5
        flag = inputs[1] if len(inputs) > 1 else None
        return rate, flag is not None and bool(ctx.static(flag, "training_mode"))
    return ratio, ctx.opset < 7 and not is_test


# ------------------------------------------------------------------------------ sampling


def _reflect(xp, c, lo: float, hi: float):
    """Reflect coordinates into [lo, hi] by the nearer border, repeatedly (as ONNX does)."""
    span = hi - lo
    if span <= 0:
        return xp.full_like(c, lo)
    below = lo - c
    nb = xp.floor(below / span)
    rb = below - nb * span
    refl_lo = xp.where(xp.remainder(nb, 2) == 0, lo + rb, hi - rb)
    above = c - hi
    na = xp.floor(above / span)
    ra = above - na * span
    refl_hi = xp.where(xp.remainder(na, 2) == 0, hi - ra, lo + ra)
    return xp.where(c < lo, refl_lo, xp.where(c > hi, refl_hi, c))


def _cubic_coeffs(t):
    a = -0.75
    t1, t2 = t + 1, 1 - t
    return [
        ((a * t1 - 5 * a) * t1 + 8 * a) * t1 - 4 * a,
        ((a + 2) * t - (a + 3)) * t * t + 1,
        ((a + 2) * t2 - (a + 3)) * t2 * t2 + 1,
        ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a,
    ]


def grid_sample(kern: NnKernel, x, grid, *, align_corners: bool, mode: str, padding_mode: str):
    """X (N, C, D1..Dn) sampled at ``grid`` (N, O1..Ok, n) in [-1, 1] (innermost axis first)."""
    xp = kern.xp
    n = x.ndim - 2
    nb, c = x.shape[:2]
    dims = tuple(x.shape[2:])
    out_sp = tuple(grid.shape[1:-1])
    g = astype(xp, xp.reshape(grid, (nb, int(np.prod(out_sp)), n)), x.dtype)
    coords, borders = [], []
    for i, size in enumerate(dims):
        u = g[:, :, n - 1 - i]  # the grid's last axis lists the innermost dimension first
        if align_corners:
            coords.append((u + 1) / 2 * (size - 1))
            borders.append((0.0, size - 1.0))
        else:
            coords.append(((u + 1) * size - 1) / 2)
            borders.append((-0.5, size - 0.5))
    if mode == "nearest":
        coords = [xp.rint(q) for q in coords]  # half to even, like PyTorch
    if padding_mode == "border":
        coords = [xp.clip(q, 0, size - 1) for q, size in zip(coords, dims, strict=True)]
    elif padding_mode == "reflection":
        coords = [_reflect(xp, q, *bd) for q, bd in zip(coords, borders, strict=True)]
    data = xp.reshape(x, (nb, c, -1))

    def fetch(index):  # integer coords per dim (N, M) -> (N, C, M)
        fixed = []
        for q, size, bd in zip(index, dims, borders, strict=True):
            if padding_mode == "border":
                q = xp.clip(q, 0, size - 1)
            elif padding_mode == "reflection":
                q = kern.index(xp.trunc(_reflect(xp, astype(xp, q, x.dtype), *bd)))
                q = xp.clip(q, 0, size - 1)
            fixed.append(q)
        return kern.gather_points(data, fixed, dims)

    if mode == "nearest":
        y = fetch([kern.index(q) for q in coords])
    else:
        taps = (0, 1) if mode == "linear" else (-1, 0, 1, 2)
        base = [xp.floor(q) for q in coords]
        frac = [q - b0 for q, b0 in zip(coords, base, strict=True)]
        if mode == "linear":
            weights = [[1 - f, f] for f in frac]
        else:
            weights = [_cubic_coeffs(f) for f in frac]
        base = [kern.index(b0) for b0 in base]
        y = 0
        for combo in itertools.product(range(len(taps)), repeat=n):
            w = 1
            for i, t in enumerate(combo):
                w = w * weights[i][t]
            y = y + w[:, None, :] * fetch([b0 + taps[t] for b0, t in zip(base, combo, strict=True)])
    return astype(xp, xp.reshape(y, (nb, c) + out_sp), x.dtype)


def affine_points(spatial, align_corners: bool) -> np.ndarray:
    """AffineGrid's homogeneous points ``(x, y[, z], 1)`` (innermost dimension first), one row
    per output position."""
    axes = []
    for s in spatial:
        if align_corners:
            axes.append(np.linspace(-1.0, 1.0, s) if s > 1 else np.zeros(1))
        else:
            axes.append((np.arange(s) * 2.0 + 1.0) / s - 1.0)
    mesh = np.meshgrid(*axes, indexing="ij")
    return np.stack([*mesh[::-1], np.ones_like(mesh[0])], axis=-1).reshape(-1, len(spatial) + 1)


def register_sampling_ops(builtin: Callable[..., Any], kern: NnKernel) -> None:
    """Register GridSample and AffineGrid."""
    xp = kern.xp

    @builtin("GridSample", attrs={"align_corners": 0, "mode": "linear", "padding_mode": "zeros"})
    def grid_sample_op(ctx, x, grid, *, align_corners, mode, padding_mode):
        """GridSample(X, grid) -> Y: sample X at normalised grid points ([-1, 1], last axis
        x, y, ...)."""
        mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
        check_choice(ctx, "mode", mode, ("linear", "nearest", "cubic"))
        check_choice(ctx, "padding_mode", padding_mode, ("zeros", "border", "reflection"))
        return kern.sample(
            grid_sample,
            kern.asarray(x),
            kern.asarray(grid),
            align_corners=bool(align_corners),
            mode=mode,
            padding_mode=padding_mode,
        )

    @builtin("AffineGrid", attrs={"align_corners": 0})
    def affine_grid(ctx, theta, size, *, align_corners):
        """AffineGrid(theta, size) -> grid: normalised sampling points theta @ (x, y[, z], 1)."""
        theta = kern.asarray(theta)
        spatial = [int(v) for v in ctx.static(size, "size")][2:]
        pts = kern.constant(affine_points(spatial, bool(align_corners)), theta.dtype, theta)
        grid = xp.einsum("pk,njk->npj", pts, theta)
        return xp.reshape(grid, (theta.shape[0], *spatial, len(spatial)))
