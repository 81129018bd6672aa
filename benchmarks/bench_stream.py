"""Checkpoints larger than memory: streamed torch -> Flax, side by side with a numpy copy.

For a sharded safetensors Llama-shape checkpoint (``benchmarks/make_checkpoint.py``), each step
runs in its own child process (wall seconds, and that child's peak RSS from
``resource.getrusage(RUSAGE_CHILDREN)``):

* **floor**: every tensor read through numpy (``read_tensor``) and written to a new shard, one
  tensor at a time: the bandwidth floor of any conversion of these bytes;
* **convert**: ``from_checkpoint`` (headers, weightless trace) then ``write_target`` to Flax
  (source planned on stand-ins, weights streamed shard by shard, kernels transposed);
* **parity**: trace again, then the layerwise check (float64 oracle per block, one block's
  weights in memory at a time, every written weight compared bit for bit);
* **forward**: the generated ``load(out_dir)`` and one forward pass of the Flax model.

The rows go into ``benchmarks/scale.md`` between the ``streamed`` markers (the rest of the
file is ``bench_scale.py``'s).

    python benchmarks/bench_stream.py --checkpoint DIR --label "Llama-shape 7B bf16" [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._memory import run_measured  # noqa: E402

BEGIN, END = "<!-- streamed: begin -->", "<!-- streamed: end -->"

_FLOOR = """
import json, sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from xconv.weights.shards import CheckpointIndex, ShardWriter, numpy_dtype, read_tensor
t = time.perf_counter()
index = CheckpointIndex({ckpt!r})
for shard, refs in index.by_shard().items():
    specs = [(r.name, r.shape, numpy_dtype(r.dtype)) for r in refs]
    w = ShardWriter(Path({out!r}) / shard.name, specs)
    with open(shard, "rb") as f:
        for r in refs:
            w.write(r.name, read_tensor(r, index.log, f))
    w.close()
print(json.dumps({{"s": time.perf_counter() - t, "bytes": index.nbytes}}))
"""

_CONVERT = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
from xconv.checkpoint import CheckpointOptions, convert_checkpoint
marks = {{}}
def progress(msg):
    marks.setdefault(msg.split()[0], time.perf_counter())
t0 = time.perf_counter()
r = convert_checkpoint("transformers:LlamaForCausalLM", {ckpt!r}, config={cfg!r}, target="flax",
                       out_dir={out!r}, options=CheckpointOptions(parity="none", early={early!r}),
                       progress=progress)
t2 = time.perf_counter()
ck = r.checkpoint_bytes
import xconv.weights.shards as sh
index = sh.CheckpointIndex({ckpt!r})
print(json.dumps({{"trace_s": marks["writing"] - t0, "write_s": t2 - marks["writing"],
    "total_s": t2 - t0, "early": r.stream.early, "route": r.route,
    "helper_peak_gib": r.stream.helper_peak_kib / 2**20,
    "wait_s": t2 - marks.get("waiting", t2), "plan_s": marks.get("waiting", t2) - marks["writing"],
    "helper": r.stream.helper_stats,
    "bytes_written": r.stream.bytes_written, "largest_shard": index.largest_shard_bytes(),
    "read_once": all(n == sum(x.nbytes for x in index.tensors.values()
                              if str(x.shard) == k) for k, n in r.stream.bytes_read.items())}}))
"""

_PARITY = """
import json, sys, time
sys.path.insert(0, {root!r})
from xconv.checkpoint import from_checkpoint, plan_flax
from xconv.parity.streamed import check_streamed
from pathlib import Path
traced = from_checkpoint("transformers:LlamaForCausalLM", {ckpt!r}, config={cfg!r})
_, targets = plan_flax(traced)
t = time.perf_counter()
rep = check_streamed(traced, Path({out!r}), targets)
print(json.dumps({{"s": time.perf_counter() - t, "passed": rep.passed, "blocks": len(rep.blocks),
    "blocks_passed": sum(b["passed"] for b in rep.blocks), "first": rep.first_divergence,
    "weights_checked": rep.checked_weights, "weights_bad": len(rep.mismatched_weights)}}))
"""

_FORWARD = """
import json, sys, time, importlib.util
import numpy as np
sys.path.insert(0, {root!r})
t = time.perf_counter()
spec = importlib.util.spec_from_file_location("streamed_model", {out!r} + "/model.py")
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
model, variables = mod.load({out!r})
t1 = time.perf_counter()
ids = np.random.default_rng(0).integers(0, {vocab}, (1, 8))
out = model.apply(variables, ids)
out = np.asarray(out[0] if isinstance(out, tuple) else out, dtype=np.float32)
print(json.dumps({{"load_s": t1 - t, "s": time.perf_counter() - t, "shape": list(out.shape),
    "finite": bool(np.isfinite(out).all())}}))
"""


def _child(code: str) -> tuple[dict, float, float]:
    """Run ``code`` in a fresh Python; (its last JSON line, wall s, peak RSS GiB)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    run = run_measured([sys.executable, "-c", code], env=env)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    return json.loads(run.stdout.strip().splitlines()[-1]), run.seconds, run.peak_gib


def evict(ckpt: Path) -> None:
    """Drop the checkpoint's shards from the page cache (``fsync`` then
    ``POSIX_FADV_DONTNEED``; only these files, nothing else on the machine), so the floor and
    each conversion start from the same cold cache instead of whatever the previous step or
    ``make_checkpoint.py`` left there."""
    from xconv.weights.stream import drop_page_cache

    for shard in sorted(ckpt.glob("*.safetensors")):
        drop_page_cache(shard)


PARTS = ("floor", "sequential", "convert", "parity", "forward")


def measure(ckpt: Path, work: Path, parts: set[str], out: Path) -> dict:
    """The ``parts`` asked for; ``parity`` and ``forward`` read the Flax output at ``out``
    (written by ``convert`` in this run or kept from an earlier one)."""
    cfg = str(ckpt / "config.json")
    vocab = json.loads(Path(cfg).read_text())["vocab_size"]
    row: dict = {}
    if "floor" in parts:
        floor_out = work / "floor"
        floor_out.mkdir()
        evict(ckpt)
        floor, floor_s, floor_peak = _child(
            _FLOOR.format(root=str(ROOT), ckpt=str(ckpt), out=str(floor_out))
        )
        shutil.rmtree(floor_out)
        row["bytes"], row["params"] = floor["bytes"], floor["bytes"] / 2
        row["floor"] = {"s": floor_s, "peak_gib": floor_peak, "copy_s": floor["s"]}
    # One output on disk at a time (a 7 B one is 13 GiB).
    if "sequential" in parts:
        seq_out = work / "sequential"
        evict(ckpt)
        seq_row, seq_s, seq_peak = _child(
            _CONVERT.format(root=str(ROOT), ckpt=str(ckpt), cfg=cfg, out=str(seq_out), early=False)
        )
        row["sequential"] = {"s": seq_s, "peak_gib": seq_peak, **seq_row}
        shutil.rmtree(seq_out, ignore_errors=True)
    if "convert" in parts:
        shutil.rmtree(out, ignore_errors=True)
        evict(ckpt)
        conv, conv_s, conv_peak = _child(
            _CONVERT.format(root=str(ROOT), ckpt=str(ckpt), cfg=cfg, out=str(out), early=True)
        )
        row["largest_shard"] = conv["largest_shard"]
        # The early stream's child process runs beside the conversion: its peak is added (an
        # upper bound of the two processes' peak together).
        row["convert"] = {"s": conv_s, "peak_gib": conv_peak + conv["helper_peak_gib"], **conv}
    if "parity" in parts:
        par, par_s, par_peak = _child(
            _PARITY.format(root=str(ROOT), ckpt=str(ckpt), cfg=cfg, out=str(out))
        )
        row["parity"] = {"wall_s": par_s, "peak_gib": par_peak, **par}
    if "forward" in parts:
        fwd, fwd_s, fwd_peak = _child(_FORWARD.format(root=str(ROOT), out=str(out), vocab=vocab))
        row["forward"] = {"wall_s": fwd_s, "peak_gib": fwd_peak, **fwd}
    return row


def render(rows: list[tuple[str, dict]], note: str) -> str:
    head = [
        "checkpoint", "GiB (largest shard)", "numpy copy s / peak GiB",
        "xconv s / peak GiB (stream beside trace)", "trace s; after it s", "time / floor",
        "trace, then stream s / peak GiB", "time / floor", "peak budget GiB",
        "layerwise parity", "load() + forward",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, r in rows:
        c, f, p, q = r["convert"], r["floor"], r.get("parity"), r.get("sequential")
        budget = r["largest_shard"] / 2**30 + 2
        verdict = "-" if p is None else "passed" if p["passed"] else f"FAILED ({p['first']})"
        fwd = r.get("forward")
        fcell = (
            f"{fwd['s']:.0f} s, {fwd['peak_gib']:.1f} GiB, logits {fwd['shape']}"
            + ("" if fwd["finite"] else " NOT finite")
            if fwd
            else "-"
        )
        lines.append(
            "| " + " | ".join([
                label,
                f"{r['bytes'] / 2**30:.2f} ({r['largest_shard'] / 2**30:.2f})",
                f"{f['s']:.0f} / {f['peak_gib']:.2f}",
                f"{c['s']:.0f} / {c['peak_gib']:.2f}" + ("" if c["early"] else " (streamed again)"),
                f"{c['trace_s']:.0f}; {c['write_s']:.0f}",
                f"{c['s'] / f['s']:.2f}x",
                f"{q['trace_s']:.0f} + {q['write_s']:.0f} = {q['s']:.0f} / {q['peak_gib']:.2f}"
                if q else "not run",
                f"{q['s'] / f['s']:.2f}x" if q else "-",
                f"{budget:.2f}"
                + (" ok" if max(c["peak_gib"], (q or c)["peak_gib"]) <= budget else " EXCEEDED"),
                f"{verdict}: {p['blocks_passed']}/{p['blocks']} blocks, {p['weights_checked']} "
                f"written weights bit-equal; {p['wall_s']:.0f} s, peak {p['peak_gib']:.1f} GiB"
                if p else "not run",
                fcell,
            ]) + " |"
        )  # fmt: skip
    return "\n".join([
        BEGIN,
        "## Checkpoints larger than memory (streamed)",
        "",
        "Written by `python benchmarks/bench_stream.py` (do not edit by hand). A random",
        "Llama-shape checkpoint from `benchmarks/make_checkpoint.py`, converted with the",
        "checkpoint route (`xconv torch-to-flax --module transformers:LlamaForCausalLM --config",
        "--weights`): traced on fake weights, weights streamed shard by shard. Each timed cell is",
        "one child process (wall s including Python start and imports; its peak RSS, plus the",
        "peak of the process the early stream runs in). The floor",
        "is the same bytes read and written through numpy, tensor by tensor, in the same run.",
        "The checkpoint's shards are dropped from the page cache before the floor and before",
        "each conversion (`POSIX_FADV_DONTNEED` on those files), so all three read it cold.",
        "xconv streams the weights in a second process while it traces (layout guessed from the",
        "module's nn.Linear layers, checked against the emitter's plan afterwards; \"after it\" is",
        "the plan and the rest of the stream; that process reads and writes with `O_DIRECT`,",
        "not through the page cache, reading ahead and writing behind on threads);",
        "\"trace, then stream\" is the same conversion with",
        "`CheckpointOptions(early=False)`, run before it. The budget is the largest shard + 2 GiB.",
        "Parity (on the streamed-beside-trace output) retraces, then checks block by block.",
        "",
        *lines,
        "",
        note,
        END,
    ])  # fmt: skip


def write_section(path: Path, section: str) -> None:
    text = path.read_text() if path.is_file() else ""
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, action="append", required=True)
    ap.add_argument("--label", action="append", required=True)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--no-forward", action="store_true")
    ap.add_argument("--no-sequential", action="store_true", help="Skip the trace-then-stream run.")
    ap.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="Comma list of the steps to run (default all: %(default)s). The others are kept "
        "from the stored row of the same label (scale_stream.json), each part with the commit "
        "and load it was measured at: a 7 B run split over several holds of the heavy-job lock; "
        "'none' rewrites the table from the stored rows.",
    )
    ap.add_argument(
        "--keep-output",
        type=Path,
        default=None,
        help="The Flax output folder, kept after the run (parity/forward of a later run with "
        "--parts read it); default: a temporary folder deleted at the end.",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "scale.md")
    ap.add_argument("--note", action="append", default=[], help="A line added under the table.")
    a = ap.parse_args(argv)
    store = a.out.with_name("scale_stream.json")  # every measured row, by label
    kept = json.loads(store.read_text()) if store.is_file() else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    parts = set(a.parts.split(",")) - {"none"}  # none: rewrite the table from the stored rows
    parts -= {"forward"} if a.no_forward else set()
    parts -= {"sequential"} if a.no_sequential else set()
    if parts - set(PARTS):
        ap.error(f"--parts: unknown {sorted(parts - set(PARTS))}; choose from {PARTS}")
    for ckpt, label in zip(a.checkpoint, a.label, strict=True):
        work = Path(tempfile.mkdtemp(prefix="xconv-stream-", dir=a.work))
        load = os.getloadavg()
        try:
            new = measure(ckpt, work, parts, a.keep_output or work / "flax")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        after = os.getloadavg()
        run = {"load_before": load[0], "load_after": after[0], "commit": commit,
               "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}  # fmt: skip
        row = {} if parts == set(PARTS) else dict(kept.get(label, {}))
        runs = dict(row.get("runs") or {p: row["run"] for p in PARTS if "run" in row})
        row.pop("run", None)
        for part in parts:
            row.pop(part, None)
            runs[part] = run
        row.update(new)
        row["runs"] = {p: r for p, r in runs.items() if row.get(p) is not None}
        print(label, json.dumps(row), flush=True)
        # Rows are kept by label and the table rewritten after every checkpoint, so a later one
        # that fails or runs out of time leaves the rows measured so far.
        kept[label] = row
        store.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
        rows = sorted(kept.items(), key=lambda kv: -kv[1]["bytes"])
        section = render(rows, "\n".join([*_run_notes(rows), *a.note]))
        write_section(a.out, section)
        print(section, flush=True)


def _run_notes(rows: list[tuple[str, dict]]) -> list[str]:
    """One line per row: the trace route, and the commit and load each part was measured at."""
    notes = []
    for label, r in rows:
        runs = r.get("runs") or {p: r["run"] for p in PARTS if r.get(p) is not None and "run" in r}
        groups: dict[tuple, list[str]] = {}
        for part in PARTS:
            if part in runs:
                run = runs[part]
                key = (run.get("commit", "?"), run.get("machine", "?"), run.get("load_before"),
                       run.get("load_after"))  # fmt: skip
                groups.setdefault(key, []).append(part)
        when = "; ".join(
            f"{', '.join(ps)} measured at {c} on {m}, load average {b:.1f} before, {e:.1f} after"
            for (c, m, b, e), ps in groups.items()
        )
        route = r["convert"].get("route") or "full trace"
        notes.append(f"- {label}: {route}. {when} (a shared machine: wall times are noisy).")
    return notes


if __name__ == "__main__":
    main()
