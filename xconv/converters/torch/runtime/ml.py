"""The PyTorch kernel of the classical ML ops (LabelEncoder, ArrayFeatureExtractor,
Binarizer, TreeEnsemble, TfIdfVectorizer), written once in :mod:`xconv.converters.ops.ml`.

Numeric data runs in torch under numpy's names (:mod:`.xp`); string data on numpy object
arrays, a numeric result coming back as a tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from xconv.converters.ops.ml import register_ml_ops
from xconv.converters.torch.runtime.registry import REQUIRED, builtin
from xconv.converters.torch.runtime.xp import TorchKernel, from_numpy


class _Kernel(TorchKernel):
    @staticmethod
    def constant(a, like=None):
        # Next to numpy data (all inputs static, or strings), a constant stays numpy.
        return from_numpy(a, like) if isinstance(like, torch.Tensor) else np.asarray(a)

    @staticmethod
    def fuse(fn):
        return fn

    @staticmethod
    def repeat(xp, step, init, n):
        for _ in range(n):
            init = step(init)
        return init

    @staticmethod
    def finfo(xp, dtype):
        return np.finfo(dtype) if xp is np else torch.finfo(dtype)

    @staticmethod
    def erfinv(xp, x):
        return torch.erfinv(torch.from_numpy(x)).numpy() if xp is np else torch.erfinv(x)


register_ml_ops(builtin, _Kernel(), REQUIRED)
