"""Deterministic text form of an IR model, metadata included (for diffs and golden tests)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def _type(value: ir.Value) -> str:
    dtype = value.dtype.name.lower() if value.dtype is not None else "?"
    if value.shape is None:
        return dtype
    dims = ",".join(str(d) if d is not None else "?" for d in value.shape)
    return f"{dtype}[{dims}]"


def _attr(attr: ir.Attr) -> str:
    if attr.is_ref():
        return f"@{attr.ref_attr_name}"
    v = attr.value
    if attr.type == ir.AttributeType.TENSOR:
        arr = v.numpy()
        return f"tensor<{arr.dtype}{list(arr.shape)}>" + (
            f"={arr.tolist()}" if arr.size <= 8 else ""
        )
    if attr.type == ir.AttributeType.GRAPH:
        return f"graph<{v.name}>"
    if attr.type == ir.AttributeType.GRAPHS:
        return "graphs<" + ",".join(g.name or "?" for g in v) + ">"
    if attr.type in (ir.AttributeType.INTS, ir.AttributeType.FLOATS, ir.AttributeType.STRINGS):
        return repr(list(v))
    if isinstance(v, float):
        return repr(float(np.float32(v)))
    return repr(v)


def _meta(props: dict[str, str]) -> str:
    keys = sorted(k for k in props if k.startswith("xconv."))
    return "  # " + " ".join(f"{k[6:]}={props[k]}" for k in keys) if keys else ""


def format_graph(graph: ir.Graph, indent: str = "") -> list[str]:
    lines = [f"{indent}graph {graph.name or 'main'}("]
    for v in graph.inputs:
        lines.append(f"{indent}  in  %{v.name}: {_type(v)}")
    for name in sorted(graph.initializers):
        v = graph.initializers[name]
        lines.append(f"{indent}  init %{name}: {_type(v)}{_meta(v.metadata_props)}")
    lines.append(f"{indent}) {{")
    for node in graph:
        outs = ", ".join(f"%{o.name}" for o in node.outputs)
        ins = ", ".join(f"%{i.name}" if i is not None else "_" for i in node.inputs)
        attrs = ", ".join(f"{k}={_attr(a)}" for k, a in sorted(node.attributes.items()))
        op = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
        lines.append(
            f"{indent}  {outs} = {op}({ins})"
            + (f" {{{attrs}}}" if attrs else "")
            + _meta(node.metadata_props)
        )
        for a in node.attributes.values():
            if a.is_ref():
                continue
            if a.type == ir.AttributeType.GRAPH:
                lines += format_graph(a.value, indent + "    ")
            elif a.type == ir.AttributeType.GRAPHS:
                for g in a.value:
                    lines += format_graph(g, indent + "    ")
    lines.append(f"{indent}  return " + ", ".join(f"%{v.name}: {_type(v)}" for v in graph.outputs))
    lines.append(f"{indent}}}")
    return lines


def format_model(model: ir.Model) -> str:
    """The model as stable text: same model, same bytes."""
    opsets = ", ".join(f"{d or 'ai.onnx'}:{v}" for d, v in sorted(model.opset_imports.items()))
    return "\n".join([f"model opset({opsets})", *format_graph(model.graph)]) + "\n"
