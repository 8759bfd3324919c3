"""Median wall time of a callable, for the micro-benchmark scripts in this folder."""

from __future__ import annotations

import statistics
import time


def median_ms(fn, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return 1e3 * statistics.median(samples)
