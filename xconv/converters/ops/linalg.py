"""Softmax, LogSoftmax and Hardmax written once: the opset rules (one axis from opset 13,
the input coerced to 2-D before), with the backend's kernels along one axis."""

from __future__ import annotations

import math
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


# --------------------------------------------------------------------------------------
# TopK

#: ``top_k(x, k, axis, largest) -> (values, indices)`` along a normalised ``axis``, equal
#: values keeping the lower index first, indices in the backend's index dtype.
TopK = Callable[[Any, int, int, bool], tuple[Any, Any]]


def register_topk(builtin: Callable[..., Any], top_k: TopK, required: Any) -> None:
    """TopK-1 (k an attribute), TopK-10 (k an input), TopK-11 (``largest``, ``sorted``)."""
    from xconv.converters.ops.attrs import static_int

    def run(ctx, x, k: int, axis: int, largest: int):
        ax = normalize_axis(ctx, axis, len(x.shape))
        n = x.shape[ax]
        if not 0 <= k <= n:
            raise ctx.error(f"k={k} is out of range for an axis of size {n}")
        return top_k(x, k, ax, bool(largest))

    @builtin("TopK", since=1, until=9, attrs={"axis": -1, "k": required})
    def topk_1(ctx, x, *, axis, k):
        """TopK-1(X) -> (Values, Indices): the k largest along ``axis`` (k an attribute)."""
        return run(ctx, x, int(k), axis, 1)

    @builtin("TopK", since=10, until=10, attrs={"axis": -1})
    def topk_10(ctx, x, k, *, axis):
        """TopK-10(X, K) -> (Values, Indices): the k largest along ``axis``."""
        return run(ctx, x, static_int(ctx, k, "k"), axis, 1)

    @builtin("TopK", since=11, attrs={"axis": -1, "largest": 1, "sorted": 1})
    def topk(ctx, x, k, *, axis, largest, sorted):  # noqa: A002 - the ONNX attribute name
        """TopK(X, K) -> (Values, Indices): the k largest (or smallest) along ``axis``.

        Equal values keep the lower index first, as ONNX specifies; ``k`` must be static.
        The output is always sorted (``sorted=0`` leaves the order unspecified).
        """
        return run(ctx, x, static_int(ctx, k, "k"), axis, largest)


# --------------------------------------------------------------------------------------
# Losses

#: The reductions of NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.
LOSS_REDUCTIONS = ("none", "sum", "mean")


def _nll(xp, index_dtype, logp, target, weight, reduction: str, ignore_index):
    """Negative log-likelihood of ``logp`` (N, C, d...) at ``target`` (N, d...)."""
    from xconv.converters.ops.arrays import astype

    dtype = logp.dtype
    valid = None if ignore_index is None else target != ignore_index
    safe = target if valid is None else xp.where(valid, target, xp.zeros_like(target))
    safe = astype(xp, xp.clip(safe, 0, logp.shape[1] - 1), index_dtype)
    loss = -xp.squeeze(xp.take_along_axis(logp, xp.expand_dims(safe, 1), axis=1), 1)
    w = None if weight is None else astype(xp, weight, dtype)[safe]
    if valid is not None:
        w = xp.where(valid, xp.ones_like(loss) if w is None else w, xp.zeros_like(loss))
        loss = xp.where(valid, loss, xp.zeros_like(loss))
    if w is not None:
        loss = loss * w
    if reduction == "none":
        return astype(xp, loss, dtype)
    total = xp.sum(loss)
    if reduction == "sum":
        return astype(xp, total, dtype)
    count = math.prod(loss.shape) if w is None else xp.sum(w)
    return astype(xp, total / count, dtype)


def register_loss_ops(builtin: Callable[..., Any], k: Any, log_softmax: Callable) -> None:
    """NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss through ``k.run``;
    ``log_softmax(x, axis)`` is the backend's, on its arrays."""

    def nll(ctx, logp, target, weight, reduction, ignore_index):
        if reduction not in LOSS_REDUCTIONS:
            raise ctx.error(f"reduction {reduction!r} is not one of {list(LOSS_REDUCTIONS)}")
        if len(logp.shape) < 2:
            raise ctx.error(f"input must have shape (N, C, ...), got rank {len(logp.shape)}")
        return k.run(
            lambda xp, lp, t, w: _nll(xp, k.index_dtype(xp), lp, t, w, reduction, ignore_index),
            logp,
            target,
            weight,
        )

    attrs = {"reduction": "mean", "ignore_index": None}

    @builtin("NegativeLogLikelihoodLoss", since=12, attrs=attrs)
    def negative_log_likelihood_loss(ctx, x, target, weight=None, *, reduction, ignore_index):
        """NegativeLogLikelihoodLoss(input, target, weight?) -> loss = -input[n, target[n],
        ...] (weighted, ``ignore_index`` entries excluded), reduced by ``reduction``."""
        return nll(ctx, x, target, weight, reduction, ignore_index)

    @builtin("SoftmaxCrossEntropyLoss", since=12, attrs=attrs)
    def softmax_cross_entropy_loss(ctx, scores, labels, weights=None, *, reduction, ignore_index):
        """SoftmaxCrossEntropyLoss(scores, labels, weights?) -> (output, log_prob?):
        NegativeLogLikelihoodLoss of LogSoftmax(scores, axis=1)."""
        if len(scores.shape) < 2:
            raise ctx.error(f"scores must have shape (N, C, ...), got rank {len(scores.shape)}")
        log_prob = log_softmax(scores, 1)
        loss = nll(ctx, log_prob, labels, weights, reduction, ignore_index)
        outputs = ctx.node.outputs
        wants_log_prob = len(outputs) > 1 and outputs[1].name != ""
        return (loss, log_prob) if wants_log_prob else loss


# --------------------------------------------------------------------------------------
# Cumulative ops


def _cumulative(xp, x, ax: int, exclusive: int, reverse: int, name: str, identity: int):
    if reverse:
        x = xp.flip(x, ax)
    if exclusive:
        # Shift right by one along the axis, filling with the identity.
        head = tuple(slice(0, 1) if d == ax else slice(None) for d in range(x.ndim))
        body = tuple(slice(0, x.shape[ax] - 1) if d == ax else slice(None) for d in range(x.ndim))
        x = xp.concatenate([xp.full_like(x[head], identity), x[body]], axis=ax)
    y = getattr(xp, name)(x, axis=ax, dtype=x.dtype)
    return xp.flip(y, ax) if reverse else y


def register_cumulative_ops(builtin: Callable[..., Any], k: Any) -> None:
    """CumSum and CumProd through ``k.run`` (``xp.cumsum``/``xp.cumprod``)."""
    from xconv.converters.ops.attrs import static_int

    def run(ctx, x, axis, exclusive, reverse, name, identity):
        ax = normalize_axis(ctx, static_int(ctx, axis, "axis"), len(np.shape(x)))
        return k.run(lambda xp, x: _cumulative(xp, x, ax, exclusive, reverse, name, identity), x)

    @builtin("CumSum", since=11, attrs={"exclusive": 0, "reverse": 0})
    def cumsum(ctx, x, axis, *, exclusive, reverse):
        """CumSum(x, axis) -> y: running sum along ``axis`` (optionally exclusive /
        reversed)."""
        return run(ctx, x, axis, exclusive, reverse, "cumsum", 0)

    @builtin("CumProd", since=26, attrs={"exclusive": 0, "reverse": 0})
    def cumprod(ctx, x, axis, *, exclusive, reverse):
        """CumProd(x, axis) -> y: running product along ``axis`` (optionally exclusive /
        reversed)."""
        return run(ctx, x, axis, exclusive, reverse, "cumprod", 1)
