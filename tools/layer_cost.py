#!/usr/bin/env python
"""Compute cost of one decode token's routed experts in one MoE layer, at 35B shapes.

Explains, by measurement, the per-step compute gap between mlx-lm's resident model and
Edge0's streaming paths in ``edge0 bench``. Every variant runs the same SwitchGLU (three
``gather_qmm`` calls and a swiglu, one token, k experts, float32 activations) over a
different weight stack:

- ``resident f32``: all E experts stacked, scales and biases cast to float32 (the fair
  resident arm);
- ``resident bf16 scales``: the same stack with scales and biases left in bfloat16, as
  stored: MLX promotes the whole E-expert scale and bias stacks to float32 on every call
  (the handicapped arm the benchmarks used before);
- ``bundle bf16 scales``: the k selected experts in a ``--bundle``-row buffer with the
  scales as read from disk (what the exact path computes), likewise ``slots`` for a
  staged layer's 2k slots;
- ``bundle f32 scales``: the bundle with its scales converted once.

    python tools/layer_cost.py [--experts 256 --k 8 --hidden 2048 --width 512 --bundle 32 --repeats 30]
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
from _timing import median_ms


def stack(e: int, width: int, hidden: int, scale_dtype, seed: int = 0) -> dict:
    """Random int4 group-64 weights of ``e`` experts (gate, up: [width, hidden]; down:
    [hidden, width]); scales and biases in ``scale_dtype``."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (o, i) in (("gate_proj", (width, hidden)), ("up_proj", (width, hidden)), ("down_proj", (hidden, width))):
        w = mx.array(rng.integers(0, 2**32, size=(e, o, i // 8), dtype=np.uint32))
        s = mx.array((rng.standard_normal((e, o, i // 64)) * 0.01).astype(np.float32)).astype(scale_dtype)
        b = mx.array((rng.standard_normal((e, o, i // 64)) * 0.01).astype(np.float32)).astype(scale_dtype)
        out[name] = (w, s, b)
    mx.eval(out)
    return out


def switch_glu(x, weights: dict, idx):
    def proj(h, name):
        w, s, b = weights[name]
        return mx.gather_qmm(h, w, s, b, rhs_indices=idx, transpose=True, group_size=64, bits=4)

    g = proj(x, "gate_proj")
    h = g * mx.sigmoid(g) * proj(x, "up_proj")
    return proj(h, "down_proj")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--bundle", type=int, default=32)
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    x = mx.random.normal((1, 1, 1, 1, a.hidden))
    mx.eval(x)
    picks = sorted(np.random.default_rng(1).choice(a.experts, a.k, replace=False).tolist())
    rows = {}
    for label, e, dtype in (("resident f32", a.experts, mx.float32),
                            ("resident bf16 scales", a.experts, mx.bfloat16),
                            (f"bundle of {a.bundle}, bf16 scales", a.bundle, mx.bfloat16),
                            (f"bundle of {a.bundle}, f32 scales", a.bundle, mx.float32),
                            (f"slots of {2 * a.k}, bf16 scales", 2 * a.k, mx.bfloat16)):
        weights = stack(e, a.width, a.hidden, dtype)
        idx = mx.array([[[*(picks if e == a.experts else range(a.k))]]])
        rows[label] = median_ms(lambda: mx.eval(switch_glu(x, weights, idx)), a.repeats)
        del weights
    base = rows["resident f32"]
    print(f"One decode token, one MoE layer: E={a.experts}, k={a.k}, hidden {a.hidden}, width {a.width}, "
          f"float32 activations; median of {a.repeats}.\n")
    print("| weights | ms per layer | vs resident f32 |")
    print("|---|---:|---:|")
    for label, ms in rows.items():
        print(f"| {label} | {ms:.2f} | {ms / base:.2f}x |")


if __name__ == "__main__":
    main()
