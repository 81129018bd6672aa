"""jaxpr handlers for indexing: ``gather``, the ``scatter`` family, ``stack`` and ``tile``.

XLA's gather and scatter are general: each output (update) element has a batch position
(the index tensor's leading dims), a window offset, operand batching dims paired with index
batching dims (vmapped indexing, ``take_along_axis``), and windows that may be partial
(``dynamic_slice`` under ``vmap``). The general lowering builds the full ONNX index tensor:

1. operand dims split into *indexed* dims K (indexed by the index vector, batching dims,
   partial windows) and *free* dims F (whole, unindexed windows). The operand is transposed
   to ``K + F`` so ``GatherND`` / ``ScatterND`` index only its leading dims;
2. the index tensor has shape ``[*batch, *window(K), len(K)]``: per indexed dim, the
   (clamped) start from the index vector, or an iota over the paired batch dim, plus an iota
   over the window;
3. the result (``[*batch, *window(K), *F]``) is transposed to jax's output order.

Out-of-bounds modes, for a window whose start is outside ``[0, dim - window]``:

- gather ``clip`` / ``promise_in_bounds`` (and ``one_hot``): the start is clamped, like XLA;
- gather ``fill`` (``FILL_OR_DROP``, jnp's default for ``take_along_axis``): the whole window
  is ``fill_value`` (jax's default: NaN, the int minimum, the uint maximum, True), exactly;
- scatter ``clip``: the start is clamped;
- scatter ``drop`` and ``promise_in_bounds`` (jnp ``.at[]`` default): the whole update window
  is discarded, exactly, by routing it into padding that is sliced off afterwards.

ONNX ``ScatterND`` with ``reduction="none"`` leaves duplicate indices undefined, like jax's
``.at[].set`` (which documents no order); the reductions (add/mul/min/max) are exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.converters.flax.importer.primitives import builtin
from xconv.converters.flax.importer.symbolic import (
    SymbolicShapeError,
    as_dims,
    dim_value,
    dims,
    shape_value,
    static_dim,
)
from xconv.errors import ConversionError


def _scalar(ctx, d: Any) -> ir.Value:
    """A dimension (int or symbolic) as an int64 scalar IR value."""
    k = static_dim(d)
    if k is not None:
        return ctx.i64(k)
    return ctx.op("Reshape", [dim_value(ctx, d), ctx.i64(np.zeros((0,), np.int64))])


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an inconclusive symbolic comparison
        return False


def _static(d: Any, what: str) -> int:
    k = static_dim(d)
    if k is None:
        raise SymbolicShapeError(f"{what} needs a static size, got {d}")
    return k


def _inverse(perm: list[int]) -> list[int]:
    return [int(i) for i in np.argsort(perm)]


def _transpose(ctx, x, perm: list[int]):
    return ctx.op("Transpose", [x], {"perm": perm}) if perm != list(range(len(perm))) else x


def _mode(eqn) -> str:
    mode = eqn.params.get("mode")
    return getattr(mode, "name", str(mode or "FILL_OR_DROP")).upper()


def _default_fill(dtype: np.dtype) -> Any:
    """jax's fill value for an out-of-bounds gather window when none is given."""
    if dtype.kind in "fc":
        return np.nan
    if dtype.kind == "i":
        return np.iinfo(dtype).min
    if dtype.kind == "u":
        return np.iinfo(dtype).max
    return True


class _Plan:
    """Where each operand dim of a gather/scatter comes from, and how to lay out the result.

    Args:
        shape: The operand shape.
        batch: The index tensor's batch shape (all but its last dim, the index vector).
        index_map: Operand dim indexed by each index-vector entry.
        batching: Pairs ``(operand dim, index batch dim)``.
        window: The window size along each operand dim (1 for collapsed / batching dims).
        window_dims: The operand dims that appear as window dims in the result, in order.
    """

    def __init__(self, shape, batch, index_map, batching, window, window_dims):
        self.shape = list(shape)
        self.batch = list(batch)
        self.index_map = list(index_map)
        self.batching = dict(batching)
        self.window = list(window)
        self.window_dims = list(window_dims)
        rank = len(shape)
        self.free = [
            d
            for d in range(rank)
            if d in self.window_dims
            and d not in self.index_map
            and _same(self.window[d], self.shape[d])
        ]
        if len(self.free) == rank:  # GatherND needs at least one indexed dim
            self.free = self.free[1:]
        self.indexed = [d for d in range(rank) if d not in self.free]
        self.kept = [d for d in self.indexed if d in self.window_dims]
        self.perm = self.indexed + self.free

    @property
    def grid(self) -> list[Any]:
        return self.batch + [self.window[d] for d in self.kept]

    def last_start(self, ctx, d: int) -> ir.Value:
        """The largest in-bounds window start along operand dim ``d`` (a scalar)."""
        hi = self.shape[d] - self.window[d]
        k = static_dim(hi)
        return ctx.i64(max(k, 0)) if k is not None else _scalar(ctx, hi)

    def starts(self, ctx, idx):
        """Per index-vector entry: the raw start (int64, batch-shaped)."""
        nb = len(self.batch)
        out = []
        axis = ctx.i64([nb])
        if len(self.index_map) == 1:
            return [ctx.op("Squeeze", [idx, axis])]
        for k in range(len(self.index_map)):
            part = ctx.op("Slice", [idx, ctx.i64([k]), ctx.i64([k + 1]), axis])
            out.append(ctx.op("Squeeze", [part, axis]))
        return out

    def in_bounds(self, ctx, raw):
        """Boolean, batch-shaped: every window start lies in ``[0, dim - window]``."""
        mask = None
        for k, d in enumerate(self.index_map):
            ok = ctx.op(
                "And",
                [
                    ctx.op("GreaterOrEqual", [raw[k], ctx.i64(0)]),
                    ctx.op("LessOrEqual", [raw[k], self.last_start(ctx, d)]),
                ],
            )
            mask = ok if mask is None else ctx.op("And", [mask, ok])
        return mask

    def index_tensor(self, ctx, raw, redirect=None):
        """The full ``[*grid, len(indexed)]`` int64 index tensor (starts clamped).

        ``redirect`` (batch-shaped bool) sends a window's first indexed coordinate past the
        end of that dim (into padding the caller adds), for dropped scatter updates.
        """
        nb = len(self.batch)
        grid = self.grid
        rank = len(grid)
        pieces = []
        for pos, d in enumerate(self.indexed):
            if d in self.index_map:
                k = self.index_map.index(d)
                hi = self.last_start(ctx, d)
                start = ctx.op("Max", [ctx.op("Min", [raw[k], hi]), ctx.i64(0)])
                if pos == 0 and redirect is not None:
                    start = ctx.op("Where", [redirect, start, _scalar(ctx, self.shape[d])])
                if rank > nb:
                    start = ctx.op("Unsqueeze", [start, ctx.i64(list(range(nb, rank)))])
            else:
                view = [1] * rank
                if d in self.batching:
                    b = self.batching[d]
                    n = static_dim(self.batch[b])
                    if n is not None:
                        view[b] = n
                        start = ctx.i64(np.arange(n, dtype=np.int64).reshape(view))
                    else:
                        view[b] = -1
                        one = ctx.i64(1)
                        iota = ctx.op("Range", [ctx.i64(0), _scalar(ctx, self.batch[b]), one])
                        start = ctx.op("Reshape", [iota, ctx.i64(view)])
                else:
                    start = ctx.i64(np.zeros(view, np.int64))
                if pos == 0 and redirect is not None:
                    past = _scalar(ctx, self.shape[d])
                    start = ctx.op("Where", [_unsq(ctx, redirect, nb, rank), start, past])
            if d in self.kept:
                p = nb + self.kept.index(d)
                view = [1] * rank
                view[p] = _static(self.window[d], "a partial gather/scatter window")
                offset = ctx.i64(np.arange(view[p], dtype=np.int64).reshape(view))
                start = ctx.op("Add", [start, offset])
            full = ctx.op("Expand", [start, shape_value(ctx, grid)])
            pieces.append(ctx.op("Unsqueeze", [full, ctx.i64([rank])]))
        if len(pieces) == 1:
            return pieces[0]
        return ctx.op("Concat", pieces, {"axis": -1})


def _unsq(ctx, mask, nb: int, rank: int):
    return ctx.op("Unsqueeze", [mask, ctx.i64(list(range(nb, rank)))]) if rank > nb else mask


def _int64_indices(ctx, idx, ishape):
    if not ishape:  # jax always gives the index vector its own (last) dim
        raise ConversionError("gather/scatter with scalar indices is not supported")
    return ctx.op("Cast", [idx], {"to": ir.DataType.INT64})


# --- gather ------------------------------------------------------------------------------


@builtin("gather")
def _gather(ctx, eqn, inputs):
    """gather(operand, indices; dimension_numbers, slice_sizes, mode, fill_value)."""
    dn = eqn.params["dimension_numbers"]
    offset = [int(d) for d in dn.offset_dims]
    collapsed = [int(d) for d in dn.collapsed_slice_dims]
    index_map = [int(d) for d in dn.start_index_map]
    obd = [int(d) for d in getattr(dn, "operand_batching_dims", ())]
    sibd = [int(d) for d in getattr(dn, "start_indices_batching_dims", ())]
    sizes = list(as_dims(eqn.params["slice_sizes"]))
    shape = dims(eqn.invars[0])
    ishape = dims(eqn.invars[1])
    mode = _mode(eqn)
    x, idx = inputs
    idx = _int64_indices(ctx, idx, ishape)
    batch = list(ishape[:-1])
    window_dims = [d for d in range(len(shape)) if d not in collapsed and d not in obd]
    plan = _Plan(shape, batch, index_map, zip(obd, sibd, strict=True), sizes, window_dims)
    raw = plan.starts(ctx, idx)
    mask = plan.in_bounds(ctx, raw) if mode == "FILL_OR_DROP" and index_map else None

    simple = (
        not obd
        and len(index_map) == 1
        and collapsed == index_map
        and all(_same(sizes[d], shape[d]) for d in range(len(shape)) if d not in index_map)
    )
    if simple:  # a take along one axis: one Gather (keeps embedding lookups recognisable)
        a = index_map[0]
        start = ctx.op("Max", [ctx.op("Min", [raw[0], plan.last_start(ctx, a)]), ctx.i64(0)])
        y = ctx.op("Gather", [x, start], {"axis": a})
        onnx_order = [("w", d) for d in range(a)] + [("b", i) for i in range(len(batch))]
        onnx_order += [("w", d) for d in range(a + 1, len(shape))]
    else:
        xt = _transpose(ctx, x, plan.perm)
        y = ctx.op("GatherND", [xt, plan.index_tensor(ctx, raw)])
        onnx_order = [("b", i) for i in range(len(batch))]
        onnx_order += [("w", d) for d in plan.kept + plan.free]
    if mask is not None:
        dtype = np.dtype(eqn.outvars[0].aval.dtype)
        fill = eqn.params.get("fill_value")
        fill = _default_fill(dtype) if fill is None else fill
        # The mask is batch-shaped; the batch dims sit together in ONNX's order.
        around = [i for i, t in enumerate(onnx_order) if t[0] == "w"]
        m = ctx.op("Unsqueeze", [mask, ctx.i64(around)]) if around else mask
        y = ctx.op("Where", [m, y, ctx.const(np.asarray(fill, dtype))])
    jax_order = []
    b = o = 0
    for pos in range(len(batch) + len(offset)):
        if pos in offset:
            jax_order.append(("w", window_dims[o]))
            o += 1
        else:
            jax_order.append(("b", b))
            b += 1
    return [_transpose(ctx, y, [onnx_order.index(t) for t in jax_order])]


# --- scatter -----------------------------------------------------------------------------

_REDUCTION = {
    "scatter": "none",
    "scatter-add": "add",
    "scatter_add": "add",
    "scatter-sub": "add",
    "scatter_sub": "add",
    "scatter-mul": "mul",
    "scatter_mul": "mul",
    "scatter-min": "min",
    "scatter_min": "min",
    "scatter-max": "max",
    "scatter_max": "max",
}


@builtin(*_REDUCTION)
def _scatter(ctx, eqn, inputs):
    """scatter[-add|-sub|-mul|-min|-max](operand, indices, updates; dimension_numbers, mode)."""
    name = eqn.primitive.name
    dn = eqn.params["dimension_numbers"]
    uwd = [int(d) for d in dn.update_window_dims]
    inserted = [int(d) for d in dn.inserted_window_dims]
    index_map = [int(d) for d in dn.scatter_dims_to_operand_dims]
    obd = [int(d) for d in getattr(dn, "operand_batching_dims", ())]
    sibd = [int(d) for d in getattr(dn, "scatter_indices_batching_dims", ())]
    shape = dims(eqn.invars[0])
    ishape = dims(eqn.invars[1])
    ushape = dims(eqn.invars[2])
    mode = _mode(eqn)
    x, idx, upd = inputs
    if name == "scatter" and eqn.params.get("update_jaxpr") is not None:
        return _scatter_apply(ctx, eqn, inputs)
    idx = _int64_indices(ctx, idx, ishape)
    batch = list(ishape[:-1])
    window_dims = [d for d in range(len(shape)) if d not in inserted and d not in obd]
    window = [1] * len(shape)
    for d, u in zip(window_dims, uwd, strict=True):
        window[d] = ushape[u]
    plan = _Plan(shape, batch, index_map, zip(obd, sibd, strict=True), window, window_dims)
    raw = plan.starts(ctx, idx)
    drop = mode != "CLIP" and bool(index_map)
    mask = plan.in_bounds(ctx, raw) if drop else None
    indices = plan.index_tensor(ctx, raw, redirect=mask)

    # Updates: [*scatter dims, *window dims] in jax's order -> [*batch, *kept, *free].
    scatter_dims = [u for u in range(len(ushape)) if u not in uwd]
    to_window = dict(zip(window_dims, uwd, strict=True))
    uperm = scatter_dims + [to_window[d] for d in plan.kept + plan.free]
    upd = _transpose(ctx, upd, uperm)
    if name in ("scatter-sub", "scatter_sub"):
        upd = ctx.op("Neg", [upd])
    xt = _transpose(ctx, x, plan.perm)
    lead = plan.indexed[0]
    if drop:  # dropped windows land in padding past the end of the first indexed dim
        pad = [0] * (2 * len(shape))
        pad[len(shape)] = _static(plan.window[lead], "a scatter window")
        xt = ctx.op("Pad", [xt, ctx.i64(pad)])
    y = ctx.op("ScatterND", [xt, indices, upd], {"reduction": _REDUCTION[name]})
    if drop:
        end = dim_value(ctx, shape[lead])
        y = ctx.op("Slice", [y, ctx.i64([0]), end, ctx.i64([0])])
    return [_transpose(ctx, y, _inverse(plan.perm))]


def _scatter_apply(ctx, eqn, inputs):
    raise ConversionError(
        "scatter with an update function (x.at[i].apply(f)) is not supported; use "
        ".at[i].set(f(x[i])) instead"
    )


# --- assembly ----------------------------------------------------------------------------


@builtin("stack")
def _stack(ctx, eqn, inputs):
    axis = int(eqn.params["axis"])
    parts = [ctx.op("Unsqueeze", [v, ctx.i64([axis])]) for v in inputs]
    if len(parts) == 1:
        return parts
    return [ctx.op("Concat", parts, {"axis": axis})]


@builtin("tile")
def _tile(ctx, eqn, inputs):
    reps = [int(r) for r in eqn.params["reps"]]
    return [ctx.op("Tile", [inputs[0], ctx.i64(reps)])]
