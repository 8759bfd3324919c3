#!/usr/bin/env python
"""Cost of one quantized gather matmul (one token, k experts) against the stack size E.

Explains a benchmark observation: on MLX's CPU backend, `gather_qmm` over a stack of all
E experts costs more than over a small bundle holding only the selected ones, with the
same selected weights and the same arithmetic.

    python tools/gather_cost.py [--k 8] [--hidden 2048] [--width 512] [--repeats 50]
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from _timing import median_ms


def time_call(x, w, s, b, idx, repeats: int) -> float:
    return median_ms(lambda: mx.eval(mx.gather_qmm(x, w, s, b, rhs_indices=idx, transpose=True, group_size=64,
                                                   bits=4)), repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--repeats", type=int, default=50)
    a = p.parse_args()
    mx.random.seed(0)
    x = mx.random.normal((1, 1, 1, 1, a.hidden))
    print("| stack size E | median ms per gather_qmm |")
    print("|---:|---:|")
    for e in (a.k, 32, 64, 128, 256):
        w, s, b = mx.quantize(mx.random.normal((e, a.width, a.hidden)) * 0.02, 64, 4)
        s, b = s.astype(mx.bfloat16), b.astype(mx.bfloat16)
        mx.eval(w, s, b)
        picks = mx.array([[[round(i * (e - 1) / (a.k - 1)) for i in range(a.k)]]])
        print(f"| {e} | {time_call(x, w, s, b, picks, a.repeats):.2f} |")


if __name__ == "__main__":
    main()
