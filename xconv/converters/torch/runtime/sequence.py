"""The PyTorch kernel of the sequence and optional ops (written once in
:mod:`xconv.converters.ops.sequence`).

An ONNX sequence is a Python list of tensors and an empty optional is None.
"""

from __future__ import annotations

import numpy as np
import torch

from xconv.converters.ops import sequence as sequences
from xconv.converters.torch.runtime.dtypes import is_numpy
from xconv.converters.torch.runtime.registry import REQUIRED, builtin
from xconv.converters.torch.runtime.shape import concatenate
from xconv.converters.torch.runtime.xp import from_numpy


class _Kernel:
    constant = staticmethod(from_numpy)

    @staticmethod
    def split(x, sizes, axis):
        return list(torch.split(x, sizes, dim=axis))

    @staticmethod
    def squeeze(x, axis):
        return x.squeeze(axis)

    @staticmethod
    def expand_dims(x, axis):
        return np.expand_dims(x, axis) if is_numpy(x) else x.unsqueeze(axis)

    concat = staticmethod(concatenate)

    @staticmethod
    def dynamic_at(ctx, seq, position):
        return None  # positions are read with ctx.static


sequences.register_list_ops(builtin, REQUIRED, _Kernel())
