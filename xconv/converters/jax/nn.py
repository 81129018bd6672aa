"""JAX handlers for the neural-network ops. Convolution, pooling, GridSample and AffineGrid
are written once in :mod:`xconv.converters.ops.nn`, RoiAlign, MaxRoiPool and DeformConv in
:mod:`xconv.converters.ops.detection` (this module's :class:`JaxNnKernel`:
``lax.conv_general_dilated``, ``lax.reduce_window``, gathers); the normalisations in
:mod:`xconv.converters.ops.normalization`. LRN and Dropout are here.

All spatial ops keep ONNX's channels-first layout (``N, C, D1, ..., Dn``) and read their
geometry (kernel, strides, pads) statically, so they trace under ``jax.jit``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xconv.converters.jax.kernel import KERNEL
from xconv.converters.jax.kernel import conv as kernel_conv
from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops.detection import register_detection_ops
from xconv.converters.ops.nn import (
    DROPOUT_ATTRS,
    dropout_mode,
    register_conv_ops,
    register_pool_ops,
    register_sampling_ops,
)
from xconv.converters.ops.normalization import register_batch_norm, register_normalization_ops

# --------------------------------------------------------------------------- geometry


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
def _jitted(fn, static: tuple[str, ...]):
    return jax.jit(functools.partial(fn, NN_KERNEL), static_argnames=static)


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
    def sample(fn, *arrays, **static):
        return _jitted(fn, tuple(sorted(static)))(*arrays, **static)

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
register_detection_ops(builtin, NN_KERNEL, REQUIRED)
