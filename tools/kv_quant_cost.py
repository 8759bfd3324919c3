"""What KV cache quantization (``--kv-bits``) saves and costs on a model: the cache's bytes
per 1,000 tokens of context, and the held-out perplexity when every chunk of a window
attends to the quantized cache of the chunks before it.

The model runs as Edge0 computes it on the CPU (mlx-lm's own model class, in float32; the
attention and its cache are the same on every executor path, which only change how the
routed experts are read), the prompt fed in chunks of ``--chunk`` tokens with mlx-lm's
``maybe_quantize_kv_cache`` after each, as Edge0's prefill and mlx-lm's generation loop do
it, with ``--start`` the quantized_kv_start (0: the whole context quantized but the first
chunk's own attention).

    python tools/kv_quant_cost.py [--model src/edge0/data/demo_model] [--windows 8 --window 1024]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edge0.backend import nn as bnn  # noqa: E402
from edge0.train import data as D  # noqa: E402


def window_nll(model, tokens: np.ndarray, chunk: int, bits: int | None, group: int, start: int) -> tuple[float, int]:
    """Summed next-token NLL of one window, fed chunk by chunk on one cache, and the
    cache's bytes at its end."""
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    total = 0.0
    for s in range(0, len(tokens) - 1, chunk):
        piece = tokens[s:s + chunk + 1]
        logits = model(mx.array(piece[None, :-1]), cache=cache).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        target = mx.array(piece[None, 1:])
        total -= mx.take_along_axis(logp, target[..., None], axis=-1).sum().item()
        maybe_quantize_kv_cache(cache, quantized_kv_start=start, kv_group_size=group, kv_bits=bits)
    mx.eval([c.state for c in cache])
    return total, bnn.cache_nbytes(cache)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / "src" / "edge0" / "data" / "demo_model"))
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from mlx_lm.utils import load_model

    model, _ = load_model(Path(args.model))
    bnn.cast_model(model, mx.float32)  # Edge0's compute dtype on the CPU
    _, held, _ = D.token_streams(Path(args.model))
    starts = np.linspace(0, len(held) - args.window - 1, args.windows).astype(int)
    windows = [held[s:s + args.window + 1].astype(np.int32) for s in starts]
    rows = []
    for bits in (None, 8, 4):
        nll, nbytes = 0.0, 0
        for w in windows:
            total, nbytes = window_nll(model, w, args.chunk, bits, args.group, args.start)
            nll += total
        positions = len(windows) * args.window
        rows.append({"kv_bits": bits, "perplexity": math.exp(nll / positions),
                     "cache_mib_per_1000_tokens": nbytes / (args.window + 1) * 1000 / 2**20, "positions": positions})
    base = rows[0]
    print(f"{Path(args.model).name}: {args.windows} held-out windows of {args.window} tokens, chunks of {args.chunk}, "
          f"quantized_kv_start {args.start}, kv_group_size {args.group}, compute float32\n")
    print("| KV cache | MiB per 1,000 tokens of context | vs float32 | held-out perplexity | vs float32 |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        name = "float32 (off)" if r["kv_bits"] is None else f"{r['kv_bits']}-bit"
        print(f"| {name} | {r['cache_mib_per_1000_tokens']:.2f} | {r['cache_mib_per_1000_tokens'] / base['cache_mib_per_1000_tokens']:.3f}x "
              f"| {r['perplexity']:.3f} | {r['perplexity'] / base['perplexity']:.4f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args) | {"model": Path(args.model).name},
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
