"""Where a decode step's time goes, in one process: mlx-lm's model on Edge0's kernels
(``resident@edge0``) and Edge0's staged step with its prerouter, with reads on and off.

Each step is timed in three parts on the thread that runs it: the plan (the Stager's
``begin_step``: the heads' flush, its one host read, the call into the scheduler), building
the forward pass's graph, and evaluating it (the sampled token's read: the graph runs, and
waits inside for the slots). The flush is timed apart inside the plan. Medians over the
steps after a warm-up. The checkpoint: the bench's 35B-shaped one (``edge0 bench`` writes
it; ``--layers`` as the bench's), warm-start heads written beside the results on first use.

    python tools/step_breakdown.py [--layers 12] [--steps 40] [--out step-breakdown.json]
        [--flushes numpy,mlx] [--no-resident]

Under a memory cap (the 40-layer checkpoint under 8 GiB), run it inside a memory cgroup
with ``--no-resident`` (mlx-lm's model holds every expert) and one ``--flushes`` and
``--reads`` a process, a fresh cgroup each (an engine plans by what its cgroup holds): the
staged step then reads into slots with direct reads through the expert cache, as
``edge0 bench --memory-limit``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _steps(step, n: int, warm: int) -> dict:
    parts: dict[str, list[float]] = {}
    for i in range(n + warm):
        got = step()
        if i >= warm:
            for k, v in got.items():
                parts.setdefault(k, []).append(1e3 * v)
    return {k: round(statistics.median(v), 2) for k, v in parts.items()}


def resident(model_dir: Path, n: int, warm: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from edge0.benchmark.arms import ARMS

    arm = "resident@edge0"
    loaded = ARMS["resident"](str(model_dir), {"compute_dtype": "float32", "arm": arm,
                                               "arm_options": {arm: {"kernels": "edge0"}}})
    model, cache, tok = loaded.model, None, [7]
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(5, 37))]), cache=cache))

    def step():
        t0 = time.perf_counter()
        logits = model(mx.array([[tok[0]]]), cache=cache)
        t1 = time.perf_counter()
        tok[0] = int(mx.argmax(logits[0, -1]).item()) % 500
        return {"build": t1 - t0, "eval": time.perf_counter() - t1, "step": time.perf_counter() - t0}

    return _steps(step, n, warm)


class _NoReads:
    def read(self, layer, expert, slot):
        return 0


def staged(model_dir: Path, heads: Path, n: int, warm: int, reads: bool, flush: str) -> dict:
    import mlx.core as mx

    from edge0.backend import nn as bnn
    from edge0.config import EngineConfig
    from edge0.loader import load_streaming_model
    from edge0.prerouter.runtime import Observing
    from edge0.streaming import StepModel

    s = load_streaming_model(model_dir, EngineConfig(prerouter="on", prerouter_file=str(heads), adapter="off",
                                                     compute_dtype="float32", prerouter_flush=flush))
    stager = s.stager
    stager.reset()
    if not reads and stager.pool is None:  # over the mapping nothing is read: reads off is reads on
        s.close()
        return {}
    if not reads:
        stager.scheduler.store = _NoReads()
        stager.check_routing = False  # unread slots give other activations, hence other routing
    flush_s = []
    planner_flush = stager.planner.flush

    def timed_flush(*args):
        t = time.perf_counter()
        try:
            return planner_flush(*args)
        finally:
            flush_s.append(time.perf_counter() - t)

    stager.planner.flush = timed_flush
    model = StepModel(s)
    cache = bnn.make_cache(model)
    mx.eval(model(mx.array([list(range(5, 37))]), cache=cache))
    tok = [7]

    def step():
        flush_s.clear()
        t0 = time.perf_counter()
        inputs = mx.array([[tok[0]]])
        heads = Observing(model.observed)  # what the heads observed of the sequence: it plans the step
        model.plan(inputs, True, heads)
        t1 = time.perf_counter()
        logits = model.forward(inputs, cache=cache, decode=True, heads=heads)
        t2 = time.perf_counter()
        tok[0] = int(mx.argmax(logits[0, -1]).item()) % 500
        t3 = time.perf_counter()
        model.observed = heads.after()
        flushed = sum(flush_s)
        return {"flush": flushed, "plan_rest": t1 - t0 - flushed, "build": t2 - t1, "eval": t3 - t2, "step": t3 - t0}

    try:
        out = _steps(step, n, warm)
        stats = stager.stats()
        out["waited_ms_per_step"] = round(1e3 * stats.stall_seconds / max(stats.steps_run, 1), 2)
        return out
    finally:
        s.close()


def main() -> None:
    from edge0.benchmark.command import default_bench_model
    from edge0.train.heads import make_warm_heads

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--out", default="step-breakdown.json")
    p.add_argument("--flushes", default="numpy,mlx", help="the heads' flushes to time the staged step with")
    p.add_argument("--no-resident", action="store_true", help="leave out resident@edge0")
    p.add_argument("--reads", choices=("on", "off", "both"), default="both",
                   help="the staged step with its reads, without them (compute only), or both")
    args = p.parse_args()
    model_dir = default_bench_model(args.layers)
    heads = Path(args.out).with_suffix(".heads.safetensors")
    if not heads.exists():
        make_warm_heads(model_dir, heads)
    result = {"model": model_dir.name, "steps": args.steps, "warmup": args.warmup, "ms": {}}
    if not args.no_resident:
        result["ms"]["resident@edge0"] = resident(model_dir, args.steps, args.warmup)
    for flush in args.flushes.split(","):
        for reads in {"on": (True,), "off": (False,), "both": (True, False)}[args.reads]:
            name = f"staged+prerouter ({flush} flush, reads {'on' if reads else 'off'})"
            parts = staged(model_dir, heads, args.steps, args.warmup, reads, flush)
            if parts:
                result["ms"][name] = parts
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, parts in result["ms"].items():
        print(f"{name:48s} " + "  ".join(f"{k} {v}" for k, v in parts.items()))


if __name__ == "__main__":
    main()
