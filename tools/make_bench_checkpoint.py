#!/usr/bin/env python
"""Write the synthetic 35B-tier-shaped int4 checkpoint used by the benchmarks.

    python tools/make_bench_checkpoint.py OUT [--layers 12] [--seed 0] [--overwrite]

Expert shapes of Qwen3.6-35B-A3B: hidden 2048, 256 experts of width 512, k=8, int4 group
64 (1,769,472 bytes per expert per layer). 12 layers = 5.4 GB of experts (the default,
sized for a 24 GB developer machine); 40 layers = 18 GB. Streams to disk; refuses to
start when the disk lacks room.
"""

from __future__ import annotations

import argparse
import sys
import time

from edge0.benchmark.checkpoint import BenchShape, make_bench_checkpoint
from edge0.errors import Edge0Error


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output directory")
    p.add_argument("--layers", type=int, default=12, help="MoE layers (default 12 = 5.4 GB of experts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    if a.layers < 1:
        p.error("--layers must be >= 1")
    shape = BenchShape(layers=a.layers)
    print(f"writing {shape.layers} layers x {shape.experts} experts x {shape.bytes_per_expert:,} bytes "
          f"= {shape.expert_bytes / 1e9:.2f} GB of experts to {a.out}", file=sys.stderr)

    def progress(done, total, seconds):
        rate = done / seconds / 1e6 if seconds > 0 else 0.0
        print(f"\r  {done / 1e9:6.2f} / {total / 1e9:.2f} GB  {rate:7.0f} MB/s", end="", file=sys.stderr)

    t0 = time.perf_counter()
    try:
        out = make_bench_checkpoint(a.out, shape, seed=a.seed, overwrite=a.overwrite, progress=progress)
    except (Edge0Error, FileExistsError) as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    print(f"\ndone in {time.perf_counter() - t0:.0f} s: {out}", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
