#!/usr/bin/env python
"""Open thousands of hostile model directories and count what happens to each.

    python tools/fuzz_checkpoints.py [--variants 10000] [--workers 2] [--seed 0]
        [--time-limit 60] [--memory-limit-gb 4] [--out fuzz.json]

Bases: a tiny random int4 checkpoint of each supported family (built once) and the
packaged demo model, each with warm-start prerouter heads beside it. Each variant is one
base with one mutation (``tests/fuzzing.py``: headers, bytes, config values, the shard
index, heads, tokenizer, file kinds). A worker process opens it with ``Engine(dir)``,
generates 2 tokens and closes it, under a time limit and an address-space limit. Outcomes:

- ``typed``: an ``Edge0Error`` (the expected answer to a bad directory);
- ``opened``: it opened and generated (the mutation was harmless, e.g. an unused field);
- ``untyped``: any other exception (a defect);
- ``hang``: no answer within the time limit (the worker is killed and replaced);
- ``crash``: the worker died (a signal);
- ``memory``: past the memory limit (MemoryError, or killed while allocating).

Prints the outcome table and, for every non-typed failure, the variant that caused it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUTCOMES = ("typed", "opened", "untyped", "hang", "crash", "memory")


def build_bases(workdir: Path) -> list[Path]:
    from edge0.cli import PACKAGED_DEMO
    from edge0.tiny import FAMILIES
    from edge0.tiny import make_tiny
    from edge0.train.heads import make_warm_heads

    bases = []
    for family in FAMILIES:
        d = make_tiny(family, workdir / f"base-{family}", seed=0, overwrite=True)
        bases.append(Path(d))
    demo = workdir / "base-demo"
    shutil.copytree(PACKAGED_DEMO, demo)
    bases.append(demo)
    for d in bases:
        make_warm_heads(d, d / "prerouter.safetensors", width=32)
    return bases


def campaign(variants: int, workers: int, seed: int, time_limit: float, memory_limit: int,
             progress=lambda done, total, counts: None) -> dict:
    """Variant i is base ``i % bases`` mutated with a generator seeded by (seed, i): the
    campaign is the same whatever the number of workers."""
    import threading

    import numpy as np

    from tests.fuzzing import Worker, mutate

    counts: Counter = Counter()
    failures: list[dict] = []
    by_mutation: dict[str, Counter] = {}
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="edge0-fuzz-") as tmp:
        tmp = Path(tmp)
        bases = build_bases(tmp)
        outside = tmp / "outside"
        outside.mkdir()
        todo = iter(range(variants))

        def drive(w: Worker) -> None:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                rng = np.random.default_rng([seed, i])
                base = bases[i % len(bases)]
                d = tmp / f"v{i}"
                what = mutate(base, d, rng, outside)
                outcome, detail = w.run(d, time_limit)
                shutil.rmtree(d, ignore_errors=True)
                family = base.name.removeprefix("base-")
                kind = what.split(" ")[0].rstrip(":")
                with lock:
                    counts[outcome] += 1
                    by_mutation.setdefault(kind, Counter())[outcome] += 1
                    if outcome not in ("typed", "opened"):
                        failures.append({"variant": i, "base": family, "mutation": what, "outcome": outcome,
                                         "detail": detail})
                    progress(sum(counts.values()), variants, counts)

        pool = [Worker(memory_limit) for _ in range(workers)]
        threads = [threading.Thread(target=drive, args=(w,)) for w in pool]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for w in pool:
                w.close()
    return {"variants": variants, "seed": seed, "time_limit_s": time_limit,
            "memory_limit_bytes": memory_limit, "outcomes": {k: counts.get(k, 0) for k in OUTCOMES},
            "by_mutation": {k: dict(v) for k, v in sorted(by_mutation.items())},
            "failures": sorted(failures, key=lambda f: f["variant"])}


def table(result: dict) -> str:
    lines = [f"{result['variants']} variants (seed {result['seed']}, time limit {result['time_limit_s']:.0f} s, "
             f"memory limit {result['memory_limit_bytes'] / 2**30:.0f} GiB)", "",
             "| mutation | " + " | ".join(OUTCOMES) + " |", "|---|" + "---:|" * len(OUTCOMES)]
    for kind, c in result["by_mutation"].items():
        lines.append(f"| {kind} | " + " | ".join(str(c.get(o, 0)) for o in OUTCOMES) + " |")
    lines.append("| **all** | " + " | ".join(f"**{result['outcomes'][o]}**" for o in OUTCOMES) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", type=int, default=10000)
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per variant before it counts as a hang")
    p.add_argument("--memory-limit-gb", type=float, default=4.0, help="address-space limit of a worker")
    p.add_argument("--out", default=None, help="write the full result (every failure) as JSON")
    a = p.parse_args()
    t0 = time.time()

    def progress(done, total, counts):
        if done % 100 == 0 or done == total:
            print(f"[fuzz] {done}/{total} {dict(counts)} {time.time() - t0:.0f} s", file=sys.stderr, flush=True)

    result = campaign(a.variants, a.workers, a.seed, a.time_limit, int(a.memory_limit_gb * 2**30), progress)
    result["wall_s"] = round(time.time() - t0, 1)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    print(table(result))
    for f in result["failures"][:50]:
        print(f"- variant {f['variant']} ({f['base']}): {f['mutation']} -> {f['outcome']}: {f['detail'][-300:]}")
    bad = sum(result["outcomes"][k] for k in ("untyped", "hang", "crash", "memory"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
