"""Streaming converted weights into a sharded Orbax checkpoint.

The weights-only path converts a checkpoint one input shard at a time
(``xconv.weights.convert``); the meta-device route reads it tensor by tensor
(``xconv.checkpoint``). :func:`write_sharded_orbax` and :func:`stream_orbax_parts` put
every array straight onto the mesh with the sharding its logical axes and the rules give
(one ``device_put`` per array; the host copy is dropped as it is placed), have Orbax write
each input shard's placed arrays as one part (``part-00001``, ...; each device writes its
own shards), drop the part and hand its memory back to the system before the next shard
is read. The host therefore holds about one part (and Orbax's copy of it while it is
written), never the whole tree. The generated ``load(out_dir, mesh=)`` restores the parts
one by one, each straight onto its target shardings.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from xconv.converters.codegen import replace_dir
from xconv.sharding.axes import logical_axes
from xconv.sharding.rules import make_mesh, mesh_spec, resolve_rules

SEP = "/"


_COLLECTIONS = frozenset({"params", "batch_stats"})
PART = "part-{:05d}"


def write_sharded_orbax(
    parts: Iterable[Mapping[str, np.ndarray]],
    path: str | os.PathLike,
    mesh: Any,
    rules: Any = None,
    *,
    model: Any = None,
) -> dict[str, Any]:
    """Write ``parts`` (``{"params/layer/kernel": array}`` each, e.g. one converted input
    shard) as an Orbax checkpoint in parts at ``path`` (``path/part-00001`` holds the first
    part, as :func:`stream_orbax_parts` writes them), every array placed on ``mesh`` by
    ``rules`` as it arrives.

    A part's host arrays are dropped as they are placed (a part given as a ``dict`` is
    emptied, so no reference the caller keeps holds them), the placed part is written and
    dropped before the next part is taken, and its memory is handed back
    (:func:`release_host_memory`): the peak follows the largest part, not the checkpoint.
    The folder appears at ``path`` only once every part is written.

    Returns ``{"specs": {name: spec}, "parts": [dirs], "largest_part_bytes": int,
    "notes": [...]}``.
    """
    import orbax.checkpoint as ocp

    mesh = make_mesh(mesh)
    table = resolve_rules(rules)
    pin_mmap_threshold()
    specs: dict[str, tuple] = {}
    notes: list[str] = []
    largest = 0
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    parent = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    ckpt = ocp.PyTreeCheckpointer()
    names: list[str] = []
    try:
        staged = parent / "ckpt"
        staged.mkdir()
        for k, part in enumerate(parts, start=1):
            # Emptied as placed (a dict is popped in place, so the caller's reference to it
            # keeps no host copy alive either).
            part = part if isinstance(part, dict) else dict(part)
            # Shapes only: a reference here would keep each host array past its placing.
            tree = {tuple(name.split(SEP)): _Shape(np.shape(a)) for name, a in part.items()}
            if not tree:
                continue
            # linen trees start with a collection ("params/..."); nnx state does not.
            linen = all(key[0] in _COLLECTIONS for key in tree)
            axes, why = logical_axes(_nest(tree), model=model, strip_collection=linen)
            notes.extend(why)
            placed: dict[tuple[str, ...], Any] = {}
            nbytes = 0
            while part:
                name, array = part.popitem()  # the host copy goes once it is placed
                key = tuple(name.split(SEP))
                nbytes += int(np.asarray(array).nbytes)
                placed[key], specs[name] = _place(array, axes[key], table, mesh, notes, name)
                del array
            largest = max(largest, nbytes)
            name = PART.format(k)
            ckpt.save((staged / name).absolute(), _nest(placed))
            del placed
            release_host_memory()
            names.append(name)
        replace_dir(staged, out)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    return {"specs": specs, "parts": [out / n for n in names], "largest_part_bytes": largest,
            "notes": notes}  # fmt: skip


class _Shape:
    """A leaf's shape alone (what ``logical_axes`` looks at)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = tuple(shape)
        self.ndim = len(self.shape)


def _place(array: Any, axes: tuple, table: Any, mesh: Any, notes: list[str], name: str):
    """``(array on mesh, its partition spec)``: sharded by the logical ``axes`` and rules."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    spec, why = mesh_spec(axes, np.shape(array), table, mesh)
    notes.extend(f"{name}: {w}" for w in why)
    return jax.device_put(array, NamedSharding(mesh, PartitionSpec(*spec))), spec


def _nest(flat: Mapping[tuple[str, ...], Any]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def release_host_memory() -> None:
    """Give the host memory of a written part back to the system.

    The arrays of a written part are freed (``jax.live_arrays()`` and malloc's in-use bytes
    stay flat from part to part), but glibc keeps freed chunks in the arena of the thread
    that freed them (XLA's and tensorstore's worker threads each have one) and does not hand
    them back while a live chunk sits above them; the next part is then allocated in fresh
    pages, and RSS grows by about a part per part (``benchmarks/shard_stream.md``).
    ``malloc_trim(0)`` returns the free pages of every arena. A no-op off glibc. (No
    ``gc.collect()``: a part's arrays go by reference counting, and a full collection over
    a traced model's objects cost 1.8 s per part on the 186 MiB Llama.)
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


#: Buffers at least this large are mmapped by glibc and unmapped when freed (``mallopt``).
MMAP_THRESHOLD = 128 << 10
_M_MMAP_THRESHOLD = -3


def pin_mmap_threshold() -> None:
    """Have glibc mmap every buffer of ``MMAP_THRESHOLD`` bytes or more, for the rest of the
    process. By default glibc raises its mmap threshold to the size of the largest mmapped
    buffer freed so far (up to 32 MiB), so after the first tensor every tensor-sized buffer
    comes from the heap arenas, where freed memory stays resident; pinned, a freed tensor
    buffer goes back to the system at once. Costs one mmap per large buffer. No-op off glibc.
    """
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def _glibc() -> Any:
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


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
    before the next shard is read, its memory handed back (:func:`release_host_memory`): the
    peak follows the largest part, not the checkpoint (``benchmarks/shard_stream.md``).
    The generated ``load(out_dir, mesh=)`` restores the parts one by one, each straight onto
    its target shardings.

    Returns ``{"specs": {name: spec}, "parts": [dirs], "tensors": n, "bytes_written": n,
    "largest_part_bytes": n, "notes": [...]}``.
    """
    import jax
    import orbax.checkpoint as ocp

    from xconv.weights.stream import shard_groups

    if mesh is None:
        mesh = f"1x{len(jax.devices())}"
    mesh = make_mesh(mesh)
    pin_mmap_threshold()
    table = resolve_rules(rules)
    groups, _ = shard_groups(targets, index)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    ckpt = ocp.PyTreeCheckpointer()
    out: dict[str, Any] = {"specs": {}, "parts": [], "tensors": 0, "bytes_written": 0,
                           "largest_part_bytes": 0, "notes": []}  # fmt: skip
    for k, (shard, items) in enumerate(groups, start=1):
        if progress:
            progress(f"weights part {k}/{len(groups)} onto the mesh")
        placed, nbytes = _place_part(index, shard, items, axes, table, mesh, out)
        part = root / PART.format(k)
        ckpt.save(part.absolute(), _nest(placed))
        del placed
        release_host_memory()
        out["parts"].append(part)
        out["bytes_written"] += nbytes
        out["largest_part_bytes"] = max(out["largest_part_bytes"], nbytes)
    return out


def _place_part(index, shard, items, axes, table, mesh, out) -> tuple[dict, int]:
    """One part's variables read from ``shard`` tensor by tensor and placed on ``mesh``
    (``{path: array}``) and their bytes; counts tensors and records specs and notes in
    ``out``."""
    from xconv.weights.shards import numpy_dtype
    from xconv.weights.stream import _prefetched

    placed: dict[tuple[str, ...], Any] = {}
    nbytes = 0
    handle = open(shard, "rb") if shard is not None else None  # noqa: SIM115
    try:
        for (_, ts), array in _prefetched(index.log, items, handle):
            for t in ts:
                data = t.planned.replay(array) if t.planned is not None else t.value
                data = np.asarray(data, dtype=numpy_dtype(t.dtype))
                placed[tuple(t.name.split(SEP))], out["specs"][t.name] = _place(
                    data, axes[t.name], table, mesh, out["notes"], t.name
                )
                nbytes += data.nbytes
                out["tensors"] += 1
                del data
            del array
    finally:
        if handle is not None:
            handle.close()
    return placed, nbytes


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
