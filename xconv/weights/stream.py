"""Weights streamed from a checkpoint into a converted model's shard files, one at a time.

The IR of a model traced without weights (:mod:`xconv.converters.torch.importer.meta`) holds its
initializers as lazy references into the checkpoint (:class:`LazyWeight`: shard file, byte
offset, dtype, shape). Writing a target then takes two steps:

1. **Plan.** The target's emitter runs on the IR with every lazy weight standing in as a
   :class:`Planned` array: it has a shape and a dtype and records the layout operations the
   emitter applies to it (a kernel transpose), but no data. What comes out is the generated
   source and, for each target variable, the source tensor and the operations to replay.
2. **Stream.** The checkpoint is read shard by shard, each tensor once, in file order; each is
   transformed and appended to the output shard of its input shard, then dropped. Peak memory
   is one tensor (and its transposed copy), not the model.

:class:`EarlyStream` does step 2 before step 1, beside the trace, on a guessed layout that
step 1's plan must then match exactly (else it is discarded and step 2 runs as above). Its
process reads each shard with ``O_DIRECT`` (when not page-cached) a tensor ahead on a thread,
transposes into an aligned output buffer and writes whole blocks with ``O_DIRECT`` on another
thread: two source and two output buffers of the largest tensor (1.0 GiB for a 7 B Llama's
262 MB embedding), and none of the page-cache fill, reclaim and dirty-page waits that made a
buffered 7 B stream 76 s of mostly kernel time (now ~14-21 s).

Output shards are safetensors files written to a temporary name and renamed when complete,
inside the caller's staging folder (the folder is moved into place only when everything was
written).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.errors import ConversionError
from xconv.weights.shards import (
    CheckpointIndex,
    ReadLog,
    ShardWriter,
    TensorRef,
    header_bytes,
    numpy_dtype,
    write_index,
)

#: Output names: ``variables-00001-of-00004.safetensors`` + this index.
INDEX_NAME = "variables.safetensors.index.json"


class LazyWeight(ir.ExternalTensor):
    """An IR initializer that is a tensor of a safetensors shard, read only when used.

    It is an ``onnx_ir`` external tensor (location = the shard, offset = the tensor's bytes),
    so serialising the IR writes the reference, never the bytes.
    """

    def __init__(self, ref: TensorRef, name: str | None = None) -> None:
        super().__init__(
            ref.shard.name,
            ref.offset,
            ref.nbytes,
            ir.DataType.from_numpy(numpy_dtype(ref.dtype)),
            shape=ir.Shape(ref.shape),
            name=name or ref.name,
            base_dir=str(ref.shard.parent),
        )
        self.ref = ref


def attach(model: ir.Model, index: CheckpointIndex, tied: Mapping[str, str] | None = None) -> int:
    """Make every initializer that is a checkpoint entry a :class:`LazyWeight`; returns how many.

    ``tied`` names entries stored once under another key (an LM head tied to the embedding).
    """
    tied = dict(tied or {})
    n = 0
    for name, value in model.graph.initializers.items():
        ref = index.tensors.get(name) or index.tensors.get(tied.get(name, ""))
        if ref is None:
            continue
        lazy = LazyWeight(ref, name=name)  # a tied name reads its partner's bytes
        lazy.metadata_props.update(getattr(value.const_value, "metadata_props", {}) or {})
        value.const_value = lazy
        n += 1
    return n


class NeedsDataError(ConversionError):
    """An emitter asked for the values of a weight it should only rearrange."""


class Planned:
    """A stand-in array for a checkpoint tensor: shape and dtype, and the operations applied.

    Supports what emitters do to weights (``np.transpose``, ``np.ascontiguousarray``,
    ``.reshape``, ``.astype`` to the same dtype, ``.T``); reading values raises
    :class:`NeedsDataError`. :meth:`replay` applies the recorded operations to the real array.
    """

    __array_priority__ = 1000

    def __init__(self, source: str, shape, dtype, ops: tuple = ()) -> None:
        self.source = source
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.ops = ops

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape, dtype=np.int64)))
    nbytes = property(lambda self: self.size * self.dtype.itemsize)
    itemsize = property(lambda self: self.dtype.itemsize)

    def __repr__(self) -> str:
        return f"Planned({self.source!r}, {self.shape}, {self.dtype.name}, ops={self.ops})"

    def transpose(self, *axes) -> Planned:
        if len(axes) == 1 and isinstance(axes[0], tuple | list):
            axes = tuple(axes[0])
        perm = tuple(int(a) % max(self.ndim, 1) for a in axes) or tuple(reversed(range(self.ndim)))
        shape = tuple(self.shape[a] for a in perm)
        return Planned(self.source, shape, self.dtype, (*self.ops, ("transpose", perm)))

    @property
    def T(self) -> Planned:  # noqa: N802 (numpy's name)
        return self.transpose()

    def reshape(self, *shape) -> Planned:
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        dims = [int(d) for d in shape]
        if -1 in dims:
            known = int(np.prod([d for d in dims if d != -1], dtype=np.int64))
            dims[dims.index(-1)] = self.size // max(known, 1)
        new = tuple(dims)
        return Planned(self.source, new, self.dtype, (*self.ops, ("reshape", new)))

    def astype(self, dtype, copy: bool = True) -> Planned:
        dtype = np.dtype(dtype)
        if dtype == self.dtype:
            return self
        return Planned(self.source, self.shape, dtype, (*self.ops, ("astype", dtype.name)))

    def copy(self) -> Planned:
        return self

    def __array_function__(self, func, types, args, kwargs):
        if func is np.transpose:
            axes = kwargs.get("axes", args[1] if len(args) > 1 else None)
            return args[0].transpose(*(() if axes is None else (tuple(axes),)))
        if func in (np.ascontiguousarray, np.copy):
            return args[0]
        if func is np.reshape:
            shape = kwargs.get("shape", kwargs.get("newshape", args[1] if len(args) > 1 else None))
            return args[0].reshape(shape)
        if func is np.shape:
            return args[0].shape
        if func is np.ndim:
            return args[0].ndim
        if func is np.size:
            return args[0].size
        raise NeedsDataError(
            f"the emitter applied {func.__name__} to the weight {self.source!r} of a model traced "
            "without weights; only layout changes (transpose, reshape) can be streamed"
        )

    def __array__(self, dtype=None, copy=None):
        raise NeedsDataError(
            f"the emitter read the values of the weight {self.source!r} of a model traced without "
            "weights; only layout changes (transpose, reshape) can be streamed"
        )

    def replay(self, array: np.ndarray, scratch: Scratch | None = None) -> np.ndarray:
        """Apply the recorded operations to the real source array.

        With ``scratch`` a transpose is written into its reused buffer: the result is valid
        only until the next replay with the same scratch (the stream writes it out first).
        """
        for op, arg in self.ops:
            if op == "transpose":
                array = _transpose(array, arg, scratch)
            elif op == "reshape":
                array = array.reshape(arg)
            else:
                array = array.astype(numpy_dtype(arg))
        return np.ascontiguousarray(array)


class Scratch:
    """One output buffer reused by every transpose of a stream (one per thread).

    A fresh 100 MB array per tensor costs a page fault per 4 KiB page (the allocator hands
    large blocks back to the kernel); reusing one buffer sized for the largest tensor took
    the 1.5 B stream's page faults from ~190k to ~43k and its transpose CPU time down ~25 %.
    """

    def __init__(self) -> None:
        self._buf: np.ndarray | None = None

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A C-contiguous ``shape`` ``dtype`` view of the buffer (grown when too small)."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self._buf is None or self._buf.size < n:
            self._buf = None  # drop the old one before allocating the larger
            self._buf = np.empty(n, dtype=np.uint8)
        return self._buf[:n].view(dtype).reshape(shape)


def _transpose(
    array: np.ndarray, perm: tuple[int, ...], scratch: Scratch | None = None
) -> np.ndarray:
    """``np.transpose`` made contiguous; through torch's blocked copy when torch is loaded
    (numpy's strided copy of a large 2-byte matrix is ~10x slower); into ``scratch``'s buffer
    when given."""
    torch = sys.modules.get("torch")
    ints = {2: "int16", 4: "int32", 8: "int64"}.get(array.dtype.itemsize)
    if torch is None or ints is None or array.size < 1 << 16:
        return np.ascontiguousarray(np.transpose(array, perm))
    src = torch.from_numpy(np.ascontiguousarray(array).view(ints)).permute(perm)
    if scratch is None:
        return src.contiguous().numpy().view(array.dtype)
    out = scratch.take(tuple(src.shape), np.dtype(ints))
    torch.from_numpy(out).copy_(src)
    return out.view(array.dtype)


class _PlanTensor(ir.ExternalTensor):
    """A LazyWeight whose ``numpy()`` is a :class:`Planned` (used only while planning)."""

    def __init__(self, lazy: ir.ExternalTensor, source: str) -> None:
        super().__init__(
            lazy.location,
            lazy.offset,
            lazy.length,
            lazy.dtype,
            shape=lazy.shape,
            name=lazy.name,
            base_dir=lazy.base_dir,
        )
        self.source = source

    def numpy(self) -> Any:
        return Planned(self.source, tuple(self.shape.numpy()), self.dtype.numpy())

    def __array__(self, dtype=None, copy=None):
        return self.numpy().__array__()

    def tobytes(self) -> bytes:
        raise NeedsDataError(f"the bytes of {self.source!r} were asked for while planning")


def planning_copy(model: ir.Model, sources: Mapping[str, str]) -> ir.Model:
    """A copy of ``model`` whose lazy weights are :class:`Planned` stand-ins.

    ``sources`` maps initializer names to checkpoint keys (``{name: ref.name}``).
    """
    copy = ir.from_proto(ir.to_proto(model))  # lazy weights serialise as references
    for name, value in copy.graph.initializers.items():
        tensor = value.const_value
        if name in sources and isinstance(tensor, ir.ExternalTensor):
            value.const_value = _PlanTensor(tensor, sources[name])
    return copy


@dataclass(frozen=True)
class Target:
    """One variable of the target: its flat name, where its data comes from, its type.

    ``planned`` replays the layout change on the source tensor; ``value`` is a small array
    computed while tracing (a non-persistent buffer) with no checkpoint entry.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    planned: Planned | None = None
    value: np.ndarray | None = None


@dataclass
class StreamReport:
    """What a streamed write did: files, bytes, and the bytes read per input shard."""

    files: list[Path] = field(default_factory=list)
    bytes_written: int = 0
    bytes_read: dict[str, int] = field(default_factory=dict)
    tensors: int = 0
    early: bool = False  # written by an EarlyStream, side by side with the trace
    #: Peak RSS (KiB) of the EarlyStream's child process, not in the caller's own peak.
    helper_peak_kib: int = 0
    #: The EarlyStream child's timings (``EarlyStream.stats``).
    helper_stats: dict[str, Any] = field(default_factory=dict)
    #: Streamed into Orbax parts placed on a mesh (``xconv.sharding.stream``): its summary.
    sharding: dict[str, Any] | None = None


def shard_groups(
    targets: Sequence[Target], index: CheckpointIndex
) -> tuple[list[tuple[Path | None, list[tuple[TensorRef | None, list[Target]]]]], dict]:
    """``(input shard, [(tensor ref, targets planned from it)])`` per output part, in the
    index's shard order (computed targets, with no source tensor, make one more part), and the
    targets by source key. The one grouping of the streamed writers (:func:`stream_targets`,
    ``xconv.sharding.stream.stream_orbax_parts``)."""
    by_source: dict[str, list[Target]] = {}
    computed: list[Target] = []
    for t in targets:
        if t.planned is not None:
            by_source.setdefault(t.planned.source, []).append(t)
        else:
            computed.append(t)
    groups: list[tuple[Path | None, list[tuple[TensorRef | None, list[Target]]]]] = []
    for shard, refs in index.by_shard().items():
        items = [(r, by_source[r.name]) for r in refs if r.name in by_source]
        if items:
            groups.append((shard, items))
    if computed:
        groups.append((None, [(None, computed)]))
    return groups, by_source


def stream_targets(
    targets: Sequence[Target],
    index: CheckpointIndex,
    out_dir: Path,
    *,
    stem: str = "variables",
    index_name: str = INDEX_NAME,
    progress: Callable[[str], None] | None = None,
) -> StreamReport:
    """Write ``targets`` as safetensors shards (+ index) into ``out_dir``, streaming.

    Output shard ``k`` holds the variables whose source is input shard ``k``, in its file
    order; computed values go in one more shard. Each input shard is opened once and each of
    its tensors read once, however many targets it feeds.
    """
    groups, by_source = shard_groups(targets, index)
    unknown = sorted(set(by_source) - set(index.tensors))
    if unknown:
        raise ConversionError(f"targets read tensors the checkpoint lacks: {unknown}")
    report = StreamReport()
    before = dict(index.log.bytes_read)
    weight_map: dict[str, str] = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    n = len(groups)
    scratch = Scratch()
    for k, (shard, items) in enumerate(groups, start=1):
        name = f"{stem}-{k:05d}-of-{n:05d}.safetensors"
        specs = [(t.name, t.shape, numpy_dtype(t.dtype)) for _, ts in items for t in ts]
        if progress:
            progress(f"weights shard {k}/{n}")
        writer = ShardWriter(out_dir / name, specs, metadata={"format": "flax"})
        try:
            handle = open(shard, "rb") if shard is not None else None  # noqa: SIM115
            try:
                for (_, ts), array in _prefetched(index.log, items, handle):
                    for t in ts:
                        data = (
                            t.planned.replay(array, scratch) if t.planned is not None else t.value
                        )
                        writer.write(t.name, np.asarray(data, dtype=numpy_dtype(t.dtype)))
                        weight_map[t.name] = name
                        report.tensors += 1
                    del array, data
            finally:
                if handle is not None:
                    handle.close()
        except BaseException:
            writer.abort()
            raise
        report.files.append(writer.close())
        report.bytes_written += writer.nbytes
    write_index(out_dir / index_name, weight_map, report.bytes_written)
    report.files.append(out_dir / index_name)
    report.bytes_read = {
        k: n - before.get(k, 0) for k, n in index.log.bytes_read.items() if n != before.get(k, 0)
    }
    return report


def _prefetched(
    log: ReadLog,
    items: Sequence[tuple[Any, Any]],
    handle: Any,
    reader: Callable[[TensorRef | None], np.ndarray | None] | None = None,
):
    """``(item, array)`` in order, reading the next tensor on a thread while the caller
    transforms and writes this one (file reads and torch's copies release the GIL). At most
    two source tensors are in memory. ``reader`` replaces the plain read from ``handle``."""
    from concurrent.futures import ThreadPoolExecutor

    from xconv.weights.shards import read_tensor

    def read(ref: TensorRef | None) -> np.ndarray | None:
        if reader is not None:
            return reader(ref)
        return read_tensor(ref, log, handle) if ref is not None else None

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(read, items[0][0]) if items else None
        for i, item in enumerate(items):
            array = pending.result()
            pending = pool.submit(read, items[i + 1][0]) if i + 1 < len(items) else None
            yield item, array
            del array


class EarlyStream:
    """Stream the weights while the module is still being traced, on a guessed layout.

    Tracing a 7 B Llama costs most of a minute and streaming it as long again, so they run
    side by side: a child Python process (not a thread: the tracer holds the GIL, and a
    stream thread that waits for it at every file read and copy ran 2-3x slower, 11-15 s ->
    30-49 s for a 1.5 B checkpoint beside a busy Python loop) writes each input shard's
    tensors, in file order, with the layout ``guesses`` names (``{checkpoint key: Planned}``,
    e.g. every ``nn.Linear`` weight transposed), into a temporary file whose header space is
    reserved. Once the emitter has planned the real targets, :meth:`finish` checks that every
    target is one streamed tensor with exactly the guessed operations, shape and dtype; only
    then are the headers (the emitter's names) written and the files renamed. Any
    disagreement, a header that does not fit, or an error in the child returns None: the files
    are deleted and the caller streams again the ordinary way. Never wrong weights.

    ``helper_peak_kib`` is the child's peak RSS (a caller measuring its own peak adds it).
    """

    def __init__(self, index: CheckpointIndex, guesses: Mapping[str, Planned], stage: Path):
        self.index = index
        self.guesses = dict(guesses)
        self.stage = Path(stage)
        self.parts: list[_Part] = []
        self.error: str | None = None
        self.reason = ""
        self.seconds = 0.0
        self.helper_peak_kib = 0
        #: The child's timings (start, torch import, read waits, transforms, writes).
        self.stats: dict[str, Any] = {}
        self._proc: Any = None
        self._stderr: Any = None
        self._done = False

    def start(self) -> EarlyStream:
        import pickle
        import subprocess
        import tempfile
        import time

        jobs = []
        for shard, refs in self.index.by_shard().items():
            items = [(r, self.guesses[r.name]) for r in refs if r.name in self.guesses]
            if items:
                part = _Part(self.stage, items)
                part.flush()  # the child writes the data after the reserved header space
                self.parts.append(part)
                jobs.append((str(shard), str(part.tmp), part.reserve, items))
        root = str(Path(__file__).resolve().parents[2])
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
            XCONV_EARLY_T0=repr(time.time()),  # the child reports its start-up time
        )
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by _wait)
        code = "from xconv.weights.stream import _early_child; _early_child()"
        self._proc = subprocess.Popen(  # noqa: S603 (this interpreter, fixed code)
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
        )
        try:
            self._proc.stdin.write(pickle.dumps(jobs))
            self._proc.stdin.close()
        except OSError:
            pass  # the child died at start: _wait reports it
        return self

    def _wait(self) -> None:
        """Wait for the child; its sizes go to the parts, its reads to the index's log."""
        import pickle

        if self._done or self._proc is None:
            return
        self._done = True
        out = self._proc.stdout.read()
        rc = self._proc.wait()
        self._proc.stdout.close()
        try:
            result = pickle.loads(out)
        except Exception:
            self._stderr.seek(0)
            tail = self._stderr.read()[-2000:].decode(errors="replace")
            result = {"error": f"the stream process exited {rc}: {tail}"}
        finally:
            self._stderr.close()
        self.error = result.get("error")
        self.seconds = result.get("seconds", 0.0)
        self.helper_peak_kib = result.get("peak_kib", 0)
        self.stats = result.get("stats", {})
        for part, n in zip(self.parts, result.get("sizes", []), strict=False):
            part.nbytes = n
        for shard, n in result.get("bytes_read", {}).items():
            self.index.log.add(Path(shard), n)

    def cancel(self) -> None:
        """Stop the child and delete what it wrote."""
        if self._proc is not None and not self._done:
            self._proc.kill()
            self._wait()
        for part in self.parts:
            part.abort()

    def finish(
        self, targets: Sequence[Target], *, stem: str = "variables", index_name: str = INDEX_NAME
    ) -> StreamReport | None:
        """Wait for the child; the report of the files made final, or None (files deleted,
        ``reason`` says why) when the guess was not exactly what ``targets`` need."""
        self._wait()
        self.reason = self._mismatch(targets)
        if self.reason:
            self.cancel()
            return None
        computed = [t for t in targets if t.planned is None]
        by_source = {t.planned.source: t for t in targets if t.planned is not None}
        n = len(self.parts) + bool(computed)
        report = StreamReport()
        weight_map: dict[str, str] = {}
        names = [f"{stem}-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        for part, name in zip(self.parts, names, strict=False):
            specs = [by_source[ref.name] for ref, _ in part.items]
            if not part.set_header([(t.name, t.shape, numpy_dtype(t.dtype)) for t in specs]):
                self.reason = f"the header of {name} outgrew the space reserved for it"
                self.cancel()
                return None
        for part, name in zip(self.parts, names, strict=False):
            report.files.append(part.commit(self.stage / name))
            report.bytes_written += part.nbytes
            report.tensors += len(part.items)
            weight_map.update({by_source[ref.name].name: name for ref, _ in part.items})
        if computed:
            specs = [(t.name, t.shape, numpy_dtype(t.dtype)) for t in computed]
            writer = ShardWriter(self.stage / names[-1], specs, metadata={"format": "flax"})
            for t in computed:
                writer.write(t.name, np.asarray(t.value, dtype=numpy_dtype(t.dtype)))
            report.files.append(writer.close())
            report.bytes_written += writer.nbytes
            report.tensors += len(computed)
            weight_map.update({t.name: names[-1] for t in computed})
        write_index(self.stage / index_name, weight_map, report.bytes_written)
        report.files.append(self.stage / index_name)
        report.bytes_read = dict(self.index.log.bytes_read)
        report.early = True
        report.helper_peak_kib = self.helper_peak_kib
        report.helper_stats = dict(self.stats, seconds=round(self.seconds, 2))
        return report

    def _mismatch(self, targets: Sequence[Target]) -> str:
        """Why the streamed tensors are not exactly ``targets``' sources ('' when they are)."""
        if self.error is not None:
            return f"the early stream failed: {self.error}"
        streamed = {ref.name: guess for part in self.parts for ref, guess in part.items}
        seen: set[str] = set()
        for t in targets:
            if t.planned is None:
                continue
            src = t.planned.source
            guess = streamed.get(src)
            if guess is None or src in seen:
                return f"{t.name} reads {src}, which was not streamed once for it"
            seen.add(src)
            if (guess.ops, guess.shape, guess.dtype.name) != (t.planned.ops, t.shape, t.dtype):
                return (
                    f"{t.name}: the emitter applies {t.planned.ops} -> {t.shape} {t.dtype} to "
                    f"{src}, the guess was {guess.ops} -> {guess.shape} {guess.dtype.name}"
                )
        unused = sorted(set(streamed) - seen)
        return f"streamed tensors no target reads: {unused[:5]}" if unused else ""


class _Part:
    """One output shard being written before its tensor names are known: the header space
    is reserved (padded with spaces once written, which JSON and safetensors allow)."""

    def __init__(self, stage: Path, items: Sequence[tuple[TensorRef, Planned]]) -> None:
        import tempfile

        self.items = list(items)
        # Room for names up to 3x the checkpoint key's length (the emitter's are about 1x).
        room = 4096 + sum(160 + 3 * len(ref.name) for ref, _ in self.items)
        self.reserve = 8 + room + (-(8 + room) % 4096)
        fd, tmp = tempfile.mkstemp(dir=stage, prefix=".early.", suffix=".tmp")
        self.tmp = Path(tmp)
        self._f = os.fdopen(fd, "wb")
        self._f.seek(self.reserve)
        self.nbytes = 0

    def write(self, array: np.ndarray) -> None:
        self._f.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
        self.nbytes += array.nbytes

    def flush(self) -> None:
        self._f.close()

    def set_header(self, specs: Sequence[tuple[str, tuple[int, ...], Any]]) -> bool:
        import struct

        raw, nbytes = header_bytes(specs, {"format": "flax"})
        if nbytes != self.nbytes or 8 + len(raw) > self.reserve:
            return False
        raw += b" " * (self.reserve - 8 - len(raw))
        with open(self.tmp, "r+b") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
        return True

    def commit(self, path: Path) -> Path:
        os.chmod(self.tmp, 0o644)
        os.replace(self.tmp, path)
        return path

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.tmp.unlink(missing_ok=True)


_ALIGN = 4096  # O_DIRECT's rule for buffer addresses, file offsets and lengths


def _aligned(n: int) -> np.ndarray:
    """An ``n``-byte uint8 buffer whose address is a multiple of :data:`_ALIGN`."""
    raw = np.empty(n + _ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % _ALIGN
    return raw[skip : skip + n]


def drop_page_cache(path: str | os.PathLike[str]) -> None:
    """Drop one file from the page cache (``fsync``, then ``POSIX_FADV_DONTNEED``; nothing else
    on the machine), so a read of it starts cold: how the tests reach the ``O_DIRECT`` path
    and the benchmarks time a cold stream."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cached(fd: int, size: int, probes: int = 8) -> bool:
    """Whether the file looks page-cached: ``probes`` pages spread over it all read without
    waiting for the disk (``RWF_NOWAIT``); False where that flag is missing."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None or size <= 0:
        return False
    page = bytearray(1)
    for k in range(probes):
        try:
            if os.preadv(fd, [page], size * k // probes, flag) != 1:
                return False
        except OSError:  # BlockingIOError: not cached; EOPNOTSUPP: no such probe here
            return False
    return True


class _ShardReader:
    """Reads tensors of one shard, in file order, into two reused buffers (the tensor being
    transformed and the one read ahead) with ``O_DIRECT`` when the shard is not page-cached.

    A cold buffered read of a 13 GB checkpoint cost the stream ~1.6 s of kernel CPU per GB
    (page-cache fill and reclaim, then a copy) on the 2-core machine class; ``O_DIRECT``
    moves the bytes from the disk into the buffer. A cached shard (or a file system without
    ``O_DIRECT``) is read the ordinary way. The returned array is valid until the read after
    the next one (the caller copies it out first)."""

    def __init__(self, path: Path, log: ReadLog, direct: bool = True) -> None:
        self.path = Path(path)
        self.log = log
        self._file = open(self.path, "rb")  # noqa: SIM115 (closed by close())
        self._dfd: int | None = None
        size = os.fstat(self._file.fileno()).st_size
        if direct and hasattr(os, "O_DIRECT") and not _cached(self._file.fileno(), size):
            try:
                self._dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                self._dfd = None
        self._bufs: list[np.ndarray | None] = [None, None]
        self._k = 0

    @property
    def direct(self) -> bool:
        return self._dfd is not None

    def read(self, ref: TensorRef | None) -> np.ndarray | None:
        if ref is None:
            return None
        if self._dfd is not None:
            try:
                return self._read_direct(ref)
            except OSError as e:
                import errno

                if e.errno != errno.EINVAL:
                    raise
                os.close(self._dfd)  # accepted at open, refused at read: read buffered
                self._dfd = None
        from xconv.weights.shards import read_tensor

        return read_tensor(ref, self.log, self._file)

    def _read_direct(self, ref: TensorRef) -> np.ndarray:
        start = ref.offset - ref.offset % _ALIGN
        end = ref.offset + ref.nbytes
        end += -end % _ALIGN
        k, self._k = self._k, (self._k + 1) % 2
        buf = self._bufs[k]
        if buf is None or buf.size < end - start:
            self._bufs[k] = None
            buf = self._bufs[k] = _aligned(end - start)
        view = memoryview(buf)
        got = 0
        while got < end - start:
            n = os.preadv(self._dfd, [view[got : end - start]], start + got)
            if n <= 0:
                break
            got += n
        if got < ref.offset + ref.nbytes - start:
            from xconv.errors import WeightsError

            raise WeightsError(f"truncated shard {self.path.name}: {ref.name} is cut short")
        skip = ref.offset - start
        array = buf[skip : skip + ref.nbytes].view(numpy_dtype(ref.dtype)).reshape(ref.shape)
        if not array.flags.aligned:
            array = array.copy()
        self.log.add(ref.shard, ref.nbytes)
        return array

    def close(self) -> None:
        self._file.close()
        if self._dfd is not None:
            os.close(self._dfd)
            self._dfd = None


class _Region:
    """A :class:`Scratch` whose one buffer is a given output region (a transpose lands in
    the output buffer with no copy)."""

    def __init__(self, region: np.ndarray) -> None:
        self.region = region

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return self.region.view(np.dtype(dtype)).reshape(shape)


class _Appender:
    """Appends tensors' bytes to a file from an aligned offset, written with ``O_DIRECT`` by
    a writer thread while the caller prepares the next tensor (the bytes go to the disk, not
    into dirty page cache that a 13 GB stream then waits on). Each tensor is laid out in one
    of two aligned buffers after the unaligned tail of the one before; whole blocks are
    written, the last block padded and the file cut to its exact length on :meth:`close`.
    Falls back to ordinary writes where ``O_DIRECT`` is refused (tmpfs)."""

    def __init__(self, path: Path, offset: int, direct: bool = True) -> None:
        from concurrent.futures import ThreadPoolExecutor

        assert offset % _ALIGN == 0
        self.path = Path(path)
        self.fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_DIRECT)
            except OSError:
                self.fd = -1
        self.direct = self.fd >= 0
        if self.fd < 0:
            self.fd = os.open(self.path, os.O_WRONLY)
        self.pos = offset  # file offset of the carried tail's first byte
        self.end = offset  # the file's length once everything is written
        self.nbytes = 0
        self._carry = np.empty(0, dtype=np.uint8)
        self._bufs: list[np.ndarray | None] = [None, None]
        self._k = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xconv-write")
        self._pending: Any = None
        self.write_s = 0.0  # seconds the writer thread spent writing

    def put(self, array: np.ndarray, planned: Planned | None = None, scratch=None) -> None:
        """Append ``planned.replay(array)`` (or ``array``)."""
        c = self._carry.size
        out_dtype = planned.dtype if planned is not None else array.dtype
        out_shape = planned.shape if planned is not None else array.shape
        nbytes = int(np.prod(out_shape, dtype=np.int64)) * np.dtype(out_dtype).itemsize
        size = c + nbytes
        size += -size % _ALIGN
        k, self._k = self._k, (self._k + 1) % 2
        buf = self._bufs[k]  # its last write was waited for before the previous one was sent
        if buf is None or buf.size < size:
            self._bufs[k] = None
            buf = self._bufs[k] = _aligned(max(size, _ALIGN))
        buf[:c] = self._carry
        region = buf[c : c + nbytes]
        if planned is None:
            data = np.ascontiguousarray(array)
        else:
            # The transpose lands in the region when it makes the final bytes: one transpose,
            # no dtype change, the region aligned for the dtype (else a copy into it).
            into = None
            ops = [op for op, _ in planned.ops]
            if (
                ops.count("transpose") == 1
                and "astype" not in ops
                and region.ctypes.data % np.dtype(out_dtype).itemsize == 0
            ):
                into = _Region(region)
            data = planned.replay(array, into or scratch)
        if nbytes and data.__array_interface__["data"][0] != region.ctypes.data:
            region[:] = data.reshape(-1).view(np.uint8)
        total = c + nbytes
        whole = total - total % _ALIGN
        self._carry = buf[whole:total].copy()
        self._wait()
        if whole:
            self._pending = self._pool.submit(self._write, buf[:whole], self.pos)
        self.pos += whole
        self.end += nbytes
        self.nbytes += nbytes

    def _write(self, data: np.ndarray, pos: int) -> None:
        import time

        t = time.perf_counter()
        view = memoryview(data)
        done = 0
        while done < len(view):
            try:
                done += os.pwrite(self.fd, view[done:], pos + done)
            except OSError as e:
                import errno

                if e.errno != errno.EINVAL or not self.direct:
                    raise
                os.close(self.fd)  # accepted at open, refused at write: write buffered
                self.fd = os.open(self.path, os.O_WRONLY)
                self.direct = False
        self.write_s += time.perf_counter() - t

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        """Write the last partial block (padded) and cut the file to its length."""
        try:
            self._wait()
            if self._carry.size:
                last = _aligned(_ALIGN)
                last[: self._carry.size] = self._carry
                last[self._carry.size :] = 0
                self._write(last, self.pos)
            os.ftruncate(self.fd, self.end)
        finally:
            self._release()

    def abort(self) -> None:
        """Stop writing (the caller deletes the file); a write's error was already raised."""
        try:
            self._wait()
        except BaseException:  # noqa: S110 (the error that made the caller abort matters)
            pass
        finally:
            self._release()

    def _release(self) -> None:
        if self.fd >= 0:
            self._pool.shutdown(wait=True)
            os.close(self.fd)
            self.fd = -1


def _stream_parts(
    jobs: Sequence[tuple],
    log: ReadLog,
    direct: bool = True,
    stats: dict | None = None,
    ready: Callable[[], None] | None = None,
) -> list[int]:
    """Write each job's tensors (``(shard, part file, header room, [(ref, Planned)])``) after
    the header room of its part file; the bytes written per part.

    Three things overlap: a thread reads the next tensor (:class:`_ShardReader`), this one
    transforms the current one into an output buffer, a thread writes the one before
    (:class:`_Appender`). ``stats`` (if given) gets the seconds spent waiting for reads,
    transforming, waiting for writes, and the writer's own seconds. ``ready`` is called once
    the first reads are under way, before the first transform (the child imports torch)."""
    import time

    scratch = Scratch()
    sizes = []
    acc = {"read_wait_s": 0.0, "ready_wait_s": 0.0, "transform_s": 0.0, "write_s": 0.0,
           "direct_reads": 0, "direct_writes": 0}  # fmt: skip
    for shard, tmp, reserve, items in jobs:
        reader = _ShardReader(Path(shard), log, direct)
        out = _Appender(Path(tmp), reserve, direct)
        acc["direct_reads"] += reader.direct  # shards read with O_DIRECT
        try:
            t = time.perf_counter()
            for (_, guess), array in _prefetched(log, items, None, reader.read):
                acc["read_wait_s"] += time.perf_counter() - t
                if ready is not None:
                    wait, ready, t = ready, None, time.perf_counter()
                    wait()
                    acc["ready_wait_s"] = time.perf_counter() - t
                t = time.perf_counter()
                out.put(array, guess, scratch)
                del array
                acc["transform_s"] += time.perf_counter() - t
                t = time.perf_counter()
            out.close()
        except BaseException:
            out.abort()
            raise
        finally:
            reader.close()
        acc["write_s"] += out.write_s
        acc["direct_writes"] += out.direct
        sizes.append(out.nbytes)
    if stats is not None:
        stats.update({k: round(v, 2) for k, v in acc.items()})
    return sizes


def _early_child() -> None:
    """The :class:`EarlyStream` process: jobs pickled on stdin, a result pickled on stdout."""
    import pickle
    import resource
    import threading
    import time

    t0 = time.perf_counter()
    started = float(os.environ.get("XCONV_EARLY_T0", "0") or 0)
    stats: dict[str, Any] = {"boot_s": round(time.time() - started, 2) if started else None}
    jobs = pickle.load(sys.stdin.buffer)
    result: dict[str, Any] = {"stats": stats}
    out, sys.stdout = sys.stdout, sys.stderr  # nothing but the result on stdout
    log = ReadLog()

    def import_torch() -> None:
        try:
            import torch  # its blocked copy for the transposes (see _transpose)

            torch.set_num_threads(1)  # the other core traces
        except ImportError:
            pass
        stats["torch_import_s"] = round(time.perf_counter() - t0, 2)

    # The first reads start while torch imports (1-5 s); the first transform waits for it.
    importer = threading.Thread(target=import_torch, name="xconv-import-torch", daemon=True)
    importer.start()
    try:
        result["sizes"] = _stream_parts(jobs, log, stats=stats, ready=importer.join)
    except BaseException as e:  # reported by finish(); the caller streams again
        result["error"] = f"{type(e).__name__}: {e}"
    result["bytes_read"] = log.bytes_read
    result["seconds"] = time.perf_counter() - t0
    result["peak_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out.buffer.write(pickle.dumps(result))
    out.flush()


def read_flat(out_dir: str | os.PathLike, index_name: str = INDEX_NAME) -> dict[str, np.ndarray]:
    """Read a streamed output folder back as ``{flat name: array}`` (for tests and tools)."""
    out = Path(out_dir)
    weight_map = json.loads((out / index_name).read_text())["weight_map"]
    result: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        ix = CheckpointIndex(out / shard)
        for name in ix.tensors:
            result[name] = ix.read(name)
    return result


__all__ = [
    "INDEX_NAME",
    "EarlyStream",
    "LazyWeight",
    "NeedsDataError",
    "Planned",
    "Scratch",
    "StreamReport",
    "Target",
    "attach",
    "planning_copy",
    "read_flat",
    "stream_targets",
]
