"""A staged layer's slot table: what each slot holds (EMPTY, LOADING: being read, READY),
which steps pin it, which slot is the next victim (the least recently used unpinned one).
Plain data, no MLX; the scheduler (``edge0.io_sched.scheduler``) and the hot path use it.
Beside it the scheduler's other plain data: what a step will route to (``StepPlan`` of
``LayerPlan``s) in, a read of one expert into one slot (``ReadRequest``), a layer ready for
compute (``SlotMap``) out."""

from __future__ import annotations

from dataclasses import dataclass


EMPTY, LOADING, READY = "empty", "loading", "ready"


class SlotTable:
    def __init__(self, layer: int, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"layer {layer}: a slot table needs at least one slot, got {num_slots}")
        self.layer = layer
        self.num_slots = num_slots
        self.expert_of: list[int | None] = [None] * num_slots
        self.state: list[str] = [EMPTY] * num_slots
        self.pins: list[set[int]] = [set() for _ in range(num_slots)]
        self.last_used: list[int] = [-1] * num_slots
        self.slot_of: dict[int, int] = {}
        self._clock = 0

    def lookup(self, expert: int) -> int | None:
        slot = self.slot_of.get(expert)
        return slot if slot is not None and self.state[slot] == READY else None

    def _victim(self) -> int | None:
        free = [s for s in range(self.num_slots) if not self.pins[s] and self.state[s] != LOADING]
        if not free:
            return None
        empty = [s for s in free if self.state[s] == EMPTY]
        return empty[0] if empty else min(free, key=lambda s: self.last_used[s])

    def claim(self, expert: int, step: int) -> tuple[int, bool] | None:
        """Pin a slot holding (or about to hold) ``expert`` for ``step``.

        Returns (slot, needs_read), or None when every slot is pinned by other steps."""
        self._clock += 1
        slot = self.slot_of.get(expert)
        if slot is not None and self.state[slot] in (READY, LOADING):
            self.pins[slot].add(step)
            self.last_used[slot] = self._clock
            return slot, False
        slot = self._victim()
        if slot is None:
            return None
        old = self.expert_of[slot]
        if old is not None:
            self.slot_of.pop(old, None)
        self.expert_of[slot] = expert
        self.slot_of[expert] = slot
        self.state[slot] = LOADING
        self.pins[slot] = {step}
        self.last_used[slot] = self._clock
        return slot, True

    def complete(self, slot: int, ok: bool) -> None:
        if ok:
            self.state[slot] = READY
            return
        self.state[slot] = EMPTY
        expert = self.expert_of[slot]
        if expert is not None:
            self.slot_of.pop(expert, None)
        self.expert_of[slot] = None

    def invalidate(self) -> None:
        """Every unpinned slot becomes EMPTY: its bytes may no longer match the file."""
        for slot in range(self.num_slots):
            if not self.pins[slot] and self.state[slot] != LOADING:
                self.complete(slot, False)

    def release(self, step: int) -> None:
        for pins in self.pins:
            pins.discard(step)

    def resize(self, num_slots: int) -> None:
        """Grow to ``num_slots`` (new slots EMPTY) or shrink to it (the experts of the slots
        cut off are forgotten). Only while nothing is pinned or loading: the caller has
        moved the slots' bytes to buffers of the new size."""
        if num_slots < 1 or self.pinned() or self.loading():
            raise ValueError(f"layer {self.layer}: cannot resize to {num_slots} slots with slots pinned or loading")
        for slot in range(num_slots, self.num_slots):
            self.complete(slot, False)
        extra = max(0, num_slots - self.num_slots)
        self.expert_of = self.expert_of[:num_slots] + [None] * extra
        self.state = self.state[:num_slots] + [EMPTY] * extra
        self.pins = self.pins[:num_slots] + [set() for _ in range(extra)]
        self.last_used = self.last_used[:num_slots] + [-1] * extra
        self.num_slots = num_slots

    def pinned(self) -> int:
        return sum(1 for p in self.pins if p)

    def loading(self) -> int:
        return sum(1 for s in self.state if s == LOADING)


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
