"""No-op elimination, transpose-pair cancellation and dead-node removal."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from xconv.ir.metadata import LAYER
from xconv.ir.passes._utils import (
    constant_of,
    copy_provenance,
    forward,
    is_annotated,
    static_dims,
)


class NoOpEliminationPass(ir.passes.InPlacePass):
    """Remove nodes that return their input unchanged.

    ``Identity``; ``Dropout`` in inference (no ``training_mode`` input or a constant false
    one, mask unused); ``Cast`` to the input's own type; ``Reshape``/``Expand`` to the input's
    own static shape; ``Transpose`` with the identity permutation; ``x * 1`` and an integer
    ``x + 0`` / ``x - 0`` (a position offset of zero, RoPE's ``attention_scaling`` of 1). A
    node carrying
    ``xconv.layer`` is kept: its layer (e.g. a dropout) is emitted as the target's native layer.
    An ``Attention``'s mask that masks nothing is dropped (see :func:`masks_nothing`).
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        annotated = is_annotated(graph)
        modified = False
        for node in list(graph):
            if node.domain not in ("", "ai.onnx") or LAYER in node.metadata_props:
                continue
            if node.op_type == "Attention" and masks_nothing(node, annotated):
                node.replace_input_with(3, None)
                modified = True
                continue
            source = _noop_source(node, annotated)
            if source is not None and forward(graph, node, source):
                modified = True
        return ir.passes.PassResult(model, modified=modified)


#: Ops that only move or repeat a mask's values.
_VALUE_KEEPING = frozenset({"Expand", "Reshape", "Unsqueeze", "Squeeze", "Identity", "Transpose"})


def masks_nothing(node: ir.Node, annotated: bool) -> bool:
    """Whether an ``Attention``'s ``attn_mask`` is a constant that masks nothing: every entry
    True (boolean) or 0 (float), seen through ops that only move or repeat its values (how
    exporters write the mask of an input without padding), over every key (a shorter mask
    is padded with masked keys)."""
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    if mask is None or mask.shape is None or len(node.inputs) < 2 or node.inputs[1] is None:
        return False
    k = node.inputs[1]
    if k.shape is None or len(k.shape) not in (3, 4) or not len(mask.shape):
        return False
    past = node.inputs[4] if len(node.inputs) > 4 else None
    kv_len = k.shape[len(k.shape) - 2] if len(k.shape) == 4 else k.shape[1]
    if past is not None or not isinstance(kv_len, int) or mask.shape[-1] != kv_len:
        return False
    value = mask
    while (producer := value.producer()) is not None and producer.op_type in _VALUE_KEEPING:
        if producer.domain not in ("", "ai.onnx") or producer.inputs[0] is None:
            return False
        value = producer.inputs[0]
    const = constant_of(value, annotated)
    if const is None or const.size == 0:
        return False
    return bool(np.all(const)) if const.dtype == np.bool_ else not np.any(const)


def _noop_source(node: ir.Node, annotated: bool) -> ir.Value | None:
    x = node.inputs[0] if node.inputs else None
    if x is None:
        return None
    op = node.op_type
    if op == "Identity":
        return x
    if op == "Dropout":
        training = node.inputs[2] if len(node.inputs) > 2 else None
        if training is not None and training.name:
            flag = constant_of(training, annotated)
            if flag is None or bool(flag):
                return None
        return x
    if op == "Cast":
        to = node.attributes.get("to")
        if x.dtype is not None and to is not None and ir.DataType(to.value) == x.dtype:
            return x
        return None
    if op in ("Reshape", "Expand"):
        dims = static_dims(x)
        target = constant_of(node.inputs[1], annotated)
        if dims is None or target is None:
            return None
        target = [int(t) for t in np.asarray(target).reshape(-1)]
        if op == "Reshape":
            allowzero = node.attributes.get("allowzero")
            if not (allowzero is not None and allowzero.value):
                target = [dims[i] if t == 0 and i < len(dims) else t for i, t in enumerate(target)]
            if target.count(-1) == 1 and len(target) == len(dims):
                known = int(np.prod([t for t in target if t != -1], dtype=np.int64))
                if known:
                    target = [
                        int(np.prod(dims, dtype=np.int64)) // known if t == -1 else t
                        for t in target
                    ]
            return x if tuple(target) == dims else None
        return (
            x
            if len(target) <= len(dims)
            and all(t == 1 or t == d for t, d in zip(target[::-1], dims[::-1], strict=False))
            else None
        )
    if op == "Transpose":
        perm = node.attributes.get("perm")
        if perm is not None and list(perm.value) == list(range(len(perm.value))):
            return x
    if op in ("Add", "Sub", "Mul") and len(node.inputs) == 2:
        return _unit_operand_source(node, annotated)
    return None


def _unit_operand_source(node: ir.Node, annotated: bool) -> ir.Value | None:
    """The operand of ``x * 1`` (any dtype: exact) or of an integer ``x + 0`` / ``x - 0``
    (a float ``-0.0 + 0`` is ``+0.0``), when the unit does not broadcast ``x`` to more."""
    unit = 1 if node.op_type == "Mul" else 0
    sides = [(0, 1), (1, 0)] if node.op_type != "Sub" else [(0, 1)]
    for i, j in sides:
        x, c = node.inputs[i], node.inputs[j]
        if x is None or c is None or x.dtype is None or x.dtype != node.outputs[0].dtype:
            continue
        if unit == 0 and not x.dtype.is_integer():
            continue
        const = constant_of(c, annotated)
        if const is None or not np.all(np.asarray(const) == unit):
            continue
        dims = x.shape
        if const.ndim == 0 or (
            dims is not None and const.ndim <= len(dims) and all(d == 1 for d in const.shape)
        ):
            return x
    return None


class TransposeCancellationPass(ir.passes.InPlacePass):
    """Fuse ``Transpose(Transpose(x, p), q)`` into one transpose, or none when they cancel."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            if (
                node.graph is None
                or node.op_type != "Transpose"
                or node.domain not in ("", "ai.onnx")
            ):
                continue
            first = node.inputs[0].producer() if node.inputs[0] is not None else None
            if first is None or first.op_type != "Transpose" or first.domain not in ("", "ai.onnx"):
                continue
            p, q = _perm(first), _perm(node)
            if p is None or q is None or len(p) != len(q):
                continue
            combined = [p[i] for i in q]
            source = first.inputs[0]
            if combined == list(range(len(combined))):
                if forward(graph, node, source):
                    modified = True
                continue
            fused = ir.node(
                "Transpose", inputs=[source], attributes={"perm": combined}, name=node.name
            )
            copy_provenance(node, fused)
            out = node.outputs[0]
            if out.type is not None:
                fused.outputs[0].type = out.type
            fused.outputs[0].shape = out.shape
            graph.insert_before(node, fused)
            name = out.name
            ir.convenience.replace_all_uses_with(out, fused.outputs[0], replace_graph_outputs=True)
            out.name = None
            fused.outputs[0].name = name
            graph.remove(node, safe=True)
            modified = True
        return ir.passes.PassResult(model, modified=modified)


def _perm(node: ir.Node) -> list[int] | None:
    attr = node.attributes.get("perm")
    if attr is not None:
        return list(attr.value)
    x = node.inputs[0]
    if x is None or x.shape is None:
        return None
    return list(range(len(x.shape)))[::-1]


class DeadNodeRemovalPass(ir.passes.InPlacePass):
    """Remove nodes and initializers nothing uses (the model's signature is kept)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnx_ir.passes.common import RemoveUnusedNodesPass

        return RemoveUnusedNodesPass()(model)
