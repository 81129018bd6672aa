"""Metadata keys that carry source structure through the IR (see DESIGN.md)."""

from __future__ import annotations

import json
from typing import Any

import onnx_ir as ir

#: Source module path of a node (``layer1.0.conv1``; Flax ``Block_0/Conv_0``).
SCOPE = "xconv.scope"
#: Source module class of a node (``torch.nn.Conv2d``, ``flax.linen.Conv``).
MODULE = "xconv.module"
#: Recognised layer kind and hyper-parameters, JSON: ``{"kind": "conv", "strides": [1, 1], ...}``.
LAYER = "xconv.layer"
#: Role of a weight within its layer: kernel, bias, scale, mean, var, embedding, ...
ROLE = "xconv.role"
#: Memory layout of a weight: OIHW, HWIO, OI, IO, ...
LAYOUT = "xconv.layout"
#: The user's source line (``file.py:12``) when the framework records it.
SOURCE_LINE = "xconv.source_line"
#: In memory only (``Value.meta``, never written): the torch ``ExportedProgram`` nodes a value
#: computes (a tuple of names), for the layerwise parity check (``"{call}:{name}"`` inside a
#: higher-order op).
FX_NODE = "xconv.fx_node"
#: In memory only (``Model.meta``): a weak reference to the ``torch.fx.Graph`` that
#: ``FX_NODE`` names the nodes of.
FX_GRAPH = "xconv.fx_graph"


def get_scope(obj: ir.Node | ir.Value) -> str | None:
    return obj.metadata_props.get(SCOPE) or None


def get_layer(node: ir.Node) -> dict[str, Any] | None:
    raw = node.metadata_props.get(LAYER)
    return json.loads(raw) if raw else None


def set_layer(node: ir.Node, kind: str, **params: Any) -> None:
    node.metadata_props[LAYER] = json.dumps({"kind": kind, **params}, sort_keys=True)
