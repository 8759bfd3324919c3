#!/usr/bin/env python
"""Held-out perplexity served with the heads' flush in float32 (NumPy) and in 8-bit weights.

    python tools/flush_quality.py --model DIR --data TEXT_FILE [--tokens 4096] [--window 256]

Decodes the text token by token through the served path (the heads staging each step, the
adapter beside the model applied) twice, with ``prerouter_flush numpy`` and ``edge0``
(docs/PREROUTER.md), and prints both perplexities and their ratio.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edge0 import Engine, EngineConfig
from edge0.train.quality import served_perplexity


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="a text file")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=256)
    a = p.parse_args()
    with Engine(a.model) as engine:
        tokens = engine.encode(Path(a.data).read_text())[: a.tokens + 1]
    out = {flush: served_perplexity(a.model, tokens, EngineConfig(prerouter_flush=flush), window=a.window)
           for flush in ("numpy", "edge0")}
    for flush, r in out.items():
        print(f"prerouter_flush {flush}: perplexity {r['perplexity']:.5f} over {r['tokens']} tokens")
    print(f"8-bit against float32: {out['edge0']['perplexity'] / out['numpy']['perplexity']:.6f}x")


if __name__ == "__main__":
    main()
