"""Layout passes: move data transposes forward until they cancel, out of layer bodies.

A channels-last source (Flax, Keras) imported into the IR shows each convolution, pooling and
BatchNormalization as ``Transpose(NHWC -> NCHW) -> op -> Transpose(NCHW -> NHWC)``, with the
elementwise work between layers (bias adds, activations, residual adds) done channels-last.
For a channels-first target (torch), :class:`TransposeSinkingPass` pushes each data transpose
forward through elementwise ops, reductions, softmax and concatenation, so that consecutive
inverse pairs meet and :class:`~xconv.ir.passes.simplify.TransposeCancellationPass` removes
them: the graph then computes channels-first, with one transpose where the layout truly
changes (the graph input, a flatten). :func:`detach_boundary_transposes` then moves the data
transposes left at the edge of a layer's body into the enclosing scope, so a recognised
layer's body is exactly the layer (a native ``nn.Conv2d`` can replace it).

Not part of :func:`~xconv.ir.passes.canonicalize`: emitters whose target is channels-first
call :func:`sink_transposes`; the Flax emitter wants the opposite direction and has its own
layout propagation.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from xconv.ir.metadata import LAYER, MODULE, SCOPE, get_scope
from xconv.ir.passes._utils import copy_provenance, static_dims
from xconv.ir.passes.simplify import DeadNodeRemovalPass, TransposeCancellationPass, _perm

#: Elementwise ops (all inputs broadcast against each other, output shaped like them).
ELEMENTWISE = frozenset(
    {
        *("Abs", "Acos", "Asin", "Atan", "Ceil", "Cos", "Cosh", "Elu", "Erf", "Exp", "Floor"),
        *("Gelu", "HardSigmoid", "HardSwish", "Identity", "IsInf", "IsNaN", "LeakyRelu", "Log"),
        *("Mish", "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin"),
        *("Sinh", "Softplus", "Softsign", "Sqrt", "Tan", "Tanh", "Celu", "ThresholdedRelu"),
        *("Cast", "Clip"),
        *("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mean", "Sum", "Mod", "PRelu"),
        *("And", "Or", "Xor", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"),
        "Where",
    }
)
#: Reductions whose axes come from the ``axes`` input (opset 18+) or attribute.
REDUCTIONS = frozenset(
    {
        *("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd"),
        *("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"),
    }
)
#: Single-input ops with one ``axis`` attribute that a transpose renames (Concat, with several
#: inputs, moves with the elementwise ops).
AXIS_OPS = frozenset({"Softmax", "LogSoftmax"})

#: Upper bound on sweeps over the graph (each sweep moves every movable transpose one op).
MAX_SWEEPS = 64


def sink_transposes(model: ir.Model) -> ir.Model:
    """Sink data transposes, cancel inverse pairs, drop dead nodes, detach layer plumbing.

    In place; returns ``model``.
    """
    for _ in range(MAX_SWEEPS):
        changed = TransposeSinkingPass()(model).modified
        changed |= TransposeCancellationPass()(model).modified
        DeadNodeRemovalPass()(model)
        if not changed:
            break
    detach_boundary_transposes(model.graph)
    return model


def _dynamic_values(graph: ir.Graph) -> set[ir.Value]:
    """Values that depend on a graph input (the rest are weights and constants)."""
    dynamic: set[ir.Value] = set(graph.inputs)
    for node in graph:
        if any(v in dynamic for v in node.inputs if v is not None):
            dynamic.update(node.outputs)
    return dynamic


def _inverse(perm: list[int]) -> list[int]:
    return [int(i) for i in np.argsort(perm)]


class TransposeSinkingPass(ir.passes.InPlacePass):
    """Move data ``Transpose`` nodes below the layout-agnostic ops that consume them.

    ``op(Transpose(x, p), c)`` becomes ``Transpose(op(x, c'), p)`` where ``c'`` is the static
    operand ``c`` transposed by ``p``'s inverse (after right-aligning its rank). Only nodes
    whose every data (input-dependent) operand is a transpose with the same permutation move,
    so no transpose is added on another data path.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        dynamic = _dynamic_values(graph)
        modified = False
        for node in list(graph):
            if node.graph is None or node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type in ELEMENTWISE or node.op_type == "Concat":
                modified |= _sink_elementwise(graph, node, dynamic)
            elif node.op_type in REDUCTIONS:
                modified |= _sink_reduction(graph, node, dynamic)
            elif node.op_type in AXIS_OPS:
                modified |= _sink_axis_op(graph, node)
        return ir.passes.PassResult(model, modified=modified)


def transpose_of(value: ir.Value | None) -> tuple[ir.Node, list[int]] | None:
    """``(node, perm)`` when ``value`` is the output of a plain Transpose with a known perm."""
    producer = value.producer() if value is not None else None
    if (
        producer is None
        or producer.op_type != "Transpose"
        or producer.domain not in ("", "ai.onnx")
    ):
        return None
    perm = _perm(producer)
    return None if perm is None else (producer, perm)


def _sink_elementwise(graph: ir.Graph, node: ir.Node, dynamic: set[ir.Value]) -> bool:
    if len(node.outputs) != 1:
        return False
    data = [i for i, v in enumerate(node.inputs) if v is not None and v in dynamic]
    if not data:
        return False
    perm = None
    for i in data:
        found = transpose_of(node.inputs[i])
        if found is None or (perm is not None and found[1] != perm):
            return False
        perm = found[1]
    assert perm is not None
    rank = len(perm)
    if node.op_type == "Concat" and not _axis_in_rank(node, rank):
        return False
    inv = _inverse(perm)
    new_inputs: list[ir.Value | None] = []
    for i, v in enumerate(node.inputs):
        if v is None or i in data:
            new_inputs.append(None if v is None else node.inputs[i].producer().inputs[0])
            continue
        moved = _permute_static(graph, node, v, inv, rank)
        if moved is False:
            return False
        new_inputs.append(moved)
    attrs = dict(node.attributes)
    if node.op_type == "Concat":
        axis = int(attrs["axis"].value) % rank
        attrs["axis"] = ir.AttrInt64("axis", perm[axis])
    _rebuild(graph, node, new_inputs, attrs, perm)
    return True


def _axis_in_rank(node: ir.Node, rank: int) -> bool:
    attr = node.attributes.get("axis")
    return attr is not None and -rank <= int(attr.value) < rank


def _permute_static(
    graph: ir.Graph, node: ir.Node, value: ir.Value, inv: list[int], rank: int
) -> ir.Value | None | bool:
    """The static operand for the channels-first op, or False when it cannot be moved."""
    dims = static_dims(value)
    if dims is None:
        return False
    if len(dims) > rank:
        return False
    if all(d == 1 for d in dims) and len(dims) <= rank:
        return value  # a scalar-like operand broadcasts the same in any layout
    if node.op_type in ("Clip",):  # min / max are scalars
        return value
    if len(dims) < rank:
        shape = ir.node(
            "Constant",
            inputs=[],
            attributes={"value": ir.tensor(np.array([1] * (rank - len(dims)) + list(dims)))},
        )
        reshape = ir.node("Reshape", inputs=[value, shape.outputs[0]])
        for n in (shape, reshape):
            copy_provenance(node, n)
        graph.insert_before(node, [shape, reshape])
        reshape.outputs[0].dtype = value.dtype
        reshape.outputs[0].shape = ir.Shape([1] * (rank - len(dims)) + list(dims))
        value = reshape.outputs[0]
        dims = (1,) * (rank - len(dims)) + tuple(dims)
    t = ir.node("Transpose", inputs=[value], attributes={"perm": inv})
    copy_provenance(node, t)
    graph.insert_before(node, t)
    t.outputs[0].dtype = value.dtype
    t.outputs[0].shape = ir.Shape([dims[i] for i in inv])
    return t.outputs[0]


def _rebuild(
    graph: ir.Graph,
    node: ir.Node,
    inputs: list[ir.Value | None],
    attrs: dict[str, ir.Attr],
    out_perm: list[int] | None,
) -> None:
    """Replace ``node`` by the same op on ``inputs``, then ``Transpose(out_perm)`` if given."""
    old = node.outputs[0]
    new = ir.node(
        node.op_type,
        inputs=inputs,
        attributes=attrs,
        domain=node.domain,
        name=node.name,
        version=node.version,
    )
    for key, val in node.metadata_props.items():
        new.metadata_props[key] = val
    new.outputs[0].dtype = old.dtype
    graph.insert_before(node, new)
    result = new.outputs[0]
    if out_perm is not None and out_perm != list(range(len(out_perm))):
        if old.shape is not None:
            result.shape = ir.Shape([old.shape[i] for i in _inverse(out_perm)])
        t = ir.node("Transpose", inputs=[result], attributes={"perm": out_perm})
        copy_provenance(node, t)
        graph.insert_before(node, t)
        result = t.outputs[0]
        result.dtype = old.dtype
    result.shape = old.shape
    name = old.name
    ir.convenience.replace_all_uses_with(old, result, replace_graph_outputs=True)
    old.name = None
    result.name = name
    graph.remove(node, safe=True)


def _sink_reduction(graph: ir.Graph, node: ir.Node, dynamic: set[ir.Value]) -> bool:
    found = transpose_of(node.inputs[0])
    if found is None or len(node.outputs) != 1:
        return False
    _, perm = found
    rank = len(perm)
    axes_attr = node.attributes.get("axes")
    axes_input = node.inputs[1] if len(node.inputs) > 1 else None
    if axes_input is not None:
        if axes_input in dynamic or axes_input.const_value is None:
            return False
        axes = [int(a) for a in np.asarray(axes_input.const_value.numpy()).reshape(-1)]
    elif axes_attr is not None:
        axes = [int(a) for a in axes_attr.value]
    else:
        return False  # all axes or noop_with_empty_axes: nothing to gain
    if not axes:
        return False
    axes = sorted(a % rank for a in axes)
    new_axes = sorted(perm[a] for a in axes)
    keep = int(node.attributes["keepdims"].value) if "keepdims" in node.attributes else 1
    if keep:
        out_perm = perm
    else:
        kept = [perm[j] for j in range(rank) if j not in axes]
        order = sorted(kept)
        out_perm = [order.index(d) for d in kept]
    attrs = dict(node.attributes)
    inputs: list[ir.Value | None] = [node.inputs[0].producer().inputs[0]]
    if axes_input is not None:
        const = ir.node(
            "Constant", inputs=[], attributes={"value": ir.tensor(np.array(new_axes, np.int64))}
        )
        copy_provenance(node, const)
        graph.insert_before(node, const)
        inputs.append(const.outputs[0])
        inputs += list(node.inputs[2:])
    else:
        attrs["axes"] = ir.AttrInt64s("axes", new_axes)
    _rebuild(graph, node, inputs, attrs, out_perm)
    return True


def _sink_axis_op(graph: ir.Graph, node: ir.Node) -> bool:
    found = transpose_of(node.inputs[0])
    if found is None or len(node.outputs) != 1 or len(node.inputs) != 1:
        return False
    _, perm = found
    if not _axis_in_rank(node, len(perm)):
        return False
    attrs = dict(node.attributes)
    axis = int(attrs["axis"].value) % len(perm)
    attrs["axis"] = ir.AttrInt64("axis", perm[axis])
    _rebuild(graph, node, [node.inputs[0].producer().inputs[0]], attrs, perm)
    return True


def detach_boundary_transposes(graph: ir.Graph) -> int:
    """Move data transposes at the edge of a layer's scope into the enclosing scope.

    A transpose belongs to a layer's body when the importer wrote it there (Flax's
    ``nn.Conv`` runs channels-last, so its NCHW Conv node sits between two transposes in the
    layer's scope). When its input comes from outside the scope (leading) or its output is
    only used outside it (trailing), it is layout plumbing between layers, not the layer.
    Returns the number of transposes moved.
    """
    layer_scopes = {get_scope(n) for n in graph if LAYER in n.metadata_props and get_scope(n)}
    dynamic = _dynamic_values(graph)
    moved = 0
    for node in graph:
        scope = get_scope(node)
        if (
            node.op_type != "Transpose"
            or scope not in layer_scopes
            or node.inputs[0] not in dynamic
        ):
            continue
        producer = node.inputs[0].producer()
        leading = producer is None or get_scope(producer) != scope
        users = [u.node for u in node.outputs[0].uses()]
        trailing = bool(users) and all(get_scope(u) != scope for u in users)
        if not (leading or trailing):
            continue
        parent = _parent(scope)
        for key in (SCOPE, MODULE, LAYER):
            node.metadata_props.pop(key, None)
        if parent:
            node.metadata_props[SCOPE] = parent
        moved += 1
    return moved


def _parent(scope: str) -> str:
    for sep in ("/", "."):
        if sep in scope:
            return scope.rsplit(sep, 1)[0]
    return ""


__all__ = [
    "TransposeSinkingPass",
    "detach_boundary_transposes",
    "sink_transposes",
]
