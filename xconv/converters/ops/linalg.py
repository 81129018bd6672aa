"""Softmax, LogSoftmax and Hardmax written once: the opset rules (one axis from opset 13,
the input coerced to 2-D before), with the backend's kernels along one axis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from xconv.converters.ops.arrays import normalize_axis

#: fn(x, axis) -> y, one per op: a backend's ``{"Softmax": ..., "LogSoftmax": ...,
#: "Hardmax": ...}``.
AxisKernels = dict[str, Callable[[Any, int], Any]]


def _softmax_like(ctx, x, axis, fn):
    """Opset >= 13: ``fn`` along one axis (default -1). Before 13: coerce the input to 2-D
    at ``axis`` (default 1), apply ``fn`` along the flattened trailing dimensions."""
    if ctx.opset >= 13:
        return fn(x, normalize_axis(ctx, -1 if axis is None else axis, x.ndim))
    ax = normalize_axis(ctx, 1 if axis is None else axis, x.ndim) if x.ndim else 0
    rows = int(np.prod(x.shape[:ax], dtype=np.int64))
    cols = int(np.prod(x.shape[ax:], dtype=np.int64))
    return fn(x.reshape(rows, cols), 1).reshape(x.shape)


_DOCS = {
    "Softmax": "Softmax(input) -> output: exp(x - max) / sum along ``axis``.",
    "LogSoftmax": "LogSoftmax(input) -> output: x - max - log(sum(exp(x - max))) along ``axis``.",
    "Hardmax": "Hardmax(input) -> output: 1 at the first maximum along ``axis``, 0 elsewhere.",
}


def register_softmax_ops(
    builtin: Callable[..., Any], kernels: AxisKernels, asarray: Callable[[Any], Any]
) -> None:
    """Register Softmax, LogSoftmax and Hardmax; ``asarray`` brings an input to the backend."""
    for op_type, fn in kernels.items():

        def handler(ctx, x, *, axis, fn=fn):
            return _softmax_like(ctx, asarray(x), axis, fn)

        handler.__name__ = op_type.lower()
        handler.__doc__ = _DOCS[op_type]
        builtin(op_type, since=1, attrs={"axis": None})(handler)
