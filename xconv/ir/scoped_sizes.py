"""Sizes of symbolic dims, computed in the scope that reads them.

With symbolic shapes, torch.export reads every input dim's size once, at the root
(``Squeeze(Shape(x, start=i, end=i + 1))``, its ``sym_size_int``), and reuses a product of
sizes one layer computed in the next. A layer body of the generated source would then take
those scalars as inputs, and the emitter could not write it as the standard layer it is
(``nn.MultiheadAttention``). :func:`localize_sizes` gives each scope its own copy, computed
from a tensor that enters the scope with the same dim. The source emitters run it on their
copy of the IR; the IR itself keeps the exporter's values (the layerwise parity check cuts the
program at them by name).
"""

from __future__ import annotations

import re

import onnx_ir as ir

from xconv.ir.metadata import MODULE, SCOPE, SOURCE_LINE


def _scope_suffix(scope: str | None) -> str:
    return re.sub(r"\W", "_", scope) if scope else "root"


def _size_of(node: ir.Node) -> tuple[ir.Value, int] | None:
    """``(x, axis)`` when ``node`` is the exporter's size of one dim, ``Squeeze(Shape(x,
    start=axis, end=axis + 1))`` (``sym_size_int`` of a symbolic dim)."""
    if node.op_type != "Squeeze" or len(node.inputs) != 1 or node.inputs[0] is None:
        return None
    shape = node.inputs[0].producer()
    if shape is None or shape.op_type != "Shape" or not shape.inputs:
        return None
    start = shape.attributes.get("start")
    end = shape.attributes.get("end")
    if start is None or end is None or end.as_int() != start.as_int() + 1:
        return None
    return shape.inputs[0], start.as_int()


#: Scalar arithmetic torch.export writes over symbolic sizes (``batch * heads``).
_SIZE_ARITHMETIC = frozenset({"Add", "Sub", "Mul", "Div", "Cast", "Neg", "Max", "Min"})


def _size_expr(node: ir.Node | None, depth: int = 0) -> bool:
    """Whether ``node`` computes a scalar from the sizes of symbolic dims and constants only:
    a size (:func:`_size_of`) or scalar arithmetic over such values."""
    if node is None or depth > 8:
        return False
    if _size_of(node) is not None:
        return True
    if node.op_type == "Constant" and not node.inputs:
        return depth > 0
    if node.op_type not in _SIZE_ARITHMETIC or len(node.outputs) != 1:
        return False
    out = node.outputs[0]
    if out.shape is None or len(out.shape) != 0:
        return False
    return all(v is not None and _size_expr(v.producer(), depth + 1) for v in node.inputs)


def localize_sizes(graph: ir.Graph) -> int:
    """Give each scope that reads a size of a symbolic dim (or scalar arithmetic over sizes)
    from another scope its own copy, computed from a value that enters the scope with that dim.

    With symbolic shapes, torch.export reads every input dim's size once, at the root, and
    reuses a product of sizes one layer computed in the next: each layer body would then take
    those scalars as inputs, and an emitter could not write it as the standard layer it is
    (``nn.MultiheadAttention``). The layer's own input holds the same dims.
    """
    order = {node: i for i, node in enumerate(graph)}
    by_scope: dict[str, list[ir.Node]] = {}
    names = {v.name for v in graph.inputs} | set(graph.initializers)
    for node in graph:
        by_scope.setdefault(node.metadata_props.get(SCOPE) or "", []).append(node)
        names.update(o.name for o in node.outputs if o.name)
    copies = 0
    for node in list(graph):
        if not _size_expr(node):
            continue
        (value,) = node.outputs
        own = node.metadata_props.get(SCOPE) or ""
        foreign: dict[str, list[tuple[ir.Node, int]]] = {}
        for use in value.uses():
            scope = use.node.metadata_props.get(SCOPE) or ""
            if scope and scope != own:
                foreign.setdefault(scope, []).append((use.node, use.idx))
        for scope, uses in sorted(foreign.items()):
            first = min((u for u, _ in uses), key=order.__getitem__)
            made: list[ir.Node] = []
            local = _clone_size(node, scope, by_scope, order, order[first], first, made, {})
            if local is None:
                continue
            for clone in made:
                for out in clone.outputs:
                    while out.name in names:
                        out.name += "_"
                    names.add(out.name)
            graph.insert_before(first, made)
            for user, idx in uses:
                user.replace_input_with(idx, local)
            copies += 1
    return copies


def _clone_size(
    node: ir.Node, scope: str, by_scope: dict, order: dict, before: int, first: ir.Node,
    made: list[ir.Node], memo: dict,
) -> ir.Value | None:  # fmt: skip
    """The value of the size expression ``node`` computed inside ``scope`` (new nodes
    appended to ``made``, in order), or None when a size it reads has no entry there."""
    if node in memo:
        return memo[node]
    found = _size_of(node)
    if found is not None:
        x, axis = found
        dim = x.shape[axis] if x.shape is not None and axis < len(x.shape) else None
        if not isinstance(dim, ir.SymbolicDim) or dim.value is None:
            return None
        entry = _entry_with_dim(by_scope, scope, dim.value, order, before)
        if entry is None:
            return None
        h, k = entry
        shape_out = ir.Value(name=f"{h.name}_shape_{k}", type=ir.TensorType(ir.DataType.INT64),
                             shape=ir.Shape([1]))  # fmt: skip
        new = [
            ir.Node(
                "",
                "Shape",
                [h],
                attributes=[ir.AttrInt64("start", k), ir.AttrInt64("end", k + 1)],
                outputs=[shape_out],
            ),  # fmt: skip
            ir.Node(
                "",
                "Squeeze",
                [shape_out],
                outputs=[
                    ir.Value(
                        name=f"{h.name}_size_{k}", type=node.outputs[0].type, shape=ir.Shape([])
                    )
                ],
            ),  # fmt: skip
        ]
    else:
        inputs = []
        for v in node.inputs:
            got = _clone_size(v.producer(), scope, by_scope, order, before, first, made, memo)
            if got is None:
                return None
            inputs.append(got)
        out = node.outputs[0]
        new = [ir.Node(
            node.domain, node.op_type, inputs,
            attributes=[ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()],
            outputs=[ir.Value(name=f"{out.name}_{_scope_suffix(scope)}", type=out.type,
                              shape=out.shape)],
        )]  # fmt: skip
    for clone in new:
        clone.metadata_props[SCOPE] = scope
        for key in (MODULE, SOURCE_LINE):
            if key in first.metadata_props:
                clone.metadata_props[key] = first.metadata_props[key]
    made.extend(new)
    memo[node] = new[-1].outputs[0]
    return memo[node]


def _entry_with_dim(
    by_scope: dict[str, list[ir.Node]], scope: str, dim: str, order: dict, before: int
) -> tuple[ir.Value, int] | None:
    """A tensor that enters ``scope`` (read there, made outside it, before node index
    ``before``) and has the symbolic ``dim`` at some axis: ``(value, axis)``."""
    inside = [
        n for s, nodes in by_scope.items() if s == scope or s.startswith(scope + ".") for n in nodes
    ]
    members = set(inside)
    for node in sorted(inside, key=order.__getitem__):
        for value in node.inputs:
            if value is None or value.shape is None or value.is_initializer():
                continue
            producer = value.producer()
            if producer in members or _size_expr(producer):
                continue
            if producer is not None and order.get(producer, before) >= before:
                continue
            for k, d in enumerate(value.shape):
                if isinstance(d, ir.SymbolicDim) and d.value == dim:
                    return value, k
    return None
