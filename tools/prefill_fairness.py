#!/usr/bin/env python
"""How long a running stream waits while another request's long prompt is prefilled.

    python tools/prefill_fairness.py [--model DIR] [--prompt-tokens 4000]
        [--chunks 2048,1024,512,256] [--repeats 3] [--out prefill_fairness.json]

For each ``prefill_step_size`` (the prompt tokens prefilled between two decode steps of the
batch): an engine (the demo by default) decodes stream A (a short prompt, EOS ruled out so
it keeps going); once A has produced 16 tokens, request B arrives with a prompt of
``--prompt-tokens`` tokens and asks for one token. Reported per setting, medians over the
repeats: A's longest gap between two tokens while B prefills, A's median gap outside it,
and B's time to its first token. Each repeat opens a fresh engine; the settings take turns
within a repeat, so a slower minute of the machine falls on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import anyio


async def one_run(model: Path, chunk: int, prompt_tokens: int) -> dict:
    from edge0 import Engine, EngineConfig

    async with Engine.open(model, EngineConfig(prefill_step_size=chunk, max_batch=4)) as engine:
        eos = sorted(getattr(engine.tokenizer, "eos_token_ids", None) or [engine.tokenizer.eos_token_id])
        vocab = engine.vocab_size
        long_prompt = [(7919 * i) % (vocab - 3) + 3 for i in range(prompt_tokens)]  # deterministic, no EOS
        stamps: list[float] = []
        window: dict[str, float] = {}
        started = anyio.Event()

        async def stream_a():
            async for ev in engine.generate("def f(x):", max_tokens=400, logit_bias={t: -100.0 for t in eos}):
                if ev is None:
                    continue
                stamps.append(time.perf_counter())
                if len(stamps) == 16:
                    started.set()
                if "end" in window and time.perf_counter() > window["end"] + 1.0:
                    break

        async def request_b():
            await started.wait()
            window["start"] = time.perf_counter()
            async for ev in engine.generate(long_prompt, max_tokens=1):
                if ev is not None:
                    window["end"] = time.perf_counter()
                    break

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream_a)
            tg.start_soon(request_b)
    gaps = [(b - a, a, b) for a, b in zip(stamps, stamps[1:])]
    during = [g for g, a, b in gaps if b >= window["start"] and a <= window["end"]]
    outside = [g for g, a, b in gaps if b < window["start"]]
    return {"longest_gap_s": max(during) if during else 0.0,
            "median_gap_outside_s": statistics.median(outside) if outside else 0.0,
            "b_first_token_s": window["end"] - window["start"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the packaged demo)")
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--chunks", default="2048,1024,512,256", help="prefill_step_size values, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the results here (JSON)")
    a = p.parse_args(argv)
    from edge0.cli import PACKAGED_DEMO

    model = Path(a.model) if a.model else PACKAGED_DEMO
    chunks = [int(c) for c in a.chunks.split(",")]
    runs: dict[int, list[dict]] = {c: [] for c in chunks}
    for r in range(a.repeats):
        for c in chunks:
            out = anyio.run(one_run, model, c, a.prompt_tokens)
            runs[c].append(out)
            print(f"repeat {r + 1} prefill_step_size {c}: " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()),
                  file=sys.stderr, flush=True)
    table = {c: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for c, rs in runs.items()}
    print("| prefill_step_size | longest gap of the running stream | its median gap otherwise | "
          "long prompt's first token |")
    print("|---:|---:|---:|---:|")
    for c, row in table.items():
        print(f"| {c} | {row['longest_gap_s'] * 1000:.0f} ms | {row['median_gap_outside_s'] * 1000:.1f} ms | "
              f"{row['b_first_token_s']:.2f} s |")
    if a.out:
        Path(a.out).write_text(json.dumps({"model": str(model.name), "prompt_tokens": a.prompt_tokens,
                                           "repeats": a.repeats, "runs": runs, "medians": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
