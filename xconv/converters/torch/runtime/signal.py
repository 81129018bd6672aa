"""The PyTorch kernel of the signal ops (window functions, DFT, STFT, MelWeightMatrix).

The ops are written once in :mod:`xconv.converters.ops.signal_ops`.
"""

from __future__ import annotations

import torch

from xconv.converters.ops.signal_ops import register_signal_ops
from xconv.converters.torch.runtime.dtypes import to_tensor
from xconv.converters.torch.runtime.registry import builtin


class _Kernel:
    @staticmethod
    def array(x):
        return x

    constant = staticmethod(to_tensor)
    complex = staticmethod(torch.complex)

    @staticmethod
    def pair(z, like):
        if not z.is_complex():
            z = torch.complex(z, torch.zeros_like(z))
        return torch.stack([z.real, z.imag], dim=-1).to(like.dtype)

    @staticmethod
    def cast(x, like):
        return x.to(like.dtype)

    @staticmethod
    def fft(name, z, n, axis):
        return getattr(torch.fft, name)(z, n=n, dim=axis)

    @staticmethod
    def narrow(x, axis, start, length):
        return x.narrow(axis, start, length)

    @staticmethod
    def conj_flip(x, axis):
        return torch.conj(torch.flip(x, (axis,)))

    @staticmethod
    def concat(xs, axis):
        return torch.cat(xs, dim=axis)

    @staticmethod
    def frames(signal, index):
        return signal[:, torch.as_tensor(index), :]


register_signal_ops(builtin, _Kernel())
