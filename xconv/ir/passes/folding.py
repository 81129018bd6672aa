"""Constant folding and static shape folding.

Exporters leave shape bookkeeping behind (``Shape -> Gather -> Concat -> Reshape``). On
static shapes it is all known before run time: these passes turn it into constants, so a
``Reshape`` ends up with a literal shape. Symbolic dimensions (a dynamic batch) stay symbolic.
Weights (initializers carrying ``xconv.role``) are never folded into other tensors.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir

from xconv.ir.passes._utils import (
    constant_node,
    constant_of,
    is_annotated,
    replace_with_constants,
)

logger = logging.getLogger(__name__)

#: Ops whose results vary per call or depend on training state: never folded.
NON_FOLDABLE = frozenset(
    {
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Bernoulli",
        "Multinomial",
        "Dropout",
        "Constant",
    }
)

#: Fold only results up to this many elements: larger ones would bloat the model.
MAX_FOLDED_ELEMENTS = 1 << 20


def evaluate_node(node: ir.Node, inputs: list[np.ndarray | None], opset: int) -> list[np.ndarray]:
    """Run one node on numpy inputs with the ONNX reference evaluator."""
    from onnx.reference import ReferenceEvaluator

    node_proto = ir.serde.serialize_node(node)
    in_names = [f"in{i}" if x is not None else "" for i, x in enumerate(inputs)]
    out_names = [f"out{i}" if o.name else "" for i, o in enumerate(node.outputs)]
    del node_proto.input[:]
    node_proto.input.extend(in_names)
    del node_proto.output[:]
    node_proto.output.extend(out_names)
    graph_inputs = [
        onnx.helper.make_tensor_value_info(
            n, onnx.helper.np_dtype_to_tensor_dtype(np.asarray(x).dtype), np.asarray(x).shape
        )
        for n, x in zip(in_names, inputs, strict=True)
        if n
    ]
    graph_outputs = [onnx.helper.make_empty_tensor_value_info(n) for n in out_names if n]
    graph = onnx.helper.make_graph([node_proto], "fold", graph_inputs, graph_outputs)
    model = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", opset)], ir_version=10
    )
    feeds = {n: np.asarray(x) for n, x in zip(in_names, inputs, strict=True) if n}
    results = ReferenceEvaluator(model).run(None, feeds)
    return [np.asarray(r) for r in results]


def evaluable(node: ir.Node) -> bool:
    """Whether :func:`evaluate_node` may compute ``node`` from its inputs' values: a default
    domain op, not random or stateful (:data:`NON_FOLDABLE`), with no subgraph."""
    if node.domain not in ("", "ai.onnx") or node.op_type in NON_FOLDABLE:
        return False
    return not any(
        a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
        for a in node.attributes.values()
        if not a.is_ref()
    )


class ConstantFoldingPass(ir.passes.InPlacePass):
    """Evaluate nodes whose inputs are all constants and replace them with ``Constant`` nodes.

    Weights stay weights: a node reading an initializer with ``xconv.role`` (or, in a model
    without roles, any floating-point initializer of rank >= 1) is not folded.
    """

    def __init__(self, max_elements: int = MAX_FOLDED_ELEMENTS) -> None:
        super().__init__()
        self.max_elements = max_elements

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        annotated = is_annotated(graph)
        opset = model.opset_imports.get("", 1)
        modified = False
        for node in list(graph):
            if not self._foldable(node):
                continue
            if node.op_type == "CastLike":
                folded = _fold_cast_like(node, annotated)
                if folded is not None:
                    replace_with_constants(graph, node, [folded])
                    modified = True
                continue
            args = []
            ok = True
            for v in node.inputs:
                if v is None or not v.name:
                    args.append(None)
                    continue
                c = constant_of(v, annotated)
                if c is None:
                    ok = False
                    break
                args.append(c)
            if not ok:
                continue
            try:
                results = evaluate_node(node, args, node.version or opset)
            except Exception as e:  # the evaluator raises many kinds; folding is optional
                logger.debug("not folding %s (%s): %s", node.name, node.op_type, e)
                continue
            if any(r.size > self.max_elements for r in results):
                continue
            results = [self._keep_dtype(r, o) for r, o in zip(results, node.outputs, strict=False)]
            replace_with_constants(graph, node, results)
            modified = True
        return ir.passes.PassResult(model, modified=modified)

    @staticmethod
    def _foldable(node: ir.Node) -> bool:
        return evaluable(node) and all(o.name for o in node.outputs)

    @staticmethod
    def _keep_dtype(result: np.ndarray, value: ir.Value) -> np.ndarray:
        if value.dtype is not None:
            want = value.dtype.numpy()
            if result.dtype != want:
                return result.astype(want)
        return result


class ShapeFoldingPass(ir.passes.InPlacePass):
    """Replace ``Shape``/``Size`` of statically shaped values by constants.

    Also folds ``Gather(Shape(x), i)`` when the gathered dimensions are static even if other
    dimensions of ``x`` are symbolic, and turns ``Reshape(x, Concat(Shape(x)[:1], [-1]))``
    into ``Reshape(x, [0, -1])`` (0 copies the input's dimension), so a reshape keeps a
    literal shape under a dynamic batch. Runs ONNX shape inference first.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from onnx_ir.passes.common import ShapeInferencePass

        _clear_wrong_sequence_types(model.graph)
        ShapeInferencePass()(model)
        if propagate_same_shape(model.graph):
            ShapeInferencePass()(model)  # carry on past ops ONNX has no inference for
        graph = model.graph
        annotated = is_annotated(graph)
        modified = False
        for node in list(graph):
            if node.domain not in ("", "ai.onnx"):
                continue
            folded = None
            if node.op_type == "Shape":
                folded = _fold_shape(node)
            elif node.op_type == "Size":
                dims = _dims(node.inputs[0])
                if dims is not None and all(isinstance(d, int) for d in dims):
                    folded = np.array(int(np.prod(dims, dtype=np.int64)), dtype=np.int64)
            elif node.op_type == "Gather":
                folded = _fold_gather_of_shape(node, annotated)
            elif node.op_type == "Reshape":
                literal = _reshape_literal(node, annotated)
                if literal is not None:
                    if "allowzero" in node.attributes:  # every 0 in the literal copies
                        node.attributes["allowzero"] = ir.AttrInt64("allowzero", 0)
                    const = constant_node(literal, None, node)
                    graph.insert_before(node, const)
                    node.replace_input_with(1, const.outputs[0])
                    modified = True
                continue
            if folded is not None:
                replace_with_constants(graph, node, [folded])
                modified = True
        return ir.passes.PassResult(model, modified=modified)


def _dims(value: ir.Value | None) -> list[int | None] | None:
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in value.shape]


def _shape_slice(node: ir.Node) -> list[int | None] | None:
    dims = _dims(node.inputs[0])
    if dims is None:
        return None
    rank = len(dims)
    start = node.attributes.get("start")
    end = node.attributes.get("end")
    s = start.value if start is not None else 0
    e = end.value if end is not None else rank
    s = min(max(s + rank if s < 0 else s, 0), rank)
    e = min(max(e + rank if e < 0 else e, 0), rank)
    return dims[s:e]


def _fold_shape(node: ir.Node) -> np.ndarray | None:
    dims = _shape_slice(node)
    if dims is None or any(d is None for d in dims):
        return None
    return np.array(dims, dtype=np.int64)


def _fold_gather_of_shape(node: ir.Node, annotated: bool) -> np.ndarray | None:
    data = node.inputs[0]
    producer = data.producer() if data is not None else None
    if producer is None or producer.op_type != "Shape" or producer.domain not in ("", "ai.onnx"):
        return None
    axis = node.attributes.get("axis")
    if axis is not None and axis.value != 0:
        return None
    indices = constant_of(node.inputs[1], annotated)
    dims = _shape_slice(producer)
    if indices is None or dims is None:
        return None
    picked = np.take(np.array([-1 if d is None else d for d in dims], dtype=np.int64), indices)
    if np.any(picked < 0):
        return None
    return picked.astype(np.int64)


def _fold_cast_like(node: ir.Node, annotated: bool) -> np.ndarray | None:
    """``CastLike(c, x)`` only reads ``x``'s dtype: fold it when ``c`` is constant."""
    c = constant_of(node.inputs[0], annotated)
    target = node.inputs[1].dtype if node.inputs[1] is not None else None
    if c is None or target is None:
        return None
    try:
        return c.astype(target.numpy())
    except (TypeError, ValueError):
        return None


def _reshape_literal(node: ir.Node, annotated: bool) -> np.ndarray | None:
    """A literal shape for ``Reshape(x, Concat(...dimensions read by Shape..., constants))``.

    A piece that reads, at output position ``k``, the dimension ``x`` has at ``k`` becomes 0
    (copy the input's dimension): a ``Shape`` of ``x`` itself, or of another value whose
    dimension is the same symbol (how exporters read the batch once, from the graph input,
    for every later reshape). One other one-element piece (the batch times the heads)
    becomes -1, inferred from the element count, when no other is -1. Under ``allowzero=1``
    (exporters write it so a literal 0 is a size) there is none when a literal is 0: every 0
    returned copies a dimension, so the caller drops ``allowzero``.
    """
    allowzero = node.attributes.get("allowzero")
    data, shape = node.inputs[0], node.inputs[1]
    if data is None or data.shape is None or shape is None:
        return None
    concat = shape.producer()
    if concat is None or concat.op_type != "Concat" or constant_of(shape, annotated) is not None:
        return None
    dims: list[int] = []
    copies = 0
    for part in concat.inputs:
        c = constant_of(part, annotated)
        if c is not None:
            dims.extend(int(v) for v in np.asarray(c).reshape(-1))
            continue
        read = _read_dims(part, annotated)
        if read is None:
            if not _one_element(part):
                return None
            dims.append(-1)  # computed (the batch times the heads): inferred, if alone
            continue
        for src, i in read:
            k, d = len(dims), src.shape[i]
            if isinstance(d, int) and d > 0:
                dims.append(d)
            elif k < len(data.shape) and ((src is data and i == k) or _same(d, data.shape[k])):
                dims.append(0)
                copies += 1
            elif len(read) == 1:
                dims.append(-1)  # a dimension of another length: inferred, if alone
            else:
                return None
    if dims.count(-1) > 1:
        return None
    if allowzero is not None and allowzero.value and dims.count(0) > copies:
        return None  # a literal 0 is a size there
    return np.array(dims, dtype=np.int64)


def _one_element(value: ir.Value | None) -> bool:
    return value is not None and value.shape is not None and list(value.shape) in ([1], [])


def _same(a: object, b: object) -> bool:
    """Whether two symbolic dimensions are known equal: the same named symbol."""
    if isinstance(a, ir.SymbolicDim) and isinstance(b, ir.SymbolicDim):
        return a.value is not None and a.value == b.value
    return False


def _read_dims(part: ir.Value | None, annotated: bool) -> list[tuple[ir.Value, int]] | None:
    """The dimensions a ``Shape``-derived 1-D (or scalar) value holds, in order, each as
    (the value whose shape was read, its axis); None when ``part`` is not read from a shape."""
    p = part.producer() if part is not None else None
    if p is None:
        return None
    if p.op_type == "Shape" and p.inputs[0] is not None and p.inputs[0].shape is not None:
        src = p.inputs[0]
        start = p.attributes.get("start")
        end = p.attributes.get("end")
        s = start.value if start is not None else 0
        e = end.value if end is not None else len(src.shape)
        return [(src, i) for i in range(len(src.shape))[s:e]]
    if p.op_type == "Gather":
        idx = constant_of(p.inputs[1], annotated)
        axis = p.attributes.get("axis")
        if idx is None or idx.ndim > 1 or (axis is not None and axis.value):
            return None
        base = _read_dims(p.inputs[0], annotated)
        if base is None:
            return None
        try:
            return [base[int(i)] for i in idx.reshape(-1)]
        except IndexError:
            return None
    if p.op_type in ("Unsqueeze", "Squeeze", "Reshape"):
        # a one-element value made scalar or 1-D (a Reshape to [-1] or [1])
        base = _read_dims(p.inputs[0], annotated)
        if base is None or len(base) != 1:
            return None
        if p.op_type == "Reshape":
            target = constant_of(p.inputs[1], annotated)
            if target is None or target.size != 1 or int(target.reshape(-1)[0]) not in (-1, 1):
                return None
        return base
    return None


#: Ops whose first output has the shape and type of their first input.
SAME_SHAPE_OPS = frozenset(
    {
        "GroupNormalization",
        "LayerNormalization",
        "RMSNormalization",
        "BatchNormalization",
        "InstanceNormalization",
        "Dropout",
        "Identity",
        "Relu",
        "Sigmoid",
        "Tanh",
        "Gelu",
        "Erf",
        "Softmax",
        "LogSoftmax",
        "LeakyRelu",
        "Elu",
        "Selu",
        "HardSigmoid",
        "HardSwish",
        "Mish",
        "Softplus",
        "Softsign",
        "Abs",
        "Neg",
        "Exp",
        "Log",
        "Sqrt",
        "Reciprocal",
        "Clip",
    }
)


def propagate_same_shape(graph: ir.Graph) -> bool:
    """Give shape-preserving ops' outputs their input's shape and type where ONNX inferred none.

    ONNX shape inference stops at some function-defined ops (``GroupNormalization``); the
    emitters need ranks to place channels, so the shape is carried through by hand.
    """
    changed = False
    for node in graph:
        if node.op_type not in SAME_SHAPE_OPS or node.domain not in ("", "ai.onnx"):
            continue
        x, y = node.inputs[0] if node.inputs else None, node.outputs[0]
        if x is None or x.shape is None or y.shape is not None:
            continue
        y.shape = x.shape
        if y.type is None and x.type is not None:
            y.type = x.type
        changed = True
    return changed


#: Ops whose first output is an ONNX sequence.
SEQUENCE_PRODUCERS = frozenset(
    {"SplitToSequence", "SequenceConstruct", "SequenceInsert", "SequenceErase", "SequenceEmpty"}
)


def _clear_wrong_sequence_types(graph: ir.Graph) -> None:
    """Drop tensor types some exporters declare on sequence values: ONNX shape inference
    rejects the whole model over them (it re-infers the right sequence type)."""
    for node in graph:
        if node.op_type in SEQUENCE_PRODUCERS and node.domain in ("", "ai.onnx"):
            out = node.outputs[0]
            if isinstance(out.type, ir.TensorType):
                out.type = None
                out.shape = None
