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


PART = "part-{:05d}"


def stream_orbax_parts(
    targets: Any,
    index: Any,
    path: str | os.PathLike,
    axes: Mapping[str, tuple],
    mesh: Any = None,
    rules: Any = None,
    *,
    progress: Any = None,
) -> dict[str, Any]:
    """The meta-device route's Flax variables (``xconv.weights.stream.Target`` s read from the
    checkpoint ``index``) as an Orbax checkpoint in parts: ``path/part-00001`` holds the
    variables of input shard 1, and so on (computed values in one more part).

    Each input shard is read once, tensor by tensor; every variable is placed on ``mesh``
    (default: all visible devices as ``1xN``) with the sharding its logical ``axes`` and the
    ``rules`` give, the part is written by Orbax (each device its own shards) and dropped
    before the next shard is read (no reference to a written part is kept; the measured peak
    is still ~1x the checkpoint on simulated CPU devices, ``benchmarks/shard_stream.md``).
    The generated ``load(out_dir, mesh=)`` restores the parts one by one, each straight onto
    its target shardings.

    Returns ``{"specs": {name: spec}, "parts": [dirs], "tensors": n, "bytes_written": n,
    "largest_part_bytes": n, "notes": [...]}``.
    """
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec

    from xconv.weights.shards import numpy_dtype
    from xconv.weights.stream import _prefetched

    if mesh is None:
        mesh = f"1x{len(jax.devices())}"
    mesh = make_mesh(mesh)
    table = resolve_rules(rules)
    by_source: dict[str, list] = {}
    computed: list = []
    for t in targets:
        if t.planned is not None:
            by_source.setdefault(t.planned.source, []).append(t)
        else:
            computed.append(t)
    groups = []
    for shard, refs in index.by_shard().items():
        items = [(r, by_source[r.name]) for r in refs if r.name in by_source]
        if items:
            groups.append((shard, items))
    if computed:
        groups.append((None, [(None, computed)]))
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    ckpt = ocp.PyTreeCheckpointer()
    out: dict[str, Any] = {"specs": {}, "parts": [], "tensors": 0, "bytes_written": 0,
                           "largest_part_bytes": 0, "notes": []}  # fmt: skip
    for k, (shard, items) in enumerate(groups, start=1):
        if progress:
            progress(f"weights part {k}/{len(groups)} onto the mesh")
        placed: dict[tuple[str, ...], Any] = {}
        nbytes = 0
        handle = open(shard, "rb") if shard is not None else None  # noqa: SIM115
        try:
            for (_, ts), array in _prefetched(index, items, handle):
                for t in ts:
                    data = t.planned.replay(array) if t.planned is not None else t.value
                    data = np.asarray(data, dtype=numpy_dtype(t.dtype))
                    spec, why = mesh_spec(axes[t.name], data.shape, table, mesh)
                    out["notes"].extend(f"{t.name}: {w}" for w in why)
                    placed[tuple(t.name.split(SEP))] = jax.device_put(
                        data, NamedSharding(mesh, PartitionSpec(*spec))
                    )
                    out["specs"][t.name] = spec
                    nbytes += data.nbytes
                    out["tensors"] += 1
                    del data
                del array
        finally:
            if handle is not None:
                handle.close()
        part = root / PART.format(k)
        ckpt.save(part.absolute(), _nest(placed))
        del placed
        out["parts"].append(part)
        out["bytes_written"] += nbytes
        out["largest_part_bytes"] = max(out["largest_part_bytes"], nbytes)
    return out


class OrbaxParts:
    """Reads single variables back from a checkpoint :func:`stream_orbax_parts` wrote, one
    part on the host at a time (``read(name)``, as ``CheckpointIndex.read`` does)."""

    def __init__(self, path: str | os.PathLike) -> None:
        import orbax.checkpoint as ocp

        self._ckpt = ocp.PyTreeCheckpointer()
        self._where: dict[str, Path] = {}
        for part in sorted(Path(path).glob("part-*")) or [Path(path)]:
            meta = self._ckpt.metadata(part.absolute())
            meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
            for name in _flat_names(meta):
                self._where[name] = part
        self._part: Path | None = None
        self._arrays: dict[str, np.ndarray] = {}

    def read(self, name: str) -> np.ndarray:
        import orbax.checkpoint as ocp

        part = self._where[name]
        if part != self._part:
            self._arrays = {}
            names = [n for n, p in self._where.items() if p == part]
            args = _nest({tuple(n.split(SEP)): ocp.RestoreArgs(restore_type=np.ndarray)
                          for n in names})  # fmt: skip
            tree = self._ckpt.restore(
                part.absolute(), args=ocp.args.PyTreeRestore(restore_args=args)
            )
            self._arrays = {n: np.asarray(a) for n, a in _flat_items(tree)}
            self._part = part
        return self._arrays[name]


def _flat_items(tree: Any, prefix: str = ""):
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _flat_items(v, f"{prefix}{SEP if prefix else ''}{k}")
    else:
        yield prefix, tree


def _flat_names(tree: Any) -> list[str]:
    return [n for n, _ in _flat_items(tree)]
