"""Plain data the scheduler takes and returns. No behaviour, no array library."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LayerPlan:
    """One staged layer's routed experts for one step."""

    layer: int
    experts: tuple[int, ...]  # distinct expert ids, any order


@dataclass(frozen=True)
class StepPlan:
    """What one step will route to, known before the step runs."""

    step: int  # increasing step id; earlier steps have priority
    layers: tuple[LayerPlan, ...]  # in execution order: earlier layers are read first


@dataclass(frozen=True)
class ReadRequest:
    """Read one expert's rows into one slot of one layer."""

    step: int
    layer: int
    expert: int
    slot: int
    priority: tuple  # (step, position of the layer in its plan, expert)


@dataclass(frozen=True)
class SlotMap:
    """A layer ready for compute: every planned expert is in a READY slot."""

    step: int
    layer: int
    slot_of: dict[int, int]  # expert -> slot
    hits: int  # experts already resident (sticky slots), not read again
    misses: int  # experts read for this step


@dataclass
class SchedulerStats:
    reads: int = 0
    bytes: int = 0
    read_seconds: float = 0.0  # summed time inside the store's read calls
    retries: int = 0
    failures: int = 0
    hits: int = 0
    misses: int = 0
    cancelled: int = 0
    per_layer: dict = field(default_factory=dict)  # layer -> {"hits": n, "misses": n}
