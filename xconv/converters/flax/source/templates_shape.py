"""Flax source templates for reductions, shape and indexing ops. Importing this module
registers them in ``templates.registry``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from xconv.converters import expressions as ex
from xconv.converters.codegen import reshape_dims, scalar_literal
from xconv.converters.flax.source.templates import (
    INT64_MAX,
    OpCall,
    dtype_expr,
    registry,
    template,
    tuple_literal,
)
from xconv.converters.registry import REQUIRED
from xconv.ir.passes._utils import constant_of

# ---------------------------------------------------------------- values computed at run time

registry.helpers["static_ints"] = '''
def _static(value, what):
    """A value the graph computes at run time that fixes a shape (axes, pads, bounds, sizes,
    scales) as a flat numpy array: known when the model runs eagerly; under jax.jit it must
    be a constant."""
    if isinstance(value, jax.core.Tracer):
        raise ValueError(
            f"{what} is computed at run time, and jax.jit needs it when tracing: "
            "run the model without jit, or make it a constant"
        )
    return np.asarray(value).reshape(-1)


def _static_ints(value, what):
    """_static's integers, as a tuple."""
    return tuple(int(v) for v in _static(value, what))
'''


def runtime(c: OpCall, i: int, what: str) -> str | None:
    """Input ``i`` as a ``_static_ints(...)`` call when the graph computes it at run time
    (None when it is a constant or absent): read eagerly, as ``to_jax`` reads it."""
    if not c.has(i) or c.consts[i] is not None:
        return None
    if c.perm is not None:
        raise c.fail(f"{what} computed at run time on a channels-last input")
    c.helpers.add("static_ints")
    return f'_static_ints({c.args[i]}, "{c.node.op_type} {what}")'


# ---------------------------------------------------------------- reductions


def _empty_initial(c: OpCall, fn: str) -> str:
    """``initial=`` for a max / min over an input with an empty axis: ONNX's identity (-inf /
    inf, an integer type's bounds, False / True), where numpy's reduction raises."""
    dtype = c.node.inputs[0].dtype
    if fn not in ("max", "min") or 0 not in (c.shapes[0] or ()) or dtype is None:
        return ""
    if dtype == ir.DataType.BOOL:
        return f", initial={fn == 'min'}"
    if dtype.is_floating_point():
        return f", initial={'-' if fn == 'max' else ''}jnp.inf"
    bound = "min" if fn == "max" else "max"
    return f", initial=jnp.iinfo({c.args[0]}.dtype).{bound}"


def _reduce(
    fn: str, pre: str = "{0}", post: str = "{0}", kept: str | None = None
) -> Callable[[OpCall], str]:
    """``post(fn(pre(x), axis))``; ``fn`` in the call's namespace unless it names its own
    (``jax.nn.logsumexp``). Over no axes with noop_with_empty_axes, ``kept(x)`` (by default
    ``post(pre(x))``): the elementwise part ONNX keeps (``xconv.converters.ops.reduce``)."""

    def emit(c: OpCall) -> str:
        keep = ", keepdims=True" if c.attrs["keepdims"] else ""  # numpy's default: False
        keep += _empty_initial(c, fn)
        x = pre.format(c.args[0])
        call = fn if "." in fn else f"{c.xp}.{fn}"
        dynamic = runtime(c, 1, "axes")
        if dynamic is not None:  # all axes when empty, or with noop_with_empty_axes none
            out = post.format(f"{call}({x}, axis={dynamic} or None{keep})")
            if not c.attrs["noop_with_empty_axes"]:
                return out
            kept_x = post.format(x) if kept is None else kept.format(c.args[0])
            return f"({out} if {dynamic} else {kept_x})"
        axes = c.attrs.get("axes")
        if c.has(1):
            axes = c.const(1, "axes")
        if axes is None or len(np.asarray(axes).reshape(-1)) == 0:
            if c.attrs["noop_with_empty_axes"]:
                return post.format(x) if kept is None else kept.format(c.args[0])
            return post.format(f"{call}({x}{keep})")
        phys = tuple(sorted(c.axis(int(a)) for a in np.asarray(axes).reshape(-1)))
        if fn == "mean" and len(phys) > 1 and c.float_output():
            c.helpers.add("mean")
            return post.format(f"_mean({x}, axis={phys}{keep})")
        return post.format(f"{call}({x}, axis={phys}{keep})")

    return emit


for _op, _args in {
    "ReduceMean": ("mean",),
    "ReduceSum": ("sum",),
    "ReduceMax": ("max",),
    "ReduceMin": ("min",),
    "ReduceProd": ("prod",),
    "ReduceSumSquare": ("sum", "jnp.square({0})"),
    "ReduceL1": ("sum", "jnp.abs({0})"),
    "ReduceL2": ("sum", "jnp.square({0})", "jnp.sqrt({0})"),
    # jax.nn.logsumexp subtracts the largest value first
    "ReduceLogSumExp": ("jax.nn.logsumexp", "{0}", "{0}", "jnp.log(jnp.exp({0}))"),
    "ReduceLogSum": ("sum", "{0}", "jnp.log({0})"),
}.items():
    registry.builtin(
        _op,
        attrs={"axes": None, "keepdims": 1, "noop_with_empty_axes": 0},
        layout="reduce",
        static_ok=_op in ("ReduceSum", "ReduceProd", "ReduceMax", "ReduceMin"),
    )(_reduce(*_args))


registry.helpers["center_crop_pad"] = '''
def _center_crop_pad(x, shape, axes=None):
    """ONNX CenterCropPad: each axis (of ``axes``) cut to ``shape`` around its centre, or
    zero-padded around it."""
    index, widths = [slice(None)] * x.ndim, [(0, 0)] * x.ndim
    axes = range(x.ndim) if axes is None else [a % x.ndim for a in axes]
    for a, size in zip(axes, shape, strict=True):
        n = x.shape[a]
        if size < n:
            index[a] = slice((n - size) // 2, (n - size) // 2 + size)
        elif size > n:
            widths[a] = ((size - n) // 2, size - n - (size - n) // 2)
    return jnp.pad(x[tuple(index)], widths)
'''


@template("CenterCropPad", axes=None)
def _center_crop_pad(c: OpCall) -> str:
    c.helpers.add("center_crop_pad")
    shape = runtime(c, 1, "shape") or tuple_literal(c.const(1, "shape"))
    axes = c.attrs["axes"]
    tail = "" if axes is None else f", axes={tuple(int(a) for a in axes)}"
    return f"_center_crop_pad({c.args[0]}, {shape}{tail})"


registry.helpers["affine_grid"] = '''
def _affine_grid(theta, size, align_corners=False):
    """ONNX AffineGrid (torch's F.affine_grid): theta (N, n, n + 1) applied to the normalised
    points (x, y[, z], 1) of an output of ``size`` (N, C, *spatial): (N, *spatial, n)."""
    spatial = size[2:]
    if align_corners:
        axes = [np.linspace(-1.0, 1.0, s) if s > 1 else np.zeros(1) for s in spatial]
    else:
        axes = [(np.arange(s) * 2.0 + 1.0) / s - 1.0 for s in spatial]
    mesh = np.meshgrid(*axes, indexing="ij")
    points = np.stack([*mesh[::-1], np.ones_like(mesh[0])], axis=-1).reshape(-1, len(spatial) + 1)
    grid = jnp.einsum("pk,njk->npj", points.astype(theta.dtype), theta)
    return jnp.reshape(grid, (theta.shape[0], *spatial, len(spatial)))
'''


@template("AffineGrid", align_corners=0)
def _affine_grid(c: OpCall) -> str:
    c.helpers.add("affine_grid")
    size = runtime(c, 1, "size") or tuple_literal(c.const(1, "size"))
    tail = ", align_corners=True" if c.attrs["align_corners"] else ""
    return f"_affine_grid({c.args[0]}, {size}{tail})"


@template("Compress", axis=None)
def _compress(c: OpCall) -> str:
    """The slices where the condition holds: a shape that depends on its values, so the
    condition is read eagerly (``_static``)."""
    c.helpers.add("static_ints")
    keep = f'np.flatnonzero(_static({c.args[1]}, "Compress condition"))'
    if c.attrs["axis"] is None:
        return f"jnp.take(jnp.ravel({c.args[0]}), {keep})"
    return f"jnp.take({c.args[0]}, {keep}, axis={int(c.attrs['axis'])})"


@template("NonZero")
def _non_zero(c: OpCall) -> str:
    """The indices of the nonzero elements, (rank, count): a shape that depends on the values,
    so they are read eagerly (``_static``)."""
    c.helpers.add("static_ints")
    x = f'np.reshape(_static({c.args[0]}, "NonZero input"), jnp.shape({c.args[0]}))'
    return f"jnp.asarray(np.stack(np.nonzero({x})), dtype={c.dtype()})"


registry.helpers["cosine_window"] = ex.COSINE_WINDOW


@template("HannWindow", "HammingWindow", "BlackmanWindow", output_datatype=1, periodic=1)
def _window(c: OpCall) -> str:
    size = runtime(c, 0, "size")
    n = f"{size}[0]" if size else int(np.asarray(c.const(0, "size")).reshape(-1)[0])
    return f"jnp.asarray({ex.window_call(c, str(n))}, dtype={c.dtype()})"


@template("EyeLike", dtype=None, k=0)
def _eye_like(c: OpCall) -> str:
    k = int(c.attrs["k"])
    return f"jnp.eye(*{c.args[0]}.shape, k={k}, dtype={c.dtype()})"


@template("DepthToSpace", "SpaceToDepth", blocksize=REQUIRED, mode="DCR")
def _block_rearrange(c: OpCall) -> str:
    return ex.block_rearrange(c, "transpose")


@template("ArgMax", "ArgMin", axis=0, keepdims=1, select_last_index=0)
def _argmax(c: OpCall) -> str:
    fn = "argmax" if c.node.op_type == "ArgMax" else "argmin"
    x, a, k = c.args[0], c.attrs["axis"], bool(c.attrs["keepdims"])
    call = f"jnp.{fn}({x}, axis={a}, keepdims={k})"
    if c.attrs["select_last_index"]:  # the first extremum of the reversed axis
        call = f"({x}.shape[{a}] - 1 - {call.replace(x, f'jnp.flip({x}, {a})', 1)})"
    return f"{call}.astype({c.dtype()})"


registry.helpers["cumulative"] = '''
def _cumulative(x, axis, fn, identity, exclusive=False, reverse=False):
    """ONNX CumSum / CumProd: ``fn`` (jnp.cumsum / jnp.cumprod) along ``axis``, from the end
    when ``reverse``, each output leaving its own element out when ``exclusive``."""
    if reverse:
        x = jnp.flip(x, axis)
    if exclusive:
        head = jnp.full_like(lax.slice_in_dim(x, 0, 1, axis=axis), identity)
        x = jnp.concatenate([head, lax.slice_in_dim(x, 0, x.shape[axis] - 1, axis=axis)], axis)
    y = fn(x, axis=axis, dtype=x.dtype)
    return jnp.flip(y, axis) if reverse else y
'''


@template("CumSum", "CumProd", exclusive=0, reverse=0)
def _cumulative(c: OpCall) -> str:
    dynamic = runtime(c, 1, "axis")
    axis = f"{dynamic}[0]" if dynamic else int(c.const(1, "axis"))
    fn, identity = ("jnp.cumsum", 0) if c.node.op_type == "CumSum" else ("jnp.cumprod", 1)
    if not (c.attrs["exclusive"] or c.attrs["reverse"]):
        return f"{fn}({c.args[0]}, axis={axis})"
    c.helpers.add("cumulative")
    flags = "".join(f", {k}=True" for k in ("exclusive", "reverse") if c.attrs[k])
    return f"_cumulative({c.args[0]}, {axis}, {fn}, {identity}{flags})"


# ---------------------------------------------------------------- shape and indexing


@template("Shape", static_ok=True, start=0, end=None)
def _shape(c: OpCall) -> str:
    s, e = c.attrs["start"], c.attrs["end"]
    sl = "" if (s == 0 and e is None) else f"[{s or ''}:{'' if e is None else e}]"
    return f"np.asarray({c.args[0]}.shape{sl}, dtype=np.int64)"


@template("Size", static_ok=True)
def _size(c: OpCall) -> str:
    return f"np.asarray(math.prod({c.args[0]}.shape), dtype=np.int64)"


@template("Reshape", static_ok=True, allowzero=0)
def _reshape(c: OpCall) -> str:
    target = c.consts[1]
    if target is not None:
        dims = reshape_dims(c.args[0], c.shapes[0], target, c.attrs["allowzero"])
        if len(dims) == 1 and dims[0].startswith("*"):
            return f"{c.xp}.reshape({c.args[0]}, {dims[0][1:]})"  # the input's leading dims
        return f"{c.xp}.reshape({c.args[0]}, ({', '.join(dims)}{',' if len(dims) == 1 else ''}))"
    if c.attrs["allowzero"]:  # a 0 in the shape is a dimension of size 0
        return f"{c.xp}.reshape({c.args[0]}, tuple(int(d) for d in {c.args[1]}))"
    c.helpers.add("reshape")
    return f"_reshape({c.args[0]}, {c.args[1]})"


@template("Flatten", axis=1)
def _flatten(c: OpCall) -> str:
    a = c.attrs["axis"]
    if a == 0:
        return f"jnp.reshape({c.args[0]}, (1, -1))"
    if a == 1:
        return f"jnp.reshape({c.args[0]}, ({c.args[0]}.shape[0], -1))"
    return f"jnp.reshape({c.args[0]}, (math.prod({c.args[0]}.shape[:{a}]), -1))"


@template("Transpose", static_ok=True, perm=None)
def _transpose(c: OpCall) -> str:
    perm = c.attrs["perm"]
    if perm is None:
        return f"{c.xp}.transpose({c.args[0]})"
    return f"{c.xp}.transpose({c.args[0]}, {tuple(int(p) for p in perm)})"


@template("Concat", layout="axis", static_ok=True, axis=REQUIRED)
def _concat(c: OpCall) -> str:
    return f"{c.xp}.concatenate([{', '.join(c.args)}], axis={c.axis(c.attrs['axis'])})"


@template("Squeeze", static_ok=True)
def _squeeze(c: OpCall) -> str:
    if not c.has(1):
        return f"{c.xp}.squeeze({c.args[0]})"
    axes = runtime(c, 1, "axes") or tuple_literal(c.const(1, "axes"))
    return f"{c.xp}.squeeze({c.args[0]}, axis={axes})"


@template("Unsqueeze", static_ok=True)
def _unsqueeze(c: OpCall) -> str:
    axes = runtime(c, 1, "axes") or tuple_literal(c.const(1, "axes"))
    return f"{c.xp}.expand_dims({c.args[0]}, {axes})"


@template("Expand", static_ok=True)
def _expand(c: OpCall) -> str:
    shape = c.consts[1]
    target = tuple_literal(shape) if shape is not None else f"tuple({c.args[1]})"
    return f"{c.xp}.broadcast_to({c.args[0]}, {c.xp}.broadcast_shapes({c.args[0]}.shape, {target}))"


@template("Tile", static_ok=True)
def _tile(c: OpCall) -> str:
    repeats = runtime(c, 1, "repeats") or tuple_literal(c.const(1, "repeats"))
    return f"{c.xp}.tile({c.args[0]}, {repeats})"


def _slice_bound(v: int, dim: int | None) -> str | None:
    if v >= INT64_MAX // 2 or v <= -INT64_MAX // 2:
        return None
    return str(v)


registry.helpers["slice"] = '''
def _slice(x, starts, ends, axes=None, steps=None):
    """ONNX Slice with bounds computed at run time: Python's slices clamp them as ONNX does."""
    starts, ends = _static_ints(starts, "Slice starts"), _static_ints(ends, "Slice ends")
    axes = range(len(starts)) if axes is None else _static_ints(axes, "Slice axes")
    steps = (1,) * len(starts) if steps is None else _static_ints(steps, "Slice steps")
    index = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
        index[a] = slice(s, e, st)
    return x[tuple(index)]
'''


@template("Slice", static_ok=True)
def _slice(c: OpCall) -> str:
    if any(c.has(i) and c.consts[i] is None for i in range(1, 5)):
        if c.perm is not None:
            raise c.fail("Slice bounds computed at run time on a channels-last input")
        c.helpers |= {"slice", "static_ints"}
        args = [c.args[i] if c.has(i) else "None" for i in range(5)]
        while args[-1] == "None":
            args.pop()
        return f"_slice({', '.join(args)})"
    starts = c.const(1, "starts").reshape(-1)
    ends = c.const(2, "ends").reshape(-1)
    rank = c.rank()
    axes = c.const(3, "axes").reshape(-1) if c.has(3) else np.arange(len(starts))
    steps = c.const(4, "steps").reshape(-1) if c.has(4) else np.ones(len(starts), np.int64)
    if rank is None:
        raise c.fail("Slice of an input with unknown rank")
    idx = [":"] * rank
    for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
        a = int(a) + rank if a < 0 else int(a)
        st = int(st)
        lo = _slice_bound(int(s), None)
        hi = _slice_bound(int(e), None)
        if st > 0:
            lo = None if lo == "0" else lo
        idx[a] = f"{lo or ''}:{hi or ''}" + (f":{st}" if st != 1 else "")
    while idx and idx[-1] == ":":
        idx.pop()
    return f"{c.args[0]}[{', '.join(idx) or '...'}]"


@template("Gather", static_ok=True, axis=0)
def _gather(c: OpCall) -> str:
    a = c.attrs["axis"]
    idx = c.consts[1]
    if idx is not None and idx.ndim == 0 and c.rank() is not None:
        r = c.rank()
        a = a + r if a < 0 else a
        return f"{c.args[0]}[{', '.join([':'] * a + [str(int(idx))])}]"
    return f"{c.xp}.take({c.args[0]}, {c.args[1]}, axis={a})"


@template("GatherElements", axis=0)
def _gather_elements(c: OpCall) -> str:
    return f"jnp.take_along_axis({c.args[0]}, {c.args[1]}, axis={c.attrs['axis']})"


#: ONNX's scatter reductions as jax's ``.at[...]`` updates.
_AT = {"none": "set", "add": "add", "mul": "multiply", "max": "max", "min": "min"}

registry.helpers["scatter_elements"] = '''
def _scatter_elements(x, indices, updates, axis, reduction="set"):
    """ONNX ScatterElements: updates[i, j, ...] written into x at index indices[i, j, ...]
    along ``axis`` (its other coordinates i, j, ... kept), by ``x.at[...]``'s ``reduction``."""
    where = list(jnp.indices(indices.shape, sparse=True))
    where[axis] = indices
    return getattr(jnp.asarray(x).at[tuple(where)], reduction)(updates)
'''


def _at(c: OpCall) -> str:
    reduction = c.attrs["reduction"]
    if reduction not in _AT:
        raise c.fail(f"reduction={reduction!r}; ONNX defines {list(_AT)}")
    return _AT[reduction]


def _slots(c: OpCall) -> str | None:
    """The index of a ScatterElements whose indices are one vector broadcast along ``axis`` to
    the updates' shape (a cache written at its slots: ``slots.view(1, 1, -1, 1)`` expanded to
    the new keys' shape), as ``:, :, slots`` with ``slots`` read back from the indices; else
    ``None``. The write is then ``x.at[:, :, slots]``: whole slices, not one scalar each."""
    indices, updates = c.node.inputs[1], c.node.inputs[2]
    expand = indices.producer()
    if expand is None or expand.op_type != "Expand" or indices.shape is None:
        return None
    if not _same_shape(indices, updates) and not _shape_of(expand.inputs[1], updates):
        return None
    reshape = expand.inputs[0].producer()
    if reshape is None or reshape.op_type != "Reshape" or reshape.inputs[0].shape is None:
        return None
    rank, axis = len(indices.shape), c.attrs["axis"] % len(indices.shape)
    target = constant_of(reshape.inputs[1], True)
    if len(reshape.inputs[0].shape) != 1 or target is None or target.shape != (rank,):
        return None
    if any(int(d) != 1 for a, d in enumerate(target) if a != axis):
        return None
    name = c.args[1] if c.args[1].isidentifier() else f"({c.args[1]})"
    vector = ", ".join(["0"] * axis + [":"] + ["0"] * (rank - axis - 1))
    return ", ".join([":"] * axis + [f"{name}[{vector}]"])


def _same_shape(a: ir.Value, b: ir.Value) -> bool:
    """Whether ``a`` and ``b`` are known to have one shape (every dim a number or a name)."""
    if a.shape is None or b.shape is None:
        return False
    known = all(isinstance(d, int) or d.value for d in (*a.shape.dims, *b.shape.dims))
    return known and list(a.shape.dims) == list(b.shape.dims)


def _shape_of(value: ir.Value, of: ir.Value) -> bool:
    """Whether ``value`` is ``Shape(of)`` (whole)."""
    node = value.producer()
    return (
        node is not None
        and node.op_type == "Shape"
        and node.inputs[0] is of
        and not node.attributes.get("start")
        and node.attributes.get("end") is None
    )


@template("ScatterElements", axis=0, reduction="none")
def _scatter_elements(c: OpCall) -> str:
    at, x, i, u = _at(c), *c.args[:3]
    slots = _slots(c)
    if slots is not None:
        data = c.node.inputs[0]
        computed = c.consts[0] is None and not data.is_graph_input() and c.float_output()
        # A graph input or a constant may be a numpy array (no .at): a computed float is jax's.
        return f"{x if computed else f'jnp.asarray({x})'}.at[{slots}].{at}({u})"
    c.helpers.add("scatter_elements")
    tail = "" if at == "set" else f", {at!r}"
    return f"_scatter_elements({x}, {i}, {u}, {c.attrs['axis']}{tail})"


@template("ScatterND", reduction="none")
def _scatter_nd(c: OpCall) -> str:
    """``x.at[...]`` at the index tuples along the last axis of ``indices``."""
    x, i, u = c.args[:3]
    return f"jnp.asarray({x}).at[tuple(jnp.moveaxis({i}, -1, 0))].{_at(c)}({u})"


registry.helpers["reverse_sequence"] = '''
def _reverse_sequence(x, lens, batch_axis, time_axis):
    """ONNX ReverseSequence: each batch entry's first lens[b] steps along ``time_axis`` in
    reverse order, the steps after them as they are."""
    t = jnp.arange(x.shape[time_axis])
    lens = jnp.asarray(lens).astype(t.dtype)
    shape = [1] * x.ndim
    shape[time_axis], shape[batch_axis] = -1, 1
    t = jnp.reshape(t, shape)
    shape[time_axis], shape[batch_axis] = 1, -1
    lens = jnp.reshape(lens, shape)
    order = jnp.where(t < lens, lens - 1 - t, t)
    return jnp.take_along_axis(x, jnp.broadcast_to(order, x.shape), axis=time_axis)
'''


registry.builtin("ReverseSequence", attrs={"batch_axis": 1, "time_axis": 0})(
    ex.reverse_sequence_call
)


registry.helpers["one_hot"] = '''
def _one_hot(indices, depth, values, axis):
    """ONNX OneHot: values[1] at the index along ``axis`` (a negative index counts from
    ``depth``), values[0] elsewhere and for an index out of range."""
    indices = indices.astype(jnp.int32)
    indices = jnp.where(indices < 0, indices + depth, indices)
    hot = jax.nn.one_hot(indices, depth, dtype=bool, axis=axis)
    return jnp.where(hot, values[1], values[0])
'''


@template("OneHot", axis=-1)
def _one_hot(c: OpCall) -> str:
    dynamic = runtime(c, 1, "depth")
    depth = f"{dynamic}[0]" if dynamic else int(np.asarray(c.const(1, "depth")).reshape(-1)[0])
    c.helpers.add("one_hot")
    return f"_one_hot({c.args[0]}, {depth}, {c.args[2]}, {c.attrs['axis']})"


@template("Split", axis=0, num_outputs=None)
def _split(c: OpCall) -> str:
    a = c.attrs["axis"]
    dynamic = runtime(c, 1, "split")
    if dynamic:  # the cut points: the sizes' running sums, the last left out
        return f"jnp.split({c.args[0]}, list(itertools.accumulate({dynamic}))[:-1], axis={a})"
    if c.has(1):
        sizes = [int(s) for s in c.const(1, "split")]
        cuts = tuple(int(x) for x in np.cumsum(sizes)[:-1])
        return f"jnp.split({c.args[0]}, {list(cuts)}, axis={a})"
    n = c.attrs["num_outputs"] or len(c.node.outputs)
    dim = c.shapes[0][a] if c.shapes[0] is not None else None
    if n == 1 or (dim is not None and dim % n == 0):
        return f"jnp.split({c.args[0]}, {n}, axis={a})"
    if dim is None:  # ONNX's pieces of ceil(dim / n), the last smaller, from the run's shape
        x = c.args[0]
        size = f"-(-{x}.shape[{a}] // {n})"
        cuts = f"[{size}]" if n == 2 else f"[i * {size} for i in range(1, {n})]"
        return f"jnp.split({x}, {cuts}, axis={a})"
    size = -(-dim // n)
    cuts = [size * i for i in range(1, n)]
    return f"jnp.split({c.args[0]}, {cuts}, axis={a})"


registry.helpers["pad_widths"] = '''
def _pad_widths(pads, ndim, axes=None):
    """ONNX Pad's pads (every begin, then every end) over ``axes`` as jnp.pad's (before,
    after) per axis."""
    axes = range(ndim) if axes is None else [a % ndim for a in axes]
    widths = [(0, 0)] * ndim
    for i, a in enumerate(axes):
        widths[a] = (pads[i], pads[i + len(axes)])
    if min(min(w) for w in widths) < 0:
        raise ValueError(f"negative pads {pads}: the Flax source pads, it does not crop")
    return widths
'''

_PAD_MODES = ("constant", "reflect", "edge", "wrap")


@template("Pad", mode="constant")
def _pad(c: OpCall) -> str:
    m = c.attrs["mode"]
    if m not in _PAD_MODES:
        raise c.fail(f"mode={m!r}")
    extra = f", constant_values={c.args[2]}" if m == "constant" and c.has(2) else ""
    dynamic = runtime(c, 1, "pads"), runtime(c, 3, "axes")
    if any(dynamic):
        c.helpers.add("pad_widths")
        pads = dynamic[0] or tuple_literal(c.const(1, "pads"))
        axes = "" if not c.has(3) else f", {dynamic[1] or tuple_literal(c.const(3, 'axes'))}"
        widths = f"_pad_widths({pads}, {c.args[0]}.ndim{axes})"
        return f"jnp.pad({c.args[0]}, {widths}, mode={m!r}{extra})"
    pads = [int(p) for p in c.const(1, "pads")]
    rank = c.rank()
    if rank is None:
        raise c.fail("Pad of an input with unknown rank")
    axes = list(range(rank))
    if c.has(3):
        axes = [int(a) + rank if a < 0 else int(a) for a in c.const(3, "axes")]
    widths = [(0, 0)] * rank
    n = len(axes)
    for i, a in enumerate(axes):
        widths[a] = (pads[i], pads[i + n])
    if any(lo < 0 or hi < 0 for lo, hi in widths):
        raise c.fail("negative pads")
    return f"jnp.pad({c.args[0]}, {tuple(widths)}, mode={m!r}{extra})"


@template("ConstantOfShape", static_ok=True, value=None)
def _constant_of_shape(c: OpCall) -> str:
    v = c.attrs["value"]
    val = np.zeros((), np.float32) if v is None else np.asarray(v).reshape(())
    dt = dtype_expr(ir.DataType.from_numpy(val.dtype), c.xp)
    shape = tuple_literal(c.consts[0]) if c.consts[0] is not None else f"tuple({c.args[0]})"
    return f"{c.xp}.full({shape}, {scalar_literal(val[()])}, dtype={dt})"


@template("Range", static_ok=True)
def _range(c: OpCall) -> str:
    return f"{c.xp}.arange({c.args[0]}, {c.args[1]}, {c.args[2]}, dtype={c.dtype()})"


registry.helpers["trilu"] = '''
def _trilu(x, k, upper):
    """ONNX Trilu with k computed at run time (jnp.triu / tril take a static one): x where
    the column is at least (upper) or at most row + k, else 0."""
    rows = jnp.arange(x.shape[-2])[:, None]
    cols = jnp.arange(x.shape[-1])[None, :]
    k = jnp.reshape(jnp.asarray(k), ()).astype(rows.dtype)
    keep = cols - rows >= k if upper else cols - rows <= k
    return jnp.where(keep, x, jnp.zeros((), x.dtype))
'''


@template("Trilu", upper=1)
def _trilu(c: OpCall) -> str:
    fn = "triu" if c.attrs["upper"] else "tril"
    if c.has(1) and c.consts[1] is None:
        c.helpers.add("trilu")
        return f"_trilu({c.args[0]}, {c.args[1]}, upper={bool(c.attrs['upper'])})"
    k = f", {int(c.const(1, 'k'))}" if c.has(1) else ""
    return f"jnp.{fn}({c.args[0]}{k})"


@template("TopK", axis=-1, largest=1, sorted=1)
def _topk(c: OpCall) -> str:
    r = c.rank()
    a = c.attrs["axis"]
    if r is None or (a + r if a < 0 else a) != r - 1:
        raise c.fail("TopK over an axis other than the last one")
    dynamic = runtime(c, 1, "k")
    k = f"{dynamic}[0]" if dynamic else int(c.const(1, "k").reshape(-1)[0])
    x = c.args[0] if c.attrs["largest"] else f"-{c.args[0]}"
    vals = "{0}[0]" if c.attrs["largest"] else "-{0}[0]"
    return f"(lambda r: ({vals.format('r')}, r[1].astype(jnp.int64)))(lax.top_k({x}, {k}))"
