"""Activations a traced source spells out, fused back into the one call a person writes.

A Flax model's ``jax.nn.softmax`` reaches the IR as ``exp(x - max(x)) / sum(exp(...))`` and
its ``nn.gelu`` (tanh approximation) as ``x * 0.5 * (1 + tanh(0.7978846 * (x + 0.044715 *
x ** 3)))``. Where a chain of nodes computes exactly that, it becomes one ``Softmax`` /
``Gelu(approximate="tanh")`` node (and ``(x * 4) / 4`` is ``x``), so the generated PyTorch source reads ``torch.softmax(h,
dim=-1)`` / ``F.gelu(h, approximate="tanh")``. Only whole chains whose intermediate values
nothing else reads are fused; anything else is left as it is.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from xconv.ir.passes._utils import constant_of, copy_provenance, forward, is_annotated


def fuse_activations(model: ir.Model) -> bool:
    """Fuse softmax and tanh-GELU chains of ``model`` in place; True when any was fused."""
    graph = model.graph
    annotated = is_annotated(graph)
    fused = False
    for node in list(graph):
        if node.graph is None:
            continue  # removed by an earlier fusion
        match = None
        if node.op_type == "Div" and _undo_scale(graph, node, annotated):
            fused = True
            continue
        if node.op_type == "Div":
            match = _softmax(node, annotated)
        elif node.op_type == "Mul":
            match = _gelu_tanh(node, annotated)
        if match is None:
            continue
        x, op, attrs, chain = match
        _replace(graph, node, x, op, attrs, chain)
        fused = True
    return fused


def _undo_scale(graph: ir.Graph, div: ir.Node, annotated: bool) -> bool:
    """``(x * c) / c`` with ``c`` a power of two (exact both ways, as Flax's average pooling
    leaves it): ``x``."""
    c = _const(div.inputs[1], annotated)
    mul = _only(div.inputs[0])
    if c is None or mul is None or mul.op_type != "Mul" or not c or math.frexp(c)[0] != 0.5:
        return False
    x = _other(mul, annotated, c)
    if x is None or _const(x, annotated) is not None or x.dtype != div.outputs[0].dtype:
        return False
    return forward(graph, div, x)


def _only(value: ir.Value, n: int = 1) -> ir.Node | None:
    """The producer of ``value`` when exactly ``n`` nodes read it and it is not an output."""
    if value is None or value.is_graph_output() or len(value.uses()) != n:
        return None
    return value.producer()


def _const(value: ir.Value | None, annotated: bool) -> float | None:
    c = constant_of(value, annotated)
    if c is None or np.asarray(c).size != 1 or np.asarray(c).dtype.kind != "f":
        return None
    return float(np.asarray(c).reshape(-1)[0])


def _axis(node: ir.Node, annotated: bool) -> int | None:
    """The single reduced axis of a ReduceMax/ReduceSum (axes as input or attribute)."""
    axes = constant_of(node.inputs[1], annotated) if len(node.inputs) > 1 else None
    if axes is None and "axes" in node.attributes:
        axes = np.asarray(node.attributes["axes"].value)
    if axes is None or np.asarray(axes).size != 1:
        return None
    rank = _rank(node.inputs[0])
    a = int(np.asarray(axes).reshape(-1)[0])
    return a + rank if a < 0 and rank is not None else a


def _rank(value: ir.Value | None) -> int | None:
    return None if value is None or value.shape is None else len(value.shape)


def _keepdims_of(value: ir.Value, annotated: bool) -> tuple[ir.Node, list[ir.Node]] | None:
    """``(reduce node, nodes after it)`` for a reduction whose reduced axis is kept: a
    ``keepdims=1`` reduction, or ``keepdims=0`` followed by a Reshape back to that shape;
    a ``Max(-inf, m)`` on the way (jax's ``initial=-inf``) changes nothing."""
    chain: list[ir.Node] = []
    node = _only(value)
    if node is not None and node.op_type == "Reshape":
        chain.append(node)
        node = _only(node.inputs[0])
    if node is not None and node.op_type == "Max" and len(node.inputs) == 2:
        lows = [_const(v, annotated) for v in node.inputs]
        if lows[0] == -math.inf or lows[1] == -math.inf:
            chain.append(node)
            node = _only(node.inputs[1] if lows[0] == -math.inf else node.inputs[0])
    if node is None or node.op_type not in ("ReduceMax", "ReduceSum"):
        return None
    keep = node.attributes.get("keepdims")
    keep = 1 if keep is None else int(keep.value)
    reshaped = any(n.op_type == "Reshape" for n in chain)
    if keep == 1 and reshaped:
        return None
    if keep == 0:
        a, x = _axis(node, annotated), node.inputs[0]
        reshape = next(n for n in chain if n.op_type == "Reshape")
        target = constant_of(reshape.inputs[1], annotated)
        if not reshaped or a is None or x.shape is None or target is None:
            return None
        if not _restores(list(x.shape), a, [int(d) for d in np.asarray(target).reshape(-1)]):
            return None
    return node, chain


def _restores(dims: list, axis: int, target: list[int]) -> bool:
    """Whether Reshape to ``target`` of ``dims`` reduced over ``axis`` (not kept) gives
    ``dims`` with that axis 1: static dims spelled out, a dynamic one as ``-1`` (once) or
    ``0`` (copied from the same position, which the reduction only shifts past ``axis``)."""
    if len(target) != len(dims) or target[axis] != 1 or target.count(-1) > 1:
        return False
    for i, (d, t) in enumerate(zip(dims, target, strict=True)):
        if i == axis:
            continue
        if isinstance(d, int):
            if t != d:
                return False
        elif t != -1 and not (t == 0 and i < axis):
            return False
    return True


def _softmax(div: ir.Node, annotated: bool):
    """``exp(x - max(x, a)) / sum(exp(...), a)`` -> ``Softmax(x, axis=a)``."""
    e, s = div.inputs
    exp = e.producer() if e is not None and len(e.uses()) == 2 else None
    if exp is None or exp.op_type != "Exp" or e.is_graph_output():
        return None
    total = _keepdims_of(s, annotated)
    if total is None or total[0].op_type != "ReduceSum" or total[0].inputs[0] is not e:
        return None
    sub = _only(exp.inputs[0])
    if sub is None or sub.op_type != "Sub":
        return None
    x = sub.inputs[0]
    peak = _keepdims_of(sub.inputs[1], annotated)
    if peak is None or peak[0].op_type != "ReduceMax" or peak[0].inputs[0] is not x:
        return None
    a = _axis(total[0], annotated)
    if a is None or a != _axis(peak[0], annotated) or _rank(x) is None:
        return None
    axis = -1 if a == _rank(x) - 1 else a
    chain = [exp, sub, total[0], *total[1], peak[0], *peak[1]]
    return x, "Softmax", {"axis": axis}, chain


_GELU = {"half": 0.5, "one": 1.0, "scale": math.sqrt(2.0 / math.pi), "cube": 0.044715}


def _close(v: float | None, want: float) -> bool:
    return v is not None and abs(v - want) <= 1e-6 * abs(want)


def _other(node: ir.Node, annotated: bool, want: float) -> ir.Value | None:
    """The non-constant operand of a binary ``node`` whose other operand is ``want``."""
    a, b = node.inputs
    if _close(_const(a, annotated), want):
        return b
    if _close(_const(b, annotated), want):
        return a
    return None


def _gelu_tanh(mul: ir.Node, annotated: bool):
    """``x * (0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x ** 3))))`` (Flax's ``nn.gelu``)
    -> ``Gelu(x, approximate="tanh")``."""
    for x, h in (mul.inputs, reversed(mul.inputs)):
        chain: list[ir.Node] = []
        half = _only(h)
        if half is None or half.op_type != "Mul":
            continue
        one = _other(half, annotated, _GELU["half"])
        add1 = _only(one) if one is not None else None
        if add1 is None or add1.op_type != "Add":
            continue
        t = _other(add1, annotated, _GELU["one"])
        tanh = _only(t) if t is not None else None
        if tanh is None or tanh.op_type != "Tanh":
            continue
        scaled = _only(tanh.inputs[0])
        if scaled is None or scaled.op_type != "Mul":
            continue
        inner = _other(scaled, annotated, _GELU["scale"])
        add2 = _only(inner) if inner is not None else None
        if add2 is None or add2.op_type != "Add" or x not in add2.inputs:
            continue
        cubic = add2.inputs[1] if add2.inputs[0] is x else add2.inputs[0]
        mcube = _only(cubic)
        if mcube is None or mcube.op_type != "Mul":
            continue
        p = _other(mcube, annotated, _GELU["cube"])
        power = _only(p) if p is not None else None
        if (
            power is None
            or power.op_type != "Pow"
            or power.inputs[0] is not x
            or _const(power.inputs[1], annotated) != 3.0
        ):
            continue
        chain = [half, add1, tanh, scaled, add2, mcube, power]
        return x, "Gelu", {"approximate": "tanh"}, chain
    return None


def _replace(graph: ir.Graph, last: ir.Node, x: ir.Value, op: str, attrs, chain) -> None:
    """``last`` (and the ``chain`` that only feeds it) -> one ``op`` node on ``x``."""
    new = ir.node(op, inputs=[x], attributes=attrs, name=last.name)
    copy_provenance(last, new)
    out, fused = last.outputs[0], new.outputs[0]
    fused.dtype, fused.shape = out.dtype, out.shape
    graph.insert_before(last, new)
    name = out.name
    ir.convenience.replace_all_uses_with(out, fused, replace_graph_outputs=True)
    out.name = None
    fused.name = name
    graph.remove(last, safe=True)
    removed = True
    while removed:  # the chain's nodes, each read only inside it: now unused
        removed = False
        for node in chain:
            if node.graph is not None and not any(o.uses() for o in node.outputs):
                graph.remove(node, safe=True)
                removed = True
