"""Timings of the products a decode step makes, on random weights of a stated shape: what
``edge0.speed`` forecasts a checkpoint's step from (Edge0's kernels or MLX's)."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np

from edge0.backend.mlx import kernels as K


def version() -> str:
    return mx.__version__


def _qstack(count: int, rows: int, cols: int, bits: int, group: int, scale_dtype):
    """``count`` random quantized matrices [rows, cols] stacked (words, scales, biases)."""
    words = mx.random.randint(0, 2**31 - 1, (count, rows, cols * bits // 32)).astype(mx.uint32)
    scales = (mx.random.normal((count, rows, cols // group)) * 0.01).astype(scale_dtype)
    biases = (mx.random.normal((count, rows, cols // group)) * 0.01).astype(scale_dtype)
    mx.eval(words, scales, biases)
    return words, scales, biases


def _median_s(run, repeats: int) -> float:
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        run(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def nbytes(shape, bits: int, group: int, scale_bytes: int) -> int:
    """A quantized matrix's bytes: its words, scales and biases."""
    rows, cols = shape
    return rows * cols * bits // 8 + 2 * rows * (cols // group) * scale_bytes


def dense_seconds(shape: tuple[int, int], bits: int, group: int, scale_dtype: str, kernels: str, rows: int = 1,
                  pool_bytes: int = 192 * 2**20, repeats: int = 15) -> float:
    """One quantized projection [out, in] at ``rows`` rows, each repeat on another of a pool
    of matrices past the CPU's caches (its weights from memory, as in a step)."""
    dtype = getattr(mx, scale_dtype)
    count = max(2, min(64, pool_bytes // max(1, nbytes(shape, bits, group, dtype.size))))
    pool = [tuple(a[0] for a in _qstack(1, shape[0], shape[1], bits, group, dtype)) for _ in range(count)]
    x = mx.random.normal((rows, shape[1]))
    mx.eval(x, pool)
    if kernels == "edge0":
        f = lambda i: K.quantized_matmul(x, *pool[i % count], bits=bits, group_size=group)
    else:
        f = lambda i: mx.quantized_matmul(x, *pool[i % count], transpose=True, group_size=group, bits=bits)
    return _median_s(lambda i: mx.eval(f(i)), repeats)


def attention_seconds(heads: int, kv_heads: int, dim: int, positions: int) -> float:
    """Causal attention of ``positions`` queries over as many keys (MLX's fused op)."""
    q = mx.random.normal((1, heads, positions, dim))
    k = mx.random.normal((1, kv_heads, positions, dim))
    v = mx.random.normal((1, kv_heads, positions, dim))
    mx.eval(q, k, v)
    return _median_s(lambda i: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5,
                                                                            mask="causal")), 7)


def step_runner(calls: list, scale_dtype: str, experts: int, k: int, kernels: str, rows: int,
                pool_bytes: int = 2**30, draws_kept: int = 9):
    """``run(i)``: a step's quantized products (``("dense" | "routed", [out, in], bits,
    group)`` each) in order, evaluated together, the ``i``-th of ``draws_kept`` routings:
    each dense one on a matrix of its own (until ``pool_bytes``, then one of its shape
    again), each routed one gathering k experts a row from a stack of its shape (at most
    ``experts`` experts or 256 MiB), drawn at random."""
    dtype = getattr(mx, scale_dtype)
    rng = np.random.default_rng(0)
    held, mats, stacks, pools = 0, [], {}, {}
    for kind, shape, bits, group in calls:
        shape, key = tuple(shape), (tuple(shape), bits, group)
        if kind == "routed":
            if key not in stacks:
                count = max(k, min(experts, (256 << 20) // nbytes(shape, bits, group, dtype.size)))
                stacks[key] = _qstack(count, *shape, bits, group, dtype)
            mats.append(stacks[key])
            continue
        pool = pools.setdefault(key, [])
        if held < pool_bytes or not pool:  # a matrix of its own, or (past the budget) one of its shape again
            pool.append(tuple(a[0] for a in _qstack(1, *shape, bits, group, dtype)))
            held += nbytes(shape, bits, group, dtype.size)
        mats.append(pool[len(mats) % len(pool)])
    xs = {c[1][1]: mx.random.normal((rows, c[1][1])) for c in calls}
    draws = [[mx.array(np.stack([rng.choice(m[0].shape[0], k, replace=False) for _ in range(rows)])
                       .astype(np.uint32)) if c[0] == "routed" else None for c, m in zip(calls, mats)]
             for _ in range(draws_kept)]
    mx.eval(list(xs.values()), [d for ds in draws for d in ds if d is not None])

    def one(c, m, d):
        x, bits, group = xs[c[1][1]], c[2], c[3]
        if c[0] == "routed":
            x = x.reshape(rows, 1, 1, -1)
            if kernels == "edge0":
                return K.gather_qmm(x, *m, d, bits=bits, group_size=group)
            return mx.gather_qmm(x, *m, rhs_indices=d, transpose=True, group_size=group, bits=bits)
        if kernels == "edge0":
            return K.quantized_matmul(x, *m, bits=bits, group_size=group)
        return mx.quantized_matmul(x, *m, transpose=True, group_size=group, bits=bits)

    def run(i: int = 0) -> None:
        mx.eval([one(c, m, d) for c, m, d in zip(calls, mats, draws[i % draws_kept])])
    return run


def step_pair_seconds(first: dict, second: dict, kernels: str, rows: int, pool_bytes: int = 2**30,
                      repeats: int = 31) -> tuple[float, float]:
    """Median seconds of two steps' products (``first`` and ``second``: ``calls``,
    ``scale_dtype``, ``experts``, ``k`` each), timed in turns in one process: a drift of the
    machine's speed while they are measured falls on both alike, so their difference holds."""
    runs = [step_runner(p["calls"], p["scale_dtype"], p["experts"], p["k"], kernels, rows, pool_bytes,
                        min(repeats, 9)) for p in (first, second)]
    times: tuple[list, list] = ([], [])
    for i in range(repeats):
        for run, got in zip(runs, times):
            t0 = time.perf_counter()
            run(i)
            got.append(time.perf_counter() - t0)
    return statistics.median(times[0][2:]), statistics.median(times[1][2:])


# a fixed step of products: four MoE layers of 35B-shaped experts (k 8 of 64, int4, groups of 64) at one
# row, about 50 MB of weights: the machine's speed at a moment for a decode step's kind of work
PROBE_CALLS = [("routed", [512, 2048], 4, 64), ("routed", [512, 2048], 4, 64), ("routed", [2048, 512], 4, 64)] * 4
_probe: list = []


def probe_seconds(repeats: int = 9) -> float:
    """Median seconds of the probe step (``PROBE_CALLS``) on Edge0's kernels where they are
    built, else MLX's: timed before a forecast and around each bench round, the ratio of two
    says how much faster or slower the machine ran at one moment than at the other."""
    if not _probe:
        _probe.append(step_runner(PROBE_CALLS, "bfloat16", 64, 8, "edge0" if K.available() else "mlx", 1,
                                  draws_kept=repeats))
    return _median_s(_probe[0], repeats + 2)
