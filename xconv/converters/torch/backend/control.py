"""PyTorch handlers for control flow: If, Loop, Scan.

torch runs eagerly, so each op steers in Python and runs its subgraph with
``ctx.run_subgraph``: branches may differ in shape, loop-carried values may grow and may be
ONNX sequences (Python lists).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from xconv.converters.ops.control import register_scan_ops, scan_steps
from xconv.converters.torch.backend.dtypes import is_numpy, torch_dtype
from xconv.converters.torch.backend.registry import REQUIRED, builtin
from xconv.converters.torch.backend.shape import back


def _truth(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return bool(value.reshape(-1)[0])
    return bool(np.asarray(value).reshape(-1)[0])


def _stack(items: Sequence[Any]) -> Any:
    if all(is_numpy(x) for x in items):
        return np.stack([np.asarray(x) for x in items])
    return torch.stack([x if isinstance(x, torch.Tensor) else back(x) for x in items])


def _empty_like_output(value, leading: int = 0) -> Any:
    dims = []
    if value.shape is not None:
        dims = [d if isinstance(d, int) else 0 for d in value.shape]
    dtype = torch_dtype(value.dtype) if value.dtype is not None else torch.float32
    return torch.zeros([leading, *dims], dtype=dtype)


def _moveaxis(y: Any, src: int, dst: int) -> Any:
    return np.moveaxis(y, src, dst) if is_numpy(y) else torch.movedim(y, src, dst)


def _flip0(y: Any) -> Any:
    return y[::-1] if is_numpy(y) else torch.flip(y, (0,))


@builtin("If", since=1, attrs={"then_branch": REQUIRED, "else_branch": REQUIRED})
def if_(ctx, cond, *, then_branch, else_branch):
    """If(cond) -> outputs of then_branch or else_branch."""
    branch = then_branch if _truth(cond) else else_branch
    return tuple(ctx.run_subgraph(branch, []))


@builtin("Loop", since=1, attrs={"body": REQUIRED})
def loop(ctx, m, cond, *v_initial, body):
    """Loop(M?, cond?, v_initial...) -> (v_final..., scan_outputs...)."""
    n_carried = len(v_initial)
    n_scan = len(body.outputs) - 1 - n_carried
    it_dtype = m.dtype if isinstance(m, torch.Tensor) else torch.int64
    max_trip = None if m is None else int(ctx.static(m, "M").reshape(()))
    keep_going = True if cond is None else _truth(cond)
    cond_in = torch.tensor(keep_going)
    values = list(v_initial)
    scans: list[list[Any]] = [[] for _ in range(n_scan)]
    it = 0
    while keep_going and (max_trip is None or it < max_trip):
        outs = ctx.run_subgraph(body, [torch.tensor(it, dtype=it_dtype), cond_in, *values])
        values = list(outs[1 : 1 + n_carried])
        for k in range(n_scan):
            scans[k].append(outs[1 + n_carried + k])
        cond_in = outs[0]
        keep_going = _truth(cond_in)
        it += 1
    results = list(values)
    body_scan_outputs = body.outputs[1 + n_carried :]
    for k in range(n_scan):
        results.append(_stack(scans[k]) if scans[k] else _empty_like_output(body_scan_outputs[k]))
    return tuple(results)


def _scan_core(ctx, body, states, scan_inputs, in_axes, in_dirs, out_axes, out_dirs):
    """Scan-9 semantics on unbatched values; returns (final states..., scan outputs...)."""
    xs = []
    for x, axis, direction in zip(scan_inputs, in_axes, in_dirs, strict=True):
        x = _moveaxis(x, axis, 0)
        xs.append(_flip0(x) if direction else x)
    final, ys = scan_steps(ctx, body, states, xs, _stack, _empty_like_output)
    outputs = []
    for y, axis, direction in zip(ys, out_axes, out_dirs, strict=True):
        y = _flip0(y) if direction else y
        outputs.append(_moveaxis(y, 0, axis % y.ndim))
    return (*final, *outputs)


class _ScanKernel:
    """The torch side of :mod:`xconv.converters.ops.control`."""

    scan_core = staticmethod(_scan_core)
    stack = staticmethod(_stack)

    @staticmethod
    def pad_time(y, extra):
        return torch.cat([y, torch.zeros((extra, *y.shape[1:]), dtype=y.dtype, device=y.device)])


register_scan_ops(builtin, _ScanKernel(), REQUIRED)
