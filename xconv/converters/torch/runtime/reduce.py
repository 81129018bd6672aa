"""The Reduce* family and ArgMax / ArgMin on torch: written once in
:mod:`xconv.converters.ops.reduce`, run with torch under numpy's names (:mod:`.xp`, numpy for
the wide unsigned types), with torch's own ``logsumexp``."""

from __future__ import annotations

import numpy as np
import torch

from xconv.converters.ops.reduce import log_sum_exp, register_reduce_ops
from xconv.converters.torch.runtime.registry import builtin
from xconv.converters.torch.runtime.xp import TorchKernel


def _log_sum_exp(xp, x, axes, keepdims):
    if xp is np:
        return log_sum_exp(xp, x, axes, keepdims)
    return torch.logsumexp(x, dim=axes, keepdim=keepdims)


class _Kernel(TorchKernel):
    overrides = {"ReduceLogSumExp": _log_sum_exp}


register_reduce_ops(builtin, _Kernel())
