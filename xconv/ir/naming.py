"""Weight-name paths: split source names into nested keys and back."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

_SEP = re.compile(r"[./]")


def split_path(name: str) -> tuple[str, ...]:
    """``layer1.0.conv1.weight`` -> ``("layer1", "0", "conv1", "weight")``; also splits on ``/``."""
    parts = tuple(p for p in _SEP.split(name) if p)
    return parts or (name,)


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Turn ``{"a.b.w": x}`` into ``{"a": {"b": {"w": x}}}``.

    Names whose paths collide (one is a prefix of another, or two names split to the same
    path) keep their full name as a single top-level key so nothing is lost.
    """
    paths = {name: split_path(name) for name in flat}
    taken: dict[tuple[str, ...], str] = {}
    prefixes: set[tuple[str, ...]] = set()
    for p in paths.values():
        for i in range(1, len(p)):
            prefixes.add(p[:i])
    tree: dict[str, Any] = {}
    for name in sorted(flat):
        p = paths[name]
        if p in taken or p in prefixes or any(p[:i] in taken for i in range(1, len(p))):
            p = (name,)
        taken[p] = name
        node = tree
        for key in p[:-1]:
            node = node.setdefault(key, {})
        node[p[-1]] = flat[name]
    return tree


def flatten(tree: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """Inverse of :func:`nest` for the given original names."""
    nested_paths = _paths_of(list(names))
    out = {}
    for name, p in nested_paths.items():
        node: Any = tree
        for key in p:
            node = node[key]
        out[name] = node
    return out


def _paths_of(names: list[str]) -> dict[str, tuple[str, ...]]:
    marker = object()
    tree = nest({n: (marker, n) for n in names})
    out: dict[str, tuple[str, ...]] = {}

    def walk(node: Any, prefix: tuple[str, ...]) -> None:
        if isinstance(node, tuple) and len(node) == 2 and node[0] is marker:
            out[node[1]] = prefix
            return
        for k, v in node.items():
            walk(v, (*prefix, k))

    walk(tree, ())
    return out
