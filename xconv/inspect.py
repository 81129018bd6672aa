"""Summaries of an IR model: op histogram, parameters per scope, backend coverage."""

from __future__ import annotations

import collections
import importlib.util
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from xconv.converters.registry import iter_nodes
from xconv.errors import MissingOp
from xconv.ir.naming import split_path


@dataclass(frozen=True)
class ModelSummary:
    opset: dict[str, int]
    inputs: list[tuple[str, str, str]]  # name, dtype, shape
    outputs: list[tuple[str, str, str]]
    op_histogram: list[tuple[str, int]]  # sorted by count desc, then name
    params_by_scope: list[tuple[str, int]]
    total_params: int
    missing_by_backend: dict[str, list[MissingOp] | None] = field(default_factory=dict)


def _shape(v: ir.Value) -> str:
    if v.shape is None:
        return "?"
    return "[" + ", ".join(str(d) if d is not None else "?" for d in v.shape) + "]"


def _dtype(v: ir.Value) -> str:
    return v.dtype.name.lower() if v.dtype is not None else "?"


def available_backends() -> dict[str, str]:
    """Backends whose framework is installed: name -> registry module."""
    out = {}
    if importlib.util.find_spec("jax") is not None:
        out["jax"] = "xconv.converters.jax.registry"
    if importlib.util.find_spec("torch") is not None and importlib.util.find_spec(
        "xconv.converters.torch.runtime.registry"
    ):
        out["torch"] = "xconv.converters.torch.runtime.registry"
    return out


def summarize(model: ir.Model, *, backends: bool = True) -> ModelSummary:
    graph = model.graph
    hist = collections.Counter(
        f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
        for n in iter_nodes(graph)
    )
    per_scope: collections.Counter[str] = collections.Counter()
    total = 0
    for name, v in graph.initializers.items():
        if v.const_value is None:
            continue
        size = int(np.prod(v.const_value.shape.numpy())) if v.const_value.shape else 1
        total += size
        parts = split_path(name)
        per_scope[parts[0] if len(parts) > 1 else "(top level)"] += size
    summary = ModelSummary(
        opset={d or "ai.onnx": v for d, v in sorted(model.opset_imports.items())},
        inputs=[(v.name, _dtype(v), _shape(v)) for v in graph.inputs if not v.is_initializer()],
        outputs=[(v.name, _dtype(v), _shape(v)) for v in graph.outputs],
        op_histogram=sorted(hist.items(), key=lambda kv: (-kv[1], kv[0])),
        params_by_scope=sorted(per_scope.items()),
        total_params=total,
    )
    if backends:
        for name, module in available_backends().items():
            try:
                # Importing the backend package registers its handlers.
                importlib.import_module(module.rsplit(".", 1)[0])
                registry = importlib.import_module(module).registry
                summary.missing_by_backend[name] = registry.missing_ops(graph, model.opset_imports)
            except ImportError:
                summary.missing_by_backend[name] = None
    return summary
