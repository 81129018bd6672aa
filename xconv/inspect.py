"""Summaries of an IR model: op histogram, parameters per scope, backend coverage."""

from __future__ import annotations

import collections
import importlib.util
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from xconv.converters.registry import TemplateRegistry, iter_nodes
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
    #: target -> registry label -> ops it lacks (None: its framework is not installed).
    coverage_by_target: dict[str, dict[str, list[MissingOp] | None]] = field(default_factory=dict)


def _shape(v: ir.Value) -> str:
    if v.shape is None:
        return "?"
    return "[" + ", ".join(str(d) if d is not None else "?" for d in v.shape) + "]"


def _dtype(v: ir.Value) -> str:
    return v.dtype.name.lower() if v.dtype is not None else "?"


#: The registries each conversion target uses, as (label, framework, registry module): a
#: target is covered when every one of them covers the model. The source targets run the
#: IR runtime of their framework too (the parity check against ``to_jax`` / ``to_torch``).
TARGET_REGISTRIES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "jax": (("jax runtime", "jax", "xconv.converters.jax.registry"),),
    "flax": (
        ("jax runtime", "jax", "xconv.converters.jax.registry"),
        ("flax source templates", "flax", "xconv.converters.flax.source.templates"),
    ),
    "torch": (
        ("torch runtime", "torch", "xconv.converters.torch.runtime.registry"),
        ("torch source templates", "torch", "xconv.converters.torch.source.templates"),
    ),
}


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


def registry_missing(model: ir.Model, module: str) -> list[MissingOp]:
    """The ops of ``model`` the registry of ``module`` lacks (raises ImportError when its
    framework is not installed)."""
    # Importing the package registers its handlers (a templates module imports its families).
    importlib.import_module(module.rsplit(".", 1)[0])
    registry = importlib.import_module(module).registry
    if isinstance(registry, TemplateRegistry):
        # An emitter checks the top-level graph (If/Loop bodies have no template either).
        return registry.missing_templates(model.graph, model.opset_imports)
    return registry.missing_ops(model.graph, model.opset_imports)


def target_coverage(model: ir.Model) -> dict[str, dict[str, list[MissingOp] | None]]:
    """For each target, each registry it uses: the ops it lacks (None: not installed)."""
    out: dict[str, dict[str, list[MissingOp] | None]] = {}
    for target, registries in TARGET_REGISTRIES.items():
        out[target] = {}
        for label, framework, module in registries:
            if importlib.util.find_spec(framework) is None:
                out[target][label] = None
                continue
            try:
                out[target][label] = registry_missing(model, module)
            except ImportError:
                out[target][label] = None
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
                summary.missing_by_backend[name] = registry_missing(model, module)
            except ImportError:
                summary.missing_by_backend[name] = None
        summary.coverage_by_target.update(target_coverage(model))
    return summary
