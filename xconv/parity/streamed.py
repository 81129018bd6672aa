"""Layerwise parity of a checkpoint converted without loading it, one block in memory at a time.

The reference is the weightless ``ExportedProgram`` traced by :func:`xconv.from_checkpoint`;
each block's weights are read from the checkpoint when the block runs and dropped after
(:func:`xconv.parity.layerwise.run_layerwise` with lazy ``BlockWeights``). The candidate is the
converted IR run by the JAX runtime on the same captured block inputs, with the float64 oracle
of each block judging both.

The same pass also proves the streamed files: for every weight a block reads, the target
variables written from it are read back from the output shards and must equal, bit for bit,
the checkpoint tensor put through the recorded layout change (a dense kernel's transpose).
Peak memory: one block's weights (and their float64 copy) plus activations.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.weights.shards import CheckpointIndex
from xconv.weights.stream import INDEX_NAME, Target


@dataclass
class StreamedParity:
    """Per-block verdicts of a streamed conversion, and the written-weights check."""

    blocks: list[dict[str, Any]]
    policy: str
    mismatched_weights: list[str] = field(default_factory=list)
    checked_weights: int = 0
    notes: list[str] = field(default_factory=list)
    #: With a mesh: ``{"shape": {"data": 2, "model": 4}, "params": {initializer: spec}}``.
    mesh: dict[str, Any] | None = None
    #: As ``ParityReport.downgrades``: ``merged_blocks`` per boundary the candidate cannot be
    #: cut at.
    downgrades: list[dict[str, str]] = field(default_factory=list)
    #: As ``ParityReport.fixed_dims``: the input dimensions the source model fixes.
    fixed_dims: list[dict[str, Any]] | None = None

    @property
    def passed(self) -> bool:
        return (
            bool(self.blocks)
            and all(b["passed"] for b in self.blocks)
            and not self.mismatched_weights
        )

    @property
    def first_divergence(self) -> str | None:
        if self.mismatched_weights:
            return f"written weight {self.mismatched_weights[0]}"
        return next((b["name"] for b in self.blocks if not b["passed"]), None)

    def to_json(self, path: str | os.PathLike) -> None:
        body = {
            "passed": self.passed,
            "mode": "layerwise",
            "policy": self.policy,
            "first_divergence": self.first_divergence,
            "blocks": self.blocks,
            "written_weights_checked": self.checked_weights,
            "written_weights_mismatched": self.mismatched_weights,
            "notes": self.notes,
            "downgrades": self.downgrades,
            **({"mesh": self.mesh} if self.mesh is not None else {}),
            **({"fixed_dims": self.fixed_dims} if self.fixed_dims is not None else {}),
        }
        Path(path).write_text(json.dumps(body, indent=2, sort_keys=True, default=str))

    def to_html(self, path: str | os.PathLike | None = None) -> str:
        """An HTML page: the verdict, one row per block, the written-weights check."""
        import html

        e = html.escape
        color = "#1a7f37" if self.passed else "#cf222e"
        body = [
            f"<h1 style='color:{color}'>parity {'PASSED' if self.passed else 'FAILED'}</h1>",
            f"<p>layerwise: float64 oracle per block; policy {e(self.policy)}</p>",
        ]
        if self.first_divergence:
            body.append(f"<p><b>first divergence:</b> <code>{e(self.first_divergence)}</code></p>")
        keys = sorted({k for b in self.blocks for k in b} - {"name", "passed"})
        body.append(
            "<h2>blocks</h2><table><tr><th>block</th><th>result</th>"
            + "".join(f"<th>{e(k)}</th>" for k in keys)
            + "</tr>"
        )
        for b in self.blocks:
            cells = "".join(f"<td>{e(str(b.get(k, '')))}</td>" for k in keys)
            result = "ok" if b["passed"] else "FAIL"
            body.append(f"<tr><td>{e(str(b['name']))}</td><td>{result}</td>{cells}</tr>")
        body.append("</table>")
        body.append(
            f"<p>written weights equal to the checkpoint's: {self.checked_weights}"
            + (f"; mismatched: {e(', '.join(self.mismatched_weights[:20]))}" if
               self.mismatched_weights else "")
            + "</p>"
        )  # fmt: skip
        body.extend(f"<p>note: {e(n)}</p>" for n in self.notes)
        page = (
            "<!doctype html><html><head><meta charset='utf-8'><title>xconv parity</title>"
            "<style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:left}"
            "</style></head><body>" + "\n".join(body) + "</body></html>\n"
        )
        if path is not None:
            Path(path).write_text(page)
        return page

    def __str__(self) -> str:
        verdict = "passed" if self.passed else f"FAILED (first divergence: {self.first_divergence})"
        worst = max(self.blocks, key=lambda b: b.get("max_abs", 0.0), default=None)
        lines = [
            f"layerwise parity ({self.policy} policy, float64 oracle per block): {verdict}; "
            f"{sum(b['passed'] for b in self.blocks)}/{len(self.blocks)} blocks; "
            f"{self.checked_weights} written weights equal to the checkpoint's"
        ]
        if worst is not None:
            lines.append(
                f"largest block error: {worst['name']} max |cand - ref| {worst.get('max_abs')}"
            )
        if self.mesh:
            shape = " x ".join(f"{a}={n}" for a, n in self.mesh["shape"].items())
            params = self.mesh["params"]
            split = [n for n, s in params.items() if any(e != "None" for e in _entries(s))]
            lines.append(
                f"candidate blocks ran sharded on mesh {shape}; {len(split)} of {len(params)} "
                "weights split (parity.json lists each weight's sharding)"
            )
        return "\n".join(lines)


def _entries(spec: str) -> list[str]:
    """The entries of a spec's repr, ``"(('data', 'model'), None)"`` -> 2 entries."""
    import ast

    value = ast.literal_eval(spec)
    return [repr(e) if e is not None else "None" for e in value]


def _torch_tensor(array: np.ndarray):
    import torch

    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a


def detached(model: ir.Model, names: Sequence[str]) -> ir.Model:
    """A copy of ``model`` whose initializers ``names`` hold no data (they come per block)."""
    copy = ir.from_proto(ir.to_proto(model))  # lazy weights serialise as references
    for name in names:
        copy.graph.initializers[name].const_value = None
    return copy


def check_streamed(
    traced: Any,
    out_dir: Path,
    targets: Sequence[Target],
    *,
    policy: str = "oracle",
    progress: Callable[[str], None] | None = None,
    mesh: Any = None,
    rules: Any = None,
) -> StreamedParity:
    """Run layerwise parity for ``traced`` and check the streamed shards in ``out_dir``.

    With ``mesh`` (``"2x4"`` or a ``Mesh``), the candidate blocks run sharded over it: each
    weight placed by its logical axes and ``rules`` (default ``"fsdp+tp"``), block inputs
    split over ``data`` (``xconv.sharding.parity.LayerwisePlacement``); the report states
    the mesh and every weight's sharding."""
    from xconv.parity.layerwise import run_layerwise

    sources = traced.sources  # initializer name -> checkpoint key
    by_source: dict[str, list[Target]] = {}
    for t in targets:
        if t.planned is not None:
            by_source.setdefault(t.planned.source, []).append(t)
    written = _written(out_dir)
    report = StreamedParity([], policy)
    done: set[str] = set()
    weights = _checking_weights(traced, by_source, written, report, done)
    candidate = detached(traced.model, list(sources))
    placement = None
    if mesh is not None:
        from xconv.sharding.parity import LayerwisePlacement

        placement = LayerwisePlacement(candidate, list(sources), mesh, rules or "fsdp+tp")
    inputs = [np.asarray(x) for x in traced.inputs]
    result = run_layerwise(
        traced.program,
        candidate,
        inputs,
        policy=policy,
        weights=weights,
        progress=progress,
        placement=placement,
    )
    report.blocks.extend(_block_row(b) for b in result.blocks)
    report.notes.extend(getattr(result, "notes", []))
    report.downgrades.extend(getattr(result, "downgrades", []))
    if placement is not None:
        report.mesh = placement.report()
        report.notes.extend(f"sharding: {n}" for n in placement.notes)
    missing = sorted(set(by_source) - done)
    if missing:
        report.notes.append(f"{len(missing)} written weights no block reads: {missing[:5]}")
    return report


def _written(out_dir: Path) -> Any:
    """The streamed output in ``out_dir``: Orbax parts (partitioning) or safetensors shards."""
    index_file = out_dir / INDEX_NAME
    if (out_dir / "variables.orbax").is_dir():  # streamed into Orbax parts (partitioning)
        from xconv.sharding.stream import OrbaxParts

        return OrbaxParts(out_dir / "variables.orbax")
    return CheckpointIndex(index_file if index_file.is_file() else str(out_dir / "*.safetensors"))


def _checking_weights(traced: Any, by_source, written: Any, report: StreamedParity, done: set):
    """The layerwise check's weight provider: each block's weights read from the source
    checkpoint, and, the first time a source key is read, every output tensor planned from it
    compared bit for bit with what was written (into ``report``; ``done`` collects the keys)."""
    sources = traced.sources  # initializer name -> checkpoint key
    index: CheckpointIndex = traced.index
    own, constants = traced.program.state_dict, traced.program.constants

    @contextlib.contextmanager
    def weights(block: Any) -> Iterator[Mapping[str, Any]]:
        arrays: dict[str, Any] = {}
        for name in block.weights:
            key = sources.get(name)
            if key is None:  # a buffer computed while tracing (rotary inv_freq): real, small
                arrays[name] = own[name] if name in own else constants[name]
                continue
            array = index.read(key)
            if key not in done:
                done.add(key)
                for t in by_source.get(key, []):
                    got = written.read(t.name)
                    want = t.planned.replay(array)
                    if got.shape != want.shape or not np.array_equal(_bits(got), _bits(want)):
                        report.mismatched_weights.append(t.name)
                    report.checked_weights += 1
                    del got, want
            arrays[name] = _torch_tensor(array)
        try:
            yield arrays
        finally:
            arrays.clear()

    return weights


def _block_row(b: Any) -> dict[str, Any]:
    """One block's row of the report."""
    row: dict[str, Any] = {"name": b.block.name, "passed": bool(b.passed), "seconds": b.seconds}
    if b.error:
        row["error"] = b.error
    if b.outputs:
        row["max_abs"] = max(float(getattr(m, "max_abs", 0.0) or 0.0) for m in b.outputs)
    return row


__all__ = ["StreamedParity", "check_streamed", "detached"]
