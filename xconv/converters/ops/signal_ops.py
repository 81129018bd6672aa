"""Signal ops written once for every runtime: window functions, DFT, STFT, MelWeightMatrix.

ONNX stores complex numbers as a trailing axis of size 2 (real, imaginary); a trailing axis of
size 1 holds a real signal. Sizes (window length, dft_length, frame step) must be known at
trace time. The windows and the mel filter bank are numpy (:mod:`.signal`); the transforms go
through a backend's :class:`SignalKernel`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from xconv.converters.ops import signal as windows


class SignalKernel(Protocol):
    """What a backend provides for the signal ops (complex arrays and FFTs)."""

    def array(self, x: Any) -> Any:
        """A handler input as a backend array."""

    def constant(self, a: np.ndarray) -> Any:
        """A numpy result as the backend returns constants."""

    def complex(self, real: Any, imag: Any) -> Any: ...

    def pair(self, z: Any, like: Any) -> Any:
        """``[..., 2]`` (real, imaginary) of ``z`` in ``like``'s dtype."""

    def cast(self, x: Any, like: Any) -> Any: ...

    def fft(self, name: str, z: Any, n: int, axis: int) -> Any:
        """``fft``, ``ifft``, ``rfft`` or ``irfft`` of length ``n`` along ``axis``."""

    def narrow(self, x: Any, axis: int, start: int, length: int) -> Any: ...

    def conj_flip(self, x: Any, axis: int) -> Any:
        """The complex conjugate of ``x`` reversed along ``axis``."""

    def concat(self, xs: list[Any], axis: int) -> Any: ...

    def frames(self, signal: Any, index: np.ndarray) -> Any:
        """``signal[:, index, :]`` for an integer numpy ``index``."""


def _to_complex(ctx, k: SignalKernel, x):
    if x.shape[-1] == 1:
        return x[..., 0]
    if x.shape[-1] == 2:
        return k.complex(x[..., 0], x[..., 1])
    raise ctx.error(f"the last axis must have size 1 (real) or 2 (complex), got {x.shape[-1]}")


def _dft(ctx, k: SignalKernel, x, length, axis: int, inverse: bool, onesided: bool):
    x = k.array(x)
    axis = axis % x.ndim
    if axis == x.ndim - 1:
        raise ctx.error("the DFT axis cannot be the last (real/imaginary) axis")
    if length is None:
        n = 2 * (x.shape[axis] - 1) if inverse and onesided else x.shape[axis]
    else:
        n = int(ctx.static(length, "dft_length").reshape(-1)[0])
    if not inverse and x.shape[-1] == 1:
        # Forward DFT of a real signal through rfft: exact zeros where symmetry demands them.
        half = k.fft("rfft", x[..., 0], n, axis)
        if not onesided:
            # X[k] = conj(X[n - k]) for the bins rfft leaves out.
            rest = k.conj_flip(k.narrow(half, axis, 1, (n + 1) // 2 - 1), axis)
            half = k.concat([half, rest], axis)
        return k.pair(half, x)
    z = _to_complex(ctx, k, x)
    if inverse:
        if onesided:
            return k.cast(k.fft("irfft", z, n, axis)[..., None], x)
        return k.pair(k.fft("ifft", z, n, axis), x)
    out = k.fft("fft", z, n, axis)
    if onesided:
        out = k.narrow(out, axis, 0, n // 2 + 1)
    return k.pair(out, x)


_WINDOW_ATTRS = {"output_datatype": 1, "periodic": 1}


def register_signal_ops(builtin: Callable[..., Any], k: SignalKernel) -> None:
    """Register the signal ops with a backend registry's ``builtin`` and its kernel ``k``."""

    def window(ctx, size, periodic: int, output_datatype: int, coefficients):
        size = ctx.static(size, "size")
        return k.constant(
            windows.cosine_window(size, periodic, output_datatype, coefficients, ctx.error)
        )

    @builtin("HannWindow", since=17, attrs=_WINDOW_ATTRS)
    def hann_window(ctx, size, *, output_datatype, periodic):
        """HannWindow(size) -> 0.5 - 0.5 cos(2 pi n / N')."""
        return window(ctx, size, periodic, output_datatype, windows.HANN)

    @builtin("HammingWindow", since=17, attrs=_WINDOW_ATTRS)
    def hamming_window(ctx, size, *, output_datatype, periodic):
        """HammingWindow(size) -> 25/46 - 21/46 cos(2 pi n / N')."""
        return window(ctx, size, periodic, output_datatype, windows.HAMMING)

    @builtin("BlackmanWindow", since=17, attrs=_WINDOW_ATTRS)
    def blackman_window(ctx, size, *, output_datatype, periodic):
        """BlackmanWindow(size) -> 0.42 - 0.5 cos(2 pi n / N') + 0.08 cos(4 pi n / N')."""
        return window(ctx, size, periodic, output_datatype, windows.BLACKMAN)

    @builtin("DFT", since=17, attrs={"axis": 1, "inverse": 0, "onesided": 0})
    def dft(ctx, x, dft_length=None, axis_input=None, *, axis, inverse, onesided):
        """DFT(input, dft_length?, axis?) -> spectrum [..., 2]; axis is an attribute before 20."""
        if ctx.opset >= 20:
            axis = -2 if axis_input is None else int(ctx.static(axis_input, "axis").reshape(-1)[0])
        return _dft(ctx, k, x, dft_length, axis, bool(inverse), bool(onesided))

    @builtin("STFT", since=17, attrs={"onesided": 1})
    def stft(ctx, signal, frame_step, window=None, frame_length=None, *, onesided):
        """STFT(signal [batch, length, 1|2], frame_step, window?, frame_length?) ->
        [batch, frames, bins, 2]."""
        signal = k.array(signal)
        step = int(ctx.static(frame_step, "frame_step").reshape(-1)[0])
        if frame_length is not None:
            length = int(ctx.static(frame_length, "frame_length").reshape(-1)[0])
        elif window is not None:
            length = int(np.shape(window)[0])
        else:
            raise ctx.error("STFT needs a window or a frame_length")
        if window is not None and int(np.shape(window)[0]) != length:
            raise ctx.error(f"window length {np.shape(window)[0]} != frame_length {length}")
        n_frames = 1 + (signal.shape[1] - length) // step
        index = step * np.arange(n_frames)[:, None] + np.arange(length)[None, :]
        frames = k.frames(signal, index)  # [batch, frames, length, 1|2]
        if window is not None:
            frames = frames * k.cast(k.array(window), signal)[:, None]
        return _dft(ctx, k, frames, None, 2, False, bool(onesided))

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
        return k.constant(out.astype(windows.onnx_dtype(output_datatype, ctx.error)))
