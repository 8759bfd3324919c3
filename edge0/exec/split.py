"""Both cores on one MoE layer: a stack call cut into groups of expert rows, one stream each.

A single MLX op runs on one core, and the expert stack is most of a decode step. The
stack's output has one row per (token, expert slot), each computed from its own expert's
weights alone, so the call can be cut along the expert slots (or, for single-slot calls,
along the tokens) into groups that run on different streams (MLX gives each CPU stream its
own thread) and be put back together in order: every row is the same computation on the
same inputs, and the result is bit-identical to one call. The graph stays lazy: nothing
waits.
"""

from __future__ import annotations

import os

from edge0.backend import core as B


def resolve_threads(n: int) -> int:
    """``compute_threads`` 0 (auto): every core this process may run on (its CPU affinity:
    ``taskset``, a cpuset) on the CPU backend, 1 elsewhere."""
    if n:
        return n
    if not B.is_cpu():
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform (macOS)
        return max(1, os.cpu_count() or 1)


class Split:
    """Runs ``kernel(x, inds)`` over ``threads`` streams of the thread that builds the graph
    (streams belong to their thread, so each calling thread uses its own)."""

    def __init__(self, threads: int):
        self.threads = threads

    @property
    def streams(self) -> list:
        return B.compute_streams(self.threads)

    def __call__(self, kernel, x, inds):
        n = self.threads
        k = inds.shape[-1]
        if n == 1:
            return kernel(x, inds)
        streams = self.streams
        if k >= 2:  # groups of expert slots: output [..., k, D]
            parts = min(n, k)
            bounds = [k * i // parts for i in range(parts + 1)]
            outs = []
            for i in range(parts):
                with B.on_stream(streams[i]):
                    outs.append(kernel(x, inds[..., bounds[i]:bounds[i + 1]]))
            return B.concatenate(outs, axis=-2)
        rows = inds.shape[0]  # one slot per row (chunked prefill): groups of rows
        if inds.ndim != 2 or x.ndim != 2 or rows < n:
            return kernel(x, inds)
        bounds = [rows * i // n for i in range(n + 1)]
        outs = []
        for i in range(n):
            with B.on_stream(streams[i]):
                outs.append(kernel(x[bounds[i]:bounds[i + 1]], inds[bounds[i]:bounds[i + 1]]))
        return B.concatenate(outs, axis=0)
