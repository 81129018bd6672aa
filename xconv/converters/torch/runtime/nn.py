"""PyTorch handlers for the neural-network ops. Convolution, pooling, GridSample and
AffineGrid are written once in :mod:`xconv.converters.ops.nn`, RoiAlign, MaxRoiPool and
DeformConv in :mod:`xconv.converters.ops.detection` (this module's :class:`TorchNnKernel`),
the normalisations in :mod:`xconv.converters.ops.normalization`; LRN and Dropout are here.

All spatial ops keep ONNX's channels-first layout. Explicit (possibly asymmetric) padding is
applied with ``F.pad``; pooling windows come from ``Tensor.unfold`` so dilations, ceil mode
and MaxPool's Indices follow ONNX exactly. In a module in training mode, BatchNormalization
nodes of a recognised ``batch_norm`` layer use batch statistics and update the running
buffers in place (torch's momentum convention), and ``dropout`` layers drop.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from xconv.converters.ops.detection import register_detection_ops
from xconv.converters.ops.nn import (
    DROPOUT_ATTRS,
    dropout_mode,
    register_conv_ops,
    register_pool_ops,
    register_sampling_ops,
)
from xconv.converters.ops.normalization import register_batch_norm, register_normalization_ops
from xconv.converters.torch.runtime import xp
from xconv.converters.torch.runtime.registry import REQUIRED, builtin
from xconv.converters.torch.runtime.xp import KERNEL
from xconv.ir.metadata import MODULE


def _pad_spatial(x, lo_hi, value=0.0):
    """F.pad with per-spatial-dim (low, high) widths (negative widths crop)."""
    flat = [p for pair in reversed(lo_hi) for p in pair]
    if not any(flat):
        return x
    return F.pad(x, flat, value=value)


def _conv_nd(x, w, stride, dilation, groups):
    n = x.ndim - 2
    if n not in (1, 2, 3):
        raise ValueError(f"convolution supports 1 to 3 spatial dims, got {n}")
    fn = (F.conv1d, F.conv2d, F.conv3d)[n - 1]
    return fn(x, w, stride=stride, dilation=dilation, groups=groups)


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

    def bc(v):
        return v.reshape((1, -1) + (1,) * (x.ndim - 2)).to(x.dtype)

    inv = torch.rsqrt(bc(batch_var) + epsilon)
    return (x - bc(batch_mean)) * inv * bc(scale) + bc(b)


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


@builtin("Dropout", attrs=DROPOUT_ATTRS)
def dropout(ctx, x, *inputs, seed, ratio, is_test, consumed_inputs):
    """Dropout(data, ratio?, training_mode?) -> (output, mask?): identity unless training.

    Opset 12+ takes ratio and training_mode as inputs; older opsets carry ratio as an
    attribute and train only when is_test=0 (opset < 7). A recognised ``dropout`` layer drops
    when the module is in training mode.
    """
    rate, training = dropout_mode(ctx, inputs, ratio, is_test)
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


# --------------------------------------------------------------------------- the kernel


def _conv(x, w, strides, padding, dilations, groups, lhs_dilation):
    if any(si > 1 for si in lhs_dilation):
        # Dilate the input (zeros between samples): ConvTranspose's stride.
        spatial = tuple(x.shape[2:])
        dil_shape = tuple(x.shape[:2]) + tuple(
            (i - 1) * si + 1 for i, si in zip(spatial, lhs_dilation, strict=True)
        )
        xd = x.new_zeros(dil_shape)
        xd[(slice(None), slice(None), *(slice(None, None, si) for si in lhs_dilation))] = x
        x = xd
    return _conv_nd(_pad_spatial(x, padding), w, tuple(strides), tuple(dilations), groups)


def _pool(kind, x, kernel, s, d, lo_hi, extra, out, indices=False):
    n = len(kernel)
    if kind == "sum":
        win = _windows(x, kernel, s, d, lo_hi, extra, out, 0.0)
        return win.sum(dim=tuple(range(-n, 0)))
    xc = x.to(torch.int32) if x.dtype in (torch.int8, torch.uint8) else x
    win = _windows(xc, kernel, s, d, lo_hi, extra, out, _lowest(xc.dtype))
    win = win.reshape(tuple(win.shape[: 2 + n]) + (-1,))
    y, arg = win.max(dim=-1)
    y = y.to(x.dtype)
    if not indices:
        return y
    spatial = tuple(x.shape[2:])
    flat = torch.arange(int(np.prod(spatial)), device=x.device).reshape((1, 1) + spatial)
    iwin = _windows(flat.expand(x.shape[:2] + spatial), kernel, s, d, lo_hi, extra, out, -1)
    iwin = iwin.reshape(tuple(iwin.shape[: 2 + n]) + (-1,))
    return y, torch.gather(iwin, -1, arg.unsqueeze(-1)).squeeze(-1)


def _gather_points(data, coords, dims):
    valid = None
    flat = 0
    for c, size in zip(coords, dims, strict=True):
        inside = (c >= 0) & (c < size)
        valid = inside if valid is None else valid & inside
        flat = flat * size + c.clamp(0, size - 1)
    idx = flat[:, None, :].expand(data.shape[0], data.shape[1], flat.shape[-1])
    vals = torch.gather(data, 2, idx)
    return torch.where(valid[:, None, :], vals, torch.zeros((), dtype=data.dtype))


class TorchNnKernel(xp.TensorConstructors):
    """The torch side of :mod:`xconv.converters.ops.nn` (``asarray``, ``constant``:
    :class:`~xconv.converters.torch.runtime.xp.TensorConstructors`)."""

    xp = xp
    conv = staticmethod(_conv)
    pool = staticmethod(_pool)
    gather_points = staticmethod(_gather_points)

    @staticmethod
    def index(x):
        return x.to(torch.int64)

    @staticmethod
    def sample(fn, *arrays, **static):
        return fn(NN_KERNEL, *arrays, **static)

    @staticmethod
    def scatter_add(x, index, total):
        nb, c, _ = x.shape
        index = torch.as_tensor(index, device=x.device)
        return x.new_zeros((nb, c, total)).index_add(2, index, x)

    @staticmethod
    def scatter(flat_len, index, values):
        idx = index.to(torch.int64)
        keep = (idx >= 0) & (idx < flat_len)
        return values.new_zeros((flat_len,)).index_put((idx[keep],), values[keep])

    @staticmethod
    def pad_crop(y, shape):
        pad = [(0, max(0, t - i)) for t, i in zip(shape, y.shape, strict=True)]
        flat_pad = [q for pair in reversed(pad) for q in pair]
        y = F.pad(y, flat_pad) if any(flat_pad) else y
        return y[tuple(slice(0, t) for t in shape)]


NN_KERNEL = TorchNnKernel()
register_conv_ops(builtin, NN_KERNEL)
register_pool_ops(builtin, NN_KERNEL, REQUIRED)
register_sampling_ops(builtin, NN_KERNEL)
register_detection_ops(builtin, NN_KERNEL, REQUIRED)
