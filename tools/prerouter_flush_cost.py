#!/usr/bin/env python
"""Cost of one prerouter flush (every head at once), by where it runs, at the 35B tier's shapes.

    python tools/prerouter_flush_cost.py [--heads 39] [--hidden 2048] [--experts 256] [--k 8] [--width 512]
                                         [--rows 1] [--token-dim 0]

Prints the median time of a flush as served (``EngineConfig.prerouter_flush``): in MLX
(stacked weights, float16 and float32), in NumPy (float32) and on Edge0's kernels (8-bit
weights, where the kernels are built), the same flush per head,
and MLX's heads evaluated one by one. Run it with the other core idle: the flush streams
every head's weights through memory, so a neighbour's traffic shows in it.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
from _timing import median_ms

from edge0.backend.mlx import kernels as K
from edge0.prerouter.heads import PrerouterHeads
from edge0.prerouter.quantized import QuantizedHeads
from edge0.prerouter.runtime import HostHeads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=39)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--rows", type=int, default=1, help="sequences in the batch")
    p.add_argument("--token-dim", type=int, default=0, help="heads that see the token: its embedding width")
    a = p.parse_args()
    mx.random.seed(0)
    h_, r = a.heads, a.rows
    x = mx.random.normal((h_, r, a.hidden))
    inds = mx.stack([mx.stack([mx.random.permutation(a.experts)[:a.k] for _ in range(r)]) for _ in range(h_)])
    tok = mx.random.normal((1, r, a.token_dim)) if a.token_dim else None
    heads = PrerouterHeads(list(range(h_)), a.hidden, a.experts, a.k, a.width, token_dim=a.token_dim)
    print(f"{h_} heads, hidden {a.hidden}, {a.experts} experts, k {a.k}, width {a.width}, {r} row(s), "
          f"token input {a.token_dim or 'none'}")
    print("| flush | weights (MB) | flush (ms) | per head (ms) | head by head (ms) |")
    print("|---|---:|---:|---:|---:|")
    for dtype in (mx.float16, mx.float32):
        heads.set_dtype(dtype)
        heads.freeze_for_inference(dtype)
        mb = sum(w.nbytes for w in heads._stacked.values()) / 1e6
        batched = median_ms(lambda: mx.eval(heads.predict_all(x, inds, inds, tok)))
        one_by_one = median_ms(lambda: mx.eval([heads.predict(o, x[o:o + 1], inds[o:o + 1], inds[o:o + 1], tok)
                                                for o in range(h_)]))
        print(f"| mlx {str(dtype).split('.')[-1]} | {mb:.0f} | {batched:.1f} | {batched / h_:.2f} | {one_by_one:.1f} |")
    host = HostHeads(heads)
    hx, hi = np.array(x), np.array(inds).astype(np.int64)
    ht = np.array(tok).reshape(r, -1) if tok is not None else None
    t = median_ms(lambda: host.logits(hx, hi, hi, ht))
    print(f"| numpy float32 | {host.nbytes / 1e6:.0f} | {t:.1f} | {t / h_:.2f} | |")
    if K.available():
        heads.set_dtype(mx.float32)
        quantized = QuantizedHeads(heads)
        t = median_ms(lambda: mx.eval(quantized.logits(x, inds, inds, tok)))
        print(f"| edge0 8-bit | {quantized.nbytes / 1e6:.0f} | {t:.1f} | {t / h_:.2f} | |")


if __name__ == "__main__":
    main()
