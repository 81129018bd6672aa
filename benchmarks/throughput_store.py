"""The rows of ``benchmarks/throughput.md``, kept in ``throughput.json`` beside it.

``bench_throughput.py`` runs a model (or a dtype, or some batches of it) and merges the new
rows into the store, then rewrites the whole doc from the store: the table can be refreshed
in parts (one model per hold of the heavy-job lock) and every timing keeps the run it came
from. A run is a stamp: the commit it measured, the date, the load average before and after
and the arguments. Each row records, per mode and batch, which run measured it; each model
section lists its runs.

Rows measured from a tree with uncommitted changes carry ``plus uncommitted changes`` in
their commit; ``bench_throughput.py`` refuses to write the default doc from such a tree.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = ("infer", "train")
DIRTY = " plus uncommitted changes"


def commit(outputs: tuple[Path, ...] = ()) -> str:
    """``HEAD``'s short hash, plus :data:`DIRTY` when tracked files differ from it (the
    script's own ``outputs`` aside: rewriting the doc is not a code change)."""
    if os.environ.get("XCONV_TREE_COMMIT"):
        # A copy of a clean tree sent to another machine (gpu_throughput.sh on a lent device,
        # whose copy came with a .git that was not the tree's): the commit it was copied
        # from, as the sending side checked it.
        return os.environ["XCONV_TREE_COMMIT"] + " (copy)"
    head = _git("rev-parse", "--short", "HEAD").strip()
    status = _git("status", "--porcelain", "--untracked-files=no")
    mine = tuple(str(p.resolve().relative_to(ROOT)) for p in outputs if _inside(p))
    changed = [ln for ln in status.splitlines() if ln.strip() and not ln.endswith(mine)]
    return (head or "unknown") + (DIRTY if changed else "")


def _git(*args: str) -> str:
    """``git args`` in the repository: its stdout, empty where git or the repository is missing."""
    try:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def _inside(path: Path) -> bool:
    try:
        path.resolve().relative_to(ROOT)
    except ValueError:
        return False
    return True


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def save(path: Path, store: dict) -> None:
    path.write_text(json.dumps(store, indent=1, sort_keys=True) + "\n")


def _key(row: dict) -> tuple[str, str]:
    return row["path"], row["dtype"]


def _ints(d: dict) -> dict:
    return {int(k): v for k, v in d.items()}


def merge(store: dict, backend: str, result: dict, stamp: dict) -> dict:
    """Merge one worker ``result`` (a model's rows) measured under ``stamp`` into ``store``
    (in place; returned). A new row replaces the stored row's timings at the batches it
    measured and its parity, note and conversion time; a new row that measured nothing (a
    path not run this time) leaves a stored row that has timings as it was."""
    models = store.setdefault(backend, {})
    name = result["model"]
    entry = models.setdefault(name, {"batches": [], "meta": {}, "rows": [], "runs": []})
    if "error" in result:
        entry["last_error"] = {**stamp, "error": result["error"]}
        return store
    entry.pop("last_error", None)
    runs = entry["runs"]
    if stamp not in runs:
        runs.append(stamp)
    run_id = runs.index(stamp) + 1
    entry["meta"] = result.get("meta", {})
    entry["batches"] = sorted(set(entry["batches"]) | set(result["batches"]))
    stored = {_key(r): r for r in entry["rows"]}
    for new in result["rows"]:
        new = {**new, **{k: _ints(new.get(k, {})) for k in timing_keys()}}
        measured = {m: sorted(new[m]) for m in MODES if new[m]}
        old = stored.get(_key(new))
        if old is not None and not measured and any(old[m] for m in MODES):
            continue
        row = dict(new)
        row["run"] = {m: {} for m in MODES}
        row["processes"] = {m: _ints(new.get("processes", {}).get(m, {})) for m in MODES}
        if old is not None:
            for k in timing_keys():
                row[k] = {**_ints(old.get(k, {})), **new[k]}
            for m in MODES:
                row["run"][m] = _ints(old.get("run", {}).get(m, {}))
                # a batch measured again keeps only the new run's per-process timings
                kept = _ints(old.get("processes", {}).get(m, {}))
                kept = {b: t for b, t in kept.items() if b not in new[m]}
                row["processes"][m] = {**kept, **row["processes"][m]}
        for m, batches in measured.items():
            row["run"][m].update({b: run_id for b in batches})
        stored[_key(new)] = row
    entry["rows"] = list(stored.values())
    _compact(entry)
    return store


def combine(results: list[dict]) -> dict:
    """One worker result from the results of several fresh processes of the same model (the
    script's ``--processes``): each timing the median over the processes that measured it, a
    row's parity the first that is not a pass (else the first process's), its note the first
    process's. A process that failed is left out; if every one did, the first's error stands.
    The meta records how many processes each timing is the median of; each row's
    ``processes`` keeps every process's own timing, for the spread of a ratio between paths
    (a path's calls and another's interleave within one process)."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[0]
    first = ok[0]
    rows = []
    for i, row in enumerate(first["rows"]):
        same = [r["rows"][i] for r in ok if i < len(r["rows"]) and _key(r["rows"][i]) == _key(row)]
        out = dict(row)
        for k in timing_keys():
            got = [_ints(r.get(k, {})) for r in same]
            batches = sorted({b for g in got for b in g})
            out[k] = {
                b: _median([g[b] for g in got if b in g and g[b] is not None]) for b in batches
            }
        # Each process's own timing, in process order (None where it measured none): a
        # path's ratio to another in one process pairs calls interleaved in the same rounds.
        out["processes"] = {
            m: {
                b: [_ints(r[m]).get(b) for r in same]
                for b in out[m]
                if len(same) > 1 and len(same) == len(ok)
            }
            for m in MODES
        }
        conv = [r["conversion_s"] for r in same if r.get("conversion_s") is not None]
        out["conversion_s"] = statistics.median(conv) if conv else None
        bad = [
            r["parity"]
            for r in same
            if r["parity"] and not r["parity"].startswith(("pass", "reference"))
        ]
        out["parity"] = bad[0] if bad else row["parity"]
        rows.append(out)
    meta = {**first.get("meta", {}), "processes": len(ok)}
    return {**first, "meta": meta, "rows": rows}


def drop(store: dict, backend: str, path: str) -> int:
    """Remove the stored rows of ``path`` (a row label the script no longer measures, such
    as the non-default kernel layout's after the default changed) from every model of
    ``backend``, in place; returns how many went."""
    gone = 0
    for entry in store.get(backend, {}).values():
        kept = [r for r in entry["rows"] if r["path"] != path]
        gone += len(entry["rows"]) - len(kept)
        entry["rows"] = kept
        _compact(entry)
    return gone


def timing_keys() -> tuple[str, ...]:
    """A row's per-batch entries: the timings, the first calls' seconds and their peak memory
    (absent from rows stored before it was measured)."""
    return ("infer", "train", "infer_compile", "train_compile", "infer_peak", "train_peak")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _compact(entry: dict) -> None:
    """Drop the runs no row refers to any more and renumber the rest in order."""
    used = sorted({i for r in entry["rows"] for m in MODES for i in _ints(r["run"][m]).values()})
    renumber = {old: new for new, old in enumerate(used, 1)}
    entry["runs"] = [entry["runs"][i - 1] for i in used]
    for r in entry["rows"]:
        r["run"] = {m: {b: renumber[i] for b, i in _ints(r["run"][m]).items()} for m in MODES}


def results(store: dict, backend: str, order: list[str]) -> list[dict]:
    """The stored models of ``backend`` as ``render_model`` inputs, in ``order``."""
    models = store.get(backend, {})
    out = []
    for name in order:
        if name not in models:
            continue
        entry = models[name]
        rows = [
            {
                **r,
                **{k: _ints(r.get(k, {})) for k in timing_keys()},
                "run": {m: _ints(r.get("run", {}).get(m, {})) for m in MODES},
                "processes": {m: _ints(r.get("processes", {}).get(m, {})) for m in MODES},
            }
            for r in entry["rows"]
        ]
        out.append({"model": name, **entry, "rows": rows})
    return out


def run_lines(entry: dict) -> list[str]:
    """One line per run of a model: what it measured and at which commit and load."""
    lines = []
    for i, run in enumerate(entry.get("runs", []), 1):
        covered: dict[str, set[int]] = {}
        for r in entry["rows"]:
            for m in MODES:
                for b, j in r["run"][m].items():
                    if j == i:
                        covered.setdefault(r["dtype"], set()).add(int(b))
        what = "; ".join(
            f"{d} b={'/'.join(map(str, sorted(bs)))}" for d, bs in sorted(covered.items())
        )
        lines.append(f"- run {i}: {describe(run)}: {what or 'no timings'}")
    if entry.get("last_error"):
        e = entry["last_error"]
        lines.append(f"- a later run did not finish ({describe(e)}): {e['error']}")
    return lines


def describe(run: dict[str, Any]) -> str:
    argv = " ".join(run.get("argv", []))
    return (
        f"commit `{run.get('commit', '?')}`, {run.get('date', '?')}, load average "
        f"{run.get('load_before', '?')} before / {run.get('load_after', '?')} after"
        + (f", {run['cpu']}" if run.get("cpu") else "")
        + (f", on {run['device']} with {run['versions']}" if run.get("device") else "")
        + (f", `{argv}`" if argv else "")
    )
