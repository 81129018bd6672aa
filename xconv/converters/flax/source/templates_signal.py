"""Flax source templates: DFT, STFT and MelWeightMatrix.

The generated ``_dft`` and ``_stft`` compute with ``jnp.fft`` as the JAX runtime's kernel does
(``ops/signal_ops``); sizes, the axis and the mel filter bank's inputs a graph computes at run
time are read eagerly (``_static``), as ``to_jax`` reads them.
"""

from __future__ import annotations

import numpy as np

from xconv.converters import expressions as ex
from xconv.converters.flax.source.templates import OpCall, registry, template
from xconv.converters.flax.source.templates_shape import runtime

registry.helpers["dft"] = '''
def _dft(x, axis, n=None, inverse=False, onesided=False):
    """ONNX DFT along ``axis`` of x [..., 1 | 2] (a real signal, or complex as real and
    imaginary parts): [..., 2]. ``n`` (dft_length) zero-pads or truncates the axis; onesided
    keeps the n // 2 + 1 bins of a real signal's spectrum, or inverts such a half spectrum."""
    if x.shape[-1] not in (1, 2):
        raise ValueError(f"DFT: the last axis must have size 1 or 2, got {x.shape[-1]}")
    axis = axis % x.ndim
    if n is None:
        n = 2 * (x.shape[axis] - 1) if inverse and onesided else x.shape[axis]
    if not inverse and x.shape[-1] == 1:
        out = jnp.fft.rfft(x[..., 0], n=n, axis=axis)
        if not onesided:  # the bins rfft leaves out: X[k] = conj(X[n - k])
            rest = lax.slice_in_dim(out, 1, (n + 1) // 2, axis=axis)
            out = jnp.concatenate([out, jnp.conj(jnp.flip(rest, axis))], axis=axis)
    else:
        z = x[..., 0]
        if x.shape[-1] == 2:
            z = z + 1j * x[..., 1].astype(jnp.result_type(z, jnp.complex64))
        if inverse and onesided:
            return jnp.fft.irfft(z, n=n, axis=axis)[..., None].astype(x.dtype)
        out = (jnp.fft.ifft if inverse else jnp.fft.fft)(z, n=n, axis=axis)
        if onesided:
            out = lax.slice_in_dim(out, 0, n // 2 + 1, axis=axis)
    return jnp.stack([jnp.real(out), jnp.imag(out)], axis=-1).astype(x.dtype)
'''

registry.helpers["stft"] = '''
def _stft(signal, step, window=None, length=None, onesided=True):
    """ONNX STFT of signal [batch, time, 1 | 2]: frames of ``length`` samples ``step`` apart,
    each times the window, through _dft: [batch, frames, bins, 2]."""
    length = window.shape[0] if length is None else length
    if window is not None and window.shape[0] != length:
        raise ValueError(f"STFT: window length {window.shape[0]} != frame_length {length}")
    count = 1 + (signal.shape[1] - length) // step
    frames = signal[:, step * np.arange(count)[:, None] + np.arange(length)[None, :], :]
    if window is not None:
        frames = frames * window.astype(signal.dtype)[:, None]
    return _dft(frames, 2, onesided=onesided)
'''

registry.helpers["mel_weight_matrix"] = ex.MEL_WEIGHT_MATRIX


def _int(c: OpCall, i: int, what: str) -> str | None:
    """Input ``i`` as a Python int: a literal when constant, else read eagerly; None when
    absent."""
    if not c.has(i):
        return None
    read = runtime(c, i, what)
    return f"{read}[0]" if read else str(int(np.asarray(c.consts[i]).reshape(-1)[0]))


def _dft(c: OpCall, axis: str) -> str:
    last = c.shapes[0][-1] if c.shapes[0] else None
    if last not in (1, 2, None):
        raise c.fail(f"the last axis must have size 1 (real) or 2 (complex), not {last}")
    return ex.dft_call(c, axis, _int(c, 1, "dft_length"))


@registry.builtin("DFT", since=17, until=19, attrs={"axis": 1, **ex.DFT_ATTRS})
def _dft_17(c: OpCall) -> str:
    """Opsets 17 to 19: the axis is an attribute."""
    return _dft(c, str(int(c.attrs["axis"])))


@registry.builtin("DFT", since=20, attrs=ex.DFT_ATTRS)
def _dft_20(c: OpCall) -> str:
    """Opset 20 on: the axis is an input (default -2)."""
    return _dft(c, _int(c, 2, "axis") or "-2")


@template("STFT", onesided=1)
def _stft(c: OpCall) -> str:
    if not (c.has(2) or c.has(3)):
        raise c.fail("STFT needs a window or a frame_length")
    return ex.stft_call(c, _int(c, 1, "frame_step"), _int(c, 3, "frame_length"))


@template("MelWeightMatrix", output_datatype=1)
def _mel_weight_matrix(c: OpCall) -> str:
    def read(i: int, what: str) -> str:
        c.helpers.add("static_ints")
        return f'_static({c.args[i]}, "MelWeightMatrix {what}")[0]'

    return f"jnp.asarray({ex.mel_weight_matrix_call(c, read)}, dtype={c.dtype()})"
