#!/usr/bin/env python
"""Open thousands of hostile model directories and count what happens to each.

    python tools/fuzz_checkpoints.py [--mode mixed|values|adapter|all] [--variants 10000]
        [--workers 2] [--seed 0] [--time-limit 60] [--memory-limit-gb 4] [--out fuzz.json]

Bases: a tiny random int4 checkpoint of each supported family (built once) and the
packaged demo model, each with warm-start prerouter heads beside it (and, for the adapter
mode, a valid adapter in ``adapter/``). Each variant is one base with one mutation:

- ``mixed`` (the default): ``tests/fuzzing.py``: headers, bytes, config values, the shard
  index, heads, tokenizer, file kinds;
- ``values``: ``tests/fuzz_values.py``: one config.json value at any depth (top level,
  ``text_config``, ``rope_parameters``, ``rope_scaling``, ``quantization``, any nested
  object or list) replaced by a value of one kind (huge integers, huge or non-finite
  floats, negatives, zeros, fractions, bools, lists, objects, strings, null, long
  strings); the kinds take turns, so each gets the same number of variants;
- ``adapter``: one hostile change to ``adapter/`` beside the checkpoint (config values of
  every kind, FIFOs, directories, symlink loops, missing files, huge or garbled headers);
- ``all``: the three in turn.

A worker process opens it with ``Engine(dir)``, generates 2 tokens and closes it, under a
time limit and an address-space limit. Outcomes:

- ``typed``: an ``Edge0Error`` (the expected answer to a bad directory);
- ``opened``: it opened and generated (the mutation was harmless, e.g. an unused field);
- ``untyped``: any other exception (a defect);
- ``hang``: no answer within the time limit (the worker is killed and replaced);
- ``crash``: the worker died (a signal);
- ``memory``: past the memory limit (MemoryError, or killed while allocating).

Prints the outcome table (one row per mutation kind: ``value:<kind>``, ``adapter:<case>``)
and, for every non-typed failure, the variant that caused it.
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
MODES = ("mixed", "values", "adapter", "all")


# architectures whose configs nest: a text_config read by another args class, rope objects
# (yarn, dynamic, per layer type), a linear-attention object
NESTED = ("qwen3_vl_moe", "kimi_k25", "mistral3", "llama4", "gemma4", "deepseek_v2", "mistral4", "mellum",
          "kimi_linear", "hunyuan")


def build_bases(workdir: Path, adapters: bool = False, nested: bool = False) -> list[Path]:
    """The tiny checkpoint of each family (and, with ``nested``, of each NESTED
    architecture), then the packaged demo model; prerouter heads beside each that takes
    them, and (``adapters``) a valid adapter in ``adapter/``."""
    from edge0.cli import PACKAGED_DEMO
    from edge0.errors import Edge0Error
    from edge0.tiny import FAMILIES
    from edge0.tiny import make_tiny
    from edge0.train.heads import make_warm_heads

    bases = []
    for family in FAMILIES + (NESTED if nested else ()):
        d = make_tiny(family, workdir / f"base-{family}", seed=0, overwrite=True)
        bases.append(Path(d))
    demo = workdir / "base-demo"
    shutil.copytree(PACKAGED_DEMO, demo)
    bases.append(demo)
    for d in bases:
        try:
            make_warm_heads(d, d / "prerouter.safetensors", width=32)
        except Edge0Error:  # no prerouter for this architecture (gemma4: the layer owns its experts)
            pass
        if adapters:
            from tests.fuzz_values import make_adapter

            make_adapter(d, d / "adapter")
    return bases


class Plan:
    """What variant ``i`` of a campaign over ``bases`` is. In the values and adapter modes
    the kinds (cases) take turns; in the values mode each kind walks its own seeded
    permutation of every (base, slot) pair (``tests/fuzz_values.config_slots``), so that a
    campaign of kinds x pairs variants puts every kind in every slot of every base."""

    def __init__(self, mode: str, bases: list[Path], seed: int):
        import numpy as np

        from tests import fuzz_values as fv

        self.mode, self.bases = mode, bases
        self.pairs = [(b, slot) for b, base in enumerate(bases)
                      for slot in fv.config_slots(json.loads((base / "config.json").read_text()))]
        self.order = [np.random.default_rng([seed, k, 1]).permutation(len(self.pairs)) for k in range(len(fv.KINDS))]

    def make(self, i: int, d: Path, rng, outside: Path) -> tuple[Path, str]:
        """(the base, what was done) of variant ``i``, written to ``d``."""
        from tests import fuzz_values as fv
        from tests.fuzzing import mutate

        mode = self.mode
        if mode == "all":
            mode, i = MODES[i % 3], i // 3
        if mode == "mixed":
            base = self.bases[i % len(self.bases)]
            return base, mutate(base, d, rng, outside)
        if mode == "values":
            k = i % len(fv.KINDS)
            b, slot = self.pairs[self.order[k][(i // len(fv.KINDS)) % len(self.pairs)]]
            base = self.bases[b]
        else:
            case = fv.ADAPTER_CASES[i % len(fv.ADAPTER_CASES)]
            base = self.bases[(i // len(fv.ADAPTER_CASES)) % len(self.bases)]
        fv.copy_with_adapter(base, d, adapter=mode == "adapter")  # an adapter pins config.json's identity too
        heads = d / "prerouter.safetensors"
        if heads.exists() and (mode == "values" or rng.integers(4)):
            heads.unlink()  # heads pin config.json's identity: a changed value would never reach the model
        if mode == "values":
            return base, fv.apply_value(d, slot, fv.KINDS[k], rng)
        return base, fv.mutate_adapter(d, rng, outside, case)


def campaign(variants: int, workers: int, seed: int, time_limit: float, memory_limit: int,
             progress=lambda done, total, counts: None, mode: str = "mixed", first: int = 0) -> dict:
    """Variants ``first`` .. ``first + variants - 1``; variant i is a base mutated with a
    generator seeded by (seed, i) (``Plan``): the campaign is the same whatever the number
    of workers, and a long one can run in chunks (``first``)."""
    import threading

    import numpy as np

    from tests.fuzzing import Worker

    counts: Counter = Counter()
    failures: list[dict] = []
    unnamed: list[dict] = []  # typed errors of a value mutation whose message does not name the key
    fuzzer_errors: list[dict] = []
    by_mutation: dict[str, Counter] = {}
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="edge0-fuzz-") as tmp:
        tmp = Path(tmp)
        bases = build_bases(tmp, adapters=mode in ("adapter", "all"), nested=mode != "mixed")
        plan = Plan(mode, bases, seed)
        outside = tmp / "outside"
        outside.mkdir()
        todo = iter(range(first, first + variants))

        def drive(w: Worker) -> None:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                rng = np.random.default_rng([seed, i])
                d = tmp / f"v{i}"
                try:
                    base, what = plan.make(i, d, rng, outside)
                except Exception as e:  # a defect of the fuzzer, not of Edge0: counted, never silent
                    shutil.rmtree(d, ignore_errors=True)
                    with lock:
                        fuzzer_errors.append({"variant": i, "detail": f"{type(e).__name__}: {e}"})
                    continue
                outcome, detail = w.run(d, time_limit)
                shutil.rmtree(d, ignore_errors=True)
                family = base.name.removeprefix("base-")
                kind = what.split(" ")[0].rstrip(":")
                with lock:
                    counts[outcome] += 1
                    by_mutation.setdefault(kind, Counter())[outcome] += 1
                    case = {"variant": i, "base": family, "mutation": what, "outcome": outcome, "detail": detail}
                    if outcome not in ("typed", "opened"):
                        failures.append(case)
                    elif outcome == "typed" and not names_the_key(what, detail):
                        by_mutation[kind]["unnamed"] += 1
                        unnamed.append(case)
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
    return {"mode": mode, "variants": variants, "first": first, "seed": seed, "pairs": len(plan.pairs),
            "time_limit_s": time_limit,
            "memory_limit_bytes": memory_limit, "outcomes": {k: counts.get(k, 0) for k in OUTCOMES},
            "by_mutation": {k: dict(v) for k, v in sorted(by_mutation.items())},
            "failures": sorted(failures, key=lambda f: f["variant"]),
            "unnamed": sorted(unnamed, key=lambda f: f["variant"]),
            "fuzzer_errors": sorted(fuzzer_errors, key=lambda f: f["variant"])}


def names_the_key(what: str, detail: str) -> bool:
    """Whether the typed error of a ``value:`` mutation (``value:KIND a.b.c = V``) or of an
    adapter config value (``adapter:config_value KIND a.b.c = V``) names the key it changed
    (``c``; a list element's list); other mutations are not judged."""
    if what.startswith("value:"):
        path = what.split(" ", 2)[1].split(".")
    elif what.startswith("adapter:config_value "):
        path = what.split(" ", 3)[2].split(".")
    else:
        return True
    keys = [k for k in path if not k.isdigit()]
    return not keys or keys[-1] in detail


def table(result: dict) -> str:
    """The outcome counts per mutation kind; for the values and adapter modes also the
    typed errors whose message does not name the key changed (``names_the_key``)."""
    mode = result.get("mode", "mixed")
    first = result.get("first", 0)
    span = f"variants {first}..{first + result['variants'] - 1}" if first else f"{result['variants']} variants"
    pairs = f", {result['pairs']} (base, slot) pairs" if mode in ("values", "all") else ""
    cols = OUTCOMES + (("unnamed",) if mode != "mixed" else ())
    lines = [f"{span} (mode {mode}{pairs}, seed {result['seed']}, time limit {result['time_limit_s']:.0f} s, "
             f"memory limit {result['memory_limit_bytes'] / 2**30:.0f} GiB)", "",
             "| mutation | " + " | ".join(OUTCOMES) + (" | typed, key not named |" if mode != "mixed" else " |"),
             "|---|" + "---:|" * len(cols)]
    totals = dict(result["outcomes"], unnamed=len(result.get("unnamed", [])))
    for kind, c in result["by_mutation"].items():
        lines.append(f"| {kind} | " + " | ".join(str(c.get(o, 0)) for o in cols) + " |")
    lines.append("| **all** | " + " | ".join(f"**{totals[o]}**" for o in cols) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES, default="mixed", help="which mutations (see above)")
    p.add_argument("--variants", "--cases", type=int, default=10000)
    p.add_argument("--first", type=int, default=0, help="the first variant (to run a campaign in chunks)")
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

    result = campaign(a.variants, a.workers, a.seed, a.time_limit, int(a.memory_limit_gb * 2**30), progress,
                      a.mode, a.first)
    result["wall_s"] = round(time.time() - t0, 1)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    print(table(result))
    for f in result["failures"][:50]:
        print(f"- variant {f['variant']} ({f['base']}): {f['mutation']} -> {f['outcome']}: {f['detail'][-300:]}")
    for f in result["unnamed"][:20]:
        print(f"- variant {f['variant']} ({f['base']}): {f['mutation']} -> typed, key not named: {f['detail'][:200]}")
    for f in result["fuzzer_errors"][:20]:
        print(f"- variant {f['variant']}: the fuzzer failed to build it: {f['detail'][:200]}")
    bad = sum(result["outcomes"][k] for k in ("untyped", "hang", "crash", "memory")) + len(result["fuzzer_errors"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
