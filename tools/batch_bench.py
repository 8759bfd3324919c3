"""Aggregate decode speed of concurrent generations on one engine (continuous batching).

    python tools/batch_bench.py [--model DIR] [--arms exact,staged] [--batch 1,4,16]
                                [--tokens 32] [--repeats 3] [--heads FILE] [--json FILE]

For each arm (an engine configuration: ``exact`` = every layer on the exact path without heads,
``staged`` = the model directory's heads and routing, ``staged-replace`` = its heads with
routing replace; ``exact-micro`` and ``staged-micro``: the same under a two-rank pipeline with
``pipeline_micro_batches=2``, whose decode steps count each half's pass) one engine is opened
(``max_batch`` = the largest batch) and warmed up with one generation; then, for each batch
size B, ``--repeats`` times: B greedy generations of ``--tokens`` tokens, started together
through the async API (each its own prompt), timed from the first submission to the last token.
Reported per (arm, B): the median aggregate tok/s (every row's tokens over the wall time) and
its ratio to B = 1, time to first token (median over the rows of the median run), decode
forward passes, and the expert bytes read per generated token, the staged slots' peak bytes and
the staged layer-steps run exact because a union did not fit (``Engine.metrics()``). Prints a
markdown table; ``--json`` writes the raw runs too.

Under ``mlx.launch`` (``mlx.launch -n 2 --backend ring .venv/bin/python tools/batch_bench.py
...``) every rank runs the same generations in the same order, as a pipeline needs; the
engine splits the layers over the ranks, and rank 0 alone prints and writes (its expert
bytes and slots are its own layers'). "ms / step" is the run's wall time over its decode
steps (the rows' prefill included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge0 import Engine, EngineConfig  # noqa: E402

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def", "for i in range(10):",
           "def parse_args(argv):\n", "with open(path) as f:\n", "    return self._value\n", "try:\n    import json\n"]

ARMS = {
    "exact": dict(prerouter="off"),
    "staged": dict(),
    "staged-replace": dict(routing="replace"),
    "staged-fixed": dict(slot_budget_mb=0),  # the slots never grow: a union over them runs exact
    "staged-replace-fixed": dict(routing="replace", slot_budget_mb=0),
    # under a two-rank pipeline: the batch in two micro-batches that take turns (one process: as exact/staged)
    "exact-micro": dict(prerouter="off", pipeline_micro_batches=2),
    "staged-micro": dict(pipeline_micro_batches=2),
}


async def run_batch(engine: Engine, b: int, tokens: int) -> dict:
    m0 = engine.metrics()
    t0 = time.perf_counter()
    firsts: list[float] = []
    slot_bytes = [m0.slot_bytes]

    async def one(i: int) -> int:
        n, first = 0, None
        async for ev in engine.generate(PROMPTS[i % len(PROMPTS)] * (1 + i // len(PROMPTS)), max_tokens=tokens,
                                        temp=0.0):
            if first is None:
                first = time.perf_counter() - t0
            n += 1
            slot_bytes.append(engine.metrics().slot_bytes)
        firsts.append(first)
        return n

    counts = await asyncio.gather(*(one(i) for i in range(b)))
    wall = time.perf_counter() - t0
    m1 = engine.metrics()
    made = m1.decode_tokens - m0.decode_tokens
    return {"rows": b, "tokens": sum(counts), "wall_s": wall, "tok_s": sum(counts) / wall,
            "ttft_median_s": statistics.median(firsts), "ttft_max_s": max(firsts),
            "steps": m1.decode_steps - m0.decode_steps,
            "bytes_per_token": (m1.decode_expert_bytes - m0.decode_expert_bytes) / made if made else 0.0,
            "peak_slot_bytes": max(slot_bytes), "over_slot_layers": m1.over_slot_layers - m0.over_slot_layers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "src" / "edge0" / "data" / "demo_model"))
    p.add_argument("--arms", default="exact,staged")
    p.add_argument("--batch", default="1,4,16")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--heads", default=None, help="the staged arms' heads file (made as warm-start heads, "
                   "edge0.train.heads.make_warm_heads, when it does not exist); default: the model directory's")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.heads and not Path(args.heads).exists():
        from edge0.train.heads import make_warm_heads
        make_warm_heads(args.model, args.heads)
    sizes = [int(x) for x in args.batch.split(",")]
    arms = args.arms.split(",")
    for arm in arms:
        if arm not in ARMS:
            p.error(f"unknown arm {arm!r}; arms: {', '.join(ARMS)}")
    results: dict = {}
    from edge0.backend import dist

    group = dist.group()
    if group is not None and group.rank() != 0:  # a pipeline's other ranks: the same work, nothing printed
        global print
        print = lambda *a, **k: None  # noqa: E731
        args.json = None
    for arm in arms:
        heads = {"prerouter_file": args.heads} if args.heads and arm != "exact" else {}
        config = EngineConfig(**ARMS[arm], **heads, max_batch=max(sizes))
        with Engine(args.model, config) as engine:
            asyncio.run(run_batch(engine, 1, 8))  # warm-up
            for b in sizes:
                runs = [asyncio.run(run_batch(engine, b, args.tokens)) for _ in range(args.repeats)]
                results[f"{arm}/{b}"] = runs
                med = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
                if group is None or group.rank() == 0:
                    print(f"[batch_bench] {arm} B={b}: {med['tok_s']:.2f} tok/s", file=sys.stderr, flush=True)
    ranks = f", pipeline of {group.size()} ranks" if group is not None else ""
    print(f"model: {Path(args.model).name}, {args.tokens} greedy tokens per row, median of {args.repeats}{ranks}\n")
    print("| arm | rows | aggregate tok/s | vs 1 row | TTFT median s | TTFT max s | decode steps | ms / step | "
          "expert bytes / token | peak slot MiB | layer-steps over slots |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for arm in arms:
        base = None
        for b in sizes:
            runs = results[f"{arm}/{b}"]
            med = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
            base = base or med["tok_s"]
            print(f"| {arm} | {b} | {med['tok_s']:.2f} | {med['tok_s'] / base:.2f}x | {med['ttft_median_s']:.3f} | "
                  f"{med['ttft_max_s']:.3f} | {med['steps']} | {1000 * med['wall_s'] / med['steps']:.1f} | "
                  f"{med['bytes_per_token']:,.0f} | "
                  f"{med['peak_slot_bytes'] / 2**20:.1f} | {med['over_slot_layers']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": Path(args.model).name, "tokens": args.tokens, "runs": results},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
