"""Shared timing helpers for the benchmarks: warm up, then the median of repeated runs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_seconds(
    fn: Callable[[], object], *, warmup: int = 3, repeat: int = 20, min_time: float = 0.2
) -> float:
    """Median wall time of ``fn()`` after ``warmup`` calls; repeats until ``min_time`` spent."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < repeat or spent < min_time:
        start = time.perf_counter()
        fn()
        dt = time.perf_counter() - start
        times.append(dt)
        spent += dt
        if len(times) >= 10 * repeat:
            break
    return statistics.median(times)
