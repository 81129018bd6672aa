"""Sharded safetensors checkpoints read and written one tensor at a time, from the headers.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, offsets relative to the end of
the header) and the raw little-endian tensor bytes. That is all a larger-than-memory
conversion needs: :class:`CheckpointIndex` reads every shard's header (a few KiB each) and
checks the whole checkpoint against what the model expects before a byte of weights is read;
:func:`read_tensor` reads one tensor with a plain ``readinto`` (no mmap, so the bytes leave
memory when the array does); :class:`ShardWriter` writes a shard whose header is known up
front, one tensor at a time, to a temporary file renamed into place when complete.

``ReadLog`` counts the bytes read per shard, so tests and benchmarks can prove that no shard
was read twice.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xconv.errors import WeightsError

#: safetensors dtype name -> numpy dtype name (bfloat16 / float8 through ml_dtypes).
DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
_NAMES = {v: k for k, v in DTYPES.items()}
#: Headers larger than this are not safetensors headers (the format's own limit is 100 MB).
_MAX_HEADER = 100_000_000


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a safetensors or numpy dtype name (``BF16``, ``bfloat16``)."""
    name = DTYPES.get(name, name)
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def safetensors_dtype(dtype: Any) -> str:
    """The safetensors name (``BF16``) of a numpy dtype."""
    name = np.dtype(dtype).name
    if name not in _NAMES:
        raise WeightsError(f"safetensors cannot store dtype {name}; it stores {sorted(_NAMES)}")
    return _NAMES[name]


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes are: a shard file, an absolute byte offset, its type.

    Attributes:
        name: The checkpoint key (``model.layers.0.mlp.up_proj.weight``).
        shard: The shard file.
        offset: Absolute byte offset of the data in the shard.
        nbytes: Byte length.
        dtype: numpy dtype name (``bfloat16``).
        shape: The shape.
    """

    name: str
    shard: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class ReadLog:
    """Bytes read per shard file (every :func:`read_tensor` adds to it)."""

    bytes_read: dict[str, int] = field(default_factory=dict)

    def add(self, shard: Path, n: int) -> None:
        key = str(shard)
        self.bytes_read[key] = self.bytes_read.get(key, 0) + n


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """``(header, data start)`` of one safetensors file; raises WeightsError when unreadable."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise WeightsError(f"{path}: not a safetensors file (header size {n})")
            raw = f.read(n)
    except OSError as e:
        raise WeightsError(f"{path}: cannot read the shard: {e}") from e
    if len(raw) < n:
        raise WeightsError(f"{path}: truncated safetensors file (header cut short)")
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise WeightsError(f"{path}: the safetensors header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: the safetensors header is not a JSON object")
    return header, 8 + n


class CheckpointIndex:
    """Every tensor of a (sharded) safetensors checkpoint, from the headers alone.

    Args:
        spec: A ``*.safetensors`` file, a glob (``"ckpt/model-*.safetensors"``), a
            ``*.index.json`` or a folder holding one of those.

    Problems found while scanning (an index naming a missing shard, a truncated shard, an
    unknown dtype) are collected in ``problems``, not raised, so one error can list them all
    with the model's own missing / unexpected / mismatched keys (:meth:`check`).
    """

    def __init__(self, spec: str | os.PathLike) -> None:
        self.spec = str(spec)
        self.problems: list[str] = []
        self.tensors: dict[str, TensorRef] = {}
        self.shards: list[Path] = []
        self.root = Path(".")
        self.log = ReadLog()
        self._declared: dict[str, str] | None = None  # an index's weight_map
        self._scan(self._shard_files())

    def _shard_files(self) -> list[Path]:
        p = Path(self.spec)
        if p.is_dir():
            index = sorted(p.glob("*.safetensors.index.json"))
            if index:
                p = index[0]
            else:
                return self._glob(str(p / "*.safetensors"))
        if p.name.endswith(".json"):
            self.root = p.parent
            try:
                weight_map = json.loads(p.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise WeightsError(f"{p} is not a safetensors index (no weight_map): {e}") from e
            names = sorted(set(weight_map.values()))
            files = [p.parent / n for n in names]
            for f in files:
                if not f.is_file():
                    self.problems.append(f"the index {p.name} names a missing shard file: {f}")
            self._declared = dict(weight_map)
            return [f for f in files if f.is_file()]
        return self._glob(self.spec)

    def _glob(self, pattern: str) -> list[Path]:
        files = sorted(Path(f) for f in glob.glob(pattern))
        if not files:
            raise WeightsError(f"no safetensors files match {pattern!r}")
        self.root = files[0].parent
        return files

    def _scan(self, files: Iterable[Path]) -> None:
        for shard in files:
            try:
                header, start = read_header(shard)
            except WeightsError as e:
                self.problems.append(str(e))
                continue
            self.shards.append(shard)
            size = shard.stat().st_size
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                try:
                    begin, end = (int(x) for x in info["data_offsets"])
                    shape = tuple(int(d) for d in info["shape"])
                    dtype = DTYPES[info["dtype"]]
                except (KeyError, TypeError, ValueError):
                    self.problems.append(f"{shard.name}: bad header entry for {name}: {info}")
                    continue
                ref = TensorRef(name, shard, start + begin, end - begin, dtype, shape)
                if ref.size * numpy_dtype(dtype).itemsize != ref.nbytes:
                    self.problems.append(
                        f"{shard.name}: {name} has {ref.nbytes} bytes for shape {shape} {dtype}"
                    )
                elif start + end > size:
                    self.problems.append(
                        f"truncated shard {shard.name}: {name} ends at byte {start + end}, the "
                        f"file has {size}"
                    )
                if name in self.tensors:
                    self.problems.append(
                        f"{name} is in two shards: {self.tensors[name].shard.name}, {shard.name}"
                    )
                self.tensors[name] = ref
        if self._declared:
            for name, file in sorted(self._declared.items()):
                ref = self.tensors.get(name)
                if ref is not None and ref.shard.name != file:
                    self.problems.append(
                        f"the index puts {name} in {file}, but it is in {ref.shard.name}"
                    )

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.tensors.values())

    def largest_shard_bytes(self) -> int:
        return max((s.stat().st_size for s in self.shards), default=0)

    def check(
        self,
        expected: Mapping[str, tuple[tuple[int, ...], str]],
        *,
        tied: Mapping[str, str] | None = None,
        what: str = "the checkpoint",
    ) -> None:
        """Raise one WeightsError listing every problem: unreadable files, missing,
        unexpected, mis-shaped or mis-typed tensors against ``expected``
        (``{name: (shape, numpy dtype name)}``). ``tied`` maps a name the checkpoint may omit
        to the name it shares storage with."""
        tied = dict(tied or {})
        lines = list(self.problems)
        for name, (shape, dtype) in sorted(expected.items()):
            ref = self.tensors.get(name)
            if ref is None:
                if tied.get(name) in self.tensors:
                    continue
                lines.append(f"missing tensor: {name} {list(shape)} {dtype}")
                continue
            if tuple(ref.shape) != tuple(shape):
                lines.append(
                    f"shape mismatch: {name}: checkpoint {list(ref.shape)}, model {list(shape)}"
                )
            if ref.dtype != dtype:
                lines.append(f"dtype mismatch: {name}: checkpoint {ref.dtype}, model {dtype}")
        for name in sorted(set(self.tensors) - set(expected)):
            lines.append(f"unexpected tensor: {name} (in {self.tensors[name].shard.name})")
        if lines:
            head = f"{what} ({self.spec}) does not fit the model: {len(lines)} problem(s)"
            raise WeightsError("\n".join([head, *(f"  {x}" for x in lines)]))

    def read(self, name: str) -> np.ndarray:
        """One tensor, read from its shard (counted in ``log``)."""
        return read_tensor(self.tensors[name], self.log)

    def by_shard(self) -> dict[Path, list[TensorRef]]:
        """Tensors grouped by shard, each group in file order."""
        out: dict[Path, list[TensorRef]] = {s: [] for s in self.shards}
        for ref in self.tensors.values():
            out[ref.shard].append(ref)
        return {s: sorted(refs, key=lambda r: r.offset) for s, refs in out.items()}


def read_tensor(ref: TensorRef, log: ReadLog | None = None, f: Any = None) -> np.ndarray:
    """Read one tensor's bytes into a fresh array (``f``: an open handle on its shard)."""
    out = np.empty(ref.shape, dtype=numpy_dtype(ref.dtype))
    buf = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(b"")
    own = f is None
    if own:
        f = open(ref.shard, "rb")  # noqa: SIM115
    try:
        f.seek(ref.offset)
        n = f.readinto(buf) if out.size else 0
    finally:
        if own:
            f.close()
    if n != ref.nbytes:
        raise WeightsError(f"truncated shard {ref.shard.name}: {ref.name} is cut short")
    if log is not None:
        log.add(ref.shard, n)
    return out


def header_bytes(
    specs: Iterable[tuple[str, tuple[int, ...], Any]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, int]:
    """``(JSON header padded to 8 bytes, data bytes)`` of a safetensors file holding ``specs``
    (``[(name, shape, numpy dtype)]``) back to back, in that order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "np"})}
    offset = 0
    for name, shape, dtype in specs:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {
            "dtype": safetensors_dtype(dtype),
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return raw, offset


class ShardWriter:
    """Write one safetensors file whose tensors are known up front, a tensor at a time.

    The header (names, dtypes, shapes, offsets) is written first; :meth:`write` then appends
    each tensor's bytes in header order. The file is a temporary sibling until :meth:`close`
    checks every tensor arrived and renames it into place; :meth:`abort` deletes it.

    Args:
        path: The final file.
        specs: ``[(name, shape, numpy dtype)]`` in the order they will be written.
    """

    def __init__(
        self, path: Path, specs: Iterable[tuple[str, tuple[int, ...], Any]], metadata=None
    ) -> None:
        self.path = Path(path)
        self.specs = [(n, tuple(s), np.dtype(d)) for n, s, d in specs]
        raw, self.nbytes = header_bytes(self.specs, metadata)
        fd, tmp = tempfile.mkstemp(
            dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp"
        )
        self._tmp = Path(tmp)
        self._f = os.fdopen(fd, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, array: np.ndarray) -> None:
        want, shape, dtype = self.specs[self._next]
        if name != want or tuple(array.shape) != shape or array.dtype != dtype:
            raise WeightsError(
                f"{self.path.name}: expected {want} {list(shape)} {dtype} next, got {name} "
                f"{list(array.shape)} {array.dtype}"
            )
        self._f.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
        self._next += 1

    def close(self) -> Path:
        if self._next != len(self.specs):
            missing = [n for n, _, _ in self.specs[self._next :]]
            self.abort()
            raise WeightsError(f"{self.path.name}: tensors never written: {missing}")
        self._f.close()
        os.chmod(self._tmp, 0o644)  # mkstemp makes it private; a checkpoint is not
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        self._f.close()
        self._tmp.unlink(missing_ok=True)


def write_index(path: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    """The ``*.safetensors.index.json`` beside the shards (atomic)."""
    body = {
        "metadata": {"total_size": int(total_size)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(body, f, indent=2, sort_keys=True)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


__all__ = [
    "DTYPES",
    "CheckpointIndex",
    "ReadLog",
    "ShardWriter",
    "TensorRef",
    "header_bytes",
    "numpy_dtype",
    "read_header",
    "read_tensor",
    "safetensors_dtype",
    "write_index",
]
