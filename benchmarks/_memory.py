"""Shared peak-memory helpers for the memory measurements (``bench_shard``,
``bench_shard_stream``, ``bench_scale``, ``bench_stream``, ``tests/sharding/stream_memory_worker.py``
and the CLI memory tests): Linux ``/proc`` and ``getrusage`` only."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


def rss_kib(field: str) -> int:
    """``field`` of ``/proc/self/status`` in KiB (``VmRSS``: now; ``VmHWM``: the peak mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak() -> int:
    """Collect garbage, hand freed heap back to the OS, reset the peak-RSS mark
    (``/proc/self/clear_refs``); the RSS in KiB, the baseline a peak is measured above."""
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return rss_kib("VmRSS")


def peak_above_mib(base: int) -> float:
    """The peak RSS since :func:`reset_peak` above ``base``, in MiB."""
    return (rss_kib("VmHWM") - base) / 1024


def warm_mesh_orbax(folder: Path, mesh: str = "2x4") -> None:
    """Pay the fixed costs before a baseline: jax on ``mesh`` and Orbax's thread pools (one
    tiny sharded save into ``folder/warm``)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec

    from xconv.sharding.rules import make_mesh

    warm = jax.device_put(
        np.zeros(8, np.float32), NamedSharding(make_mesh(mesh), PartitionSpec("model"))
    )
    ocp.PyTreeCheckpointer().save((folder / "warm").absolute(), {"w": warm})


@dataclass
class Measured:
    """One command run by :func:`run_measured`."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    peak_gib: float  # the command's own peak RSS (and its children's, the largest of them)


# Run argv as a child and report its peak RSS. This runner is a fresh interpreter of a few
# MiB, so the peak its child reports is the child's own: on Linux exec() keeps the larger of
# the caller's peak and the exec'ing process's (fs/exec.c, setmax_mm_hiwater_rss), and a
# child forked (or vforked) straight from a large process reports that process's peak.
_RUNNER = """
import json, resource, subprocess, sys, time
t = time.perf_counter()
rc = subprocess.run(sys.argv[2:]).returncode
s = time.perf_counter() - t
kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
with open(sys.argv[1], "w") as f:
    json.dump({"rc": rc, "s": s, "kib": kib}, f)
"""


def run_measured(
    argv: list[str], *, env: dict | None = None, cwd: Path | None = None,
    timeout: float | None = None,
) -> Measured:  # fmt: skip
    """Run ``argv`` through a small runner process; its exit code, output, wall seconds and
    peak RSS. Measuring ``os.wait4`` on a child of a large process (a pytest worker after a
    big test, a benchmark that holds a model) reports the parent's peak instead."""
    with tempfile.TemporaryDirectory(prefix="xconv-measured-") as tmp:
        result = Path(tmp) / "result.json"
        proc = subprocess.Popen(
            [sys.executable, "-c", _RUNNER, str(result), *argv], env=env, cwd=cwd,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the runner and the command under it
            proc.communicate()
            raise
        if not result.exists():
            raise RuntimeError(f"the runner failed ({proc.returncode}): {err[-2000:]!r}")
        data = json.loads(result.read_text())
    return Measured(
        data["rc"], out.decode(errors="replace"), err.decode(errors="replace"), data["s"],
        data["kib"] / 2**20,
    )  # fmt: skip
