#!/usr/bin/env python
"""Peak memory of Edge0's exact streaming path against mlx-lm's resident model.

Each arm runs in its own process (peaks are per process), loads the same checkpoint and
generates the same number of greedy tokens from the same prompt. Reported per arm: peak
MLX active memory (mx.get_peak_memory) and peak RSS, plus the ratio Edge0 / mlx-lm.

    python tools/measure_memory.py                      # builds the default checkpoint once
    python tools/measure_memory.py --model DIR --json out.json

The default checkpoint is a random qwen3_moe (8 layers, 64 experts of width 512, hidden
512, int4 group 64) whose routed experts are over 95% of its bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
DEFAULT_SHAPE = dict(layers=8, experts=64, k=4, hidden=512, moe_intermediate=512)


def arm_mlx_lm(model: str, max_tokens: int) -> dict:
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    from edge0.stats import peak_rss_bytes

    m, tok = load(model)
    n = sum(1 for _ in stream_generate(m, tok, PROMPT, max_tokens=max_tokens))
    return dict(tokens=n, peak_active=mx.get_peak_memory(), peak_rss=peak_rss_bytes())


def arm_edge0(model: str, max_tokens: int) -> dict:
    import mlx.core as mx

    from edge0 import Engine

    with Engine(model) as engine:
        events = list(engine.stream(PROMPT, max_tokens=max_tokens))
        stats = events[-1].stats
    return dict(tokens=len(events), peak_active=mx.get_peak_memory(), peak_rss=stats.peak_rss,
                expert_bytes_per_token=stats.expert_bytes_per_token)


ARMS = {"mlx-lm resident": arm_mlx_lm, "edge0 exact": arm_edge0}


def run_arm(name: str, model: str, max_tokens: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--arm", name, "--model", model, "--max-tokens", str(max_tokens)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def default_model() -> Path:
    from edge0.cache import cache_dir
    from edge0.tiny import make_tiny

    path = cache_dir() / "memory-qwen3_moe-v1"
    if not (path / "config.json").exists():
        make_tiny("qwen3_moe", path, seed=0, overwrite=True, **DEFAULT_SHAPE)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: build the memory test model)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--arm", choices=sorted(ARMS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:
        print(json.dumps(ARMS[args.arm](args.model, args.max_tokens)))
        return 0
    from edge0.model.open import open_checkpoint

    model = Path(args.model) if args.model else default_model()
    _, index, _ = open_checkpoint(model)
    results = {name: run_arm(name, str(model), args.max_tokens) for name in ARMS}
    base, ours = results["mlx-lm resident"], results["edge0 exact"]
    summary = dict(
        model=str(model), checkpoint_bytes=index.total_bytes, expert_bytes=index.expert_bytes_total,
        expert_fraction=index.expert_bytes_total / index.total_bytes, max_tokens=args.max_tokens,
        arms=results, active_ratio=ours["peak_active"] / base["peak_active"],
        rss_ratio=ours["peak_rss"] / base["peak_rss"],
    )
    mib = 2**20
    print(f"checkpoint {index.total_bytes / mib:.1f} MiB, routed experts {summary['expert_fraction']:.1%} of bytes")
    print("| arm | peak MLX active (MiB) | peak RSS (MiB) |")
    print("|---|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['peak_active'] / mib:.1f} | {r['peak_rss'] / mib:.1f} |")
    print(f"edge0 / mlx-lm: peak active {summary['active_ratio']:.1%}, peak RSS {summary['rss_ratio']:.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
