"""Weights-only conversion: a checkpoint of one framework into the other's names and layouts.

The template factory builds the torch module the checkpoint belongs to; it is traced once to
the IR, and the IR's weight annotations give the map (:mod:`xconv.weights.mapping`). The
checkpoint is then converted one shard at a time: with safetensors in and out (or a sharded
output), at most one shard of the input and its converted copy are in memory.

The keys are checked first, like ``load_state_dict(strict=True)``: every missing key,
unexpected key and shape mismatch is listed in the :class:`WeightsReport`, and a
:class:`~xconv.errors.WeightsError` is raised unless ``strict=False`` (then the mis-shaped and
unexpected entries are skipped and missing ones keep the template's values).

torch-only state (BatchNorm ``num_batches_tracked``) has no Flax variable: torch -> Flax writes
it beside the output as ``<out>.torch_state.npz``; Flax -> torch reads that file when it sits
beside the variables, and otherwise keeps the template's value (``0``).

Dtypes are kept as stored in both directions (a bfloat16 checkpoint gives bfloat16 variables
and back): the converter changes names and layouts, never values.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xconv.errors import ConversionError, WeightsError
from xconv.weights import io
from xconv.weights.mapping import KeyReport, WeightMap, check_keys

logger = logging.getLogger(__name__)

DIRECTIONS = ("torch-to-flax", "flax-to-torch")
#: Suffix of the side file holding torch-only state (``num_batches_tracked``).
SIDE_SUFFIX = ".torch_state.npz"


@dataclass
class WeightsReport:
    """What a weights-only conversion found and wrote.

    Attributes:
        direction: ``"torch-to-flax"`` or ``"flax-to-torch"``.
        checkpoint: The input checkpoint.
        out: The written output (None when nothing was written).
        missing: Keys the model expects that the checkpoint lacks.
        unexpected: Checkpoint keys the model does not have.
        mismatched: ``(key, checkpoint shape, model shape)`` for each shape mismatch.
        converted: Number of tensors converted from the checkpoint.
        shards: Number of input shards read.
        largest_shard_bytes: Size of the largest input shard.
        side_file: The ``num_batches_tracked`` side file written or read, if any.
    """

    direction: str
    checkpoint: Path
    out: Path | None = None
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    converted: int = 0
    shards: int = 0
    largest_shard_bytes: int = 0
    side_file: Path | None = None

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def _keys(self) -> KeyReport:
        return KeyReport(list(self.missing), list(self.unexpected), list(self.mismatched))

    def __str__(self) -> str:
        head = f"{self.direction}: {self.converted} tensor(s) from {self.shards} shard(s)"
        if self.out is not None:
            head += f" -> {self.out}"
        return head if self.ok else head + "\n" + self._keys().message(str(self.checkpoint))


@dataclass
class Template:
    """A traced template module: its weight map, tied keys and state_dict order."""

    wmap: WeightMap
    #: tied state_dict keys -> the key the IR kept (torch shares one tensor under both).
    aliases: dict[str, str]
    #: the template module's state_dict keys, in order.
    order: list[str]


def convert_weights(
    checkpoint: str | os.PathLike,
    template: Template,
    *,
    direction: str = "torch-to-flax",
    out: str | os.PathLike | None = None,
    format: str | None = None,  # noqa: A002
    strict: bool = True,
    trust_pickle: bool = False,
    max_shard_bytes: int | None = None,
    mesh: Any = None,
    partitioning: Any = None,
) -> WeightsReport:
    """Convert a checkpoint between torch and Flax names and layouts, shard by shard (the
    Flax API the variables are laid out for is the template's: ``template.wmap.api``).

    Args:
        checkpoint: Input file: a torch / safetensors (or sharded ``*.index.json``) /
            npz state_dict for torch-to-flax; a msgpack / Orbax / safetensors / npz of Flax
            variables for flax-to-torch.
        template: The :class:`Template` of the torch module the checkpoint belongs to
            (:func:`xconv.weight_template.build_template`, which traces it; or call
            :func:`xconv.weight_template.convert_weights` with a factory).
        direction: ``"torch-to-flax"`` or ``"flax-to-torch"``.
        out: Output path; None checks the keys only.
        format: Output format (``io.FORMATS``); default from ``out``'s suffix.
        strict: Raise on any missing / unexpected / mis-shaped key.
        trust_pickle: Allow a torch checkpoint that needs a full unpickle.
        max_shard_bytes: Split a safetensors output into shards of about this size.
        mesh: torch-to-flax only: write an Orbax checkpoint in parts (``out/part-00001``,
            one per input shard) whose arrays are placed on this mesh (``"2x4"`` or a
            ``Mesh``) by ``partitioning`` as each input shard arrives, each part written and
            dropped before the next (:func:`xconv.sharding.stream.write_sharded_orbax`).
        partitioning: ``"fsdp"``, ``"tp"``, ``"fsdp+tp"`` (default) or a rule table.

    Returns:
        A :class:`WeightsReport`.

    Raises:
        WeightsError: The checkpoint does not fit the template (``strict=True``); the error's
            ``report`` attribute is the full report.
    """
    if direction not in DIRECTIONS:
        raise ConversionError(f"unknown direction {direction!r}; choose one of {list(DIRECTIONS)}")
    checkpoint = Path(checkpoint)
    if not isinstance(template, Template):
        raise TypeError(
            f"expected a Template, got {type(template).__name__}: trace the module with "
            "xconv.weight_template.build_template, or call xconv.weight_template.convert_weights "
            "with the factory"
        )
    report = WeightsReport(direction, checkpoint)
    if mesh is not None and (direction != "torch-to-flax" or format not in (None, "orbax")):
        raise ConversionError("mesh= writes a sharded Orbax checkpoint: torch-to-flax only")
    if direction == "torch-to-flax":
        _torch_to_flax(
            checkpoint, template, report, out, format, strict, trust_pickle, max_shard_bytes,
            (mesh, partitioning),
        )  # fmt: skip
    else:
        _flax_to_torch(
            checkpoint, template, report, out, format, strict, trust_pickle, max_shard_bytes
        )
    return report


def _check(report: WeightsReport, keys: KeyReport, strict: bool) -> None:
    report.missing, report.unexpected, report.mismatched = (
        keys.missing,
        keys.unexpected,
        keys.mismatched,
    )
    if strict and not keys.ok:
        err = WeightsError(keys.message(str(report.checkpoint)))
        err.report = report
        raise err


def _shards(path: Path, report: WeightsReport, trust_pickle: bool) -> Iterator[dict]:
    for shard in io.iter_shards(path, trust_pickle=trust_pickle):
        report.shards += 1
        report.largest_shard_bytes = max(
            report.largest_shard_bytes, sum(a.nbytes for a in shard.values())
        )
        yield shard


def _prescan(path: Path, report, trust_pickle) -> tuple[dict, Iterator[dict]]:
    """Checkpoint shapes before converting: from headers, or from the one shard read."""
    shapes = io.checkpoint_shapes(path)
    if shapes is not None:
        return shapes, _shards(path, report, trust_pickle)
    shards = list(_shards(path, report, trust_pickle))  # single-file formats: one shard
    shapes = {k: tuple(a.shape) for s in shards for k, a in s.items()}
    return shapes, iter(shards)


def _torch_to_flax(
    path, template, report, out, fmt, strict, trust_pickle, max_shard_bytes, sharded=(None, None)
):
    wmap, aliases = template.wmap, template.aliases
    shapes, shards = _prescan(path, report, trust_pickle)
    # Tied keys: one copy is enough, under either name (HF checkpoints often drop one).
    rename = {a: k for a, k in aliases.items() if a in shapes and k not in shapes}
    shapes = {rename.get(k, k): v for k, v in shapes.items() if k not in aliases or k in rename}
    _check(report, check_keys(shapes, wmap.source_shapes), strict)
    if out is None:
        return
    out = Path(out)
    fmt = fmt or io.detect_format(out)
    bad = {k for k, _, _ in report.mismatched}
    side: dict[str, np.ndarray] = {}
    seen: set[str] = set()

    def converted() -> Iterator[dict]:
        for shard in shards:
            flax: dict[str, np.ndarray] = {}
            while shard:
                name, arr = shard.popitem()
                name = rename.get(name, name)
                if name in bad or name in aliases:
                    continue
                if name in wmap.side:
                    side[name] = arr
                for entry in wmap.targets(name):  # a tied weight can be two variables
                    flax[entry.flax_name] = entry.to_flax(arr)
                if name in wmap.entries:
                    seen.add(name)
                    report.converted += 1
            yield flax
        rest = dict(wmap.template)
        rest.update(
            {
                e.flax_name: wmap.defaults[e.flax_name]
                for e in wmap.by_flax.values()
                if e.source not in seen
            }
        )
        if rest:
            yield rest

    if sharded[0] is not None:
        from xconv.sharding.stream import write_sharded_orbax

        write_sharded_orbax(converted(), out, sharded[0], sharded[1])
        report.out = out
    else:
        report.out = _write(converted(), path, out, fmt, max_shard_bytes)
    if side:
        report.side_file = _side_path(report.out)
        io.write_checkpoint(side, report.side_file, "npz")


def _side_path(out: Path) -> Path:
    return out.with_name(out.name + SIDE_SUFFIX)


def _flax_to_torch(path, template, report, out, fmt, strict, trust_pickle, max_shard_bytes):
    wmap, aliases = template.wmap, template.aliases
    shapes, shards = _prescan(path, report, trust_pickle)
    # Template constants (buffers) are not torch state: allowed, not required.
    expected = {k: v for k, v in wmap.flax_shapes.items() if k not in wmap.template}
    shapes = {k: v for k, v in shapes.items() if k not in wmap.template}
    _check(report, check_keys(shapes, expected), strict)
    if out is None:
        return
    out = Path(out)
    fmt = fmt or io.detect_format(out)
    if fmt not in ("torch", "safetensors", "npz"):
        raise ConversionError(
            f"a torch state_dict is written as .pt, .safetensors or .npz, not {fmt}"
        )
    bad = {k for k, _, _ in report.mismatched}
    side = dict(wmap.side)
    side_file = _side_path(path)
    if side and side_file.is_file():
        side.update({k: v for k, v in io.read_checkpoint(side_file).items() if k in side})
        report.side_file = side_file
    by_alias: dict[str, list[str]] = {}
    for k, v in aliases.items():
        by_alias.setdefault(v, []).append(k)
    seen: set[str] = set()

    def converted() -> Iterator[dict]:
        for shard in shards:
            state: dict[str, np.ndarray] = {}
            while shard:
                name, arr = shard.popitem()
                entry = wmap.by_flax.get(name)
                if entry is None or name in bad or entry is not wmap.entries[entry.source]:
                    continue  # unknown, mis-shaped, or a tied weight's second copy
                arr = entry.to_source(arr)  # dtype kept as stored: never silently cast
                state[entry.source] = arr
                for alias in by_alias.get(entry.source, ()):
                    state[alias] = arr
                seen.add(entry.source)
                report.converted += 1
            yield state
        rest = dict(side)
        for k, e in wmap.entries.items():
            if k not in seen:
                rest[k] = e.to_source(wmap.defaults[e.flax_name])
        yield rest

    order = [*template.order, *(k for k in wmap.entries if k not in set(template.order))]
    report.out = _write(converted(), path, out, fmt, max_shard_bytes, order)


def _write(parts, source: Path, out: Path, fmt: str, max_shard_bytes, order=None) -> Path:
    """Stream shard by shard into a sharded safetensors output when the input is sharded or
    the output is an ``*.index.json``; otherwise gather the parts and write one file."""
    sharded_in = source.name.lower().endswith(".json")
    if fmt == "safetensors" and (out.name.lower().endswith(".json") or sharded_in):
        index = (
            out if out.name.lower().endswith(".json") else out.with_name(out.name + ".index.json")
        )
        return io.write_sharded_safetensors((part for part in parts if part), index)
    flat: dict[str, np.ndarray] = {}
    for part in parts:
        flat.update(part)
    keys = [k for k in order if k in flat] if order else sorted(flat)
    flat = {k: flat[k] for k in keys}
    return io.write_checkpoint(flat, out, fmt, max_shard_bytes=max_shard_bytes)


def load_variables(path: str | os.PathLike) -> Mapping[str, Any]:
    """Read a Flax variables checkpoint back as the nested tree."""
    return io.unflatten(io.read_checkpoint(path))


__all__ = [
    "DIRECTIONS",
    "SIDE_SUFFIX",
    "Template",
    "WeightsReport",
    "convert_weights",
]
