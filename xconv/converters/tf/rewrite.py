"""TensorFlow importer, graph rewrites after tf2onnx: the IR made to read like the source.

GELU's ``x * 0.5 * (1 + erf(x / sqrt(2)))`` fused back into one ``Gelu``; reshapes that only
move size-1 axes written as the transposes they are; explicit ``Pad`` nodes folded into the
convolution's pads; the NHWC<->NCHW transposes tf2onnx leaves around every convolution pushed
through elementwise activations so consecutive convs meet without transposes
(:func:`_canonicalize` runs them with the IR's canonical passes). Called by
:mod:`xconv.converters.tf.importer`.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from xconv.ir.metadata import MODULE, SCOPE

_BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min"})
_UNARY = frozenset(
    {
        "Relu",
        "Sigmoid",
        "Tanh",
        "LeakyRelu",
        "Elu",
        "Selu",
        "Softplus",
        "HardSigmoid",
        "HardSwish",
        "Neg",
        "Abs",
        "Exp",
        "Erf",
        "Clip",
    }
)


def _replace_value(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    was_output = [i for i, v in enumerate(graph.outputs) if v is old]
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    if was_output:
        name = old.name
        old.name = None
        new.name = name


def _push_transposes(graph: ir.Graph) -> bool:
    """Move a Transpose below the node that reads it, so transpose pairs meet and cancel.

    ``U(T(x)) -> T(U(x))`` for elementwise unary ``U``; ``B(T(a), T(b)) -> T(B(a, b))`` for
    elementwise binary ``B`` with equal perms (residual adds); ``Pad(T(x), pads) ->
    T(Pad(x, pads'))`` with the pads permuted (Keras ZeroPadding2D). tf2onnx leaves these
    NHWC<->NCHW transposes around nodes it did not push through.
    """
    from xconv.ir.passes._utils import constant_of, is_annotated

    annotated = is_annotated(graph)
    changed = False
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or not node.inputs:
            continue
        op = node.op_type
        if op in _UNARY or op == "Pad":
            slots = [0]
        elif op in _BINARY and len(node.inputs) == 2:
            slots = [0, 1]
        else:
            continue
        ts = [_sole_transpose(node.inputs[i]) for i in slots]
        if any(t is None for t in ts):
            continue
        perm = list(ts[0].attributes["perm"].value)
        if any(list(t.attributes["perm"].value) != perm for t in ts):
            continue
        if op == "Pad":
            if len(node.inputs) > 3 or node.inputs[1] is None:
                continue
            pads = constant_of(node.inputs[1], annotated)
            if pads is None:
                continue
            pads = [int(p) for p in np.asarray(pads).reshape(-1)]
            rank = len(perm)
            if len(pads) != 2 * rank:
                continue
            inner = [0] * (2 * rank)
            for i, p in enumerate(perm):
                inner[p], inner[p + rank] = pads[i], pads[i + rank]
            const = ir.node(
                "Constant", [], attributes={"value": ir.tensor(np.array(inner, dtype=np.int64))}
            )
            graph.insert_before(node, const)
            node.replace_input_with(1, const.outputs[0])
        for i, t in zip(slots, ts, strict=True):
            node.replace_input_with(i, t.inputs[0])
        _transpose_output(graph, node, perm)
        changed = True
    return changed


def _sole_transpose(value: ir.Value | None) -> ir.Node | None:
    t = value.producer() if value is not None else None
    if t is None or t.op_type != "Transpose" or "perm" not in t.attributes:
        return None
    return t if len(list(value.uses())) == 1 else None


def _transpose_output(graph: ir.Graph, node: ir.Node, perm: list[int]) -> None:
    out = node.outputs[0]
    moved = ir.node("Transpose", [out], attributes={"perm": perm})
    for key in (SCOPE, MODULE):
        if key in node.metadata_props:
            moved.metadata_props[key] = node.metadata_props[key]
    moved.outputs[0].shape, moved.outputs[0].type = out.shape, out.type
    out.shape = None
    graph.insert_after(node, moved)
    for consumer, idx in [(u.node, u.idx) for u in out.uses() if u.node is not moved]:
        consumer.replace_input_with(idx, moved.outputs[0])
    for i, v in enumerate(graph.outputs):
        if v is out:
            graph.outputs[i] = moved.outputs[0]
            name = out.name
            out.name = None
            moved.outputs[0].name = name


def _const(value: ir.Value | None, annotated: bool) -> float | None:
    from xconv.ir.passes._utils import constant_of

    arr = constant_of(value, annotated)
    if arr is None or np.asarray(arr).size != 1:
        return None
    return float(np.asarray(arr).reshape(()))


def _split_const(node: ir.Node, annotated: bool) -> tuple[ir.Value | None, float | None]:
    """For a binary node with one scalar-constant input: ``(other input, constant)``."""
    if len(node.inputs) != 2:
        return None, None
    a, b = node.inputs
    ca, cb = _const(a, annotated), _const(b, annotated)
    if cb is not None and ca is None:
        return a, cb
    if ca is not None and cb is None:
        return b, ca
    return None, None


def _fuse_gelu(graph: ir.Graph) -> int:
    """``0.5 * x * (1 - erf(-x / sqrt(2)))`` (TF's exact GELU via Erfc) -> ``Gelu(x)``."""
    from xconv.ir.passes._utils import is_annotated

    annotated = is_annotated(graph)
    fused = 0
    for erf in [n for n in graph if n.op_type == "Erf"]:
        uses = list(erf.outputs[0].uses())
        if len(uses) != 1 or uses[0].node.op_type != "Sub" or uses[0].idx != 1:
            continue
        sub = uses[0].node
        if _const(sub.inputs[0], annotated) != 1.0:
            continue
        scaled = erf.inputs[0].producer()
        if scaled is None or scaled.op_type != "Mul":
            continue
        inner, k = _split_const(scaled, annotated)
        if inner is None or k is None:
            continue
        neg = inner.producer()
        if neg is not None and neg.op_type == "Neg" and abs(k - 0.5**0.5) < 1e-6:
            x = neg.inputs[0]
        elif abs(k + 0.5**0.5) < 1e-6:
            x = inner
        else:
            continue
        sub_uses = list(sub.outputs[0].uses())
        if len(sub_uses) != 1 or sub_uses[0].node.op_type != "Mul":
            continue
        final = sub_uses[0].node
        half = final.inputs[1 - sub_uses[0].idx]
        half_node = half.producer() if half is not None else None
        if half_node is None or half_node.op_type != "Mul":
            continue
        hx, h = _split_const(half_node, annotated)
        if hx is not x or h != 0.5:
            continue
        gelu = ir.node("Gelu", [x], attributes={"approximate": "none"}, name=f"{final.name}_gelu")
        for key in (SCOPE, MODULE):
            if key in final.metadata_props:
                gelu.metadata_props[key] = final.metadata_props[key]
        out = final.outputs[0]
        gelu.outputs[0].shape, gelu.outputs[0].type = out.shape, out.type
        graph.insert_before(final, gelu)
        _replace_value(graph, out, gelu.outputs[0])
        fused += 1
    return fused


def _canonicalize(model: ir.Model) -> None:
    from xconv.ir.passes import canonicalize

    canonicalize(model)
    if _fuse_gelu(model.graph) + _reshapes_as_transposes(model.graph) + _explicit_pads(model.graph):
        canonicalize(model)
    for _ in range(8):
        if not _push_transposes(model.graph):
            break
        canonicalize(model)
    _unscope_layout_transposes(model.graph)


def _reshape_perm(node: ir.Node, annotated: bool) -> list[int] | None:
    """The perm of the Transpose a Reshape equals, when it only moves size-1 axes (and keeps
    the batch axis first); else None.

    tf2onnx writes an NHWC<->NCHW Transpose of a tensor whose spatial axes are 1 (a squeeze-
    and-excite block's pooled ``(N, 1, 1, C)``) as such a Reshape; as a Reshape it hides the
    layout change from the emitters, which then reshape in the wrong layout.
    """
    from xconv.ir.passes._utils import constant_of

    x = node.inputs[0]
    target = constant_of(node.inputs[1], annotated) if len(node.inputs) > 1 else None
    if x is None or x.shape is None or target is None:
        return None
    dims = list(x.shape)
    target = [int(t) for t in np.asarray(target).reshape(-1)]
    if len(dims) != len(target) or len(dims) < 3 or target[0] not in (0, -1):
        return None
    rest = dims[1:]
    if not all(isinstance(d, int) for d in rest) or any(t <= 0 for t in target[1:]):
        return None
    if (
        target[0] == -1
        and not isinstance(dims[0], int)
        and int(np.prod(target[1:])) != int(np.prod(rest))
    ):
        return None
    if [d for d in rest if d != 1] != [t for t in target[1:] if t != 1] or sorted(rest) != sorted(
        target[1:]
    ):
        return None
    big = [i + 1 for i, d in enumerate(rest) if d != 1]
    ones = [i + 1 for i, d in enumerate(rest) if d == 1]
    perm = [0] + [big.pop(0) if t != 1 else ones.pop(0) for t in target[1:]]
    return None if perm == sorted(perm) else perm


def _reshapes_as_transposes(graph: ir.Graph) -> int:
    """Rewrite each Reshape that only moves size-1 axes as the Transpose it is."""
    from xconv.ir.passes._utils import is_annotated

    annotated = is_annotated(graph)
    done = 0
    for node in [n for n in graph if n.op_type == "Reshape"]:
        perm = _reshape_perm(node, annotated)
        if perm is None:
            continue
        t = ir.node("Transpose", [node.inputs[0]], attributes={"perm": perm}, name=node.name)
        for key in (SCOPE, MODULE):
            if key in node.metadata_props:
                t.metadata_props[key] = node.metadata_props[key]
        out = node.outputs[0]
        t.outputs[0].shape, t.outputs[0].type = out.shape, out.type
        graph.insert_before(node, t)
        _replace_value(graph, out, t.outputs[0])
        graph.remove(node, safe=True)
        done += 1
    return done


def _explicit_pads(graph: ir.Graph) -> int:
    """Write ``auto_pad="SAME_*"`` of Conv / pooling nodes as explicit ``pads`` where they do
    not depend on the input's size: its spatial size is known, or (a symbolic ``height`` /
    ``width``) the axis has stride 1, where SAME pads ``(k - 1) * dilation`` at any size.

    tf2onnx keeps ``SAME_UPPER`` for a ``padding="same"`` conv inside a nested function it got
    inlined (Keras 3's grouped / depthwise convs, ConvNeXt) and wherever the spatial size is
    unknown; a source emitter wants pads.
    """
    done = 0
    for node in graph:
        if node.op_type not in ("Conv", "MaxPool", "AveragePool", "ConvInteger"):
            continue
        mode = node.attributes.get("auto_pad")
        if mode is None or mode.value not in ("SAME_UPPER", "SAME_LOWER"):
            continue
        x = node.inputs[0]
        if x is None or x.shape is None:
            continue
        spatial = list(x.shape)[2:]
        kernel = node.attributes.get("kernel_shape")
        if kernel is None and node.op_type == "Conv" and node.inputs[1] is not None:
            w = node.inputs[1].shape
            kernel_dims = list(w)[2:] if w is not None else []
        else:
            kernel_dims = list(kernel.value) if kernel is not None else []
        if not spatial or len(kernel_dims) != len(spatial):
            continue
        if not all(isinstance(d, int) for d in kernel_dims):
            continue
        rank = len(spatial)
        strides = list(node.attributes["strides"].value) if "strides" in node.attributes else []
        dilations = (
            list(node.attributes["dilations"].value) if "dilations" in node.attributes else []
        )
        strides, dilations = strides or [1] * rank, dilations or [1] * rank
        if not all(isinstance(n, int) or st == 1 for n, st in zip(spatial, strides, strict=True)):
            continue
        begin, end = [], []
        for n, k, st, dl in zip(spatial, kernel_dims, strides, dilations, strict=True):
            if isinstance(n, int):
                total = max((-(-n // st) - 1) * st + (k - 1) * dl + 1 - n, 0)
            else:
                total = (k - 1) * dl
            small = total // 2
            begin.append(small if mode.value == "SAME_UPPER" else total - small)
            end.append(total - begin[-1])
        node.attributes.pop("auto_pad")
        node.attributes["pads"] = ir.AttrInt64s("pads", begin + end)
        done += 1
    return done


def _unscope_layout_transposes(graph: ir.Graph) -> None:
    """Take data-path Transposes (NHWC<->NCHW) out of layer scopes.

    tf2onnx names them after the conv they surround (``conv2d/BiasAdd__10``), but a layer's
    body must compute the layer in the IR's layout: an emitter replaces the body with one
    native layer, and a layout change inside it would be lost.
    """
    for node in graph:
        if node.op_type != "Transpose" or SCOPE not in node.metadata_props:
            continue
        if not _derives_from_weight(node.inputs[0]):
            del node.metadata_props[SCOPE]
            node.metadata_props.pop(MODULE, None)


def _derives_from_weight(value: ir.Value | None) -> bool:
    while value is not None and not value.is_initializer():
        producer = value.producer()
        if producer is None or producer.op_type not in ("Reshape", "Transpose", "Squeeze"):
            return False
        value = producer.inputs[0]
    return value is not None
