#!/usr/bin/env python
"""What prefilling short prompts that arrive together in one pass saves.

    python tools/prefill_together.py [--model DIR] [--rows 8] [--prompt-tokens 64]
        [--repeats 5] [--out prefill_together.json]

``--rows`` requests, each a prompt of ``--prompt-tokens`` tokens (distinct windows of the
held-out Python text, so the prompt cache never serves one) asking for one token, arrive
together at an engine (the demo by default): the engine's compute thread is held while
they are submitted, then released. Two arms: ``together`` (Edge0's batch loop: the rows
prefill in one pass) and ``one by one`` (each row's prompt its own pass, as before rows
were grouped). Reported per arm, medians over the repeats: the time until every request
has its token, the mean time to first token, the expert bytes read and the prompt passes.
The arms take turns within a repeat (each on a fresh engine), so a slower minute of the
machine falls on both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def prompts(engine, n: int, length: int, offset: int) -> list[list[int]]:
    from edge0.train.heads import default_texts

    _, held, _ = default_texts()
    ids = [t for text in held for t in engine.tokenizer.encode(text)]
    start = offset * n * length
    return [ids[start + i * length:start + (i + 1) * length] for i in range(n)]


def one_run(model: Path, rows: int, length: int, repeat: int, grouped: bool) -> dict:
    from edge0 import Engine, EngineConfig
    from edge0 import prefill

    group = prefill.group
    if not grouped:
        prefill.group = lambda batcher, budget: []
    try:
        with Engine(model, EngineConfig(max_batch=max(rows, 1))) as engine:
            engine.generate_text("def warm(x):", max_tokens=2, temp=0.0)  # weights and kernels warm
            batch = prompts(engine, rows, length, repeat)
            before, gate = engine.metrics(), threading.Event()
            engine._worker.submit(gate.wait)
            firsts = [0.0] * rows

            def run(i):
                for _ in engine.stream(batch[i], max_tokens=1, temp=0.0):
                    firsts[i] = time.perf_counter()

            threads = [threading.Thread(target=run, args=(i,)) for i in range(rows)]
            for t in threads:
                t.start()
            time.sleep(0.5)  # every request submitted and waiting
            t0 = time.perf_counter()
            gate.set()
            for t in threads:
                t.join()
            after = engine.metrics()
    finally:
        prefill.group = group
    return {"all_s": max(firsts) - t0, "mean_ttft_s": statistics.fmean(f - t0 for f in firsts),
            "expert_mib": (after.expert_bytes - before.expert_bytes) / 2**20,
            "prompt_passes": after.prefill_passes - before.prefill_passes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "src" / "edge0" / "data" / "demo_model")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    arms = {"together": True, "one by one": False}
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    for r in range(args.repeats):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for arm in order:
            runs[arm].append(one_run(args.model, args.rows, args.prompt_tokens, r, arms[arm]))
            print(f"repeat {r + 1} {arm}: {runs[arm][-1]}", file=sys.stderr, flush=True)
    med = {a: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for a, rs in runs.items()}
    ratio = med["one by one"]["all_s"] / med["together"]["all_s"]
    print(f"{args.rows} requests of {args.prompt_tokens} prompt tokens arriving together, medians of {args.repeats}:")
    print("| arm | all first tokens (s) | mean time to first token (s) | expert MiB read | prompt passes |")
    print("|---|---:|---:|---:|---:|")
    for a, m in med.items():
        print(f"| {a} | {m['all_s']:.3f} | {m['mean_ttft_s']:.3f} | {m['expert_mib']:.1f} | {m['prompt_passes']:.0f} |")
    print(f"one by one / together, all first tokens: {ratio:.2f}x")
    if args.out:
        shown = {k: str(v.relative_to(ROOT) if isinstance(v, Path) and v.is_relative_to(ROOT) else v)
                 for k, v in vars(args).items()}  # the repository's own paths as it names them
        args.out.write_text(json.dumps({"args": shown, "runs": runs,
                                        "medians": med, "ratio_all_s": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
