"""The memory plan, made before one tensor byte is read: the staged slots at open and how
far they may grow, the ``memory_budget_mb`` check of the expert buffers, the KV budget, the
expert cache (what ``cache_mb`` auto means), where the experts are computed from (slots, or
the checkpoint's mapping where it fits: ``expert_source``) and the check that it all fits in
the memory the process may use. ``Engine.open`` allocates by it and ``edge0 plan`` prints it, so the two
cannot disagree."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from edge0.config import EngineConfig
from edge0.errors import CheckpointError, ConfigError
from edge0.exec.mapped import resolve_source
from edge0.io_sched.direct import cgroup_current, cgroup_limit, memory_limit


def staged_slots(config: EngineConfig, spec, staged_width: int) -> int:
    """Slots per staged layer: ``slots_per_layer``, or 2 x the experts a step stages (at most
    the layer's experts, never fewer than a step stages)."""
    if config.slots_per_layer:
        return config.slots_per_layer
    return max(min(2 * staged_width, spec.num_experts), staged_width)


SLOT_GROWTH = 4  # slot_budget_mb None: the staged slots may grow to this many times their memory at open


def slot_ceiling(config: EngineConfig, index, staged: list[int], slots: int, others: int,
                 limit: int | None = None) -> int:
    """The most slots a staged layer may grow to: an equal share of ``slot_budget_mb`` (None:
    ``SLOT_GROWTH`` x the slots at open, within a quarter of ``limit``, the memory the process
    may use, less the ``others`` expert buffers' bytes), never past ``memory_budget_mb`` less
    those bytes when that is set, never fewer than ``slots``."""
    if not staged:
        return slots
    per_expert = max(index.layers[l].expert_bytes for l in staged)
    if config.slot_budget_mb is not None:
        budget = config.slot_budget_mb * 2**20
    else:  # and never more than a quarter of the memory the process may use
        limit = memory_limit() if limit is None else limit
        budget = min(SLOT_GROWTH * len(staged) * slots * per_expert, limit // 4 - others)
    if config.memory_budget_mb is not None:
        budget = min(budget, config.memory_budget_mb * 2**20 - others)
    return max(slots, budget // (len(staged) * per_expert))


def check_budget(spec, index, config: EngineConfig, staged, hot, whole, slots: int, resident=()) -> int:
    """Refuse (ConfigError) expert buffers over ``memory_budget_mb``; return the bytes of the
    buffers other than the staged slots. ``resident``: hot layers holding every expert."""
    per_expert = max(le.expert_bytes for le in index.layers.values())
    parts = {"exact bundle": config.bundle_capacity * per_expert}
    if staged:
        parts["staged slots"] = len(staged) * max(slots, spec.k) * per_expert
    if set(hot) - set(resident):
        parts["hot sets"] = (len(set(hot) - set(resident)) * min(max(config.hot_experts, spec.k), spec.num_experts)
                             * per_expert)
    if resident:
        parts["resident layers"] = len(resident) * spec.num_experts * per_expert
    if whole:
        parts["whole-layer buffers"] = 2 * spec.num_experts * per_expert
    total = sum(parts.values())
    if config.memory_budget_mb is not None and total > config.memory_budget_mb * 2**20:
        detail = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in parts.items())
        raise ConfigError(f"expert buffers need {total / 2**20:.1f} MiB ({detail}), over memory_budget_mb="
                          f"{config.memory_budget_mb}")
    return total - parts.get("staged slots", 0)


FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4}


def resident_bytes(index, spec, pipe, compute_bytes: int | None = None) -> int:
    """The bytes of every tensor the headers declare but the routed experts (a pipeline rank:
    its own), floating ones in the compute dtype (``compute_bytes`` an element; None: as
    stored) as the model casts them."""
    total = 0
    for h in index.headers:
        for name, e in h.tensors.items():
            if spec.is_expert_key(name) or (pipe is not None and pipe.remote_key(name)):
                continue
            stored = FLOAT_DTYPES.get(e.dtype)
            total += e.nbytes if stored is None or compute_bytes is None else e.nbytes // stored * compute_bytes
    return total


MARGIN_SHARE = 8  # the margin left unplanned: an eighth of the memory the process may use ...
MARGIN_MIN = 2**30  # ... and at least this (activations, MLX's buffer cache, a prompt's chunk)
CACHE_MIN_SHARE = 0.10  # an automatic cache smaller than this share of the experts is none


def process_rss() -> int:
    """The bytes this process holds now (its runtime: the interpreter, MLX, mlx-lm, the
    tokenizer and whatever the application loaded), 0 where the platform does not say."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def held_now(limit: int) -> int:
    """What already counts against ``limit``: this process's resident bytes, or where the
    limit is its cgroup's, what that cgroup holds (the page cache it was charged included)."""
    rss = process_rss()
    if limit == cgroup_limit():
        return max(rss, cgroup_current() or 0)
    return rss


@dataclass(frozen=True)
class MemoryPlan:
    """What a process that opens a checkpoint will hold, decided before one tensor byte is
    read (``edge0 plan`` prints it; ``Engine.open`` allocates by it)."""

    limit: int  # the memory the process may use (physical, cgroup, rlimits) or the one asked for
    runtime: int  # the process's own memory when it plans (measured)
    resident: int  # every tensor but the routed experts
    per_expert: int  # the bytes of one expert (its nine tensors), the largest layer's
    staged: int  # staged layers
    slots: int  # slots per staged layer at open
    ceiling: int  # slots a staged layer may grow to for a batch
    others: int  # the other expert buffers: the exact bundle, hot sets, whole-layer buffers
    heads: int  # the prerouter heads as held (MLX's copy, and NumPy's for a flush on the host)
    held: int  # the experts of the layers this process holds, all of them
    kv_per_token: int  # KV cache bytes one token of one generation takes
    context: int  # tokens per generation the KV budget is for
    batch: int  # generations the KV budget is for
    margin: int  # left unplanned
    cache: int  # the expert cache's bytes (0: none)
    policy: str
    direct: bool  # expert reads bypass the page cache
    kv_note: str = ""  # what the KV estimate leaves out
    source: str = "slots"  # where the experts are computed from: "slots" (read into buffers) or "mapping"
    mapped: int = 0  # with the mapping: the bytes of the checkpoint files it spans (held in the page cache)
    whole_layers: int = 0  # layers held whole in memory (``unpredicted_layers`` resident), in ``others``

    @property
    def slots_bytes(self) -> int:
        return 0 if self.source == "mapping" else self.staged * self.slots * self.per_expert

    @property
    def ceiling_bytes(self) -> int:
        return 0 if self.source == "mapping" else self.staged * self.ceiling * self.per_expert

    @property
    def kv_bytes(self) -> int:
        return self.kv_per_token * self.context * self.batch

    @property
    def at_open(self) -> int:
        """What the process holds once open, before a generation: runtime, resident weights,
        prerouter heads, expert buffers at open and the expert cache."""
        return self.runtime + self.resident + self.heads + self.others + self.slots_bytes + self.cache

    @property
    def planned(self) -> int:
        """The most it is planned to hold: at open, the slots grown to their ceiling and the
        KV budget."""
        return self.at_open - self.slots_bytes + self.ceiling_bytes + self.kv_bytes


def kv_bytes_per_token(model, dtype_bytes: int, kv_bits: int | None, kv_group_size: int) -> tuple[int, str]:
    """(the KV cache's bytes per token of one generation, what the estimate leaves out):
    every attention layer's keys and values in the compute dtype (``kv_bits``: that many bits
    an element with a scale and a bias per group)."""
    from edge0.backend import nn as bnn

    width, unknown = bnn.kv_width(model)
    per_element = dtype_bytes if kv_bits is None else kv_bits / 8 + 2 * dtype_bytes / kv_group_size
    note = f"{len(unknown)} attention modules of another kind not counted ({unknown[0]}, ...)" if unknown else ""
    return int(width * per_element), note


def plan_memory(config: EngineConfig, index, spec, pipe, layers: list[int], on: dict, width: int, *,
                direct: bool, kv_per_token: int, kv_note: str = "", compute_bytes: int | None = None, heads: int = 0,
                limit: int | None = None, runtime: int | None = None, kernels: str = "mlx",
                files_bytes: int = 0) -> MemoryPlan:
    """The plan for the ``layers`` this process holds, ``on`` each path's layers, ``width``
    experts staged per step: the staged slots (``slots_per_layer``, 0: twice the width) and
    their ceiling, the other expert buffers (refused over ``memory_budget_mb``), the KV
    budget (``plan_context`` tokens of ``plan_batch`` generations) and the expert cache:
    ``cache_mb``, or auto (None) with direct reads: ``limit`` less everything else planned
    and the margin (an eighth of ``limit``, at least 1 GiB), less the staged layers' share
    where ``slots_per_layer`` is 0 (their slots take it: ``_slots_as_cache``), at most the
    experts held, none under ``CACHE_MIN_SHARE`` of them (on the 40-layer bench checkpoint a
    cache of 4% of its experts decoded at 0.98x no cache, 13% at 1.15x, 21% at 1.31x); with
    buffered reads none
    (the page cache keeps what was read). ``expert_source`` (with ``kernels``, what the
    engine computes with, and ``files_bytes``, the checkpoint files of the layers held):
    with the mapping no expert buffer is allocated and nothing is cached. Refuses
    (CheckpointError) what cannot fit."""
    limit = memory_limit() if limit is None else limit
    slots = staged_slots(config, spec, width)
    others = check_budget(spec, index, config, on["staged"], on["hot"], on["whole_layer"], slots,
                          on.get("resident", ()))
    per_expert = max(index.layers[l].expert_bytes for l in layers) if layers else 0
    plan = MemoryPlan(limit=limit, runtime=held_now(limit) if runtime is None else runtime,
                      resident=resident_bytes(index, spec, pipe, compute_bytes), per_expert=per_expert, heads=heads,
                      staged=len(on["staged"]),
                      slots=slots, ceiling=max(slots, min(slot_ceiling(config, index, on["staged"], slots, others, limit),
                                                          spec.num_experts)),
                      others=others, held=sum(index.layers[l].expert_bytes * spec.num_experts for l in layers),
                      kv_per_token=kv_per_token, context=config.plan_context, batch=config.plan_batch,
                      margin=max(limit // MARGIN_SHARE, MARGIN_MIN), cache=0, policy=config.cache_policy,
                      direct=direct, kv_note=kv_note, whole_layers=len(on.get("resident", ())))
    if config.cache_mb is None and direct and on["staged"] and not config.slots_per_layer:
        plan = _slots_as_cache(plan, index, spec, on["staged"], layers)
    if config.cache_mb is not None:
        cache = config.cache_mb * 2**20
    elif direct:
        cache = min(limit - plan.planned - plan.margin, plan.held)
        cache = cache if cache >= CACHE_MIN_SHARE * plan.held else 0
    else:
        cache = 0
    plan = replace(plan, cache=cache if cache >= max(per_expert, 1) else 0)
    bare = plan.runtime + plan.resident + plan.heads + plan.kv_bytes + plan.margin  # no expert buffer, no cache
    source = resolve_source(config.expert_source, kernels=kernels, direct=direct, fits=bare + files_bytes <= limit)
    if source == "mapping":
        plan = replace(plan, source=source, mapped=files_bytes, others=0, cache=0)
    check_fits(plan, index.model_dir)
    return plan


def _slots_as_cache(plan: MemoryPlan, index, spec, staged: list[int], layers: list[int]) -> MemoryPlan:
    """Sticky slots are a cache whose hits cost no copy (the expert cache copies each hit into
    a slot, and each read into itself): of what an automatic cache would get, the staged
    layers' share (their experts' of those held) goes to their slots, each layer an equal part
    (the room they had to grow for a batch included), at most its experts; the rest stays the
    cache's. Under the 8 GiB cap on the 40-layer bench checkpoint, 72 slots a layer and no
    cache decoded at 1.14x 16 slots and a 4,300 MiB cache (docs/BENCHMARKS.md)."""
    spare = plan.limit - plan.planned - plan.margin
    if spare < CACHE_MIN_SHARE * plan.held or not plan.per_expert:
        return plan
    share = sum(index.layers[l].expert_bytes for l in staged) / sum(index.layers[l].expert_bytes for l in layers)
    slots = min(plan.ceiling + int(spare * share) // (len(staged) * plan.per_expert), spec.num_experts)
    return replace(plan, slots=max(slots, plan.slots), ceiling=max(slots, plan.ceiling))


def check_fits(plan: MemoryPlan, model_dir) -> None:
    """Refuse (CheckpointError) a plan whose runtime, resident weights, expert buffers at open
    and KV budget are more than the memory the process may use: checked before one byte is
    read (a sparse file can declare gigabytes it does not hold)."""
    need = plan.runtime + plan.resident + plan.heads + plan.others + plan.slots_bytes + plan.kv_bytes
    if need > plan.limit:
        raise CheckpointError(
            f"the resident weights (every tensor but the routed experts) declare {plan.resident / 2**30:.2f} GiB, "
            f"the prerouter heads {plan.heads / 2**30:.2f} GiB, "
            f"the expert buffers need {(plan.others + plan.slots_bytes) / 2**30:.2f} GiB, the KV caches of "
            f"{plan.batch} x {plan.context} tokens {plan.kv_bytes / 2**30:.2f} GiB and the process holds "
            f"{plan.runtime / 2**30:.2f} GiB: more than the {plan.limit / 2**30:.2f} GiB this process may use "
            "(physical memory, cgroup and rlimits; plan_context and plan_batch size the KV budget)", file=model_dir)
