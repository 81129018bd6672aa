"""PyTorch source templates for reductions, shape and indexing ops. Importing this module
registers them in ``templates.registry``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from xconv.converters import expressions as ex
from xconv.converters.codegen import int_tuple, reshape_dims, scalar_literal
from xconv.converters.registry import REQUIRED
from xconv.converters.torch.source.templates import (
    INT64_MAX,
    WIDE_UNSIGNED,
    OpCall,
    dtype_expr,
    registry,
    template,
)

# ---------------------------------------------------------------- reductions

_REDUCE = {
    "ReduceMean": "torch.mean({x}, dim={d}, keepdim={k})",
    "ReduceSum": "torch.sum({x}, dim={d}, keepdim={k})",
    "ReduceMax": "torch.amax({x}, dim={d}, keepdim={k})",
    "ReduceMin": "torch.amin({x}, dim={d}, keepdim={k})",
    "ReduceSumSquare": "torch.sum(torch.square({x}), dim={d}, keepdim={k})",
    "ReduceL1": "torch.sum(torch.abs({x}), dim={d}, keepdim={k})",
    "ReduceL2": "torch.sqrt(torch.sum(torch.square({x}), dim={d}, keepdim={k}))",
    "ReduceLogSumExp": "torch.logsumexp({x}, dim={d}, keepdim={k})",
    "ReduceLogSum": "torch.log(torch.sum({x}, dim={d}, keepdim={k}))",
    "ReduceProd": "torch.prod({x}, dim={d}, keepdim={k})",
}

#: What noop_with_empty_axes keeps of each reduction over no axes: its elementwise part
#: (``xconv.converters.ops.reduce``), the input itself for the others.
_KEPT = {
    "ReduceSumSquare": "torch.square({x})",
    "ReduceL1": "torch.abs({x})",
    "ReduceL2": "torch.sqrt(torch.square({x}))",
    "ReduceLogSumExp": "torch.log(torch.exp({x}))",
    "ReduceLogSum": "torch.log({x})",
}


def _kept(c: OpCall) -> str:
    return _KEPT.get(c.node.op_type, "{x}").format(x=c.args[0])


registry.helpers["dims"] = '''
def _dims(axes, x):
    """ONNX reduction axes computed at run time as torch's dim: all of x's axes when empty."""
    return tuple(axes.tolist()) or tuple(range(x.dim()))
'''


registry.helpers["reduce_prod"] = '''
def _reduce_prod(x, dims, keepdim):
    """torch.prod over several axes (it takes one), the last first."""
    for d in sorted((d % x.dim() for d in dims), reverse=True):
        x = torch.prod(x, dim=d, keepdim=keepdim)
    return x
'''


def _empty_extreme(c: OpCall, dims: str) -> str:
    """ReduceMax / ReduceMin of an empty input (torch.amax / amin refuse one): ONNX's value
    over the empty set (-inf / inf, the dtype's lowest / highest) in the reduction's shape."""
    low = c.node.op_type == "ReduceMax"
    dtype = c.node.inputs[0].dtype
    if dtype is not None and dtype.is_floating_point():
        fill, cast = f'float("{"-" if low else ""}inf")', ""
    elif dtype == ir.DataType.BOOL:
        fill, cast = str(not low), ", dtype=torch.bool"
    else:
        t = dtype_expr(dtype)
        fill, cast = f"torch.iinfo({t}).{'min' if low else 'max'}", f", dtype={t}"
    shaped = f"torch.sum({c.args[0]}, dim={dims}, keepdim={bool(c.attrs['keepdims'])})"
    return f"torch.full_like({shaped.replace(', keepdim=False', '')}, {fill}{cast})"


def _runtime_axes(c: OpCall, fmt: str) -> str:
    """A reduction over axes the graph computes: ``dim=_dims(axes, x)`` (torch reduces over a
    tuple of any length, and ``.tolist()`` reads them as the ONNX runtime does); with
    noop_with_empty_axes, the elementwise part when they are empty."""
    c.helpers.add("dims")
    x, axes = c.args[0], c.args[1]
    if c.node.op_type in ("ReduceMax", "ReduceMin") and 0 in (c.shapes[0] or ()):
        out = _empty_extreme(c, f"_dims({axes}, {x})")
    elif c.node.op_type == "ReduceProd":  # torch.prod takes one axis: a generated loop
        c.helpers.add("reduce_prod")
        out = f"_reduce_prod({x}, _dims({axes}, {x}), {bool(c.attrs['keepdims'])})"
    else:
        out = fmt.format(x=x, d=f"_dims({axes}, {x})", k=bool(c.attrs["keepdims"]))
    out = out.replace(", keepdim=False", "")
    if not c.attrs["noop_with_empty_axes"]:
        return out
    return f"({_kept(c)} if {axes}.numel() == 0 else {out})"


def _reduce(fmt: str) -> Callable[[OpCall], str]:
    def fn(c: OpCall) -> str:
        if c.has(1) and c.consts[1] is None:
            return _runtime_axes(c, fmt)
        axes = c.const(1, "axes") if c.has(1) else None
        if axes is None or np.asarray(axes).size == 0:
            if c.attrs["noop_with_empty_axes"]:
                return _kept(c)
            axes = np.arange(c.need_rank())
        ax = [int(a) for a in np.asarray(axes).reshape(-1)]
        d = str(ax[0]) if len(ax) == 1 else int_tuple(ax)
        shape = c.shapes[0]
        empty = shape is not None and any(shape[a] == 0 for a in ax)
        if c.node.op_type in ("ReduceMax", "ReduceMin") and empty:
            return _empty_extreme(c, d)
        if c.node.op_type == "ReduceProd":  # torch.prod takes one axis: the last first
            r = c.need_rank()
            x, k = c.args[0], bool(c.attrs["keepdims"])
            for a in sorted({a % r for a in ax}, reverse=True):
                x = fmt.format(x=x, d=a, k=k).replace(", keepdim=False", "")
            return x
        out = fmt.format(x=c.args[0], d=d, k=bool(c.attrs["keepdims"]))
        return out.replace(", keepdim=False", "")  # torch's default

    return fn


for _op, _fmt in _REDUCE.items():
    registry.builtin(_op, attrs={"keepdims": 1, "noop_with_empty_axes": 0})(_reduce(_fmt))


registry.helpers["center_crop_pad"] = '''
def _center_crop_pad(x, shape, axes=None):
    """ONNX CenterCropPad: each axis (of ``axes``) cut to ``shape`` around its centre, or
    zero-padded around it."""
    index, widths = [slice(None)] * x.dim(), [(0, 0)] * x.dim()
    axes = range(x.dim()) if axes is None else [a % x.dim() for a in axes]
    for a, size in zip(axes, shape, strict=True):
        n = x.shape[a]
        if size < n:
            index[a] = slice((n - size) // 2, (n - size) // 2 + size)
        elif size > n:
            widths[a] = ((size - n) // 2, size - n - (size - n) // 2)
    return F.pad(x[tuple(index)], [v for pair in reversed(widths) for v in pair])
'''


@template("CenterCropPad", axes=None)
def _center_crop_pad(c: OpCall) -> str:
    c.helpers.add("center_crop_pad")
    axes = c.attrs["axes"]
    tail = "" if axes is None else f", axes={tuple(int(a) for a in axes)}"
    return f"_center_crop_pad({c.args[0]}, {c.ints(1)}{tail})"


@template("Compress", axis=None)
def _compress(c: OpCall) -> str:
    """The slices where the condition holds."""
    keep = f"torch.nonzero({c.args[1]}.reshape(-1)).reshape(-1)"
    if c.attrs["axis"] is None:
        return f"{c.args[0]}.reshape(-1)[{keep}]"
    return f"torch.index_select({c.args[0]}, {int(c.attrs['axis'])}, {keep})"


@template("NonZero")
def _non_zero(c: OpCall) -> str:
    """The indices of the nonzero elements, (rank, count)."""
    return f"torch.nonzero({c.args[0]}).T"


registry.helpers["cosine_window"] = ex.COSINE_WINDOW


@template("HannWindow", "HammingWindow", "BlackmanWindow", output_datatype=1, periodic=1)
def _window(c: OpCall) -> str:
    n = f"int({c.args[0]})" if c.consts[0] is None else int(np.asarray(c.consts[0]).reshape(-1)[0])
    return f"torch.as_tensor({ex.window_call(c, str(n))}).to({c.dtype()})"


@template("EyeLike", dtype=None, k=0)
def _eye_like(c: OpCall) -> str:
    x, k = c.args[0], int(c.attrs["k"])
    dt = dtype_expr(c.node.outputs[0].dtype)
    if k == 0:
        return f"torch.eye(*{x}.shape, dtype={dt}, device={x}.device)"
    return f"torch.ones_like({x}, dtype={dt}).tril({k}).triu({k})"


@template("DepthToSpace", blocksize=REQUIRED, mode="DCR")
def _depth_to_space(c: OpCall) -> str:
    if c.attrs["mode"] == "CRD":  # torch's pixel shuffle orders channels so
        return f"F.pixel_shuffle({c.args[0]}, {int(c.attrs['blocksize'])})"
    return ex.block_rearrange(c, "permute")


@template("SpaceToDepth", blocksize=REQUIRED, mode="DCR")
def _space_to_depth(c: OpCall) -> str:
    return ex.block_rearrange(c, "permute")


@template("ArgMax", "ArgMin", axis=0, keepdims=1, select_last_index=0)
def _arg(c: OpCall) -> str:
    fn = "torch.argmax" if c.node.op_type == "ArgMax" else "torch.argmin"
    x, a = c.args[0], c.attrs["axis"]
    tail = f", dim={a}, keepdim={bool(c.attrs['keepdims'])})"
    if c.attrs["select_last_index"]:  # the first extremum of the reversed axis
        return f"({x}.shape[{a}] - 1 - {fn}(torch.flip({x}, ({a},)){tail})"
    return f"{fn}({x}{tail}"


registry.helpers["cumulative"] = '''
def _cumulative(x, dim, fn, identity, exclusive=False, reverse=False):
    """ONNX CumSum / CumProd: ``fn`` (torch.cumsum / torch.cumprod) along ``dim`` in x's
    dtype, from the end when ``reverse``, each output leaving its own element out when
    ``exclusive``."""
    if reverse:
        x = torch.flip(x, (dim,))
    if exclusive:
        head = torch.full_like(x.narrow(dim, 0, 1), identity)
        x = torch.cat([head, x.narrow(dim, 0, x.shape[dim] - 1)], dim)
    y = fn(x, dim=dim, dtype=x.dtype)
    return torch.flip(y, (dim,)) if reverse else y
'''


@template("CumSum", "CumProd", exclusive=0, reverse=0)
def _cumulative(c: OpCall) -> str:
    const = c.consts[1]
    axis = str(int(np.asarray(const).reshape(()))) if const is not None else f"int({c.args[1]})"
    fn, identity = ("torch.cumsum", 0) if c.node.op_type == "CumSum" else ("torch.cumprod", 1)
    if c.attrs["exclusive"] or c.attrs["reverse"]:
        c.helpers.add("cumulative")
        flags = "".join(f", {k}=True" for k in ("exclusive", "reverse") if c.attrs[k])
        return f"_cumulative({c.args[0]}, {axis}, {fn}, {identity}{flags})"
    dtype = c.node.inputs[0].dtype  # torch sums and multiplies integers in int64
    keep = "" if dtype is None or dtype.is_floating_point() else f", dtype={dtype_expr(dtype)}"
    return f"{fn}({c.args[0]}, dim={axis}{keep})"


registry.helpers["topk"] = '''
def _topk(x, k, dim, largest):
    """ONNX TopK: the k largest (or smallest) along ``dim``, equal values in index order
    (a stable sort; torch.topk leaves the order of ties unspecified)."""
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)
'''


@template("TopK", axis=-1, largest=1, sorted=1)
def _topk(c: OpCall) -> str:
    if c.node.inputs[0].dtype in WIDE_UNSIGNED:
        raise c.fail(f"TopK of {c.node.inputs[0].dtype} (torch has no sort kernel for it)")
    const = c.consts[1]
    k = int(np.asarray(const).reshape(-1)[0]) if const is not None else f"int({c.args[1]})"
    c.helpers.add("topk")
    return f"_topk({c.args[0]}, {k}, {c.attrs['axis']}, largest={bool(c.attrs['largest'])})"


# ---------------------------------------------------------------- shape


@template("Shape", start=0, end=None)
def _shape(c: OpCall) -> str:
    s, e = c.attrs["start"], c.attrs["end"]
    sl = "" if s == 0 and e is None else f"[{s}:{'' if e is None else e}]"
    return f"torch.tensor({c.args[0]}.shape{sl}, dtype=torch.int64)"


@template("Size")
def _size(c: OpCall) -> str:
    return f"torch.tensor({c.args[0]}.numel(), dtype=torch.int64)"


@template("Reshape", allowzero=0)
def _reshape(c: OpCall) -> str:
    if c.consts[1] is None:
        if c.attrs["allowzero"]:
            return f"{c.args[0]}.reshape({c.args[1]}.tolist())"
        # A 0 in a shape computed at run time copies the input's dimension (allowzero=0).
        x = c.args[0]
        return f"{x}.reshape([{x}.shape[i] if d == 0 else d for i, d in enumerate({c.args[1]}.tolist())])"
    target = np.asarray(c.consts[1]).reshape(-1)
    if not target.size:  # to a scalar: reshape() takes no empty argument list
        return f"{c.args[0]}.reshape(())"
    dims = reshape_dims(c.args[0], c.shapes[0], target, c.attrs["allowzero"])
    if len(dims) == 1 and dims[0].startswith("*"):
        return f"{c.args[0]}.reshape({dims[0][1:]})"  # the input's leading dims
    return f"{c.args[0]}.reshape({', '.join(dims)})"


@template("Flatten", axis=1)
def _flatten(c: OpCall) -> str:
    a = c.attrs["axis"]
    if a < 0:
        a += c.need_rank()
    if a == 0:
        return f"{c.args[0]}.reshape(1, -1)"
    if a == c.rank():  # every dimension before the axis: (size, 1); flatten(a) would refuse
        return f"{c.args[0]}.reshape(-1, 1)"
    if a == 1:
        return f"{c.args[0]}.flatten(1)"
    return f"{c.args[0]}.flatten(0, {a - 1}).flatten(1)"


@template("Transpose", perm=None)
def _transpose(c: OpCall) -> str:
    perm = c.attrs["perm"]
    if perm is None:
        perm = list(range(c.need_rank()))[::-1]
    return f"{c.args[0]}.permute({', '.join(str(int(p)) for p in perm)})"


@template("Concat", axis=REQUIRED)
def _concat(c: OpCall) -> str:
    return f"torch.cat([{', '.join(a for a in c.args if a)}], dim={c.attrs['axis']})"


@template("Squeeze")
def _squeeze(c: OpCall) -> str:
    if not c.has(1):
        return f"{c.args[0]}.squeeze()"
    if c.consts[1] is None:  # axes computed at run time
        return f"{c.args[0]}.squeeze(tuple({c.args[1]}.tolist()))"
    axes = [int(a) for a in np.asarray(c.const(1, "axes")).reshape(-1)]
    return f"{c.args[0]}.squeeze({axes[0] if len(axes) == 1 else int_tuple(axes)})"


registry.helpers["unsqueeze"] = '''
def _unsqueeze(x, axes):
    """ONNX Unsqueeze with axes computed at run time (counted in the output's rank)."""
    rank = x.dim() + axes.numel()
    for a in sorted(int(a) % rank for a in axes.tolist()):
        x = x.unsqueeze(a)
    return x
'''


@template("Unsqueeze")
def _unsqueeze(c: OpCall) -> str:
    if c.consts[1] is None:
        c.helpers.add("unsqueeze")
        return f"_unsqueeze({c.args[0]}, {c.args[1]})"
    axes = [int(a) for a in np.asarray(c.const(1, "axes")).reshape(-1)]
    r = c.rank()
    if r is None and any(a < 0 for a in axes) and len(axes) > 1:
        raise c.fail("negative axes on an input of unknown rank")
    out_rank = (r or 0) + len(axes)
    expr = c.args[0]
    # One negative axis of an unknown rank stays negative: torch counts it from the output's
    # end, as ONNX does.
    for a in sorted(a + out_rank if a < 0 and r is not None else a for a in axes):
        expr = f"{expr}.unsqueeze({a})"
    return expr


@template("Expand")
def _expand(c: OpCall) -> str:
    return f"{c.args[0]}.expand(torch.broadcast_shapes({c.args[0]}.shape, {c.ints(1)}))"


@template("Tile")
def _tile(c: OpCall) -> str:
    return f"{c.args[0]}.repeat({c.ints(1)})"


registry.helpers["slice"] = '''
def _slice(x, starts, ends, axes=None, steps=None):
    """ONNX Slice with bounds computed at run time: Python's slice clamps them as ONNX does;
    a negative step (which torch's indexing lacks) picks its indices."""
    starts, ends = starts.tolist(), ends.tolist()
    axes = range(len(starts)) if axes is None else axes.tolist()
    steps = [1] * len(starts) if steps is None else steps.tolist()
    for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
        if st > 0:
            x = x[(slice(None),) * (a % x.dim()) + (slice(s, e, st),)]
        else:
            picked = range(*slice(s, e, st).indices(x.shape[a]))
            x = torch.index_select(x, a, torch.tensor(picked, dtype=torch.int64, device=x.device))
    return x
'''


@template("Slice")
def _slice(c: OpCall) -> str:
    if any(c.has(i) and c.consts[i] is None for i in range(1, 5)):
        c.helpers.add("slice")
        args = [c.args[i] if c.has(i) else "None" for i in range(5)]
        while args[-1] == "None":
            args.pop()
        return f"_slice({', '.join(args)})"
    starts = np.asarray(c.const(1, "starts")).reshape(-1)
    ends = np.asarray(c.const(2, "ends")).reshape(-1)
    r = c.need_rank()
    axes = np.asarray(c.const(3, "axes")).reshape(-1) if c.has(3) else np.arange(len(starts))
    steps = np.asarray(c.const(4, "steps")).reshape(-1) if c.has(4) else np.ones_like(starts)
    index = [":"] * r
    dims = c.shapes[0]
    flips = []
    for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
        a = int(a) + r if a < 0 else int(a)
        s, e, st = int(s), int(e), int(st)
        dim = dims[a] if dims is not None else None
        if st < 0:
            # torch has no negative steps: flip the axis, then slice forward. ONNX clamps a
            # negative-step start into [0, dim - 1] and its end into [-1, dim - 1].
            if not isinstance(dim, int):
                raise c.fail("a negative Slice step needs the axis size")
            s = min(max(s + dim if s < 0 else s, 0), dim - 1)
            e = min(max(e + dim if e < 0 else e, -1), dim - 1)
            flips.append(a)
            s, e, st = dim - 1 - s, dim - 1 - e, -st
        if isinstance(dim, int):
            s = min(max(s + dim if s < 0 else s, 0), dim)
            e = min(max(e + dim if e < 0 else e, 0), dim)
            e = max(e, s)
            if s == 0 and e == dim and st == 1:
                continue
        elif e >= INT64_MAX // 2:
            e = None
        text = f"{s or ''}:{'' if e is None or e == dim else e}"
        if st != 1:
            text += f":{st}"
        index[a] = text
    while index and index[-1] == ":":
        index.pop()
    base = f"{c.args[0]}.flip({int_tuple(flips)})" if flips else c.args[0]
    if not index:
        return base
    return f"{base}[{', '.join(index)}]"


@template("GatherND", batch_dims=0)
def _gather_nd(c: OpCall) -> str:
    if c.attrs["batch_dims"]:
        raise c.fail("batch_dims > 0 is not supported")
    # The last index axis picks one coordinate per leading data axis (negatives wrap in both).
    return f"{c.args[0]}[{c.args[1]}.long().unbind(-1)]"


@template("Gather", axis=0)
def _gather(c: OpCall) -> str:
    a = c.attrs["axis"]
    if a < 0:
        a += c.need_rank()
    idx = c.args[1]
    if c.consts[1] is not None:
        idx_arr = np.asarray(c.consts[1])
        dims = c.shapes[0]
        if idx_arr.ndim == 0:
            i = int(idx_arr)
            if dims is not None and isinstance(dims[a], int) and i < 0:
                i += dims[a]
            idx = str(i)
    return f"{c.args[0]}[{':, ' * a}{idx}]"


def _along(c: OpCall, a: int) -> str:
    """Input 1's indices along axis ``a`` of input 0, as torch's gather / scatter take them:
    int64, negatives (ONNX counts them from the end) wrapped."""
    idx, const = c.args[1], c.consts[1]
    if const is None or (np.asarray(const) < 0).any():
        idx = f"({idx} % {c.args[0]}.shape[{a}])"
    return f"{idx}.long()"


@template("GatherElements", axis=0)
def _gather_elements(c: OpCall) -> str:
    a = c.attrs["axis"]
    return f"torch.gather({c.args[0]}, {a}, {_along(c, a)})"


#: ONNX's scatter reductions as ``Tensor.scatter_reduce``'s.
_SCATTER_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _scatter_reduction(c: OpCall) -> str:
    reduction = c.attrs["reduction"]
    if reduction != "none" and reduction not in _SCATTER_REDUCE:
        raise c.fail(f"reduction={reduction!r}; ONNX defines none, add, mul, max, min")
    return reduction


@template("ScatterElements", axis=0, reduction="none")
def _scatter_elements(c: OpCall) -> str:
    a, reduction = c.attrs["axis"], _scatter_reduction(c)
    x, u = c.args[0], c.args[2]
    if reduction == "none":
        return f"torch.scatter({x}, {a}, {_along(c, a)}, {u})"
    how = _SCATTER_REDUCE[reduction]
    return f'torch.scatter_reduce({x}, {a}, {_along(c, a)}, {u}, "{how}")'


registry.helpers["scatter_nd_reduce"] = '''
def _scatter_nd_reduce(x, indices, updates, reduce):
    """ONNX ScatterND with reduction mul / max / min: each row of x at an index tuple along
    the last axis of ``indices`` (negatives count from the end) combined with its updates by
    ``reduce`` (Tensor.index_reduce's "prod", "amax", "amin"; x's own value included)."""
    k = indices.shape[-1]
    rows = torch.zeros(indices.shape[:-1], dtype=torch.int64, device=x.device)
    for i in range(k):  # the index tuples as row numbers of x flattened over its first k axes
        rows = rows * x.shape[i] + indices[..., i].long() % x.shape[i]
    flat, updates = x.flatten(0, k - 1), updates.reshape(-1, *x.shape[k:])
    return flat.index_reduce(0, rows.reshape(-1), updates, reduce).reshape(x.shape)
'''


@template("ScatterND", reduction="none")
def _scatter_nd(c: OpCall) -> str:
    """``index_put`` at the index tuples along the last axis of ``indices`` (torch indexes
    with negatives as ONNX does); ``add`` accumulates; mul, max and min are the generated
    ``_scatter_nd_reduce`` (``Tensor.index_reduce`` over x's flattened rows)."""
    reduction = _scatter_reduction(c)
    if reduction in ("none", "add"):
        acc = ", accumulate=True" if reduction == "add" else ""
        return f"{c.args[0]}.index_put({c.args[1]}.long().unbind(-1), {c.args[2]}{acc})"
    if c.node.inputs[0].dtype == ir.DataType.BOOL:
        raise c.fail(f"ScatterND reduction={reduction!r} of bool (index_reduce has no kernel)")
    c.helpers.add("scatter_nd_reduce")
    how = _SCATTER_REDUCE[reduction]
    return f'_scatter_nd_reduce({c.args[0]}, {c.args[1]}, {c.args[2]}, "{how}")'


registry.helpers["reverse_sequence"] = '''
def _reverse_sequence(x, lens, batch_axis, time_axis):
    """ONNX ReverseSequence: each batch entry's first lens[b] steps along ``time_axis`` in
    reverse order, the steps after them as they are."""
    t = torch.arange(x.shape[time_axis], device=x.device)
    shape = [1] * x.dim()
    shape[time_axis] = -1
    t = t.view(shape)
    shape[time_axis], shape[batch_axis] = 1, -1
    lens = lens.to(t.dtype).view(shape)
    order = torch.where(t < lens, lens - 1 - t, t)
    return torch.gather(x, time_axis, order.expand(x.shape))
'''


registry.builtin("ReverseSequence", attrs={"batch_axis": 1, "time_axis": 0})(
    ex.reverse_sequence_call
)


registry.helpers["one_hot"] = '''
def _one_hot(indices, depth, values, axis):
    """ONNX OneHot: values[1] at the index along ``axis`` (a negative index counts from
    ``depth``), values[0] elsewhere and for an index out of range."""
    depth, indices = int(depth), indices.long()
    indices = torch.where(indices < 0, indices + depth, indices)
    axis = axis % (indices.dim() + 1)
    classes = torch.arange(depth, device=indices.device)
    hot = indices.unsqueeze(axis) == classes.view([-1] + [1] * (indices.dim() - axis))
    return torch.where(hot, values[1], values[0])
'''


@template("OneHot", axis=-1)
def _one_hot(c: OpCall) -> str:
    c.helpers.add("one_hot")
    return f"_one_hot({c.args[0]}, {c.args[1]}, {c.args[2]}, {c.attrs['axis']})"


def _split_sizes(c: OpCall, n: int, dim: int) -> str:
    if c.has(1):
        return c.ints(1)
    size = -(-dim // n)
    return "[" + ", ".join(str(min(size, dim - i * size)) for i in range(n)) + "]"


@template("Split", axis=0, num_outputs=None)
def _split(c: OpCall) -> str:
    n, a = len(c.node.outputs), c.attrs["axis"]
    dim = None if c.shapes[0] is None else c.shapes[0][a]
    if dim is None and not c.has(1):  # torch.chunk's pieces are ONNX's: ceil(dim / n) each
        expr = f"torch.chunk({c.args[0]}, {n}, dim={a})"
    else:
        expr = f"torch.split({c.args[0]}, {_split_sizes(c, n, dim)}, dim={a})"
    return f"{expr}[0]" if n == 1 else expr  # one piece: the tensor, not a 1-tuple


#: ONNX Pad's modes as F.pad's.
_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}

registry.helpers["pad"] = '''
def _pad(x, pads, mode="constant", value=None, axes=None):
    """ONNX Pad with pads (or axes) computed at run time: F.pad's (begin, end) pairs from the
    last axis down to the first padded one."""
    r, pads = x.dim(), [int(p) for p in pads.tolist()]
    axes = range(r) if axes is None else [int(a) % r for a in axes.tolist()]
    width = dict(zip(axes, zip(pads[: len(pads) // 2], pads[len(pads) // 2 :])))
    first = min((a for a, w in width.items() if w != (0, 0)), default=r)
    flat = []
    for a in range(r - 1, first - 1, -1):
        flat += width.get(a, (0, 0))
    if mode != "constant":
        return F.pad(x, flat, mode=mode)
    return F.pad(x, flat, value=0 if value is None else value.item())
'''


def _runtime_pad(c: OpCall, mode: str) -> str:
    c.helpers.add("pad")
    args = [c.args[0], c.args[1]]
    if mode != "constant":
        args.append(f'mode="{mode}"')
    elif c.has(2):
        args.append(f"value={c.args[2]}")
    if c.has(3):
        args.append(f"axes={c.args[3]}")
    return f"_pad({', '.join(args)})"


@template("Pad", mode="constant")
def _pad(c: OpCall) -> str:
    m = _PAD_MODES.get(c.attrs["mode"])
    if m is None:
        raise c.fail(f"mode={c.attrs['mode']!r}; supported: {sorted(_PAD_MODES)}")
    if c.consts[1] is None or (c.has(3) and c.consts[3] is None):
        return _runtime_pad(c, m)
    pads = [int(p) for p in np.asarray(c.const(1, "pads")).reshape(-1)]
    r = c.need_rank()
    axes = (
        [int(a) + r if a < 0 else int(a) for a in np.asarray(c.const(3, "axes")).reshape(-1)]
        if c.has(3)
        else list(range(r))
    )
    n = len(axes)
    per_axis = {a: (pads[i], pads[i + n]) for i, a in enumerate(axes)}
    last = max((a for a, p in per_axis.items() if p != (0, 0)), default=None)
    if last is None:
        return c.args[0]
    flat: list[int] = []
    for a in range(r - 1, -1, -1):
        if a < min(per_axis):
            break
        flat += list(per_axis.get(a, (0, 0)))
        if all(per_axis.get(b, (0, 0)) == (0, 0) for b in range(a)):
            break
    value = ""
    if m == "constant" and c.has(2):
        v = c.const(2, "constant_value")
        if np.asarray(v).reshape(-1)[0] != 0:
            value = f", value={scalar_literal(np.asarray(v).reshape(-1)[0])}"
    mode_arg = "" if m == "constant" else f', mode="{m}"'
    return f"F.pad({c.args[0]}, {int_tuple(flat)}{mode_arg}{value})"


@template("ConstantOfShape", value=None)
def _constant_of_shape(c: OpCall) -> str:
    v = c.attrs["value"]
    arr = np.zeros(1, np.float32) if v is None else np.asarray(v)
    fill = scalar_literal(arr.reshape(-1)[0])
    dt = dtype_expr(ir.DataType.from_numpy(arr.dtype))
    return f"torch.full({c.ints(0)}, {fill}, dtype={dt})"


@template("Range")
def _range(c: OpCall) -> str:
    parts = []
    for i in range(3):
        if c.consts[i] is not None:
            parts.append(scalar_literal(np.asarray(c.consts[i]).reshape(())[()]))
        else:
            parts.append(f"{c.args[i]}.item()")
    return f"torch.arange({', '.join(parts)}, dtype={c.dtype()})"


@template("Trilu", upper=1)
def _trilu(c: OpCall) -> str:
    fn = "torch.triu" if c.attrs["upper"] else "torch.tril"
    if not c.has(1):
        return f"{fn}({c.args[0]})"
    k = c.consts[1]
    kk = str(int(np.asarray(k).reshape(()))) if k is not None else f"int({c.args[1]})"
    return f"{fn}({c.args[0]}, {kk})"
