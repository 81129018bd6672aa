"""Indexing ops written once against ``xp``: Gather, GatherElements, GatherND, OneHot,
Compress, ReverseSequence, and Unique's numpy core.

The scatters and Slice stay per backend (``.at[]``, ``torch.index_select``/``index_reduce``,
torch's lack of negative strides); torch overrides GatherElements with ``torch.gather``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from xconv.converters.ops.arrays import astype, is_static, normalize_axis
from xconv.converters.ops.attrs import static_ints

#: A gather from a float table of at most this many rows (a token-type embedding) is written
#: as ``where`` over its rows where gradients are taken (the JAX runtime, the generated Flax):
#: the same values as a take, and one sum per row as its gradient instead of a scatter-add,
#: which GPUs run slowly in bfloat16 when many positions hit few rows.
SELECT_ROWS = 8


class IndexingKernel(Protocol):
    """What a backend provides for the shared indexing ops."""

    def run(self, fn: Callable[..., Any], *arrays: Any) -> Any:
        """``fn(xp, *arrays)`` in the namespace this backend picks for ``arrays``."""

    def index_dtype(self, xp: Any) -> Any:
        """The integer dtype of indices in ``xp``."""

    def arange(self, xp: Any, n: int, like: Any) -> Any:
        """``xp.arange(n)`` where ``like`` lives (its device)."""


def wrap(k: IndexingKernel, xp: Any, idx: Any, dim: int) -> Any:
    """ONNX index semantics: negative indices count from the end of the axis."""
    idx = astype(xp, idx, k.index_dtype(xp))
    return xp.where(idx < 0, idx + dim, idx)


def take_elements(k: IndexingKernel, xp: Any, x: Any, idx: Any, axis: int) -> Any:
    """GatherElements on wrapped indices: ``out[..i..] = x[..idx[..i..]..]``, by advanced
    indexing with an arange grid on every other axis (``idx`` may be smaller than ``x``)."""
    shape = tuple(idx.shape)
    index = []
    for d, n in enumerate(shape):
        if d == axis:
            index.append(idx)
            continue
        view = [1] * len(shape)
        view[d] = n
        index.append(xp.reshape(k.arange(xp, n, idx), tuple(view)))
    return x[tuple(index)]


def unique(ctx, value: np.ndarray, axis: int | None, sorted: int) -> tuple[np.ndarray, ...]:  # noqa: A002
    """Unique(X) as numpy: (Y, indices, inverse_indices, counts), as many as the node has."""
    kwargs = {} if axis is None else {"axis": normalize_axis(ctx, axis, value.ndim)}
    y, first, inverse, counts = np.unique(
        value, return_index=True, return_inverse=True, return_counts=True, **kwargs
    )
    inverse = inverse.reshape(-1)
    if not sorted:
        order = np.argsort(first, kind="stable")
        rank_of = np.empty_like(order)
        rank_of[order] = np.arange(order.size)
        first, counts, inverse = first[order], counts[order], rank_of[inverse]
        y = np.take(value, first, axis=kwargs.get("axis"))
    as64 = [np.asarray(v, dtype=np.int64) for v in (first, inverse, counts)]
    return (y, *as64)[: len(ctx.node.outputs)]


def _gather_nd(ctx, k, xp, x, indices, b: int):
    d_shape, i_shape = tuple(x.shape), tuple(indices.shape)
    n = i_shape[-1]
    if d_shape[:b] != i_shape[:b] or b + n > len(d_shape):
        raise ctx.error(f"indices {i_shape} do not fit data {d_shape} with batch_dims={b}")
    nb = math.prod(d_shape[:b])
    inner = i_shape[b:-1]
    data = xp.reshape(x, (nb, *d_shape[b:]))
    idx = xp.reshape(indices, (nb, *inner, n))
    comps = tuple(wrap(k, xp, idx[..., j], d_shape[b + j]) for j in range(n))
    batch = xp.reshape(k.arange(xp, nb, idx), (nb,) + (1,) * len(inner))
    out = data[(batch, *comps)]
    return xp.reshape(out, d_shape[:b] + inner + d_shape[b + n :])


def _one_hot(k, xp, indices, values, n: int, axis: int):
    idx = wrap(k, xp, indices, n)
    view = [1] * (indices.ndim + 1)
    view[axis] = n
    hot = xp.expand_dims(idx, axis) == xp.reshape(k.arange(xp, n, idx), tuple(view))
    return astype(xp, xp.where(hot, values[1], values[0]), values.dtype)


def _reverse_sequence(k, xp, x, lens, batch_axis: int, time_axis: int):
    n_time = x.shape[time_axis]
    t = xp.reshape(k.arange(xp, n_time, lens), (1, n_time))
    lens = xp.reshape(astype(xp, lens, k.index_dtype(xp)), (-1, 1))
    src = xp.where(t < lens, lens - 1 - t, t)  # (batch, time)
    if batch_axis > time_axis:
        src = src.T
    view = [1] * x.ndim
    view[batch_axis] = x.shape[batch_axis]
    view[time_axis] = n_time
    src = xp.broadcast_to(xp.reshape(src, tuple(view)), tuple(x.shape))
    return xp.take_along_axis(x, src, axis=time_axis)


def register_slice(builtin: Callable[..., Any], apply: Callable[..., Any]) -> None:
    """Slice (opsets 1 and 10+): the static starts/ends/axes/steps checked and clamped once;
    the backend's ``apply(x, plan)`` takes ``[(axis, start, stop, step), ...]`` as
    ``slice.indices`` gives them (clamped like ONNX: [0, dim] forward, [-1, dim-1] backward)."""

    @builtin("Slice", since=1, attrs={"starts": None, "ends": None, "axes": None})
    def slice_(
        ctx, x, starts_in=None, ends_in=None, axes_in=None, steps_in=None, *, starts, ends, axes
    ):
        """Slice(data, starts, ends, axes?, steps?) -> output: strided slices along axes."""
        src_axes = axes_in if axes_in is not None else axes
        begin = static_ints(ctx, starts_in if starts_in is not None else starts, "starts")
        end = static_ints(ctx, ends_in if ends_in is not None else ends, "ends")
        ax = static_ints(ctx, src_axes, "axes") if src_axes is not None else list(range(len(begin)))
        steps = static_ints(ctx, steps_in, "steps") if steps_in is not None else [1] * len(begin)
        if not len(begin) == len(end) == len(ax) == len(steps):
            raise ctx.error("starts, ends, axes and steps must have the same length")
        shape = tuple(np.shape(x))
        plan = []
        for b, e, a, s in zip(begin, end, ax, steps, strict=True):
            if s == 0:
                raise ctx.error("slice step cannot be 0")
            a = normalize_axis(ctx, a, len(shape))
            plan.append((a, *slice(b, e, s).indices(shape[a])))
        return apply(x, plan)


def register_scatter_ops(
    builtin: Callable[..., Any], elements: Callable[..., Any], nd: Callable[..., Any]
) -> None:
    """ScatterElements, its deprecated alias Scatter, and ScatterND, over a backend's
    ``elements(ctx, x, indices, updates, axis, reduction)`` and ``nd(ctx, x, indices, updates,
    reduction)``."""

    @builtin("ScatterElements", since=11, attrs={"axis": 0, "reduction": "none"})
    def scatter_elements(ctx, x, indices, updates, *, axis, reduction):
        """ScatterElements(data, indices, updates) -> output: element-wise scatter (+
        reduction)."""
        return elements(ctx, x, indices, updates, axis, reduction)

    @builtin("Scatter", since=9, attrs={"axis": 0})
    def scatter(ctx, x, indices, updates, *, axis):
        """Scatter(data, indices, updates) -> output: deprecated alias of ScatterElements."""
        return elements(ctx, x, indices, updates, axis, "none")

    @builtin("ScatterND", since=11, attrs={"reduction": "none"})
    def scatter_nd(ctx, x, indices, updates, *, reduction):
        """ScatterND(data, indices, updates) -> output: writes slices addressed by index
        tuples."""
        return nd(ctx, x, indices, updates, reduction)


def register_indexing_ops(builtin: Callable[..., Any], k: IndexingKernel) -> None:
    """Register Gather, GatherElements, GatherND, OneHot, Compress and ReverseSequence with a
    backend's ``builtin`` (``k.overrides["GatherElements"](x, idx, axis)``, where given,
    replaces :func:`take_elements` on backend arrays; ``k.overrides["Gather"]`` replaces
    ``xp.take`` on wrapped indices)."""

    own_take = k.overrides.get("Gather")

    def take(xp, x, i, axis):
        if own_take is not None and xp is not np:
            return own_take(x, i, axis)
        return xp.take(x, i, axis=axis)

    @builtin("Gather", since=1, attrs={"axis": 0})
    def gather(ctx, x, indices, *, axis):
        """Gather(data, indices) -> output: entries of `axis` picked by indices (may be <
        0)."""
        axis = normalize_axis(ctx, axis, len(np.shape(x)))
        dim = np.shape(x)[axis]
        if is_static(indices) and np.ndim(indices) == 0 and -dim <= int(indices) < dim:
            # One constant index (how exporters split packed q, k, v): basic indexing, a
            # slice whose gradient is a pad; a take's is a scatter-add, which XLA:CPU ran as
            # an unvectorised map (a bfloat16 training step of the transformer benchmark 7 %
            # slower than the hand-written Flax).
            at = (slice(None),) * axis + (int(indices) % dim,)
            return k.run(lambda xp, x: x[at], x)
        return k.run(lambda xp, x, i: take(xp, x, wrap(k, xp, i, dim), axis), x, indices)

    own_elements = k.overrides.get("GatherElements")

    def elements(xp, x, i, axis):
        idx = wrap(k, xp, i, x.shape[axis])
        if own_elements is not None and xp is not np:
            return own_elements(x, idx, axis)
        return take_elements(k, xp, x, idx, axis)

    @builtin("GatherElements", since=11, attrs={"axis": 0})
    def gather_elements(ctx, x, indices, *, axis):
        """GatherElements(data, indices) -> output: out[..i..] = data[..indices[..i..]..]."""
        axis = normalize_axis(ctx, axis, len(np.shape(x)))
        return k.run(lambda xp, x, i: elements(xp, x, i, axis), x, indices)

    @builtin("GatherND", since=11, attrs={"batch_dims": 0})
    def gather_nd(ctx, x, indices, *, batch_dims):
        """GatherND(data, indices) -> output: slices of data addressed by index tuples."""
        return k.run(lambda xp, x, i: _gather_nd(ctx, k, xp, x, i, batch_dims), x, indices)

    @builtin("OneHot", since=9, attrs={"axis": -1})
    def one_hot(ctx, indices, depth, values, *, axis):
        """OneHot(indices, depth, values) -> output: values[1] where index matches, else
        values[0]."""
        n = int(np.asarray(ctx.static(depth, "depth")).reshape(-1)[0])
        axis = normalize_axis(ctx, axis, np.ndim(indices) + 1)
        return k.run(lambda xp, i, v: _one_hot(k, xp, i, v, n, axis), indices, values)

    @builtin("Compress", since=9, attrs={"axis": None})
    def compress(ctx, x, condition, *, axis):
        """Compress(input, condition) -> output: the slices along axis where condition is
        true."""
        keep = np.nonzero(np.asarray(ctx.static(condition, "condition")).reshape(-1))[0]
        if axis is None:
            return k.run(lambda xp, x: xp.take(xp.reshape(x, (-1,)), keep, axis=0), x)
        axis = normalize_axis(ctx, axis, np.ndim(x))
        if keep.size and keep[-1] >= np.shape(x)[axis]:
            raise ctx.error("condition selects past the end of the axis")
        return k.run(lambda xp, x: xp.take(x, keep, axis=axis), x)

    @builtin("ReverseSequence", since=10, attrs={"batch_axis": 1, "time_axis": 0})
    def reverse_sequence(ctx, x, sequence_lens, *, batch_axis, time_axis):
        """ReverseSequence(input, sequence_lens) -> Y: reverses the first lens[b] steps of
        batch b."""
        rank = np.ndim(x)
        b, t = normalize_axis(ctx, batch_axis, rank), normalize_axis(ctx, time_axis, rank)
        return k.run(lambda xp, x, n: _reverse_sequence(k, xp, x, n, b, t), x, sequence_lens)
