"""What a verify pass of speculative decoding costs against K, the tokens it checks: the
forward pass over a step's token and K drafted ones (as ``Decoder.verify`` runs it: the
decode step's path over K+1 positions, its extra positions trimmed off the cache after;
beside it the same positions as a prompt chunk), against a decode step (K = 0), on one
checkpoint, in one process (under ``--memory-limit``: a memory cgroup, root). Per K: the
median time of a pass, the expert bytes it read from the checkpoint and those the expert
cache served, and the pass's time over the step's. The drafts are random tokens: what a pass
costs does not depend on what it takes.

``--heads``: the staged path routed by prerouter heads (untrained ones, made for the run: each
its next router on its own hidden state, as the bench's staged arm uses), the pass as
``Decoder.verify`` runs it with heads (each drafted position routed inside the pass, each
staged layer staging its positions' union in its slots), the step as a decode step plans
and reads it; without, every layer exact on its own gate.

    python tools/verify_cost.py --model DIR [--heads [--heads-from-model]] [--expert-source slots]
        [--slot-budget-mb MB] [--memory-limit 8G] [--ks 1,2,4,8] [--passes 12] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from edge0.benchmark.cgroup import MemoryCap, parse_size  # noqa: E402


def verify_pass(s, model, cache, tokens: list[int]):
    """A verify pass with heads, as ``Decoder.verify`` runs it: the first position routed by
    the heads' flush of what they observed, the drafted ones inside the pass."""
    from edge0.backend import core as B
    from edge0.exec.plan import DraftedRouting

    planner, before = s.stager.planner, model.observed
    first = planner.flush(B.array([tokens[:1]], dtype=B.int32), before)
    s.stager.begin_verify()
    routing = DraftedRouting(planner, before, tokens, first)
    out = model.forward(B.array([tokens]), cache=cache, decode=True, heads=routing, routes=routing.routes)
    B.eval(out)
    model.observed = routing.taken(1)  # as a pass that took no draft


def measure(model_dir: str, ks: list[int], passes: int, prompt_tokens: int, seed: int,
            heads_file: str | None = None, settings: dict | None = None) -> dict:
    from edge0.backend import core as B
    from edge0.backend import nn as bnn
    from edge0.config import EngineConfig
    from edge0.loader import load_streaming_model
    from edge0.streaming import StepModel

    heads = dict(prerouter="on", prerouter_file=heads_file) if heads_file else dict(prerouter="off")
    config = EngineConfig(**heads, **(settings or {}))
    s = load_streaming_model(model_dir, config)
    try:
        model, rng = StepModel(s), random.Random(seed)
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        vocab = raw.get("vocab_size") or raw["text_config"]["vocab_size"]
        cache = bnn.make_cache(model)
        B.eval(model(B.array([[rng.randrange(vocab) for _ in range(prompt_tokens)]]), cache=cache, decode=False))
        stats, out = s.reader.stats, {}
        for k in [0] + ks:
            # "step": the decode step's path over the K+1 positions (what Decoder.verify runs); "prompt":
            # the same positions as a prompt chunk, passes of the two alternated
            modes = ("step", "prompt") if k and not heads_file else ("step",)
            times, read, served = ({m: [] for m in modes} for _ in range(3))
            for i in range(passes + 2):  # the first two: warm-up (a new shape)
                for mode in modes:
                    tokens = [rng.randrange(vocab) for _ in range(k + 1)]
                    b0, c0 = stats.bytes, stats.cache_bytes
                    t0 = time.perf_counter()
                    if heads_file and k:
                        verify_pass(s, model, cache, tokens)
                    else:
                        B.eval(model(B.array([tokens]), cache=cache, decode=mode == "step"))
                    took = time.perf_counter() - t0
                    bnn.trim_cache(cache, k)  # as a pass that took no draft: the step's token stays
                    if i >= 2:
                        times[mode].append(took)
                        read[mode].append(stats.bytes - b0)
                        served[mode].append(stats.cache_bytes - c0)
            out[k] = {m: {"ms": 1e3 * statistics.median(times[m]), "read_mib": statistics.mean(read[m]) / 2**20,
                          "cache_mib": statistics.mean(served[m]) / 2**20} for m in modes}
        return out
    finally:
        s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--memory-limit", default=None, help="run capped at this size (a memory cgroup; root)")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--passes", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heads", action="store_true", help="staged, routed by (untrained) prerouter heads")
    ap.add_argument("--heads-from-model", action="store_true",
                    help="with --heads: the model directory's own prerouter.safetensors (trained), not untrained ones")
    ap.add_argument("--expert-source", default="auto", help="the engine's expert_source")
    ap.add_argument("--slot-budget-mb", type=int, default=None, help="the engine's slot_budget_mb (0: never grow)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--heads-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    if args.child:
        settings = dict(expert_source=args.expert_source, slot_budget_mb=args.slot_budget_mb)
        print(json.dumps(measure(args.model, ks, args.passes, args.prompt_tokens, args.seed, args.heads_file,
                                 settings)))
        return
    argv = [sys.executable, __file__, "--child", "--model", args.model, "--ks", args.ks, "--passes",
            str(args.passes), "--prompt-tokens", str(args.prompt_tokens), "--seed", str(args.seed),
            "--expert-source", args.expert_source]
    argv += [] if args.slot_budget_mb is None else ["--slot-budget-mb", str(args.slot_budget_mb)]
    scratch = tempfile.TemporaryDirectory()
    if args.heads and args.heads_from_model:
        argv += ["--heads-file", str(Path(args.model) / "prerouter.safetensors")]
    elif args.heads:
        from edge0.train.heads import make_warm_heads

        argv += ["--heads-file", str(make_warm_heads(args.model, Path(scratch.name) / "prerouter.safetensors"))]
    cap = MemoryCap(parse_size(args.memory_limit), f"edge0-verify-cost-{os.getpid()}") if args.memory_limit else None
    join = cap.prepare() if cap is not None else None
    proc = subprocess.run(argv, capture_output=True, text=True, preexec_fn=join)
    info = cap.finish(proc.returncode) if cap is not None else {}
    if proc.returncode != 0:
        sys.exit(f"the measurement failed ({proc.returncode}): {proc.stderr[-2000:]}")
    figures = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    step = figures[0]["step"]["ms"]
    scratch.cleanup()
    print(f"{Path(args.model).name}{', capped at ' + args.memory_limit if cap else ''}"
          f"{', staged with heads' if args.heads else ''}: median of {args.passes} passes (a verify pass: the "
          "decode step's path over K+1 positions; as a prompt chunk beside it)")
    print("| K | pass ms | over a step | as a prompt chunk, ms | expert MiB read a pass | served by the expert cache |")
    print("|---:|---:|---:|---:|---:|---:|")
    for k, f in sorted(figures.items()):
        prompt = f"{f['prompt']['ms']:.1f}" if "prompt" in f else ""
        print(f"| {k} | {f['step']['ms']:.1f} | {f['step']['ms'] / step:.2f}x | {prompt} | "
              f"{f['step']['read_mib']:.1f} | {f['step']['cache_mib']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": {**vars(args), "model": Path(args.model).name}, "cap": info,
                                              "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
