"""TensorFlow importer, Keras layer marking: every node and weight tied to its Keras layer.

Weights that entered the traced function as inputs become initializers named by their Keras
variable paths (``dense_1/kernel``); each node's ``xconv.scope`` is set from the tf2onnx node
name's layer prefix (helper nodes inherit their consumers' scope); a SeparableConv's two
convolutions and a layer's fused activation get scopes of their own; the decomposed
BatchNormalization / LayerNormalization arithmetic is replaced by the single ONNX node. Called by
:mod:`xconv.converters.tf.importer`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.converters.tf.rewrite import _replace_value
from xconv.ir.metadata import MODULE, SCOPE

logger = logging.getLogger(__name__)


#: Keras layers recognised as one unit: their sublayers share the layer's scope.
_ATOMIC = frozenset({"MultiHeadAttention", "SeparableConv2D", "SeparableConv1D"})
_WEIGHT_PREFIX = "xconv_w"


def _layer_paths(model: Any) -> dict[str, Any]:
    """``{layer path: layer}`` of every sublayer; an atomic layer's sublayers are not listed."""
    out: dict[str, Any] = {}

    def walk(layer: Any, prefix: str) -> None:
        for sub in getattr(layer, "_layers", None) or []:
            if type(sub).__name__ == "InputLayer":
                continue
            path = getattr(sub, "path", None) or f"{prefix}{sub.name}"
            out.setdefault(path, sub)
            if not _atomic(sub):
                walk(sub, f"{path}/")

    walk(model, "")
    return out


def _atomic(layer: Any) -> bool:
    return type(layer).__name__ in _ATOMIC


def _owners(model: Any, variables: Sequence[Any]) -> dict[str, tuple[str, Any, str]]:
    """``{variable path: (layer scope, layer, leaf)}``."""
    layers = _layer_paths(model)
    owners: dict[str, tuple[str, Any, str]] = {}
    for v in variables:
        parts = v.path.split("/")
        for k in range(len(parts) - 1, 0, -1):
            prefix = "/".join(parts[:k])
            # The outermost atomic layer on the path owns the weight; else the innermost layer.
            atomic = next(
                (
                    "/".join(parts[:j])
                    for j in range(1, k + 1)
                    if "/".join(parts[:j]) in layers and _atomic(layers["/".join(parts[:j])])
                ),
                None,
            )
            scope = atomic or (prefix if prefix in layers else None)
            if scope:
                owners[v.path] = (scope, layers[scope], v.path[len(scope) + 1 :])
                break
    return owners


def _inputs_to_weights(graph: ir.Graph, variables: Sequence[Any]) -> None:
    """Turn the ``xconv_w<i>`` graph inputs into initializers named by Keras variable path."""
    for value in list(graph.inputs):
        match = re.fullmatch(rf"{_WEIGHT_PREFIX}(\d+)(:0)?", value.name or "")
        if not match:
            continue
        v = variables[int(match.group(1))]
        graph.inputs.remove(value)
        value.name = v.path
        value.const_value = ir.tensor(np.asarray(v.numpy()), name=v.path)
        graph.register_initializer(value)


def _name_by_value(graph: ir.Graph, variables: Sequence[Any], by_path: bool = False) -> None:
    """Rename frozen initializers to the captured variable they equal (unique match only):
    to its name, or with ``by_path`` to its Keras path (``lstm/lstm_cell/kernel``)."""
    values = [
        (v.path if by_path else v.name.split(":")[0], np.asarray(v.numpy())) for v in variables
    ]
    taken = set(graph.initializers)
    for name, value in list(graph.initializers.items()):
        if value.const_value is None:
            continue
        arr = value.const_value.numpy()
        hits = [n for n, a in values if a.shape == arr.shape and np.array_equal(a, arr)]
        if len(hits) == 1 and hits[0] not in taken:
            graph.initializers.pop(name)
            value.name = hits[0]
            graph.register_initializer(value)
            taken.add(hits[0])


def _set_scopes(
    graph: ir.Graph, owners: Mapping[str, tuple[str, Any, str]], layers: Mapping[str, Any]
) -> None:
    """Map tf2onnx's node-name prefixes (TF name scopes, ``conv2d_1``) to Keras layer paths.

    TF uniquifies name scopes (``conv2d`` may trace as ``conv2d_1``), so a prefix is mapped by
    the weights its nodes read; weightless layers (activations, pooling) by name.
    """
    by_prefix: dict[str, str] = {}
    for node in graph.all_nodes():
        prefix = _prefix(node.name)
        if not prefix or prefix in by_prefix:
            continue
        for x in node.inputs:
            if x is not None and x.name in owners:
                by_prefix[prefix] = owners[x.name][0]
                break
    claimed = set(by_prefix.values())
    names = sorted(layers, key=len, reverse=True)
    for node in graph.all_nodes():
        prefix = _prefix(node.name)
        if not prefix:
            continue
        if prefix not in by_prefix:
            exact = [p for p in names if p == prefix and p not in claimed]
            loose = [
                p
                for p in names
                if p not in claimed and re.fullmatch(re.escape(p) + r"(_\d+)+", prefix)
            ]
            hit = (exact or loose or [None])[0]
            by_prefix[prefix] = hit or ""
            if hit:
                claimed.add(hit)
        if by_prefix[prefix]:
            node.metadata_props[SCOPE] = by_prefix[prefix]
    _scope_helpers(graph)


def _scope_helpers(graph: ir.Graph) -> None:
    """Give an unscoped weight-preparing node (a kernel reshape tf2onnx added, reading only
    weights and constants) the scope of its consumers."""
    derived: set[int] = set()
    for node in graph:
        if all(
            x is None
            or x.is_initializer()
            or (x.producer() is not None and id(x.producer()) in derived)
            for x in node.inputs
        ):
            derived.add(id(node))
    for node in reversed(list(graph)):
        if node.metadata_props.get(SCOPE) or id(node) not in derived:
            continue
        scopes = {u.node.metadata_props.get(SCOPE) for o in node.outputs for u in o.uses()}
        if len(scopes) == 1 and None not in scopes and "" not in scopes:
            node.metadata_props[SCOPE] = scopes.pop()


def _prefix(name: str | None) -> str | None:
    if not name or "/" not in name:
        return None
    return name.split("/")[0]


def _split_separable(graph: ir.Graph, owners: Mapping[str, tuple[str, Any, str]]) -> None:
    """A SeparableConv is two convs: scope them ``<layer>/depthwise`` and ``<layer>/pointwise``."""
    depthwise = {p: s for p, (s, layer, leaf) in owners.items() if leaf == "depthwise_kernel"}
    scopes = set(depthwise.values())
    for node in graph.all_nodes():
        scope = node.metadata_props.get(SCOPE)
        if scope not in scopes:
            continue
        reads = _reaches(node, set(depthwise))
        node.metadata_props[SCOPE] = f"{scope}/{'depthwise' if reads else 'pointwise'}"


def _reaches(node: ir.Node, weights: set[str]) -> bool:
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        for x in n.inputs:
            if x is None:
                continue
            if x.name in weights:
                return True
            p = x.producer()
            if p is not None and id(p) not in seen and p.op_type in ("Transpose", "Reshape"):
                seen.add(id(p))
                stack.append(p)
        if n is not node:
            continue
        # the conv itself reads the reshaped kernel through its producers only
    return False


def _split_activations(graph: ir.Graph, owners: Mapping[str, tuple[str, Any, str]]) -> None:
    """Scope a layer's fused activation (``Dense(activation="relu")``) ``<layer>/activation``.

    The layer's body must compute the bare layer: an emitter replaces it with a native
    ``Dense``/``Conv``, which has no activation.
    """
    per_scope: dict[str, tuple[Any, set[str]]] = {}
    for path, (scope, layer, _leaf) in owners.items():
        per_scope.setdefault(scope, (layer, set()))[1].add(path)
    for scope, (layer, weights) in per_scope.items():
        activation = layer.get_config().get("activation") if hasattr(layer, "get_config") else None
        if activation in (None, "linear") or _atomic(layer):
            continue
        body = _body(graph, scope)
        readers = [n for n in body if any(x is not None and x.name in weights for x in n.inputs)]
        if not readers:
            continue
        core: set[int] = set()
        stack = [readers[-1]]
        ids = {id(n) for n in body}
        while stack:
            n = stack.pop()
            if id(n) in core:
                continue
            core.add(id(n))
            for x in n.inputs:
                p = x.producer() if x is not None else None
                if p is not None and id(p) in ids:
                    stack.append(p)
        for n in body:
            if id(n) not in core:
                n.metadata_props[SCOPE] = f"{scope}/activation"


def _body(graph: ir.Graph, scope: str) -> list[ir.Node]:
    return [n for n in graph if n.metadata_props.get(SCOPE) == scope]


def _boundary(graph: ir.Graph, body: list[ir.Node]) -> tuple[list[ir.Value], list[ir.Value]]:
    """Non-constant inputs from outside ``body`` and outputs used outside it."""
    ids = {id(n) for n in body}
    ins: list[ir.Value] = []
    outs: list[ir.Value] = []
    outputs = {id(v) for v in graph.outputs}
    for n in body:
        for x in n.inputs:
            if x is None or x.is_initializer():
                continue
            p = x.producer()
            if p is not None and (id(p) in ids or p.op_type == "Constant"):
                continue
            if all(x is not y for y in ins):
                ins.append(x)
        for o in n.outputs:
            if id(o) in outputs or any(id(u.node) not in ids for u in o.uses()):
                outs.append(o)
    return ins, outs


def _replace_norms(graph: ir.Graph, owners: Mapping[str, tuple[str, Any, str]]) -> None:
    """Put Keras's decomposed BatchNorm / LayerNorm arithmetic back into one ONNX node each."""
    per_scope: dict[str, tuple[Any, dict[str, str]]] = {}
    for path, (scope, layer, leaf) in owners.items():
        per_scope.setdefault(scope, (layer, {}))[1][leaf] = path
    for scope, (layer, leaves) in sorted(per_scope.items()):
        cls = type(layer).__name__
        if cls == "BatchNormalization":
            keys = ("gamma", "beta", "moving_mean", "moving_variance")
        elif cls == "LayerNormalization":
            keys = ("gamma", "beta")
        else:
            continue
        if any(k not in leaves for k in keys):
            logger.debug("%s: keeps its decomposed form (no scale or center)", scope)
            continue
        body = _body(graph, scope)
        ins, outs = _boundary(graph, body)
        if len(ins) != 1 or len(outs) != 1 or ins[0].shape is None:
            logger.debug(
                "%s: keeps its decomposed form (%d in, %d out)", scope, len(ins), len(outs)
            )
            continue
        _replace_norm(graph, scope, layer, cls, ins[0], outs[0], [leaves[k] for k in keys])


def _replace_norm(graph, scope, layer, cls, x, y, weights) -> None:
    cfg = layer.get_config()
    rank = len(x.shape)
    axis = cfg["axis"]
    axes = [a % rank for a in (axis if isinstance(axis, list | tuple) else [axis])]
    ws = [graph.initializers[w] for w in weights]
    new: list[ir.Node] = []
    if cls == "BatchNormalization":
        if axes != [rank - 1] and axes != [1]:
            return
        perm = [0, rank - 1, *range(1, rank - 1)] if axes == [rank - 1] and rank > 2 else None
        h = x
        if perm:
            t = ir.node("Transpose", [x], attributes={"perm": perm})
            new.append(t)
            h = t.outputs[0]
        bn = ir.node(
            "BatchNormalization",
            [h, *ws],
            attributes={"epsilon": float(cfg["epsilon"])},
            name=f"{scope}/BatchNormalization",
        )
        new.append(bn)
        out = bn.outputs[0]
        if perm:
            back = [0, *range(2, rank), 1]
            t2 = ir.node("Transpose", [out], attributes={"perm": back})
            new.append(t2)
            out = t2.outputs[0]
    else:
        if axes != [rank - 1]:
            return
        ln = ir.node(
            "LayerNormalization",
            [x, *ws],
            attributes={"axis": -1, "epsilon": float(cfg["epsilon"])},
            name=f"{scope}/LayerNormalization",
        )
        new.append(ln)
        out = ln.outputs[0]
    for n in new:
        n.metadata_props[SCOPE] = scope
        n.metadata_props[MODULE] = f"keras.layers.{cls}"
    producer = y.producer()
    graph.insert_before(producer, new)
    out.shape, out.type = y.shape, y.type
    _replace_value(graph, y, out)
