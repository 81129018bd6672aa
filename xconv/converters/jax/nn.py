"""JAX handlers for the neural-network ops. Convolution, pooling, GridSample and AffineGrid
are written once in :mod:`xconv.converters.ops.nn` (this module's :class:`JaxNnKernel`:
``lax.conv_general_dilated``, ``lax.reduce_window``, gathers); the normalisations in
:mod:`xconv.converters.ops.normalization`. Here too, JAX only: RoiAlign, MaxRoiPool,
DeformConv; and LRN, Dropout.

All spatial ops keep ONNX's channels-first layout (``N, C, D1, ..., Dn``) and read their
geometry (kernel, strides, pads) statically, so they trace under ``jax.jit``.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xconv.converters.jax.kernel import KERNEL
from xconv.converters.jax.kernel import conv as kernel_conv
from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops import shapes
from xconv.converters.ops.nn import (
    DROPOUT_ATTRS,
    dropout_mode,
    register_conv_ops,
    register_pool_ops,
    register_sampling_ops,
)
from xconv.converters.ops.normalization import register_batch_norm, register_normalization_ops

# --------------------------------------------------------------------------- geometry


def _bias_shape(b, ndim: int):
    return jnp.reshape(b, (1, -1) + (1,) * (ndim - 2))


def _gather_nd_points(data, coords, dims, mode: str):
    """Values of ``data`` (N, G, Cg, P) at integer points ``coords`` (list of (N, G, M)).

    ``mode`` is ``zeros`` (outside reads 0), ``border`` (clamped) or an index already valid.
    Returns (N, G, Cg, M).
    """
    valid = None
    flat = 0
    for c, size in zip(coords, dims, strict=True):
        inside = (c >= 0) & (c < size)
        valid = inside if valid is None else valid & inside
        flat = flat * size + jnp.clip(c, 0, size - 1)
    vals = jnp.take_along_axis(data, flat[:, :, None, :], axis=3)
    if mode == "zeros":
        vals = jnp.where(valid[:, :, None, :], vals, jnp.zeros((), data.dtype))
    return vals


@builtin(
    "DeformConv",
    attrs={
        "dilations": None,
        "group": 1,
        "kernel_shape": None,
        "offset_group": 1,
        "pads": None,
        "strides": None,
    },
)
def deform_conv(
    ctx,
    x,
    w,
    offset,
    b=None,
    mask=None,
    *,
    dilations,
    group,
    kernel_shape,
    offset_group,
    pads,
    strides,
):
    """DeformConv(X, W, offset, B?, mask?) -> Y: conv sampling at learned offsets (bilinear)."""
    n = np.ndim(x) - 2
    return _deform_conv_impl(
        jnp.asarray(x),
        jnp.asarray(w),
        jnp.asarray(offset),
        b,
        mask,
        s=shapes.ints(strides, n, 1),
        d=shapes.ints(dilations, n, 1),
        p=shapes.ints(pads, 2 * n, 0),
        og=int(offset_group),
        g=int(group),
    )


@functools.partial(jax.jit, static_argnames=("s", "d", "p", "og", "g"))
def _deform_conv_impl(x, w, offset, b, mask, *, s, d, p, og, g):
    n = x.ndim - 2
    nb, c = x.shape[:2]
    spatial = x.shape[2:]
    out_sp = offset.shape[2:]
    kernel = tuple(w.shape[2:])
    kk = int(np.prod(kernel))
    mo = int(np.prod(out_sp))
    off = offset.reshape((nb, og, kk, n, mo)).astype(x.dtype)
    # Base sampling positions per dimension: (K, M).
    kpos = np.stack(np.meshgrid(*[np.arange(k) for k in kernel], indexing="ij"), 0).reshape(n, kk)
    opos = np.stack(np.meshgrid(*[np.arange(o) for o in out_sp], indexing="ij"), 0).reshape(n, mo)
    base = [
        (opos[i][None, :] * s[i] - p[i] + kpos[i][:, None] * d[i]).astype(np.float32)
        for i in range(n)
    ]
    pos = [base[i].astype(x.dtype) + off[:, :, :, i, :] for i in range(n)]  # (N, og, K, M)
    data = x.reshape((nb, og, c // og, int(np.prod(spatial))))
    lo = [jnp.floor(q) for q in pos]
    frac = [q - f for q, f in zip(pos, lo, strict=True)]
    lo = [f.astype(jnp.int32) for f in lo]
    cols = 0
    for corner in itertools.product((0, 1), repeat=n):
        weight = 1
        coords = []
        for i, bit in enumerate(corner):
            weight = weight * (frac[i] if bit else 1 - frac[i])
            coords.append((lo[i] + bit).reshape(nb, og, kk * mo))
        vals = _gather_nd_points(data, coords, spatial, "zeros")
        cols = cols + vals.reshape(nb, og, c // og, kk, mo) * weight[:, :, None]
    if mask is not None:
        cols = cols * jnp.asarray(mask).reshape(nb, og, 1, kk, mo).astype(x.dtype)
    cols = cols.reshape(nb, g, c // g, kk, mo)
    wg = w.reshape((g, w.shape[0] // g, c // g, kk)).astype(x.dtype)
    y = jnp.einsum("ngckm,gock->ngom", cols, wg).reshape((nb, w.shape[0]) + tuple(out_sp))
    if b is not None:
        y = y + _bias_shape(b, y.ndim).astype(y.dtype)
    return y


# --------------------------------------------------------------------------- pooling


def _window(x, init, op, kernel, strides, dilations, lo_hi, extra, out):
    """A window reduction over the spatial axes of ``(N, C, *spatial)`` operands, run
    channels-last: XLA:CPU lays a convolution's output out channels-last, and a window
    over the channels-first view made it copy the activation to NCHW and back around each
    pooling (ResNet-50's stem: 2 transposes of the 64x112x112 map per call); the moves
    here are the inverse of that layout, so XLA drops them."""
    xs = x if isinstance(x, tuple | list) else (x,)
    last = tuple(jnp.moveaxis(v, 1, -1) for v in xs)
    padding = (
        ((0, 0),)
        + tuple((lo, hi + e) for (lo, hi), e in zip(lo_hi, extra, strict=True))
        + ((0, 0),)
    )
    y = lax.reduce_window(
        last if isinstance(x, tuple | list) else last[0],
        init,
        op,
        (1, *kernel, 1),
        (1, *strides, 1),
        padding,
        window_dilation=(1, *dilations, 1),
    )
    crop = (slice(None), *(slice(0, o) for o in out), slice(None))
    back = tuple(jnp.moveaxis(v[crop], -1, 1) for v in (y if isinstance(y, tuple | list) else (y,)))
    return back if isinstance(y, tuple | list) else back[0]


def _dilated_max(x, kernel, strides, dilations, lo_hi, extra, out):
    """Max over dilated windows as a max of strided slices: differentiable, unlike
    ``reduce_window`` with window dilation, whose VJP JAX does not implement. A window's max
    is the max over each spatial axis in turn, so a ``kh x kw`` kernel takes ``kh + kw``
    slices, not ``kh * kw`` (a 60 x 80 kernel: 140 rather than 4,800, which took minutes)."""
    pad = ((0, 0), (0, 0)) + tuple((lo, hi + e) for (lo, hi), e in zip(lo_hi, extra, strict=True))
    y = jnp.pad(x, pad, constant_values=_lowest(x.dtype))
    for axis, (k, d, s, o) in enumerate(zip(kernel, dilations, strides, out, strict=True), 2):
        parts = (lax.slice_in_dim(y, i * d, i * d + (o - 1) * s + 1, s, axis) for i in range(k))
        y = functools.reduce(jnp.maximum, parts)
    return y


def _lowest(dtype):
    dtype = np.dtype(dtype)
    if dtype.kind in "iub":
        return np.array(np.iinfo(dtype).min if dtype.kind != "b" else False, dtype)
    return np.array(-np.inf, dtype)


@builtin("MaxRoiPool", attrs={"pooled_shape": REQUIRED, "spatial_scale": 1.0})
def max_roi_pool(ctx, x, rois, *, pooled_shape, spatial_scale):
    """MaxRoiPool(X, rois) -> Y: Caffe-style max pooling over each (batch, x1, y1, x2, y2) roi."""
    ph, pw = (int(v) for v in pooled_shape)
    return _max_roi_pool_impl(
        jnp.asarray(x), jnp.asarray(rois), ph=ph, pw=pw, spatial_scale=float(spatial_scale)
    )


@functools.partial(jax.jit, static_argnames=("ph", "pw", "spatial_scale"))
def _max_roi_pool_impl(x, rois, *, ph, pw, spatial_scale):
    _, _, h, w = x.shape
    batch = rois[:, 0].astype(jnp.int32)
    box = jnp.round(rois[:, 1:] * spatial_scale).astype(jnp.int32)
    x1, y1, x2, y2 = box[:, 0], box[:, 1], box[:, 2], box[:, 3]

    def bins(start, end, pooled, size):
        length = jnp.maximum(end - start + 1, 1).astype(x.dtype)
        step = length / pooled
        k = jnp.arange(pooled, dtype=x.dtype)
        lo = jnp.clip(
            jnp.floor(k[None] * step[:, None]).astype(jnp.int32) + start[:, None], 0, size
        )
        hi = jnp.clip(
            jnp.ceil((k[None] + 1) * step[:, None]).astype(jnp.int32) + start[:, None], 0, size
        )
        r = jnp.arange(size)
        return (r[None, None] >= lo[..., None]) & (r[None, None] < hi[..., None])  # (R, P, size)

    mh, mw = bins(y1, y2, ph, h), bins(x1, x2, pw, w)
    xb = x[batch]  # (R, C, H, W)
    low = _lowest(x.dtype)
    t = jnp.max(jnp.where(mw[:, None, None, :, :], xb[:, :, :, None, :], low), axis=-1)
    y = jnp.max(jnp.where(mh[:, None, :, :, None], t[:, :, None, :, :], low), axis=-2)
    empty = ~(jnp.any(mh, -1)[:, :, None] & jnp.any(mw, -1)[:, None, :])
    return jnp.where(empty[:, None], jnp.zeros((), x.dtype), y)


@builtin(
    "RoiAlign",
    attrs={
        "coordinate_transformation_mode": "half_pixel",
        "mode": "avg",
        "output_height": 1,
        "output_width": 1,
        "sampling_ratio": 0,
        "spatial_scale": 1.0,
    },
)
def roi_align(
    ctx,
    x,
    rois,
    batch_indices,
    *,
    coordinate_transformation_mode,
    mode,
    output_height,
    output_width,
    sampling_ratio,
    spatial_scale,
):
    """RoiAlign(X, rois, batch_indices) -> Y: bilinear samples averaged (or maxed) per bin."""
    if mode not in ("avg", "max"):
        raise ctx.error(f"mode={mode!r}; supported: avg, max")
    x, rois = jnp.asarray(x), jnp.asarray(rois)
    ph, pw = int(output_height), int(output_width)
    half = coordinate_transformation_mode == "half_pixel"
    if ctx.opset < 16 and "coordinate_transformation_mode" not in ctx.node.attributes:
        half = False
    if sampling_ratio > 0:
        gh = gw = int(sampling_ratio)
    else:
        # The adaptive grid's size depends on the rois: it must be known at trace time.
        box = ctx.static(rois, "rois (with sampling_ratio=0)").astype(x.dtype)
        box = box * np.asarray(spatial_scale, x.dtype) - np.asarray(0.5 if half else 0, x.dtype)
        rh, rw = box[:, 3] - box[:, 1], box[:, 2] - box[:, 0]
        if not half:
            rh, rw = np.maximum(rh, 1), np.maximum(rw, 1)
        gh = max(1, int(np.max(np.ceil(rh / ph), initial=1)))
        gw = max(1, int(np.max(np.ceil(rw / pw), initial=1)))
    return _roi_align_impl(
        x,
        rois,
        jnp.asarray(batch_indices),
        ph=ph,
        pw=pw,
        gh=gh,
        gw=gw,
        sampling_ratio=int(sampling_ratio),
        spatial_scale=float(spatial_scale),
        half=half,
        mode=mode,
    )


@functools.partial(
    jax.jit,
    static_argnames=("ph", "pw", "gh", "gw", "sampling_ratio", "spatial_scale", "half", "mode"),
)
def _roi_align_impl(
    x, rois, batch_indices, *, ph, pw, gh, gw, sampling_ratio, spatial_scale, half, mode
):
    _, _, h, w = x.shape
    off = 0.5 if half else 0.0
    box = rois.astype(x.dtype) * spatial_scale - off
    start_w, start_h = box[:, 0], box[:, 1]
    roi_w, roi_h = box[:, 2] - start_w, box[:, 3] - start_h
    if not half:
        roi_w, roi_h = jnp.maximum(roi_w, 1.0), jnp.maximum(roi_h, 1.0)
    bin_h, bin_w = roi_h / ph, roi_w / pw
    if sampling_ratio > 0:
        grid_h = grid_w = jnp.full(rois.shape[:1], sampling_ratio)
    else:
        grid_h = jnp.ceil(roi_h / ph).astype(jnp.int32)
        grid_w = jnp.ceil(roi_w / pw).astype(jnp.int32)

    def axis_samples(start, bin_size, grid, pooled, g, size):
        """(R, pooled, g) sample low index, high index, low/high weights and usable flag."""
        k = jnp.arange(pooled, dtype=x.dtype)[None, :, None]
        i = jnp.arange(g, dtype=x.dtype)[None, None, :]
        gr = jnp.maximum(grid, 1).astype(x.dtype)[:, None, None]
        c = (
            start[:, None, None]
            + k * bin_size[:, None, None]
            + (i + 0.5) * bin_size[:, None, None] / gr
        )
        outside = (c < -1.0) | (c > size)
        c = jnp.maximum(c, 0.0)
        low = jnp.floor(c).astype(jnp.int32)
        at_end = low >= size - 1
        low = jnp.where(at_end, size - 1, low)
        high = jnp.where(at_end, size - 1, low + 1)
        c = jnp.where(at_end, low.astype(x.dtype), c)
        frac = c - low
        wl = jnp.where(outside, 0.0, 1.0 - frac)
        wh = jnp.where(outside, 0.0, frac)
        used = jnp.arange(g)[None, None, :] < grid[:, None, None]
        return low, high, wl.astype(x.dtype), wh.astype(x.dtype), used

    yl, yh, wyl, wyh, uy = axis_samples(start_h, bin_h, grid_h, ph, gh, h)
    xl, xh, wxl, wxh, ux = axis_samples(start_w, bin_w, grid_w, pw, gw, w)
    xb = x[jnp.asarray(batch_indices).astype(jnp.int32)]  # (R, C, H, W)
    r = jnp.arange(rois.shape[0])[:, None, None, None, None]

    def at(yi, xi):  # -> (R, ph, pw, gh, gw, C)
        return xb[r, :, yi[:, :, None, :, None], xi[:, None, :, None, :]]

    def wt(wy, wx):
        return (wy[:, :, None, :, None] * wx[:, None, :, None, :])[..., None]

    terms = [
        wt(wyl, wxl) * at(yl, xl),
        wt(wyl, wxh) * at(yl, xh),
        wt(wyh, wxl) * at(yh, xl),
        wt(wyh, wxh) * at(yh, xh),
    ]
    used = (uy[:, :, None, :, None] & ux[:, None, :, None, :])[..., None]
    if mode == "avg":
        count = jnp.maximum(grid_h * grid_w, 1).astype(x.dtype)[:, None, None, None]
        y = jnp.sum(jnp.where(used, sum(terms), 0), axis=(3, 4)) / count
    else:
        best = jnp.maximum(jnp.maximum(terms[0], terms[1]), jnp.maximum(terms[2], terms[3]))
        y = jnp.max(jnp.where(used, best, _lowest(x.dtype)), axis=(3, 4))
    return jnp.moveaxis(y, -1, 1).astype(x.dtype)


# --------------------------------------------------------------------------- normalisation


register_batch_norm(builtin, KERNEL)

# Instance/Layer/Group/RMS/Lp/MeanVariance normalisation: written once in
# converters/ops/normalization.py.
register_normalization_ops(builtin, KERNEL, REQUIRED)


@builtin("LRN", attrs={"alpha": 1e-4, "beta": 0.75, "bias": 1.0, "size": REQUIRED})
def lrn(ctx, x, *, alpha, beta, bias, size):
    """LRN(X) -> Y = X / (bias + alpha / size * sum of X^2 over nearby channels)^beta."""
    x = jnp.asarray(x)
    size = int(size)
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = lax.reduce_window(
        x * x,
        np.array(0, x.dtype),
        lax.add,
        (1, size) + (1,) * (x.ndim - 2),
        (1,) * x.ndim,
        ((0, 0), (lo, hi)) + ((0, 0),) * (x.ndim - 2),
    )
    return x / (bias + alpha / size * sq) ** beta


# --------------------------------------------------------------------------- dropout


@builtin("Dropout", attrs=DROPOUT_ATTRS)
def dropout(ctx, x, *inputs, seed, ratio, is_test, consumed_inputs):
    """Dropout(data, ratio?, training_mode?) -> (output, mask?): identity unless training.

    Opset 12+ takes ratio and training_mode as inputs; older opsets carry ratio as an
    attribute and train only when is_test=0 (opset < 7).
    """
    x = jnp.asarray(x)
    rate, training = dropout_mode(ctx, inputs, ratio, is_test)
    mask_dtype = (ctx.output_dtype(1) if len(ctx.output_values) > 1 else None) or np.bool_
    if not training:
        return x, jnp.ones(x.shape, dtype=mask_dtype)
    rate = jnp.asarray(rate, jnp.float32)
    keep = jax.random.uniform(ctx.key(seed), x.shape) >= rate
    scale = jnp.where(rate < 1, 1.0 / (1.0 - rate), 0.0).astype(x.dtype)
    return jnp.where(keep, x * scale, jnp.zeros((), x.dtype)), keep.astype(mask_dtype)


# --------------------------------------------------------------------------- the kernel


def _pool(kind, x, kernel, s, d, lo_hi, extra, out, indices=False):
    if kind == "sum":
        return _window(x, np.array(0, x.dtype), lax.add, kernel, s, d, lo_hi, extra, out)
    if any(di > 1 for di in d):
        y = _dilated_max(x, kernel, s, d, lo_hi, extra, out)
    else:
        y = _window(x, _lowest(x.dtype), lax.max, kernel, s, d, lo_hi, extra, out)
    if not indices:
        return y
    # Indices come from a (value, index) window reduction; Y stays on the differentiable path.
    spatial = x.shape[2:]
    size = int(np.prod(spatial))
    flat = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32).reshape(spatial), x.shape)

    def pick(a, b):
        take_a = (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))
        return jnp.where(take_a, a[0], b[0]), jnp.where(take_a, a[1], b[1])

    init = (_lowest(x.dtype), np.array(np.iinfo(np.int32).max, np.int32))
    _, idx = _window((x, flat), init, pick, kernel, s, d, lo_hi, extra, out)
    return y, idx


@functools.cache
def _jitted(fn):
    return jax.jit(
        functools.partial(fn, NN_KERNEL), static_argnames=("align_corners", "mode", "padding_mode")
    )


class JaxNnKernel:
    """The JAX side of :mod:`xconv.converters.ops.nn`."""

    xp = jnp
    asarray = staticmethod(jnp.asarray)
    pool = staticmethod(_pool)

    @staticmethod
    def constant(a, dtype, like):
        return jnp.asarray(a, dtype)

    @staticmethod
    def index(x):
        return x.astype(jnp.int32)

    @staticmethod
    def conv(x, w, strides, padding, dilations, groups, lhs_dilation):
        return kernel_conv(
            x,
            w,
            tuple(strides),
            padding,
            lhs_dilation=tuple(lhs_dilation),
            rhs_dilation=tuple(dilations),
            feature_group_count=groups,
        )

    @staticmethod
    def gather_points(data, coords, dims):
        nb, c, p = data.shape
        points = [q[:, None, :] for q in coords]
        return _gather_nd_points(data.reshape(nb, 1, c, p), points, dims, "zeros")[:, 0]

    @staticmethod
    def sample(fn, x, grid, **static):
        return _jitted(fn)(x, grid, **static)

    @staticmethod
    def scatter_add(x, index, total):
        nb, c, _ = x.shape
        return jnp.zeros((nb, c, total), x.dtype).at[:, :, index].add(x)

    @staticmethod
    def scatter(flat_len, index, values):
        return jnp.zeros((flat_len,), values.dtype).at[index].set(values, mode="drop")

    @staticmethod
    def pad_crop(y, shape):
        pad = [(0, max(0, t - i)) for t, i in zip(shape, y.shape, strict=True)]
        return jnp.pad(y, pad)[tuple(slice(0, t) for t in shape)]


NN_KERNEL = JaxNnKernel()
register_conv_ops(builtin, NN_KERNEL)
register_pool_ops(builtin, NN_KERNEL, REQUIRED)
register_sampling_ops(builtin, NN_KERNEL)
