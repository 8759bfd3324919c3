"""Decode speed with prompt lookup's drafts against without, on one engine each, the two
alternated round by round (medians over rounds): text that repeats what it holds (unit
tests of one shape, lines the model repeats), and free generation (a sampled continuation
of prose); and the expert bytes each read a token (decode). Prints a Markdown table and,
with --out, writes the figures as JSON. The engines' settings are the defaults (on the demo:
its heads, select routing, its adapter) but for the flags given.

    python tools/prompt_lookup_bench.py [--model DIR] [--rounds 9] [--max-tokens 128] [--lookup 4]
        [--prerouter auto] [--expert-source auto] [--slot-budget-mb MB] [--together] [--case free]
        [--ngram 3] [--same-engine] [--out FILE]

``--draft-model DIR`` (with ``--num-draft-tokens N``): the drafting engine drafts with that
model instead of by prompt lookup. ``--together``: the three texts at once, sharing the
batch's steps (the repeating ones drafting, the free one without drafts: its request's
prompt_lookup 0), each engine's tokens a second over the three (their prefills included).
``--same-engine``: one engine, opened with the drafting settings, runs both arms, the one
without drafts by its requests' ``prompt_lookup`` 0 (``num_draft_tokens`` 0 with a draft
model): the arms share their weights' memory, slots and caches, so what differs between
them is the drafts alone. Every mode also reports each round's ratio (the two arms back to
back): its median and quartiles, its mean and that mean's 95% interval.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from edge0 import Engine, EngineConfig

TESTS = "".join(f"def test_{name}():\n    assert parse({value!r}) == {value!r}\n\n"
                for name, value in (("int", "1"), ("float", "1.5"), ("list", "[1, 2]"), ("dict", "{}")))
CASES = {
    "repeating: unit tests of one shape": (TESTS + "def test_str():\n", {}),
    "repeating: lines": ("import os\nimport sys\nimport os\nimport sys\nimport os\n", {}),
    "free: prose, sampled": ("The history of the city begins with", {"temp": 0.8, "seed": 7}),
}


OFF = {"prompt_lookup": 0, "num_draft_tokens": 0}  # a request's fields: no drafts


def run(engine: Engine, prompt: str, max_tokens: int, sampling: dict) -> tuple[list[int], float, object]:
    first, events = None, []
    for ev in engine.stream(prompt, max_tokens=max_tokens, **sampling):
        events.append(ev)
        if first is None:
            first = time.perf_counter()
    # decode: the tokens after the first over the time after it, as the stats line counts
    return [e.token for e in events], (len(events) - 1) / (time.perf_counter() - first), events[-1].stats


def together(engine: Engine, max_tokens: int, fields: dict) -> tuple[list[list[int]], float, list]:
    """The three texts at once on ``engine``, each request with ``fields`` too: their tokens,
    the tokens a second over all three, and their stats (the free text, the sampled one, never
    drafts)."""
    async def one(prompt: str, sampling: dict):
        extra = OFF if sampling else fields
        t0 = time.perf_counter()
        events = [ev async for ev in engine.generate(prompt, max_tokens=max_tokens, **sampling, **extra)]
        events[-1].stats.seconds = time.perf_counter() - t0
        return [e.token for e in events], events[-1].stats

    async def run_all():
        return await asyncio.gather(*(one(p, s) for p, s in CASES.values()))

    t0 = time.perf_counter()
    out = asyncio.run(run_all())
    wall = time.perf_counter() - t0
    return [t for t, _ in out], sum(len(t) for t, _ in out) / wall, [s for _, s in out]


def _order(arms: dict, r: int) -> list:
    """The arms' names in round ``r``: alternated, so neither always runs first."""
    return list(arms) if r % 2 == 0 else list(arms)[::-1]


def _paired(rates: dict) -> dict:
    """Each round's ratio of the drafting arm's rate to the other's (the two back to back, so
    the machine's drift between rounds moves both): their median, quartiles, mean and the
    mean's 95% interval (normal, over rounds), and the rates round by round."""
    ratios = [b / a for a, b in zip(rates["off"], rates["lookup"])]
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    mean = statistics.fmean(ratios)
    half = 1.96 * statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0
    return {"paired_ratio": statistics.median(ratios), "paired_q1": q[0], "paired_q3": q[2],
            "paired_mean": mean, "paired_mean_ci95": [mean - half, mean + half], "rates": rates}


def _together(arms: dict, args) -> dict:
    """The three texts at once on each arm (its engine, its requests' extra fields),
    alternated round by round: a row of the table (tokens a second over the three; the
    drafts' counts over the repeating ones)."""
    for engine, extra in arms.values():  # warm-up
        together(engine, 8, extra)
    tps, tokens, read, stats = {k: [] for k in arms}, {}, {k: [] for k in arms}, None
    seconds = {k: [] for k in arms}  # each text's time to its last token
    for r in range(args.rounds):
        for name in _order(arms, r):
            engine, extra = arms[name]
            toks, rate, s = together(engine, args.max_tokens, extra)
            tps[name].append(rate)
            seconds[name].append([x.seconds for x in s])
            read[name].append(sum(x.decode_expert_bytes for x in s) / max(1, sum(x.generated_tokens for x in s)))
            tokens[name] = toks
            if name == "lookup":
                stats = s
    off, on = statistics.median(tps["off"]), statistics.median(tps["lookup"])
    total = lambda field: sum(getattr(x, field) for x in stats)  # noqa: E731
    return {"case": "all three at once (the free one without drafts)", "off_tps": off, "lookup_tps": on,
            "speedup": on / off, **_paired(tps), "same_tokens": tokens["off"] == tokens["lookup"],
            "off_bytes_per_token": statistics.median(read["off"]),
            "lookup_bytes_per_token": statistics.median(read["lookup"]),
            "verify_passes": total("verify_passes"), "draft_tokens": total("draft_tokens"),
            "accepted_tokens": total("accepted_tokens"), "generated_tokens": total("generated_tokens"),
            "seconds": {name: [statistics.median(v[i] for v in times) for i in range(len(CASES))]
                        for name, times in seconds.items()}}


def _case(arms: dict, case: str, args) -> dict:
    """One text on each arm, alternated round by round: a row of the table."""
    prompt, sampling = CASES[case]
    for engine, extra in arms.values():  # warm-up
        run(engine, prompt, 8, {**sampling, **extra})
    tps, read = {k: [] for k in arms}, {k: [] for k in arms}  # read: decode's expert bytes a token
    tokens, stats = {}, {}
    for r in range(args.rounds):
        for name in _order(arms, r):
            engine, extra = arms[name]
            toks, rate, stats[name] = run(engine, prompt, args.max_tokens, {**sampling, **extra})
            tps[name].append(rate)
            read[name].append(stats[name].decode_expert_bytes / max(1, stats[name].generated_tokens))
            tokens[name] = toks
    off, on = statistics.median(tps["off"]), statistics.median(tps["lookup"])
    return {"case": case, "off_tps": off, "lookup_tps": on, "speedup": on / off, **_paired(tps),
            "same_tokens": tokens["off"] == tokens["lookup"],
            "off_bytes_per_token": statistics.median(read["off"]),
            "lookup_bytes_per_token": statistics.median(read["lookup"]),
            "verify_passes": stats["lookup"].verify_passes, "draft_tokens": stats["lookup"].draft_tokens,
            "accepted_tokens": stats["lookup"].accepted_tokens, "generated_tokens": stats["lookup"].generated_tokens,
            "off_verify_passes": stats["off"].verify_passes}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "none read"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lookup", type=int, default=4,
                    help="prompt_lookup: the most tokens a step drafts (0: none, two engines alike, a control)")
    ap.add_argument("--ngram", type=int, default=3, help="the drafting engine's prompt_lookup_ngram")
    ap.add_argument("--prerouter", default="auto", help="the engines' prerouter setting")
    ap.add_argument("--expert-source", default="auto", help="the engines' expert_source (slots: the reads counted)")
    ap.add_argument("--slot-budget-mb", type=int, default=None, help="the engines' slot_budget_mb (0: slots never grow)")
    ap.add_argument("--draft-model", default=None, help="draft with this model instead of by prompt lookup")
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--together", action="store_true", help="the three texts at once, sharing steps")
    ap.add_argument("--same-engine", action="store_true",
                    help="one engine runs both arms, the one without drafts by its requests' fields")
    ap.add_argument("--case", default=None, help="only the texts whose name starts with this (repeating, free)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.model is None:
        from edge0.cli_args import PACKAGED_DEMO

        args.model = str(PACKAGED_DEMO)
    base = dict(prerouter=args.prerouter, expert_source=args.expert_source, slot_budget_mb=args.slot_budget_mb,
                log_level="error")
    drafting = (dict(draft_model=args.draft_model, num_draft_tokens=args.num_draft_tokens) if args.draft_model
                else dict(prompt_lookup=args.lookup, prompt_lookup_ngram=args.ngram))
    drafter = Engine(args.model, EngineConfig(**base, **drafting))
    other = drafter if args.same_engine else Engine(args.model, EngineConfig(**base))
    arms = {"off": (other, OFF if args.same_engine else {}), "lookup": (drafter, {})}
    try:
        rows = [_together(arms, args)] if args.together else [
            _case(arms, case, args) for case in CASES if not args.case or case.startswith(args.case)]
    finally:
        for e in {id(e): e for e, _ in arms.values()}.values():
            e.close()
    how = f"the draft model ({args.num_draft_tokens})" if args.draft_model else f"prompt lookup ({args.lookup})"
    print(f"| text | decode tok/s without | with {how} | speed-up | drafts taken "
          "| tokens a pass | expert MiB a token without / with | same tokens | each round's ratio: median (quartiles); mean [95%] |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        passes = r["generated_tokens"] - 1 - r["accepted_tokens"]
        print(f"| {r['case']} | {r['off_tps']:.1f} | {r['lookup_tps']:.1f} | {r['speedup']:.2f}x | "
              f"{r['accepted_tokens']}/{r['draft_tokens']} | {(r['generated_tokens'] - 1) / max(1, passes):.2f} | "
              f"{_mib(r['off_bytes_per_token'])} / {_mib(r['lookup_bytes_per_token'])} "
              f"({_ratio(r['lookup_bytes_per_token'], r['off_bytes_per_token'])}) | "
              f"{'yes' if r['same_tokens'] else 'NO'} | "
              f"{r['paired_ratio']:.3f}x ({r['paired_q1']:.3f}-{r['paired_q3']:.3f}); "
              f"{r['paired_mean']:.3f}x [{r['paired_mean_ci95'][0]:.3f}-{r['paired_mean_ci95'][1]:.3f}] |")
    for r in rows:
        if "seconds" in r:
            print("each text's seconds to its last token, without / with:", "; ".join(
                f"{case.split(':')[0]} {a:.2f} / {b:.2f}" for case, a, b in zip(CASES, *r["seconds"].values())))
    if args.out:
        with open(args.out, "w") as f:
            named = {"model": Path(args.model).name,
                     "draft_model": Path(args.draft_model).name if args.draft_model else None}
            json.dump({"args": {**vars(args), **named}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
