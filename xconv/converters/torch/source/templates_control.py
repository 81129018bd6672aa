"""PyTorch source templates: the control-flow ops If, Loop and Scan.

The emitter writes each subgraph (an If branch, a Loop or Scan body) as a function nested in
``forward`` (``emitter.subgraph_function``): its parameters are the subgraph's inputs, it
returns the tuple of its outputs, and a template receives its name in place of the graph
attribute. torch runs eagerly, so each op steers in Python as the torch runtime does
(``ops/control``): an ``if`` on ``bool(cond)``, Scan and Loop as Python loops whose scan
outputs are stacked with ``torch.stack``.
"""

from __future__ import annotations

import onnx_ir as ir

from xconv.converters import expressions_structured as exs
from xconv.converters.codegen import int_tuple
from xconv.converters.ops.control import empty_output
from xconv.converters.registry import REQUIRED
from xconv.converters.torch.source.templates import OpCall, dtype_expr, registry, template

registry.helpers["scan"] = '''
def _scan(body, states, xs, in_axes=None, in_reverse=None, out_axes=None, out_reverse=None):
    """ONNX Scan: ``body(*states, *x_t) -> (*states, *y_t)`` over each scan input's axis
    (``in_axes``, reversed where ``in_reverse``); the y_t stacked along ``out_axes``
    (reversed where ``out_reverse``). Returns the final states, then the stacked
    outputs."""
    n = len(states)
    in_axes = in_axes or (0,) * len(xs)
    in_reverse = in_reverse or (False,) * len(xs)
    xs = [torch.movedim(x, a, 0) for x, a in zip(xs, in_axes, strict=True)]
    xs = [torch.flip(x, (0,)) if r else x for x, r in zip(xs, in_reverse, strict=True)]
    if not xs[0].shape[0]:
        raise ValueError("a Scan of no steps: its outputs' shapes are unknown")
    states, ys = list(states), []
    for t in range(xs[0].shape[0]):
        outs = body(*states, *(x[t] for x in xs))
        states = list(outs[:n])
        ys.append(outs[n:])
    ys = [torch.stack(y) for y in zip(*ys, strict=True)]
    out_axes = out_axes or (0,) * len(ys)
    out_reverse = out_reverse or (False,) * len(ys)
    ys = [torch.flip(y, (0,)) if r else y for y, r in zip(ys, out_reverse, strict=True)]
    ys = [torch.movedim(y, 0, a % y.dim()) for y, a in zip(ys, out_axes, strict=True)]
    return (*states, *ys)
'''

registry.helpers["scan_batched"] = '''
def _scan_batched(body, sequence_lens, states, xs, reverse=None):
    """ONNX Scan-8: each batch entry (axis 0) scanned over axis 1 for its first
    ``sequence_lens[b]`` steps (all when None), its scan outputs zero-padded to the longest."""
    batch, steps = xs[0].shape[:2]
    lens = [steps] * batch if sequence_lens is None else sequence_lens.reshape(-1).tolist()
    n = len(states)
    results = []
    for b in range(batch):
        out = _scan(body, [s[b] for s in states], [x[b, : lens[b]] for x in xs], None, reverse)
        pad = [
            torch.cat([y, y.new_zeros((steps - lens[b], *y.shape[1:]))]) for y in out[n:]
        ]
        results.append((*out[:n], *pad))
    return tuple(torch.stack([r[i] for r in results]) for i in range(len(results[0])))
'''

registry.helpers["loop"] = '''
def _loop(body, trip_count, cond, carried, empty=()):
    """ONNX Loop: ``body(i, cond, *carried) -> (cond, *carried, *scan items)`` while the
    condition holds and ``i < trip_count`` (either may be None: no limit); the scan items
    stacked (``empty`` when it never runs)."""
    limit = None if trip_count is None else int(trip_count.reshape(-1)[0])
    it_dtype = torch.int64 if trip_count is None else trip_count.dtype
    going = True if cond is None else bool(cond.reshape(-1)[0])
    cond_in, values = torch.tensor(going), list(carried)
    scans = [[] for _ in empty]
    i = 0
    while going and (limit is None or i < limit):
        outs = body(torch.tensor(i, dtype=it_dtype), cond_in, *values)
        going = bool(outs[0].reshape(-1)[0])
        values = list(outs[1 : 1 + len(values)])
        for items, item in zip(scans, outs[1 + len(values) :], strict=True):
            items.append(item)
        cond_in = outs[0]
        i += 1
    stacked = [torch.stack(s) if s else e for s, e in zip(scans, empty, strict=True)]
    return (*values, *stacked)
'''


@template("If", then_branch=REQUIRED, else_branch=REQUIRED)
def _if(c: OpCall) -> str:
    then_, else_ = c.attrs["then_branch"], c.attrs["else_branch"]
    return exs.one_output(c, f"({then_}() if bool({c.args[0]}.reshape(-1)[0]) else {else_}())")


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
    dt = dtype_expr(ir.DataType.from_numpy(a.dtype))
    return f"torch.zeros({int_tuple(a.shape)}, dtype={dt})"
