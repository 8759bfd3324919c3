#!/usr/bin/env python
"""Cost of one prerouter flush (every head at once) by dtype, at the 35B tier's shapes.

    python tools/prerouter_flush_cost.py [--heads 11] [--hidden 2048] [--experts 256] [--k 8] [--width 512]

Prints the median time of a batched flush (stacked weights, as served) and of the same
heads evaluated one by one, in float16 and float32.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from _timing import median_ms

from edge0.prerouter.heads import PrerouterHeads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=11)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    a = p.parse_args()
    mx.random.seed(0)
    print("| dtype | batched flush (ms) | head by head (ms) |")
    print("|---|---:|---:|")
    for dtype in (mx.float16, mx.float32):
        heads = PrerouterHeads(list(range(a.heads)), a.hidden, a.experts, a.k, a.width)
        heads.set_dtype(dtype)
        heads.freeze_for_inference(dtype)
        x = mx.random.normal((a.heads, 1, a.hidden))
        inds = mx.random.randint(0, a.experts, (a.heads, 1, a.k))
        batched = median_ms(lambda: mx.eval(heads.predict_all(x, inds, inds)))
        one_by_one = median_ms(lambda: mx.eval([heads.predict(o, x[o:o + 1], inds[o:o + 1], inds[o:o + 1])
                                            for o in range(a.heads)]))
        print(f"| {dtype} | {batched:.1f} | {one_by_one:.1f} |")


if __name__ == "__main__":
    main()
