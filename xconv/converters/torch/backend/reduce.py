"""The PyTorch kernel of the Reduce* family and ArgMax / ArgMin (written once in
:mod:`xconv.converters.ops.reduce`): torch under numpy's names (:mod:`.xp`), numpy for the
wide unsigned types, and torch's own ``logsumexp``."""

from __future__ import annotations

import numpy as np
import torch

from xconv.converters.ops.reduce import register_reduce_ops
from xconv.converters.torch.backend import xp as torch_xp
from xconv.converters.torch.backend.registry import builtin


def _log_sum_exp(xp, x, axes, keepdims):
    if xp is np:
        from xconv.converters.ops.reduce import _log_sum_exp as shared

        return shared(xp, x, axes, keepdims)
    return torch.logsumexp(x, dim=axes, keepdim=keepdims)


class _Kernel:
    overrides = {"ReduceLogSumExp": _log_sum_exp}
    run = staticmethod(torch_xp.run)

    @staticmethod
    def index_dtype(xp):
        return np.int64 if xp is np else torch.int64


register_reduce_ops(builtin, _Kernel())
