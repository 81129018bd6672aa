"""Restore a source model's names when converting back a Flax module xconv generated.

``xconv.to_flax`` flattens module paths into Flax attribute names (``layer1.0.conv1`` becomes
``layer1_0_conv1``) and renames weights to Flax's (``weight`` -> ``kernel``). The generated
``model.py`` records where each came from in two module constants:

* ``SOURCE_SCOPES``: submodule path -> ``(source scope, source module class)``;
* ``SOURCE_NAMES``: variable path (``/``-joined, no collection) -> source weight name.

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
            return {str(k): (str(v[0]), str(v[1])) for k, v in scopes.items()}, {
                str(k): str(v) for k, v in names.items()
            }
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
        source = names.get((value.name or "").replace(".", "/"))
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


__all__ = ["recorded_names", "restore_source_names"]
