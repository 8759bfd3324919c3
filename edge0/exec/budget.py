"""How much memory the expert buffers take: the staged slots at open and how far they may
grow, the ``memory_budget_mb`` check made before any buffer is allocated, and the resident
weights' check against the memory the process may use."""

from __future__ import annotations

from edge0.config import EngineConfig
from edge0.errors import CheckpointError, ConfigError
from edge0.io_sched.direct import memory_limit


def staged_slots(config: EngineConfig, spec, staged_width: int) -> int:
    """Slots per staged layer: ``slots_per_layer``, or 2 x the experts a step stages (at most
    the layer's experts, never fewer than a step stages)."""
    if config.slots_per_layer:
        return config.slots_per_layer
    return max(min(2 * staged_width, spec.num_experts), staged_width)


SLOT_GROWTH = 4  # slot_budget_mb None: the staged slots may grow to this many times their memory at open


def slot_ceiling(config: EngineConfig, index, staged: list[int], slots: int, others: int) -> int:
    """The most slots a staged layer may grow to: an equal share of ``slot_budget_mb`` (None:
    ``SLOT_GROWTH`` x the slots at open, within a quarter of the memory the process may use
    less the ``others`` expert buffers' bytes), never past ``memory_budget_mb`` less those
    bytes when that is set, never fewer than ``slots``."""
    if not staged:
        return slots
    per_expert = max(index.layers[l].expert_bytes for l in staged)
    if config.slot_budget_mb is not None:
        budget = config.slot_budget_mb * 2**20
    else:  # and never more than a quarter of the memory the process may use
        budget = min(SLOT_GROWTH * len(staged) * slots * per_expert, memory_limit() // 4 - others)
    if config.memory_budget_mb is not None:
        budget = min(budget, config.memory_budget_mb * 2**20 - others)
    return max(slots, budget // (len(staged) * per_expert))


def check_budget(spec, index, config: EngineConfig, staged, hot, whole, slots: int) -> int:
    """Refuse (ConfigError) expert buffers over ``memory_budget_mb``; return the bytes of the
    buffers other than the staged slots."""
    per_expert = max(le.expert_bytes for le in index.layers.values())
    parts = {"exact bundle": config.bundle_capacity * per_expert}
    if staged:
        parts["staged slots"] = len(staged) * max(slots, spec.k) * per_expert
    if hot:
        parts["hot sets"] = len(hot) * max(config.hot_experts, spec.k) * per_expert
    if whole:
        parts["whole-layer buffers"] = 2 * spec.num_experts * per_expert
    total = sum(parts.values())
    if config.memory_budget_mb is not None and total > config.memory_budget_mb * 2**20:
        detail = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in parts.items())
        raise ConfigError(f"expert buffers need {total / 2**20:.1f} MiB ({detail}), over memory_budget_mb="
                          f"{config.memory_budget_mb}")
    return total - parts.get("staged slots", 0)


def resident_bytes(index, spec, pipe) -> int:
    """The bytes of every tensor the headers declare but the routed experts (a pipeline rank:
    its own)."""
    return sum(e.nbytes for h in index.headers for name, e in h.tensors.items()
               if not spec.is_expert_key(name) and (pipe is None or not pipe.remote_key(name)))


def check_resident(model_dir, index, spec, pipe, buffers: int) -> None:
    """The resident weights the headers declare, with the expert buffers, within the memory
    this process may use: checked before one byte is read (a sparse file can declare
    gigabytes it does not hold)."""
    resident = resident_bytes(index, spec, pipe)
    limit = memory_limit()
    if resident + buffers > limit:
        raise CheckpointError(f"the resident weights (every tensor but the routed experts) declare "
                              f"{resident / 2**30:.2f} GiB and the expert buffers need {buffers / 2**30:.2f} GiB: "
                              f"more than the {limit / 2**30:.2f} GiB this process may use (physical memory, "
                              "cgroup and rlimits)", file=model_dir)


CACHE_MARGIN = 2 * 2**30  # at least this much is left beside an automatic expert cache
CACHE_MIN_SHARE = 0.10  # an automatic cache smaller than this share of the experts is none


def cache_budget(config: EngineConfig, index, spec, pipe, layers: list[int], buffers: int) -> int:
    """The expert cache's bytes: ``cache_mb``, or (None, auto) the memory the process may use
    less the resident weights, the expert ``buffers`` at their ceiling and a margin for KV
    caches, activations and the batch's growth (a quarter of that memory, at least
    ``CACHE_MARGIN``); never more than the experts of ``layers`` (this process's), and none
    when that is less than ``CACHE_MIN_SHARE`` of them (on the 40-layer bench checkpoint a
    cache of 4% of its experts decoded at 0.98x no cache, 13% at 1.15x, 21% at 1.31x)."""
    if config.cache_mb is not None:
        return config.cache_mb * 2**20
    limit = memory_limit()
    free = limit - resident_bytes(index, spec, pipe) - buffers - max(limit // 4, CACHE_MARGIN)
    held = sum(index.layers[l].expert_bytes * spec.num_experts for l in layers)
    budget = min(free, held)
    return budget if budget >= CACHE_MIN_SHARE * held else 0
