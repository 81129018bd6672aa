"""The JAX kernel of the signal ops (window functions, DFT, STFT, MelWeightMatrix).

The ops are written once in :mod:`xconv.converters.ops.signal_ops`.
"""

from __future__ import annotations

import jax.numpy as jnp

from xconv.converters.jax.registry import builtin
from xconv.converters.ops.signal_ops import register_signal_ops


class _Kernel:
    array = staticmethod(jnp.asarray)

    @staticmethod
    def constant(a):
        return a  # numpy: folded at trace time

    @staticmethod
    def complex(real, imag):
        return real + 1j * imag.astype(jnp.result_type(real, jnp.complex64))

    @staticmethod
    def pair(z, like):
        return jnp.stack([jnp.real(z), jnp.imag(z)], axis=-1).astype(like.dtype)

    @staticmethod
    def cast(x, like):
        return jnp.asarray(x).astype(like.dtype)

    @staticmethod
    def fft(name, z, n, axis):
        return getattr(jnp.fft, name)(z, n=n, axis=axis)

    @staticmethod
    def narrow(x, axis, start, length):
        return jnp.take(x, jnp.arange(start, start + length), axis=axis)

    @staticmethod
    def conj_flip(x, axis):
        return jnp.conj(jnp.flip(x, axis))

    @staticmethod
    def concat(xs, axis):
        return jnp.concatenate(xs, axis=axis)

    @staticmethod
    def frames(signal, index):
        return signal[:, index, :]


register_signal_ops(builtin, _Kernel())
