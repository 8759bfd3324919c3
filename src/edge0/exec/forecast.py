"""The disk's bytes per token forecast from recorded routing, before anything is loaded.

A trace is an oracle routing file (``edge0 record-routing --out``): each decode step's
experts per MoE layer, and what the prompt's chunks read. The replay models the engine's two
tiers in front of the disk: each staged layer's slots (least recently used, the step's own
experts pinned while it claims; a layer decoding exact has none: its bundle is read again
every step) and, behind them, the expert cache (the engine's own ``ExpertCache`` class, its
admission rule included, one byte an expert). An expert that misses both is read from the
disk. ``tools/cache_policy.py`` replays the same accesses through other policies and
Belady's optimum.
"""

from __future__ import annotations

import itertools

import numpy as np

from edge0.io_sched.expert_cache import ExpertCache

Access = tuple[int, int]  # (layer, expert)


def slot_misses(steps: list[dict[int, tuple[int, ...]]], slots_of) -> list[list[Access]]:
    """Per step, the (layer, expert) pairs its layers' slots miss (``slots_of(layer)``: the
    layer's slots, 0 for none), least recently used first out, the step's experts pinned."""
    tables: dict[int, dict[int, int]] = {}  # layer -> expert -> last step used
    out = []
    for step, layers in enumerate(steps):
        misses = []
        for layer, experts in sorted(layers.items()):
            slots = slots_of(layer)
            if not slots:
                misses.extend((layer, e) for e in experts)
                continue
            table = tables.setdefault(layer, {})
            for e in experts:
                if e not in table:
                    misses.append((layer, e))
                    if len(table) >= max(slots, len(experts)):  # evict the least recent not of this step
                        victim = min((x for x in table if x not in experts), key=table.__getitem__)
                        del table[victim]
                table[e] = step
        out.append(misses)
    return out


class _Rows:
    """Buffers of one-byte experts, as the reader's rows are to the cache."""

    def __init__(self, n: int):
        self.host = np.zeros((n, 1), dtype=np.uint8)


def cache_misses(steps: list[list[Access]], capacity: int, policy: str) -> list[list[Access]]:
    """Per step, the accesses the engine's expert cache of ``capacity`` experts under
    ``policy`` does not hold, asked as the reader asks: a layer's experts of a step in one
    call, then what was read offered to it in one call."""
    if capacity <= 0:
        return [list(a) for a in steps]
    cache = ExpertCache(capacity, policy, 1)
    out = []
    for accesses in steps:
        missed = []
        for layer, group in itertools.groupby(accesses, key=lambda a: a[0]):
            experts = [e for _, e in group]
            rows = [_Rows(len(experts))]
            left, left_rows, _ = cache.serve(layer, experts, list(range(len(experts))), rows)
            missed.extend((layer, e) for e in left)
            if left:
                cache.keep(layer, left, left_rows, rows)
        out.append(missed)
    return out


def forecast(trace, *, staged: set[int], slots: int, capacity: int, policy: str, expert_bytes: dict[int, int],
             scale: float = 1.0) -> dict:
    """Replay ``trace`` (an ``OracleRouting``): its prompt chunks first (the exact path: no
    slots; what they read may enter the cache), then each decode step through the ``staged``
    layers' ``slots`` and the cache of ``capacity`` experts. Returns the mean bytes per step
    read from the disk, those the slots miss (from the cache or the disk), and the (layer,
    expert) pairs the prompt's chunks touch. ``scale``:
    the experts a staged layer reads per step over the trace's (select routing stages more
    than the k the trace routed to)."""
    layers = set(expert_bytes)
    chunks = [{l: e for l, e in c.items() if l in layers} for c in trace.prefill]
    steps = [{l: e for l, e in s.items() if l in layers} for s in trace.steps]
    if not steps:
        return {"steps": 0, "disk_bytes_per_token": None, "expert_bytes_per_token": None, "prompt_experts": 0}
    prompt = slot_misses(chunks, lambda layer: 0)
    decode = slot_misses(steps, lambda layer: slots if layer in staged else 0)
    missed = cache_misses(prompt + decode, capacity, policy)[len(prompt):]

    def weighed(pairs) -> float:
        return sum(expert_bytes[l] * (scale if l in staged else 1.0) for l, _ in pairs)

    prompt_experts = len({(l, e) for c in chunks for l, es in c.items() for e in es})
    return {"steps": len(steps), "prompt_chunks": len(chunks), "prompt_experts": prompt_experts,
            "disk_bytes_per_token": sum(weighed(m) for m in missed) / len(steps),
            "expert_bytes_per_token": sum(weighed(m) for m in decode) / len(steps)}
