"""Replay recorded routing through the expert cache's policies against Belady's optimum.

    python tools/cache_policy.py TRACE.json [TRACE.json ...] [--slots N] [--sizes 0.1,0.25,0.5]

A trace is an oracle routing file (``edge0 record-routing --out TRACE.json``): each decode
step's experts per MoE layer. The replay models the two tiers the engine has: each layer's
slots (``--slots`` per layer, least recently used, the step's experts pinned; default 2k, the
staged default) and, behind them, one expert cache over every layer. An expert a step needs
that its layer's slots hold is no cache access; one they miss is a cache hit or a disk read.
The stream of cache accesses is the same for every policy, so each policy is replayed on it
at each cache size (a fraction of all the experts of the traced layers):

- ``lru``, ``lfu`` (LFU with dynamic aging): the engine's own cache
  (``edge0.io_sched.reader.ExpertCache``, its admission rule included: a read expert enters
  only if reads asked for it at least as often as for the entry it would replace);
- ``lru-all``, ``lfu-all``: the same policies (their classes) with every read expert copied in;
- ``lfu+next``: LFU with aging, every read expert entering, that never evicts an expert the
  next step routes to (the prerouter's prediction, taken from the trace itself: its best case);
- ``belady``: evict the expert whose next access is farthest away (the optimum, offline).

Printed: one table per trace, the miss rate of each policy and each size, and each policy's
misses against Belady's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge0.exec.forecast import cache_misses, slot_misses  # noqa: E402
from edge0.exec.oracle import OracleRouting  # noqa: E402
from edge0.io_sched.reader import POLICIES  # noqa: E402


def cache_accesses(trace: OracleRouting, slots: int) -> list[list[tuple[int, int]]]:
    """Per decode step, the (layer, expert) pairs that miss their layer's slots (the engine's
    forecast model: ``edge0.exec.forecast.slot_misses``)."""
    return slot_misses(trace.steps, lambda layer: slots)


def replay(steps: list[list[tuple[int, int]]], capacity: int, policy: str, routed=None) -> int:
    """Misses of a cache of ``capacity`` experts under ``policy`` over the access ``steps``;
    ``routed`` (per step, every (layer, expert) the step routes to) for ``lfu+next``."""
    if policy == "belady":
        return _belady(steps, capacity)
    if policy == "lfu+next":
        return _lfu_next(steps, capacity, routed)
    if policy.endswith("-all"):
        return _every_read_in(steps, capacity, policy[:-4])
    return sum(len(m) for m in cache_misses(steps, capacity, policy))  # the engine's own cache


def _every_read_in(steps, capacity: int, name: str) -> int:
    """The engine's policy ``name`` (its own class) with every read expert copied in: the
    cache without its admission rule."""
    p, held, misses = POLICIES[name](), set(), 0
    for accesses in steps:
        for key in accesses:
            if key in held:
                p.touch(key)
                continue
            misses += 1
            if not capacity:
                continue
            if len(held) >= capacity:
                victim = p.victim()
                held.discard(victim)
                p.remove(victim)
            held.add(key)
            p.touch(key)
    return misses


def _lfu_next(steps, capacity: int, routed) -> int:
    """LFU with dynamic aging, as the engine's, but never evicting what the next step routes to."""
    count: dict = {}
    rank: dict = {}  # key -> (priority, last use)
    age, tick, misses = 0, 0, 0
    for i, accesses in enumerate(steps):
        protect = routed[i + 1] if i + 1 < len(routed) else set()
        for key in accesses:
            tick += 1
            if key not in count:
                misses += 1
                if capacity == 0:
                    continue
                if len(count) >= capacity:
                    free = [k for k in count if k not in protect]
                    if not free:
                        continue  # everything held is needed next: not kept
                    victim = min(free, key=rank.__getitem__)
                    age = max(age, rank[victim][0])
                    del count[victim], rank[victim]
                count[key] = 0
            count[key] += 1
            rank[key] = (age + count[key], tick)
    return misses


def _belady(steps: list[list[tuple[int, int]]], capacity: int) -> int:
    flat = [key for accesses in steps for key in accesses]
    following: list[float] = [0.0] * len(flat)
    seen: dict = {}
    for i in range(len(flat) - 1, -1, -1):
        following[i] = seen.get(flat[i], float("inf"))
        seen[flat[i]] = i
    held: dict = {}  # key -> index of its next access
    misses = 0
    for i, key in enumerate(flat):
        if key in held:
            held[key] = following[i]
            continue
        misses += 1
        if capacity == 0:
            continue
        if len(held) >= capacity:
            victim = max(held, key=held.__getitem__)
            if held[victim] <= following[i]:
                continue  # the new one is needed later than everything held: keep them
            del held[victim]
        held[key] = following[i]
    return misses


POLICY_ORDER = ("lru", "lfu", "lru-all", "lfu-all", "lfu+next", "belady")


def table(path: Path, slots: int | None, sizes: list[float]) -> str:
    trace = OracleRouting.load(path)
    layers = sorted({l for step in trace.steps for l in step})
    experts = 1 + max(e for step in trace.steps for es in step.values() for e in es)
    k = max(len(es) for es in trace.steps[0].values())
    s = slots or 2 * k
    steps = cache_accesses(trace, s)
    routed = [{(l, e) for l, es in step.items() for e in es} for step in trace.steps]
    total = sum(len(a) for a in steps)
    lines = [f"{path.name}: {len(trace.steps)} decode steps, {len(layers)} MoE layers, at least {experts} experts "
             f"each, {s} slots per layer: {total} cache accesses ({total / max(1, len(trace.steps)):.1f} per step)",
             "", "| cache (share of all experts) | " + " | ".join(POLICY_ORDER) + " | vs Belady |",
             "|---|" + "---:|" * (len(POLICY_ORDER) + 1)]
    for share in sizes:
        capacity = int(share * len(layers) * experts)
        misses = {p: replay(steps, capacity, p, routed) for p in POLICY_ORDER}
        rates = " | ".join(f"{misses[p] / max(1, total):.3f}" for p in POLICY_ORDER)
        best = max(1, misses["belady"])
        vs = ", ".join(f"{p} {misses[p] / best:.2f}x" for p in POLICY_ORDER[:-1])
        lines.append(f"| {share:.0%} ({capacity} experts) | {rates} | {vs} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path, help="oracle routing files (edge0 record-routing --out)")
    ap.add_argument("--slots", type=int, default=None, help="slots per layer in front of the cache (default 2k)")
    ap.add_argument("--sizes", default="0.1,0.25,0.5", help="cache sizes, as shares of all the traced experts")
    args = ap.parse_args(argv)
    sizes = [float(x) for x in args.sizes.split(",")]
    for path in args.traces:
        print(table(path, args.slots, sizes))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
