"""What the quantized matmuls cost: Edge0's kernels against MLX's and against reading the same bytes.

    python tools/kernel_cost.py [--rows 1,4,16] [--repeats 15] [--threads 1,2] [--experts 256]
                                [--hidden 2048] [--moe-intermediate 512] [--k 8] [--isas avx512,avx2]
                                [--json FILE]

One MoE layer at decode shapes (35B-tier defaults: hidden 2048, moe intermediate 512, 256
experts, k = 8, int4 group-64, float32 activations), SwitchGLU's three calls (gate, up:
[rows, 1, 1, hidden] against [rows, k] indices; down: [rows, k, 1, inter]) and the swiglu
between them, with a fresh draw of experts every repeat (the stack is 400+ MB, so the
weights come from memory, not the cache, as in a real decode step):

- ``mlx``: ``mx.gather_qmm`` with float32 scales and biases (MLX's best set-up with float32
  activations: with bf16 scales it promotes the whole stack every call);
- ``edge0 tN``: Edge0's kernels on N threads, scales and biases bf16 as the checkpoint
  stores them (read as stored, no promotion); with ``--isas``, once for each of the loops
  named (``edge0 ISA tN``: the widest the CPU has by default), alternately in one process;
- ``stream tN``: N threads reading the bytes Edge0's call reads (weights, scales, biases of
  the drawn experts) and nothing else: the memory limit of the machine for that call.

Also the dense ``quantized_matmul`` (an attention-shaped 2048 x 2048 projection) on both.
Times are medians over ``--repeats`` (the first two dropped), ratios within one run.
Prints a markdown table; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from edge0.backend.mlx import kernels as K


def _stack(e, n, k, scale_dtype, seed):
    w = mx.random.normal((e, n, k), key=mx.random.key(seed)) * 0.02
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    return wq, s.astype(scale_dtype), b.astype(scale_dtype)


def _median(f, repeats):
    times = []
    for _ in range(repeats):
        args = f.prepare()
        t0 = time.perf_counter()
        f.run(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:] if len(times) > 4 else times)


class Layer:
    """SwitchGLU's three calls on one draw of experts per repeat."""

    def __init__(self, stacks, rows, k, kernel, rng):
        self.stacks, self.rows, self.k, self.kernel, self.rng = stacks, rows, k, kernel, rng
        self.e = stacks[0][0].shape[0]
        self.hidden = stacks[0][0].shape[2] * 8

    def prepare(self):
        idx = np.concatenate([self.rng.choice(self.e, self.k, replace=False) for _ in range(self.rows)])
        x = mx.random.normal((self.rows, 1, 1, self.hidden))
        inds = mx.array(idx.astype(np.uint32)).reshape(self.rows, self.k)
        mx.eval(x, inds)
        return x, inds, idx

    def run(self, x, inds, idx):
        (g, u, d), q = self.stacks, self.kernel
        a = q(x, *g, inds)
        b = q(x, *u, inds)
        h = (a * mx.sigmoid(a)) * b
        mx.eval(q(h, *d, inds))


class Stream:
    """The same bytes an Edge0 call reads, read by the kernels' threads."""

    def __init__(self, stacks, rows, k, rng):
        self.stacks, self.rows, self.k, self.rng = stacks, rows, k, rng
        self.e = stacks[0][0].shape[0]
        self.arrays = [t for stack in stacks for t in stack]

    def prepare(self):
        idx = np.unique(np.concatenate([self.rng.choice(self.e, self.k, replace=False) for _ in range(self.rows)]))
        starts, sizes, which = [], [], []
        for i, a in enumerate(self.arrays):
            row = a.nbytes // a.shape[0]
            for e in idx:
                starts.append(int(e) * row)
                sizes.append(row)
                which.append(i)
        return starts, sizes, which

    def run(self, starts, sizes, which):
        K.ext().stream_bytes(self.arrays, starts, sizes, which)


class Dense:
    def __init__(self, wsb, rows, kernel):
        self.wsb, self.rows, self.kernel = wsb, rows, kernel

    def prepare(self):
        x = mx.random.normal((self.rows, self.wsb[0].shape[1] * 8))
        mx.eval(x)
        return (x,)

    def run(self, x):
        mx.eval(self.kernel(x, *self.wsb))


def mlx_gather(x, w, s, b, inds):
    return mx.gather_qmm(x, w, s, b, rhs_indices=inds, transpose=True, group_size=64, bits=4)


def edge0_gather(x, w, s, b, inds):
    return K.gather_qmm(x, w, s, b, inds, bits=4, group_size=64)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--isas", default="", help="the kernels' loops to compare (avx512,avx2,portable); "
                   "default: the widest this CPU has")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not K.available():
        print(f"Edge0's kernels are unavailable: {K.unavailable_reason()}", file=sys.stderr)
        return 2
    rows_list = [int(r) for r in args.rows.split(",")]
    widest = K.isa()
    isas = [x for x in args.isas.split(",") if x] or [widest]
    # the edge0 columns: (label, isa, threads)
    arms = [((f"{isa} " if len(isas) > 1 else "") + f"t{t}", isa, t)
            for t in [int(t) for t in args.threads.split(",")] for isa in isas]
    threads_list = [int(t) for t in args.threads.split(",")]
    e, h, i = args.experts, args.hidden, args.moe_intermediate
    shapes = [(i, h), (i, h), (h, i)]
    f32 = [_stack(e, n, kk, mx.float32, seed) for seed, (n, kk) in enumerate(shapes)]
    bf16 = [(w, s.astype(mx.bfloat16), b.astype(mx.bfloat16)) for w, s, b in f32]
    mx.eval(f32, bf16)
    rng = np.random.default_rng(0)
    layer_bytes = args.k * sum(t.nbytes // e for stack in bf16 for t in stack)  # one row's experts, as read
    results = {"shapes": dict(experts=e, hidden=h, moe_intermediate=i, k=args.k, bits=4, group_size=64),
               "isa": widest, "isas": isas, "layer": [], "dense": []}
    before = K.get_threads()
    try:
        for rows in rows_list:
            row = {"rows": rows, "mlx_ms": 1e3 * _median(Layer(f32, rows, args.k, mlx_gather, rng), args.repeats)}
            for label, isa, t in arms:
                K.set_threads(t)
                K.ext().limit_isa(isa)
                row[f"edge0_{label}_ms"] = 1e3 * _median(Layer(bf16, rows, args.k, edge0_gather, rng), args.repeats)
            for t in threads_list:
                K.set_threads(t)
                row[f"stream_t{t}_ms"] = 1e3 * _median(Stream(bf16, rows, args.k, rng), args.repeats)
            results["layer"].append(row)
        wsb32 = _stack(1, h, h, mx.float32, 9)
        wsb32 = tuple(t[0] for t in wsb32)
        wsb16 = (wsb32[0], wsb32[1].astype(mx.bfloat16), wsb32[2].astype(mx.bfloat16))
        mx.eval(wsb32, wsb16)
        for rows in rows_list:
            row = {"rows": rows, "mlx_ms": 1e3 * _median(Dense(wsb32, rows, lambda x, w, s, b: mx.quantized_matmul(
                x, w, s, b, transpose=True, group_size=64, bits=4)), args.repeats)}
            for label, isa, t in arms:
                K.set_threads(t)
                K.ext().limit_isa(isa)
                row[f"edge0_{label}_ms"] = 1e3 * _median(Dense(wsb16, rows, lambda x, w, s, b: K.quantized_matmul(
                    x, w, s, b, bits=4, group_size=64)), args.repeats)
            results["dense"].append(row)
    finally:
        K.set_threads(before)
        K.ext().limit_isa("avx512")

    print(f"MoE layer ({e} experts, hidden {h}, moe intermediate {i}, k={args.k}, int4 g64; {', '.join(isas)}): "
          f"{layer_bytes / 1e6:.1f} MB of expert weights per row")
    best_label = arms[-len(isas)][0]  # the most threads, the first loops named
    cols = ["mlx"] + [f"edge0 {a[0]}" for a in arms] + [f"stream t{t}" for t in threads_list]
    print("| rows | " + " | ".join(f"{c} ms" for c in cols) + " | edge0/mlx | edge0/stream | edge0 GB/s |")
    print("|---:|" + "---:|" * (len(cols) + 3))
    tbest = threads_list[-1]
    for r in results["layer"]:
        ms = [r["mlx_ms"]] + [r[f"edge0_{a[0]}_ms"] for a in arms] + [r[f"stream_t{t}_ms"] for t in threads_list]
        best = r[f"edge0_{best_label}_ms"]
        distinct_bytes = layer_bytes * r["rows"]  # upper bound: draws may repeat across rows
        print(f"| {r['rows']} | " + " | ".join(f"{v:.2f}" for v in ms)
              + f" | {r['mlx_ms'] / best:.1f}x | {best / r[f'stream_t{tbest}_ms']:.2f} | "
              + f"{distinct_bytes / best / 1e6:.1f} |")
    print(f"\nDense quantized_matmul ({h} x {h}, int4 g64):")
    print("| rows | mlx ms | " + " | ".join(f"edge0 {a[0]} ms" for a in arms) + " | edge0/mlx |")
    print("|---:|---:|" + "---:|" * (len(arms) + 1))
    for r in results["dense"]:
        best = r[f"edge0_{best_label}_ms"]
        print(f"| {r['rows']} | {r['mlx_ms']:.3f} | " + " | ".join(f"{r[f'edge0_{a[0]}_ms']:.3f}" for a in arms)
              + f" | {r['mlx_ms'] / best:.1f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
