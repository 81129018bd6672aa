"""Restore a source model's names when converting back a Flax module xconv generated.

``xconv.to_flax`` flattens module paths into Flax attribute names (``layer1.0.conv1`` becomes
``layer1_0_conv1``) and renames weights to Flax's (``weight`` -> ``kernel``). The generated
``model.py`` records where each came from in two module constants:

* ``SOURCE_SCOPES``: submodule path -> ``(source scope, source module class)``;
* ``SOURCE_NAMES``: variable path (``/``-joined, no collection) -> source weight name, for
  the variables :func:`predicted_name` does not already name from ``SOURCE_SCOPES``.

:func:`restore_source_names` applies them to the IR that :func:`xconv.from_flax` traced from
such a module: initializers take their source names, node scopes and module classes their
source ones. A torch emitter then writes the original ``state_dict`` keys and layer kinds
(torch's BatchNorm running-variance rule included), so torch -> Flax -> torch round-trips.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import Any

import onnx_ir as ir

from xconv.ir.metadata import MODULE, SCOPE

#: A native Flax layer's variable -> the torch parameter / buffer it holds.
_TORCH_VARIABLE = {
    "kernel": "weight",
    "scale": "weight",
    "embedding": "weight",
    "bias": "bias",
    "mean": "running_mean",
    "var": "running_var",
}


def predicted_name(path: str, scopes: Mapping[str, tuple[str, str]]) -> str | None:
    """The source weight name a variable path implies: its submodule's source scope plus
    torch's name for the variable (``layer1_0/conv1/kernel`` -> ``layer1.0.conv1.weight``).
    ``SOURCE_NAMES`` lists only the variables this does not predict."""
    module, _, var = path.rpartition("/")
    origin = scopes.get(module)
    if origin is None or var not in _TORCH_VARIABLE:
        return None
    return f"{origin[0]}.{_TORCH_VARIABLE[var]}"


class SourceNames(dict):
    """``SOURCE_NAMES`` completed by :func:`predicted_name`: a lookup of a variable path the
    table omits returns the name its submodule's source scope implies."""

    def __init__(self, names: Mapping[str, str], scopes: Mapping[str, tuple[str, str]]):
        super().__init__(names)
        self.scopes = dict(scopes)

    def __missing__(self, key: str) -> str:
        name = predicted_name(key, self.scopes)
        if name is None:
            raise KeyError(key)
        return name

    def get(self, key: str, default: str | None = None) -> str | None:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None


def recorded_names(module: Any) -> tuple[dict[str, tuple[str, str]], dict[str, str]] | None:
    """``(SOURCE_SCOPES, SOURCE_NAMES)`` from the module's defining source, if it has them.

    Looked up in the class's Python module, or (for a ``model.py`` executed without being
    registered in ``sys.modules``) in the globals of the class's own methods.
    """
    cls = type(module)
    namespaces = []
    defining = sys.modules.get(cls.__module__)
    if defining is not None:
        namespaces.append(vars(defining))
    for attr in ("__call__", "setup", "__init__"):
        fn = vars(cls).get(attr)
        if callable(fn):
            namespaces.append(getattr(inspect.unwrap(fn), "__globals__", {}))
    for namespace in namespaces:
        scopes, names = namespace.get("SOURCE_SCOPES"), namespace.get("SOURCE_NAMES")
        if isinstance(scopes, Mapping) and isinstance(names, Mapping):
            scopes = {str(k): (str(v[0]), str(v[1])) for k, v in scopes.items()}
            return scopes, SourceNames({str(k): str(v) for k, v in names.items()}, scopes)
    return None


def restore_source_names(model: ir.Model, module: Any) -> ir.Model:
    """Rename the IR traced from an xconv-generated Flax module back to the source's names.

    In place; a module without the recorded names is left as it is. Returns ``model``.
    """
    found = recorded_names(module)
    if found is None:
        return model
    scopes, names = found
    graph = model.graph
    taken = set(graph.initializers)
    for value in list(graph.initializers.values()):
        path = (value.name or "").replace(".", "/")
        source = names.get(path)
        if source and source != value.name and source not in taken:
            taken.discard(value.name)
            value.name = source
            taken.add(source)
    by_length = sorted(scopes, key=len, reverse=True)
    for node in graph:
        scope = node.metadata_props.get(SCOPE)
        if not scope:
            continue
        for key in by_length:
            if scope == key or scope.startswith(key + "/"):
                source_scope, source_module = scopes[key]
                rest = scope[len(key) :].lstrip("/").replace("/", ".")
                node.metadata_props[SCOPE] = f"{source_scope}.{rest}" if rest else source_scope
                if source_module and not rest:
                    node.metadata_props[MODULE] = source_module
                break
    return model


__all__ = ["SourceNames", "predicted_name", "recorded_names", "restore_source_names"]
