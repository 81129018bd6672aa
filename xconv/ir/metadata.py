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
#: Model-level, JSON list: each input dimension the source model fixes, as
#: ``{"input", "dim", "size", "reason"[, "source_line"]}`` (torch importer; see
#: :mod:`xconv.converters.torch.importer.shapes` for the reasons).
FIXED_DIMS = "xconv.fixed_dims"

#: The reasons a :data:`FIXED_DIMS` entry gives, as sentences.
_FIXED_REASONS = {
    "model": "the model fixes it",
    "size-1 example": "the example has size 1 there and the model did not trace at size 2",
    "static": "static=True (--static)",
    "torchscript": "TorchScript fixes every size its interpreter reads",
    "exported program": "the exported program has it static",
}


def fixed_dims(model: ir.Model) -> list[dict[str, Any]]:
    """The :data:`FIXED_DIMS` entries of ``model`` (empty when none were recorded)."""
    raw = model.metadata_props.get(FIXED_DIMS)
    if not raw:
        return []
    try:
        value = json.loads(raw)
    except ValueError:
        return []
    return [e for e in value if isinstance(e, dict)] if isinstance(value, list) else []


def describe_fixed_dim(entry: dict[str, Any]) -> str:
    """One line for a fixed input dimension (``input x dim 1 fixed at 3: the model fixes it
    at model.py:12``)."""
    reason = str(entry.get("reason", ""))
    why = _FIXED_REASONS.get(reason, reason)
    if entry.get("source_line"):
        why += f" at {entry['source_line']}"
    return f"input {entry.get('input')} dim {entry.get('dim')} fixed at {entry.get('size')}: {why}"


def fixed_summary(model: ir.Model) -> list[str]:
    """The lines a conversion prints about its fixed input dimensions: one per dimension the
    model fixes; one line for a whole input set fixed by ``--static``, TorchScript or an
    exported program traced at static shapes (with how to export it with dynamic shapes)."""
    entries = fixed_dims(model)
    if not entries:
        return []
    reasons = {e.get("reason") for e in entries}
    symbolic = any(
        isinstance(d, ir.SymbolicDim)
        for v in model.graph.inputs
        if v.shape is not None and not v.is_initializer()
        for d in v.shape.dims
    )
    if reasons == {"exported program"} and not symbolic:
        return [
            "the exported program is fixed at its example shapes; to convert it for any "
            "shape, export it with dynamic shapes: torch.export.export(model, args, "
            "dynamic_shapes=[{i: torch.export.Dim.AUTO for i in range(a.dim())} for a in args])"
        ]
    if reasons == {"static"}:
        return ["--static: every input is fixed at its example shape"]
    if reasons == {"torchscript"} and not symbolic:
        return [
            "TorchScript: every input is fixed at its example shape (its interpreter fixes "
            "every size it reads); export the model with torch.export for symbolic shapes"
        ]
    return [describe_fixed_dim(e) for e in entries]


def get_scope(obj: ir.Node | ir.Value) -> str | None:
    return obj.metadata_props.get(SCOPE) or None


def get_layer(node: ir.Node) -> dict[str, Any] | None:
    raw = node.metadata_props.get(LAYER)
    return json.loads(raw) if raw else None


def set_layer(node: ir.Node, kind: str, **params: Any) -> None:
    node.metadata_props[LAYER] = json.dumps({"kind": kind, **params}, sort_keys=True)
