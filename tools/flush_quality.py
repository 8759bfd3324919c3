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


def held_out(doc: str) -> tuple[argparse.Namespace, list[int]]:
    """The command line (--model, --data, --tokens, --window) and the first --tokens + 1
    tokens of --data, as the model's tokenizer encodes them."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="a text file")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=256)
    a = p.parse_args()
    with Engine(a.model) as engine:
        return a, engine.encode(Path(a.data).read_text())[: a.tokens + 1]


def compare(a: argparse.Namespace, tokens: list[int], setting: str, values: tuple[str, str], label: str,
            **config) -> None:
    """Print the perplexity served with ``setting`` at each of ``values`` (the rest of the
    engine's settings ``config``), and the second's over the first's, named ``label``."""
    out = {v: served_perplexity(a.model, tokens, EngineConfig(**{setting: v}, **config), window=a.window)
           for v in values}
    for v, r in out.items():
        print(f"{setting} {v}: perplexity {r['perplexity']:.5f} over {r['tokens']} tokens")
    print(f"{label}: {out[values[1]]['perplexity'] / out[values[0]]['perplexity']:.6f}x")


def main() -> None:
    a, tokens = held_out(__doc__)
    compare(a, tokens, "prerouter_flush", ("numpy", "edge0"), "8-bit against float32")


if __name__ == "__main__":
    main()
