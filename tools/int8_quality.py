#!/usr/bin/env python
"""Held-out perplexity served with the kernels' float32 products and with integer products.

    python tools/int8_quality.py --model DIR --data TEXT_FILE [--tokens 4096] [--window 256]

Decodes the text token by token through the served path twice per configuration, with
``int8_products`` off and on (docs/KERNELS.md, "Integer products"): the demo as shipped (its
heads staging each step, its adapter beside the model) and the exact path on the model's own
gates; prints each perplexity and the ratio on / off.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flush_quality import compare, held_out  # noqa: E402

CONFIGS = {"heads and adapter": {}, "own gates (exact)": {"prerouter": "off", "adapter": "off"}}


def main() -> None:
    a, tokens = held_out(__doc__)
    for label, config in CONFIGS.items():
        print(f"{label}:")
        compare(a, tokens, "int8_products", ("off", "on"), f"{label}: integer against float32 products", **config)


if __name__ == "__main__":
    main()
