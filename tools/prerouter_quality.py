#!/usr/bin/env python
"""Held-out perplexity with prerouter routing vs the model's own gates, token by token.

    python tools/prerouter_quality.py --model DIR [--heads FILE] [--data FILE.npy|TEXT_FILE] [--tokens 2048]
        [--window 256]

--data: a .npy of token ids, or a text file to tokenize (default: the held-out split of the
Python standard library used by `edge0 train heads`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from edge0.backend import nn as bnn
from edge0.train.quality import routing_replacement_report
from edge0.train.heads import default_texts, token_chunks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", default=None)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--heads", default=None, help="heads file (default: MODEL/prerouter.safetensors)")
    a = p.parse_args()
    if a.data and a.data.endswith(".npy"):
        tokens = np.load(a.data).reshape(-1)[: a.tokens].tolist()
    else:
        tok = bnn.load_tokenizer(Path(a.model))
        texts = [Path(a.data).read_text()] if a.data else default_texts()[1]
        tokens = sum(token_chunks(tok, texts, a.tokens, a.tokens), [])
    report = routing_replacement_report(a.model, tokens, a.window, a.heads)
    print(json.dumps(report, indent=2))
    print(f"held-out perplexity: own gates {report['own_gates']['perplexity']:.3f}, prerouter "
          f"{report['prerouter']['perplexity']:.3f} ({report['ratio']:.3f}x) over {report['prerouter']['tokens']} "
          f"tokens; staged layers {report['prerouter']['staged_layers']}")


if __name__ == "__main__":
    main()
