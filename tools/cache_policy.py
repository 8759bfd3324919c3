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
  (``edge0.io_sched.expert_cache.ExpertCache``, its admission rule included: a read expert enters
  only if reads asked for it at least as often as for the entry it would replace);
- ``lru-all``, ``lfu-all``: the same policies (their classes) with every read expert copied in;
- ``lfu+next``: LFU with aging, every read expert entering, that never evicts an expert the
  next step routes to (the prerouter's prediction, taken from the trace itself: its best case);
- ``belady``: evict the expert whose next access is farthest away (the optimum, offline).

With ``--more``, variants tried against the shipped policy (none kept):

- ``lfu>``, ``lru>``: the admission rule strict (only what reads asked for more often than
  the victim enters);
- ``lfu-hist``, ``lfu-hist-noage``: LFU counting every read since the start, not since the
  expert entered, with and without aging (the admission rule as shipped);
- ``lfu+next2``: the shipped LFU and rule, never evicting the next two steps' experts;
- ``arc``: ARC (recency and frequency balanced by its ghost lists; every read expert enters);
- ``static``: offline, like Belady's, but knowing only how often each expert is accessed over
  the whole trace, not when: the most accessed experts held from their first access on.
  Under independent accesses no policy that knows only the past does better in the long
  run; what Belady's optimum gains beyond it is the order of the accesses to come.

Printed: one table per trace, the miss rate of each policy and each size, and each policy's
misses against Belady's.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import sys
from collections import Counter, OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge0.exec.forecast import cache_misses, slot_misses  # noqa: E402
from edge0.exec.oracle import OracleRouting  # noqa: E402
from edge0.io_sched.expert_cache import POLICIES  # noqa: E402


def cache_accesses(trace: OracleRouting, slots: int) -> list[list[tuple[int, int]]]:
    """Per decode step, the (layer, expert) pairs that miss their layer's slots (the engine's
    forecast model: ``edge0.exec.forecast.slot_misses``)."""
    return slot_misses(trace.steps, lambda layer: slots)


def replay(steps: list[list[tuple[int, int]]], capacity: int, policy: str, routed=None) -> int:
    """Misses of a cache of ``capacity`` experts under ``policy`` over the access ``steps``;
    ``routed`` (per step, every (layer, expert) the step routes to) for ``lfu+next`` and
    ``lfu+next2``."""
    if policy in VARIANTS:
        return _variant(steps, capacity, routed, **VARIANTS[policy])
    if policy == "arc":
        return _arc(steps, capacity)
    if policy == "belady":
        return _belady(steps, capacity)
    if policy == "static":
        return _static(steps, capacity)
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


def _static(steps: list[list[tuple[int, int]]], capacity: int) -> int:
    """Misses of the ``capacity`` most accessed experts of the whole trace held from their
    first access on (that access is a miss, as every first access is Belady's)."""
    counts = Counter(key for accesses in steps for key in accesses)
    held = {key for key, _ in counts.most_common(capacity)}
    return sum(n for key, n in counts.items() if key not in held) + len(held)


VARIANTS = {"lfu+next": dict(admit=False, ahead=1), "lfu>": dict(strict=True), "lru>": dict(strict=True, recency=True), "lfu-hist": dict(history=True),
            "lfu-hist-noage": dict(history=True, aging=False), "lfu+next2": dict(ahead=2)}


def _variant(steps, capacity: int, routed, strict=False, recency=False, history=False, aging=True, ahead=0,
             admit=True) -> int:
    """LFU with dynamic aging and the admission rule, as the engine's, changed as the flags say
    (``recency``: least recently used instead; ``history``: counts since the start; ``ahead``:
    the next steps' experts never evicted; ``admit`` False: every read expert enters)."""
    uses, count, rank, heap, tick = {}, {}, {}, [], itertools.count()
    age, misses = 0, 0
    for i, accesses in enumerate(steps):
        protect = set().union(*routed[i + 1:i + 1 + ahead]) if ahead and routed else set()
        for key in accesses:
            uses[key] = uses.get(key, 0) + 1
            if key not in count:
                misses += 1
                if not capacity:
                    continue
                if len(count) >= capacity:
                    skipped, victim = [], None
                    while heap:
                        top = heap[0]
                        if rank.get(top[2]) != top[:2]:
                            heapq.heappop(heap)  # stale
                        elif top[2] in protect:
                            skipped.append(heapq.heappop(heap))
                        else:
                            victim = top[2]
                            break
                    for entry in skipped:
                        heapq.heappush(heap, entry)
                    if victim is None or admit and (uses[key] <= uses[victim] if strict else uses[key] < uses[victim]):
                        continue  # not admitted
                    if aging:
                        age = max(age, rank[victim][0])
                    del count[victim], rank[victim]
                count[key] = 0
            count[key] += 1
            freq = uses[key] if history else count[key]
            rank[key] = (0 if recency else (age if aging else 0) + freq, next(tick))
            heapq.heappush(heap, (*rank[key], key))
    return misses


def _arc(steps, capacity: int) -> int:
    """ARC: T1 (seen once lately) and T2 (more), their ghosts B1 and B2 steering the target
    size ``p`` of T1; every missed expert enters."""
    t1, t2, b1, b2 = OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict()
    p, misses = 0.0, 0

    def replace(key) -> None:
        if t1 and ((key in b2 and len(t1) == int(p)) or len(t1) > p):
            b1[t1.popitem(last=False)[0]] = None
        else:
            b2[t2.popitem(last=False)[0]] = None

    for accesses in steps:
        for key in accesses:
            if key in t1:
                del t1[key]
                t2[key] = None
                continue
            if key in t2:
                t2.move_to_end(key)
                continue
            misses += 1
            if not capacity:
                continue
            if key in b1 or key in b2:
                if key in b1:
                    p = min(capacity, p + max(len(b2) / len(b1), 1))
                else:
                    p = max(0.0, p - max(len(b1) / len(b2), 1))
                replace(key)
                (b1 if key in b1 else b2).pop(key)
                t2[key] = None
                continue
            if len(t1) + len(b1) == capacity:
                if len(t1) < capacity:
                    b1.popitem(last=False)
                    replace(key)
                else:
                    t1.popitem(last=False)
            elif len(t1) + len(t2) + len(b1) + len(b2) >= capacity:
                if len(t1) + len(t2) + len(b1) + len(b2) == 2 * capacity:
                    b2.popitem(last=False)
                replace(key)
            t1[key] = None
    return misses


POLICY_ORDER = ("lru", "lfu", "lru-all", "lfu-all", "lfu+next", "belady")
MORE = ("lfu>", "lru>", "lfu-hist", "lfu-hist-noage", "lfu+next2", "arc", "static")


def table(path: Path, slots: int | None, sizes: list[float], more: bool = False) -> str:
    order = (*POLICY_ORDER[:-1], *(MORE if more else ()), "belady")
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
             "", "| cache (share of all experts) | " + " | ".join(order) + " | vs Belady |",
             "|---|" + "---:|" * (len(order) + 1)]
    for share in sizes:
        capacity = int(share * len(layers) * experts)
        misses = {p: replay(steps, capacity, p, routed) for p in order}
        rates = " | ".join(f"{misses[p] / max(1, total):.3f}" for p in order)
        best = max(1, misses["belady"])
        vs = ", ".join(f"{p} {misses[p] / best:.2f}x" for p in order[:-1])
        lines.append(f"| {share:.0%} ({capacity} experts) | {rates} | {vs} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path, help="oracle routing files (edge0 record-routing --out)")
    ap.add_argument("--slots", type=int, default=None, help="slots per layer in front of the cache (default 2k)")
    ap.add_argument("--sizes", default="0.1,0.25,0.5", help="cache sizes, as shares of all the traced experts")
    ap.add_argument("--more", action="store_true", help="also the variants tried against the shipped policy")
    args = ap.parse_args(argv)
    sizes = [float(x) for x in args.sizes.split(",")]
    for path in args.traces:
        print(table(path, args.slots, sizes, args.more))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
