"""PyTorch handlers for signal processing: window functions, DFT, STFT, MelWeightMatrix.

ONNX stores complex numbers as a trailing axis of size 2 (real, imaginary); a trailing
axis of size 1 holds a real signal. Sizes (window length, dft_length, frame step) must be
known at trace time.
"""

from __future__ import annotations

import numpy as np
import torch

from xconv.converters.common import signal as windows
from xconv.converters.torch.backend.dtypes import to_tensor
from xconv.converters.torch.backend.registry import builtin


def _window(ctx, size, periodic: int, output_datatype: int, coefficients) -> np.ndarray:
    """sum_k a_k cos(2 pi k n / N') for a generalized cosine window."""
    size = ctx.static(size, "size")
    return to_tensor(
        windows.cosine_window(size, periodic, output_datatype, coefficients, ctx.error)
    )


_WINDOW_ATTRS = {"output_datatype": 1, "periodic": 1}


@builtin("HannWindow", since=17, attrs=_WINDOW_ATTRS)
def hann_window(ctx, size, *, output_datatype, periodic):
    """HannWindow(size) -> 0.5 - 0.5 cos(2 pi n / N')."""
    return _window(ctx, size, periodic, output_datatype, windows.HANN)


@builtin("HammingWindow", since=17, attrs=_WINDOW_ATTRS)
def hamming_window(ctx, size, *, output_datatype, periodic):
    """HammingWindow(size) -> 25/46 - 21/46 cos(2 pi n / N')."""
    return _window(ctx, size, periodic, output_datatype, windows.HAMMING)


@builtin("BlackmanWindow", since=17, attrs=_WINDOW_ATTRS)
def blackman_window(ctx, size, *, output_datatype, periodic):
    """BlackmanWindow(size) -> 0.42 - 0.5 cos(2 pi n / N') + 0.08 cos(4 pi n / N')."""
    return _window(ctx, size, periodic, output_datatype, windows.BLACKMAN)


def _to_complex(ctx, x):
    if x.shape[-1] == 1:
        return x[..., 0]
    if x.shape[-1] == 2:
        return torch.complex(x[..., 0], x[..., 1])
    raise ctx.error(f"the last axis must have size 1 (real) or 2 (complex), got {x.shape[-1]}")


def _from_complex(z, dtype):
    if not z.is_complex():
        z = torch.complex(z, torch.zeros_like(z))
    return torch.stack([z.real, z.imag], dim=-1).to(dtype)


def _dft(ctx, x, length, axis: int, inverse: bool, onesided: bool):
    axis = axis % x.ndim
    if axis == x.ndim - 1:
        raise ctx.error("the DFT axis cannot be the last (real/imaginary) axis")
    if length is None:
        n = 2 * (x.shape[axis] - 1) if inverse and onesided else x.shape[axis]
    else:
        n = int(ctx.static(length, "dft_length").reshape(-1)[0])
    if not inverse and x.shape[-1] == 1:
        return _real_dft(x, n, axis, onesided)
    z = _to_complex(ctx, x)
    if inverse:
        if onesided:
            return torch.fft.irfft(z, n=n, dim=axis)[..., None].to(x.dtype)
        return _from_complex(torch.fft.ifft(z, n=n, dim=axis), x.dtype)
    out = torch.fft.fft(z, n=n, dim=axis)
    if onesided:
        out = out.narrow(axis, 0, n // 2 + 1)
    return _from_complex(out, x.dtype)


def _real_dft(x, n: int, axis: int, onesided: bool):
    """Forward DFT of a real signal through rfft: exact zeros where symmetry demands them."""
    half = torch.fft.rfft(x[..., 0], n=n, dim=axis)
    if not onesided:
        # X[k] = conj(X[n - k]) for the bins rfft leaves out.
        rest = torch.conj(torch.flip(half.narrow(axis, 1, (n + 1) // 2 - 1), (axis,)))
        half = torch.cat([half, rest], dim=axis)
    return _from_complex(half, x.dtype)


@builtin("DFT", since=17, attrs={"axis": 1, "inverse": 0, "onesided": 0})
def dft(ctx, x, dft_length=None, axis_input=None, *, axis, inverse, onesided):
    """DFT(input, dft_length?, axis?) -> spectrum [..., 2]; axis is an attribute before 20."""
    if ctx.opset >= 20:
        axis = -2 if axis_input is None else int(ctx.static(axis_input, "axis").reshape(-1)[0])
    return _dft(ctx, x, dft_length, axis, bool(inverse), bool(onesided))


@builtin("STFT", since=17, attrs={"onesided": 1})
def stft(ctx, signal, frame_step, window=None, frame_length=None, *, onesided):
    """STFT(signal [batch, length, 1|2], frame_step, window?, frame_length?) ->
    [batch, frames, bins, 2]."""
    step = int(ctx.static(frame_step, "frame_step").reshape(-1)[0])
    if frame_length is not None:
        length = int(ctx.static(frame_length, "frame_length").reshape(-1)[0])
    elif window is not None:
        length = int(window.shape[0])
    else:
        raise ctx.error("STFT needs a window or a frame_length")
    if window is not None and int(window.shape[0]) != length:
        raise ctx.error(f"window length {window.shape[0]} != frame_length {length}")
    n_frames = 1 + (signal.shape[1] - length) // step
    index = step * np.arange(n_frames)[:, None] + np.arange(length)[None, :]
    frames = signal[:, torch.as_tensor(index), :]  # [batch, frames, length, 1|2]
    if window is not None:
        frames = frames * window.to(signal.dtype)[:, None]
    return _dft(ctx, frames, None, 2, False, bool(onesided))


@builtin("MelWeightMatrix", since=17, attrs={"output_datatype": 1})
def mel_weight_matrix(
    ctx,
    num_mel_bins,
    dft_length,
    sample_rate,
    lower_edge_hertz,
    upper_edge_hertz,
    *,
    output_datatype,
):
    """MelWeightMatrix(num_mel_bins, dft_length, sample_rate, lower, upper) ->
    [dft_length // 2 + 1, num_mel_bins] triangular filter bank."""
    out = windows.mel_weight_matrix(
        ctx.static(num_mel_bins, "num_mel_bins"),
        ctx.static(dft_length, "dft_length"),
        ctx.static(sample_rate, "sample_rate"),
        ctx.static(lower_edge_hertz, "lower_edge_hertz"),
        ctx.static(upper_edge_hertz, "upper_edge_hertz"),
    )
    return to_tensor(out.astype(windows.onnx_dtype(output_datatype, ctx.error)))
