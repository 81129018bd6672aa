"""jaxpr handlers for control flow. Call-like primitives (``INLINE``) are translated inline,
``cond`` evaluates every branch and selects, ``scan`` (static trip count) is unrolled; control
flow that needs a real loop, ``while``, becomes an ONNX ``Loop``.

``lax.while_loop`` (and ``lax.fori_loop`` with a trip count known only at run time, which
jax lowers to ``while``) becomes one ``Loop`` node with no trip count: the condition is
evaluated once before the loop and again at the end of each body iteration. The body is an
``ir.Graph`` subgraph ``(iter, cond_in, *carry) -> (cond_out, *carry')``; the cond and body
constants (weights, closed-over arrays) are read from the enclosing graph by name, as ONNX
subgraphs may. Static-trip ``fori_loop`` lowers to ``scan`` in jax and is unrolled there.

``platform_index`` (jax's ``platform_dependent``, used by e.g. ``jnp.diagonal``) picks the
branch for the default platform: an ONNX model runs on none of jax's named backends.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.converters.flax.importer.primitives import INLINE, builtin, sub_jaxpr
from xconv.converters.flax.importer.symbolic import ir_dim
from xconv.errors import ConversionError


def _value(name: str, aval: Any) -> ir.Value:
    dtype = ir.DataType.from_numpy(np.dtype(aval.dtype))
    return ir.Value(
        name=name, type=ir.TensorType(dtype), shape=ir.Shape([ir_dim(d) for d in aval.shape])
    )


def _in_subgraph(ctx, graph: ir.Graph, build):
    """Run ``build()`` with ``ctx`` appending its nodes to ``graph``; restore the graph after."""
    outer = ctx.graph
    ctx.graph = graph
    try:
        return build()
    finally:
        ctx.graph = outer


@builtin("while")
def _while(ctx, eqn, inputs):
    """while(cond_consts..., body_consts..., init...; cond_jaxpr, body_jaxpr) -> final carry."""
    p = eqn.params
    nc, nb = int(p["cond_nconsts"]), int(p["body_nconsts"])
    cconsts, bconsts, init = inputs[:nc], inputs[nc : nc + nb], inputs[nc + nb :]
    (keep_going,) = ctx.inline(p["cond_jaxpr"], [*cconsts, *init])

    carry_avals = [v.aval for v in p["body_jaxpr"].jaxpr.invars[nb:]]
    tag = f"while_{ctx._count + 1}"  # the node counter: unique and deterministic
    body = ir.Graph([], [], nodes=[], name=f"{tag}_body")
    it = ir.Value(name=f"{tag}_iter", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    cond_in = ir.Value(
        name=f"{tag}_cond_in", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([])
    )
    carried = [_value(f"{tag}_carry{k}", a) for k, a in enumerate(carry_avals)]
    body.inputs.extend([it, cond_in, *carried])

    def build():
        new = ctx.inline(p["body_jaxpr"], [*bconsts, *carried])
        (cond_out,) = ctx.inline(p["cond_jaxpr"], [*cconsts, *new])
        outs = []
        for v in [cond_out, *new]:
            # A body output must be produced inside the body, once: pass-throughs of a
            # body input or of an enclosing value get their own Identity.
            if v.graph is not body or v.is_graph_input() or v in outs:
                v = ctx.op("Identity", [v])
            outs.append(v)
        return outs

    outs = _in_subgraph(ctx, body, build)
    for k, v in enumerate(outs):
        v.name = f"{tag}_out{k}"
    body.outputs.extend(outs)
    if not init:
        raise ConversionError("while loop with no carried values")
    result = ctx.op("Loop", [None, keep_going, *init], {"body": body}, num_outputs=len(init))
    results = [result] if len(init) == 1 else list(result)
    for value, var in zip(results, eqn.outvars, strict=True):
        typed = _value(value.name, var.aval)  # shape inference cannot see through the body
        value.type, value.shape = typed.type, typed.shape
    return results


@builtin("platform_index")
def _platform_index(ctx, eqn, inputs):
    platforms = list(eqn.params["platforms"])
    index = next((i for i, p in enumerate(platforms) if p is None), None)
    if index is None:
        index = next((i for i, p in enumerate(platforms) if "cpu" in tuple(p)), None)
    if index is None:
        raise ConversionError(
            f"platform_dependent has no default branch (platforms {platforms}); give it one"
        )
    return [ctx.const(np.asarray(index, np.dtype(eqn.outvars[0].aval.dtype)))]


def _inline(ctx, eqn, inputs):
    closed = sub_jaxpr(eqn)
    n = len(getattr(closed, "jaxpr", closed).invars)
    return ctx.inline(closed, inputs[len(inputs) - n :])


for _name in INLINE:
    builtin(_name)(_inline)


@builtin("cond")
def _cond(ctx, eqn, inputs):
    # Branches are pure: evaluate each and select, which needs no subgraphs.
    index, *ops = inputs
    results = [ctx.inline(branch, ops) for branch in eqn.params["branches"]]
    if len(results) == 1:
        return results[0]
    idtype = np.dtype(eqn.invars[0].aval.dtype)
    outs = []
    for k in range(len(results[0])):
        out = results[0][k]
        for i in range(1, len(results)):
            hit = ctx.op("Equal", [index, ctx.const(np.array(i, idtype))])
            out = ctx.op("Where", [hit, results[i][k], out])
        outs.append(out)
    return outs


@builtin("scan")
def _scan(ctx, eqn, inputs):
    # The trip count is static: unroll.
    p = eqn.params
    length, nconst, ncarry = int(p["length"]), int(p["num_consts"]), int(p["num_carry"])
    consts, carry, xs = inputs[:nconst], inputs[nconst : nconst + ncarry], inputs[nconst + ncarry :]
    if length == 0:
        raise ConversionError("scan of length 0 is not supported")
    order = range(length - 1, -1, -1) if p["reverse"] else range(length)
    ys: list[list] = []
    for i in order:
        x_i = [
            ctx.op(
                "Squeeze",
                [ctx.op("Slice", [x, ctx.i64([i]), ctx.i64([i + 1]), ctx.i64([0])]), ctx.i64([0])],
            )
            for x in xs
        ]
        outs = ctx.inline(p["jaxpr"], [*consts, *carry, *x_i])
        carry = outs[:ncarry]
        ys.append([ctx.op("Unsqueeze", [y, ctx.i64([0])]) for y in outs[ncarry:]])
    if p["reverse"]:
        ys.reverse()
    stacked = [
        ctx.op("Concat", [step[k] for step in ys], {"axis": 0})
        if length > 1
        else ctx.op("Identity", [ys[0][k]])
        for k in range(len(ys[0]))
    ]
    return [*carry, *stacked]
