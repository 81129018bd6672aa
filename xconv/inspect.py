"""Summaries of an IR model: op histogram, parameters per scope, backend coverage; and
:func:`read_model`, which reads every file kind the converters read (``xconv inspect``)."""

from __future__ import annotations

import collections
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.converters.registry import TemplateRegistry, iter_nodes
from xconv.errors import MissingOp
from xconv.ir.metadata import fixed_summary
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
    #: The input dimensions the source model fixes, one line each (``xconv.fixed_dims``).
    fixed_dims: list[str] = field(default_factory=list)


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
        fixed_dims=fixed_summary(model),
    )
    if backends:
        for name, module in available_backends().items():
            try:
                summary.missing_by_backend[name] = registry_missing(model, module)
            except ImportError:
                summary.missing_by_backend[name] = None
        summary.coverage_by_target.update(target_coverage(model))
    return summary


# ------------------------------------------------------------------ files of every kind

#: What ``xconv inspect`` reads; an error about a path of no known kind lists these.
READABLE = (
    "ONNX: .onnx",
    "torch: .pt2 (torch.export), TorchScript (any suffix), a pickled module (--trust-pickle, "
    "--input-shape), a save_pretrained folder (config.json + safetensors)",
    "TensorFlow: a SavedModel folder, .keras, .h5, frozen .pb",
    "weights only: a torch state_dict (.pt .pth .bin .ckpt), .safetensors (or its "
    ".index.json), Flax .msgpack, .npz, an Orbax folder",
)

_WEIGHT_SUFFIXES = (".safetensors", ".index.json", ".msgpack", ".npz")
_TORCH_SUFFIXES = (".pt2", ".pt", ".pth", ".bin", ".ckpt", ".jit", ".torchscript")
_TF_SUFFIXES = (".keras", ".h5", ".pb")


@dataclass(frozen=True)
class WeightsSummary:
    """A weights-only file: what it holds, without a graph."""

    format: str
    tensors: int
    total_params: int
    params_by_scope: list[tuple[str, int]]
    dtypes: list[tuple[str, int]]  # dtype -> tensor count, most frequent first


def source_kind(path: str | os.PathLike) -> str:
    """``"onnx"``, ``"torch"``, ``"tf"`` or ``"weights"``: how :func:`read_summary` reads
    ``path``, from its name and, for folders, the files they hold (no framework imported).

    Raises:
        UsageError: The path does not exist, or is a folder of no known kind.
    """
    from xconv.errors import UsageError

    p = Path(path)
    name = p.name.lower()
    if not p.exists():
        raise UsageError(f"{p} does not exist; give the path of a model file or folder")
    if p.is_dir():
        if (p / "config.json").is_file():
            return "torch"
        if (p / "saved_model.pb").is_file() or (p / "saved_model.pbtxt").is_file():
            return "tf"
        if (p / "model.onnx").is_file():
            return "onnx"
        if any(p.glob("_CHECKPOINT_METADATA")) or any(p.glob("*/_CHECKPOINT_METADATA")):
            return "weights"
        if any(p.glob("manifest.ocdbt")) or any(p.glob("_METADATA")):
            return "weights"
        raise UsageError(
            f"{p} is a folder of no kind inspect reads; it reads:\n  " + "\n  ".join(READABLE)
        )
    if name.endswith(_WEIGHT_SUFFIXES):
        return "weights"
    if name.endswith(_TORCH_SUFFIXES) or _is_torchscript(p):
        return "torch"
    if name.endswith(_TF_SUFFIXES):
        return "tf"
    return "onnx"


def _is_torchscript(path: Path) -> bool:
    import zipfile

    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except Exception:  # noqa: BLE001 (not a zip, or a corrupt one: not TorchScript)
        return False
    return any("/code/" in n for n in names) and any(n.endswith("/constants.pkl") for n in names)


def read_model(path: str | os.PathLike, options: Any = None) -> ir.Model | WeightsSummary:
    """The IR of a model file or folder of any kind the converters read, or a
    :class:`WeightsSummary` for a weights-only file (a state_dict without ``--module``).

    Args:
        path: The file or folder.
        options: A ``ConvertOptions`` (input shapes, ``trust_pickle``, ``trust_code``,
            ``module_factory``) for the sources that need them.
    """
    from xconv.errors import UsageError

    p = Path(path)
    kind = source_kind(p)
    if kind == "onnx":
        from xconv.converters.onnx.io import load

        return load(p / "model.onnx" if p.is_dir() else p)
    if kind == "weights":
        return _weights(p)
    from xconv.pipeline import ConvertOptions, import_model

    options = options or ConvertOptions(check=False)
    try:
        return import_model(p, kind, options)
    except UsageError as e:
        # A state_dict with no --module: what it holds is still worth showing.
        if kind == "torch" and any(flag.split()[0] == "--module" for flag, _ in e.missing):
            return _weights(p, trust_pickle=options.trust_pickle)
        raise


def _weights(path: Path, *, trust_pickle: bool = False) -> WeightsSummary:
    from xconv.weights.io import detect_format, read_checkpoint

    return summarize_weights(read_checkpoint(path, trust_pickle=trust_pickle), detect_format(path))


def summarize_weights(flat: dict[str, Any], fmt: str) -> WeightsSummary:
    """Tensor count, parameters per top-level scope and dtypes of ``{name: array}``."""
    import re

    per_scope: collections.Counter[str] = collections.Counter()
    dtypes: collections.Counter[str] = collections.Counter()
    total = 0
    for name, array in flat.items():
        size = int(np.prod(np.shape(array)))
        total += size
        parts = [s for s in re.split(r"[./]", name) if s]
        per_scope[parts[0] if len(parts) > 1 else "(top level)"] += size
        dtypes[str(getattr(array, "dtype", type(array).__name__))] += 1
    return WeightsSummary(
        format=fmt,
        tensors=len(flat),
        total_params=total,
        params_by_scope=sorted(per_scope.items()),
        dtypes=sorted(dtypes.items(), key=lambda kv: (-kv[1], kv[0])),
    )
