"""Streaming converted weights into a sharded Orbax checkpoint.

The weights-only path converts a checkpoint one input shard at a time
(``xconv.weights.convert``). :func:`write_sharded_orbax` takes those parts as they come,
puts every array straight onto the mesh with the sharding its logical axes and the rules
give (one ``device_put`` per array; the host copy is dropped before the next part is read),
and has Orbax write the placed arrays, each device's shards by itself. The host therefore
holds at most one input part, never the whole tree; the tree lives on the mesh, split.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from xconv.sharding.axes import logical_axes
from xconv.sharding.rules import make_mesh, mesh_spec, resolve_rules

SEP = "/"


_COLLECTIONS = frozenset({"params", "batch_stats"})


def write_sharded_orbax(
    parts: Iterable[Mapping[str, np.ndarray]],
    path: str | os.PathLike,
    mesh: Any,
    rules: Any = None,
    *,
    model: Any = None,
) -> dict[str, Any]:
    """Write ``parts`` (``{"params/layer/kernel": array}`` each) as one Orbax checkpoint at
    ``path``, every array placed on ``mesh`` by ``rules`` as it arrives.

    Returns ``{"specs": {name: spec}, "largest_part_bytes": int, "notes": [...]}``.
    """
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = make_mesh(mesh)
    table = resolve_rules(rules)
    placed: dict[tuple[str, ...], Any] = {}
    specs: dict[str, tuple] = {}
    notes: list[str] = []
    largest = 0
    for part in parts:
        largest = max(largest, sum(int(np.asarray(a).nbytes) for a in part.values()))
        tree = {tuple(k.split(SEP)): a for k, a in part.items()}
        # linen trees start with a collection ("params/..."); nnx state does not.
        linen = all(k[0] in _COLLECTIONS for k in tree)
        axes, why = logical_axes(_nest(tree), model=model, strip_collection=linen)
        notes.extend(why)
        for key, array in tree.items():
            spec, why = mesh_spec(axes[key], np.shape(array), table, mesh)
            notes.extend(f"{SEP.join(key)}: {w}" for w in why)
            placed[key] = jax.device_put(array, NamedSharding(mesh, PartitionSpec(*spec)))
            specs[SEP.join(key)] = spec
        del part, tree
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    parent = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        staged = parent / "ckpt"
        ocp.PyTreeCheckpointer().save(staged.absolute(), _nest(placed))
        if out.exists():
            os.replace(out, parent / "old")
        os.replace(staged, out)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    return {"specs": specs, "largest_part_bytes": largest, "notes": notes}


def _nest(flat: Mapping[tuple[str, ...], Any]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out
