"""PyTorch kernel of the control-flow ops (If, Loop, Scan: written once in
:mod:`xconv.converters.ops.control`).

torch runs eagerly, so each op steers in Python and runs its subgraph with
``ctx.run_subgraph``: branches may differ in shape, loop-carried values may grow and may be
ONNX sequences (Python lists).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from xconv.converters.ops.control import loop_steps, python_scan, register_scan_ops
from xconv.converters.torch.runtime.dtypes import is_numpy
from xconv.converters.torch.runtime.registry import REQUIRED, builtin
from xconv.converters.torch.runtime.xp import KERNEL, as_numpy, from_numpy


class _ControlKernel:
    """The torch side of :mod:`xconv.converters.ops.control`: every value is concrete."""

    run = staticmethod(KERNEL.run)
    constant = staticmethod(from_numpy)

    @staticmethod
    def truth(value: Any) -> bool:
        return bool(np.asarray(as_numpy(value)).reshape(-1)[0])

    @staticmethod
    def stack(items: Sequence[Any]) -> Any:
        if all(is_numpy(x) for x in items):
            return np.stack([np.asarray(x) for x in items])
        return torch.stack([x if isinstance(x, torch.Tensor) else from_numpy(x) for x in items])

    @staticmethod
    def pad_time(y, extra):
        return torch.cat([y, torch.zeros((extra, *y.shape[1:]), dtype=y.dtype, device=y.device)])

    def scan_core(self, ctx, body, states, scan_inputs, in_axes, in_dirs, out_axes, out_dirs):
        return python_scan(
            self, ctx, body, states, scan_inputs, in_axes, in_dirs, out_axes, out_dirs
        )


_KERNEL = _ControlKernel()
register_scan_ops(builtin, _KERNEL, REQUIRED)


@builtin("Loop", since=1, attrs={"body": REQUIRED})
def loop(ctx, m, cond, *v_initial, body):
    """Loop(M?, cond?, v_initial...) -> (v_final..., scan_outputs...)."""
    return loop_steps(_KERNEL, ctx, body, m, cond, v_initial)
