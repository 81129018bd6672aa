"""A benchmark's markdown doc: written by its script from committed code, stamped with the run.

commit = _doc.commit_or_refuse("bench_x", args.out, OUT_MD)   # None: refused
... measure ...
_doc.write(args.out, render(rows, _doc.run_stamp(commit, load_before)))
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from benchmarks import throughput_store as store
from benchmarks.bench_throughput import _cpu, _load


def commit_or_refuse(script: str, out: Path, default: Path) -> str | None:
    """``HEAD``'s short hash for the run's stamp; None (with a message) when the tree has
    uncommitted changes and ``out`` is the committed doc ``default``: a table in the repo comes
    from committed code. Another ``--out`` takes any tree."""
    commit = store.commit((out,))
    if store.DIRTY in commit and out.resolve() == default.resolve():
        print(
            f"{script}: uncommitted changes ({commit}); commit first or pass --out", file=sys.stderr
        )
        return None
    return commit


def load() -> str:
    """The load average now (a run's stamp gives it before and after)."""
    return _load()


def run_stamp(commit: str, load_before: str, versions: str = "") -> str:
    """``commit `abc1234`, <UTC time>, <CPU>[, versions], load average … before / … after``."""
    parts = [f"commit `{commit}`", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), _cpu()]
    if versions:
        parts.append(versions)
    parts.append(f"load average {load_before} before / {_load()} after")
    return ", ".join(parts)


def write(out: Path, text: str) -> None:
    out.write_text(text)
    print(f"wrote {out}", file=sys.stderr)
