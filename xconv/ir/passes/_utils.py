"""Helpers shared by the canonicalisation passes."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from xconv.ir.metadata import ROLE, SCOPE, SOURCE_LINE


def is_annotated(graph: ir.Graph) -> bool:
    """True when the importer marked weights with ``xconv.role`` (then only those are weights)."""
    return any(ROLE in v.metadata_props for v in graph.initializers.values())


#: Inputs that configure an op rather than carry learned values (Resize scales and roi, the
#: boxes of RoiAlign and MaxRoiPool): a floating initializer used only there is a constant,
#: not a weight. A constant is known when traced, so RoiAlign's adaptive grid, whose size
#: comes from the boxes, still runs under ``jax.jit``.
CONFIG_INPUTS = {
    "Resize": frozenset({1, 2, 3}),
    "Upsample": frozenset({1}),
    "RoiAlign": frozenset({1}),
    "MaxRoiPool": frozenset({1}),
}


def is_weight(value: ir.Value, annotated: bool) -> bool:
    """Whether an initializer is a trainable weight (``params``) or a constant.

    The one rule every backend, emitter and pass uses. In a model whose importer annotated
    weights with ``xconv.role``, exactly the annotated initializers are weights. Otherwise
    every floating-point initializer of rank >= 1 is, except one used only as an op's
    configuration (:data:`CONFIG_INPUTS`).
    """
    if not value.is_initializer():
        return False
    if annotated:
        return ROLE in value.metadata_props
    tensor = value.const_value
    if tensor is None or not tensor.dtype.is_floating_point() or len(tensor.shape) < 1:
        return False
    uses = list(value.uses())
    return not uses or not all(index in CONFIG_INPUTS.get(node.op_type, ()) for node, index in uses)


def constant_of(value: ir.Value | None, annotated: bool) -> np.ndarray | None:
    """The numpy value of a constant (Constant node output or non-weight initializer)."""
    if value is None:
        return None
    if value.is_initializer():
        if is_weight(value, annotated) or value.is_graph_input():
            return None
        return None if value.const_value is None else value.const_value.numpy()
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.domain == "":
        if value.const_value is not None:
            return value.const_value.numpy()
        attr = producer.attributes.get("value")
        if attr is not None and attr.type == ir.AttributeType.TENSOR:
            return attr.value.numpy()
        return _constant_attr_value(producer)
    return None


def _constant_attr_value(node: ir.Node) -> np.ndarray | None:
    for name, attr in node.attributes.items():
        v = attr.value
        if name == "value_float":
            return np.array(v, dtype=np.float32)
        if name == "value_floats":
            return np.array(list(v), dtype=np.float32)
        if name == "value_int":
            return np.array(v, dtype=np.int64)
        if name == "value_ints":
            return np.array(list(v), dtype=np.int64)
    return None


def copy_provenance(src: ir.Node, dst: ir.Node) -> None:
    for key in (SCOPE, SOURCE_LINE, "xconv.module"):
        if key in src.metadata_props:
            dst.metadata_props[key] = src.metadata_props[key]


def constant_node(array: np.ndarray, name: str | None, like: ir.Node) -> ir.Node:
    """A ``Constant`` node holding ``array`` with the provenance of ``like``."""
    tensor = ir.tensor(np.asarray(array), name=name)
    node = ir.node("Constant", inputs=[], attributes={"value": tensor}, name=like.name)
    out = node.outputs[0]
    out.const_value = tensor
    out.dtype = tensor.dtype
    out.shape = ir.Shape(tensor.shape)
    copy_provenance(like, node)
    return node


def replace_with_constants(graph: ir.Graph, node: ir.Node, arrays: list[np.ndarray]) -> None:
    """Replace every output of ``node`` by a Constant node and remove ``node``."""
    new_nodes = []
    for out, array in zip(node.outputs, arrays, strict=True):
        new = constant_node(array, out.name, node)
        new_nodes.append(new)
    graph.insert_before(node, new_nodes)
    for out, new in zip(node.outputs, new_nodes, strict=True):
        name = out.name
        ir.convenience.replace_all_uses_with(out, new.outputs[0], replace_graph_outputs=True)
        new.outputs[0].name = None
        out.name = None
        new.outputs[0].name = name
    graph.remove(node, safe=True)


def forward(graph: ir.Graph, node: ir.Node, source: ir.Value) -> bool:
    """Remove a no-op ``node`` whose first output equals ``source``; False if it must stay.

    Graph outputs are kept by renaming ``source`` when ``source`` is an intermediate value.
    """
    out = node.outputs[0]
    if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
        return False
    if out.is_graph_output():
        if source.is_graph_input() or source.is_initializer() or source.is_graph_output():
            return False
        name = out.name
        ir.convenience.replace_all_uses_with(out, source, replace_graph_outputs=True)
        out.name = None
        source.name = name
    else:
        ir.convenience.replace_all_uses_with(out, source)
    if source.shape is None and out.shape is not None:
        source.shape = out.shape
    graph.remove(node, safe=True)
    return True


def static_dims(value: ir.Value | None) -> tuple[int, ...] | None:
    """The value's shape when every dimension is a known integer, else None."""
    if value is None or value.shape is None:
        return None
    dims = []
    for d in value.shape:
        if not isinstance(d, int):
            return None
        dims.append(d)
    return tuple(dims)
