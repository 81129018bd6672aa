"""PyTorch source templates: DFT, STFT and MelWeightMatrix.

The generated ``_dft`` and ``_stft`` compute with ``torch.fft`` as the torch runtime's kernel
does (``ops/signal_ops``); sizes and the axis a graph computes at run time are Python ints
(``int(x)``), the mel filter bank's inputs numpy scalars of their types.
"""

from __future__ import annotations

import numpy as np

from xconv.converters import expressions as ex
from xconv.converters.torch.source.templates import OpCall, registry, template

registry.helpers["dft"] = '''
def _dft(x, axis, n=None, inverse=False, onesided=False):
    """ONNX DFT along ``axis`` of x [..., 1 | 2] (a real signal, or complex as real and
    imaginary parts): [..., 2]. ``n`` (dft_length) zero-pads or truncates the axis; onesided
    keeps the n // 2 + 1 bins of a real signal's spectrum, or inverts such a half spectrum."""
    if x.shape[-1] not in (1, 2):
        raise ValueError(f"DFT: the last axis must have size 1 or 2, got {x.shape[-1]}")
    axis = axis % x.dim()
    if n is None:
        n = 2 * (x.shape[axis] - 1) if inverse and onesided else x.shape[axis]
    if not inverse and x.shape[-1] == 1:
        out = torch.fft.rfft(x[..., 0], n=n, dim=axis)
        if not onesided:  # the bins rfft leaves out: X[k] = conj(X[n - k])
            rest = out.narrow(axis, 1, (n + 1) // 2 - 1)
            out = torch.cat([out, torch.conj(torch.flip(rest, (axis,)))], dim=axis)
    else:
        z = x[..., 0] if x.shape[-1] == 1 else torch.complex(x[..., 0], x[..., 1])
        if inverse and onesided:
            return torch.fft.irfft(z, n=n, dim=axis)[..., None].to(x.dtype)
        out = (torch.fft.ifft if inverse else torch.fft.fft)(z, n=n, dim=axis)
        if onesided:
            out = out.narrow(axis, 0, n // 2 + 1)
    return torch.stack([out.real, out.imag], dim=-1).to(x.dtype)
'''

registry.helpers["stft"] = '''
def _stft(signal, step, window=None, length=None, onesided=True):
    """ONNX STFT of signal [batch, time, 1 | 2]: frames of ``length`` samples ``step`` apart,
    each times the window, through _dft: [batch, frames, bins, 2]."""
    length = window.shape[0] if length is None else length
    if window is not None and window.shape[0] != length:
        raise ValueError(f"STFT: window length {window.shape[0]} != frame_length {length}")
    count = 1 + (signal.shape[1] - length) // step
    starts = step * torch.arange(count, device=signal.device)
    frames = signal[:, starts[:, None] + torch.arange(length, device=signal.device), :]
    if window is not None:
        frames = frames * window.to(signal.dtype)[:, None]
    return _dft(frames, 2, onesided=onesided)
'''

registry.helpers["mel_weight_matrix"] = ex.MEL_WEIGHT_MATRIX


def _int(c: OpCall, i: int) -> str | None:
    """Input ``i`` as a Python int: a literal when constant, else ``int(x)``; None when
    absent."""
    if not c.has(i):
        return None
    if c.consts[i] is None:
        return f"int({c.args[i]})"
    return str(int(np.asarray(c.consts[i]).reshape(-1)[0]))


def _dft(c: OpCall, axis: str) -> str:
    last = c.shapes[0][-1] if c.shapes[0] else None
    if last not in (1, 2, None):
        raise c.fail(f"the last axis must have size 1 (real) or 2 (complex), not {last}")
    return ex.dft_call(c, axis, _int(c, 1))


@registry.builtin("DFT", since=17, until=19, attrs={"axis": 1, **ex.DFT_ATTRS})
def _dft_17(c: OpCall) -> str:
    """Opsets 17 to 19: the axis is an attribute."""
    return _dft(c, str(int(c.attrs["axis"])))


@registry.builtin("DFT", since=20, attrs=ex.DFT_ATTRS)
def _dft_20(c: OpCall) -> str:
    """Opset 20 on: the axis is an input (default -2)."""
    return _dft(c, _int(c, 2) or "-2")


@template("STFT", onesided=1)
def _stft(c: OpCall) -> str:
    if not (c.has(2) or c.has(3)):
        raise c.fail("STFT needs a window or a frame_length")
    return ex.stft_call(c, _int(c, 1), _int(c, 3))


@template("MelWeightMatrix", output_datatype=1)
def _mel_weight_matrix(c: OpCall) -> str:
    call = ex.mel_weight_matrix_call(c, lambda i, _: f"{c.args[i]}.cpu().numpy()")
    return f"torch.as_tensor({call}).to({c.dtype()})"
