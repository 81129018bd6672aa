"""Shared peak-memory helpers for the memory measurements (``bench_shard``,
``bench_shard_stream`` and ``tests/sharding/stream_memory_worker.py``): Linux ``/proc`` only."""

from __future__ import annotations

import contextlib
import ctypes
import gc
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
