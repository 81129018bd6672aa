"""Flax source templates: the control-flow ops If, Loop and Scan.

The emitter writes each subgraph (an If branch, a Loop or Scan body) as a function nested in
``__call__`` (``emitter.subgraph_function``): its parameters are the subgraph's inputs, it
returns the tuple of its outputs, and a template receives its name in place of the graph
attribute. The generated helpers steer as the JAX runtime does (``ops/control`` and
``jax/control``): a Python ``if`` / loop on known values, ``lax.cond`` / ``lax.while_loop``
on traced ones; Scan is ``lax.scan``.
"""

from __future__ import annotations

import onnx_ir as ir

from xconv.converters import expressions_structured as exs
from xconv.converters.codegen import int_tuple
from xconv.converters.flax.source.templates import OpCall, dtype_expr, registry, template
from xconv.converters.ops.control import empty_output
from xconv.converters.registry import REQUIRED

registry.helpers["if"] = '''
def _if(cond, then_branch, else_branch, dtypes):
    """ONNX If: a Python if on a known condition; lax.cond on a traced one, whose branches
    must then give outputs of one shape and dtype (each cast to the If's output dtype)."""
    if not isinstance(cond, jax.core.Tracer):
        return then_branch() if np.asarray(cond).reshape(-1)[0] else else_branch()

    def typed(branch):
        return lambda: tuple(
            o if isinstance(o, list) or o is None else jnp.asarray(o, dtype=dt)
            for o, dt in zip(branch(), dtypes, strict=False)
        )

    pred = jnp.reshape(cond, (-1,))[0].astype(bool)
    return lax.cond(pred, typed(then_branch), typed(else_branch))
'''

registry.helpers["scan"] = '''
def _scan(body, states, xs, in_axes=None, in_reverse=None, out_axes=None, out_reverse=None):
    """ONNX Scan as lax.scan: ``body(*states, *x_t) -> (*states, *y_t)`` over each scan
    input's axis (``in_axes``, reversed where ``in_reverse``), the states keeping their dtype;
    the y_t stacked along ``out_axes`` (reversed where ``out_reverse``). Returns the final
    states, then the stacked outputs."""
    n = len(states)
    in_axes = in_axes or (0,) * len(xs)
    in_reverse = in_reverse or (False,) * len(xs)
    xs = [jnp.moveaxis(x, a, 0) for x, a in zip(xs, in_axes, strict=True)]
    xs = [jnp.flip(x, 0) if r else x for x, r in zip(xs, in_reverse, strict=True)]

    def step(carry, x_t):
        outs = body(*carry, *x_t)
        new = tuple(jnp.asarray(o).astype(c.dtype) for o, c in zip(outs[:n], carry, strict=True))
        return new, tuple(jnp.asarray(o) for o in outs[n:])

    final, ys = lax.scan(step, tuple(jnp.asarray(s) for s in states), tuple(xs))
    out_axes = out_axes or (0,) * len(ys)
    out_reverse = out_reverse or (False,) * len(ys)
    ys = [jnp.flip(y, 0) if r else y for y, r in zip(ys, out_reverse, strict=True)]
    ys = [jnp.moveaxis(y, 0, a % y.ndim) for y, a in zip(ys, out_axes, strict=True)]
    return (*final, *ys)
'''

registry.helpers["scan_batched"] = '''
def _scan_batched(body, sequence_lens, states, xs, reverse=None):
    """ONNX Scan-8: each batch entry (axis 0) scanned over axis 1 for its first
    ``sequence_lens[b]`` steps (all when None), its scan outputs zero-padded to the longest."""
    batch, steps = xs[0].shape[:2]
    if sequence_lens is None:
        lens = [steps] * batch
    else:
        lens = [int(n) for n in np.asarray(sequence_lens).reshape(-1)]
    n = len(states)
    results = []
    for b in range(batch):
        out = _scan(body, [s[b] for s in states], [x[b, : lens[b]] for x in xs], None, reverse)
        pad = [jnp.pad(y, [(0, steps - lens[b])] + [(0, 0)] * (y.ndim - 1)) for y in out[n:]]
        results.append((*out[:n], *pad))
    return tuple(jnp.stack([r[i] for r in results]) for i in range(len(results[0])))
'''

registry.helpers["loop"] = '''
def _loop(body, trip_count, cond, carried, empty=()):
    """ONNX Loop: ``body(i, cond, *carried) -> (cond, *carried, *scan items)`` while the
    condition holds and ``i < trip_count`` (either may be None: no limit). A Python loop
    when the trip count, condition and carried values are known (the scan items stacked,
    ``empty`` when it never runs); lax.while_loop on traced ones, which has no scan
    outputs."""
    steering = [v for v in (trip_count, cond, *carried) if v is not None]
    if not any(isinstance(v, jax.core.Tracer) for v in steering):
        limit = None if trip_count is None else int(np.asarray(trip_count).reshape(-1)[0])
        it_dtype = np.int64 if trip_count is None else np.asarray(trip_count).dtype
        going = True if cond is None else bool(np.asarray(cond).reshape(-1)[0])
        cond_in, values = np.array(going), list(carried)
        scans = [[] for _ in empty]
        i = 0
        while going and (limit is None or i < limit):
            outs = body(np.array(i, it_dtype), cond_in, *values)
            going = bool(np.asarray(outs[0]).reshape(-1)[0])
            values = list(outs[1 : 1 + len(values)])
            for items, item in zip(scans, outs[1 + len(values) :], strict=True):
                items.append(item)
            cond_in = outs[0]
            i += 1
        stacked = [jnp.stack(s) if s else e for s, e in zip(scans, empty, strict=True)]
        return (*values, *stacked)
    if empty:
        raise ValueError(
            "a Loop with scan outputs needs a known trip count and condition (under jax.jit "
            "its output length would depend on run-time data); run without jit"
        )
    it_dtype = jax.dtypes.canonicalize_dtype(np.int64)
    if trip_count is not None and not isinstance(trip_count, jax.core.Tracer):
        # "no limit" is often written as INT64_MAX: clamped to the counter's range
        limit = np.asarray(trip_count).reshape(-1)[0]
        trip_count = np.array(min(int(limit), np.iinfo(it_dtype).max), dtype=it_dtype)

    def going(state):
        i, c, _ = state
        if trip_count is None:
            return c
        return jnp.logical_and(c, i < jnp.asarray(trip_count).reshape(()).astype(it_dtype))

    def step(state):
        i, c, values = state
        outs = body(i, c, *values)
        new = tuple(
            jnp.asarray(o).astype(v.dtype)
            for o, v in zip(outs[1 : 1 + len(values)], values, strict=True)
        )
        return i + 1, jnp.asarray(outs[0]).reshape(()).astype(bool), new

    c0 = jnp.asarray(True if cond is None else cond).reshape(()).astype(bool)
    init = (jnp.zeros((), it_dtype), c0, tuple(jnp.asarray(v) for v in carried))
    return lax.while_loop(going, step, init)[2]
'''


@template("If", then_branch=REQUIRED, else_branch=REQUIRED)
def _if(c: OpCall) -> str:
    c.helpers.add("if")
    dtypes = ["None" if o.dtype is None else c.dtype(i) for i, o in enumerate(c.node.outputs)]
    then_, else_ = c.attrs["then_branch"], c.attrs["else_branch"]
    return exs.one_output(c, f"_if({c.args[0]}, {then_}, {else_}, {exs.tuple_text(dtypes)})")


@registry.builtin("Scan", since=9, attrs=exs.SCAN_ATTRS)
def _scan(c: OpCall) -> str:
    return exs.scan_call(c)


@registry.builtin("Scan", since=8, until=8, attrs=exs.SCAN_8_ATTRS)
def _scan_8(c: OpCall) -> str:
    return exs.scan_8_call(c)


@template("Loop", body=REQUIRED)
def _loop(c: OpCall) -> str:
    return exs.loop_call(c, _empty)


def _empty(value: ir.Value) -> str:
    """The stacked scan output of a loop that never runs, shaped as the runtimes shape it
    (``ops/control.empty_output``)."""
    a = empty_output(value)
    dt = dtype_expr(ir.DataType.from_numpy(a.dtype), "np")
    return f"np.zeros({int_tuple(a.shape)}, dtype={dt})"
