"""The staged path: routing known before the step, experts read ahead into sticky slots.

Each staged layer owns S slots (one row buffer of S experts per stacked tensor; the
``SlotPool`` holds them, the scheduler that fills them and each layer's readiness flags).
Before a decode step the ``Stager`` makes the step's ``DecodePlan`` (edge0.exec.plan) from
its planner (the prerouter's heads, or an oracle file) and makes its one call into the
async ``PrefetchScheduler``: the step before unpinned, the plan's expert sets submitted,
every layer's slot map back (the misses are read into free slots while the step runs; the
reader that completes a layer sets its flag). The plan's routes are the step's (the
``Step`` the staged routers read). A staged layer then, inside the step's graph:

1. maps its routing indices to slots with ``take`` through its lookup row (made on the
   host from the slot maps; the indices never leave the device),
2. runs the same gather matmul as exact on its slots' rows, each passed through the
   layer's slot wait first (``core.ReadyFlags.gate``: an op that returns once the flag
   holds the step's ticket). The wait happens where the rows are consumed; the thread
   that builds the step never waits and evaluates nothing per layer.

Once per step (``begin_step``) the plan's predicted sets come to the host in one read;
the step before was evaluated when its tokens were read, so its slots may be unpinned.
Routed experts missing from the plan map to slot 0 and are counted on device; the count
is checked once per step and a mismatch raises (never silently wrong output).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edge0.backend import core as B
from edge0.model.checkpoint import CheckpointIndex
from edge0.errors import ConfigError, RoutingMismatchError, SchedulerError
from edge0.exec.oracle import OracleRouting
from edge0.exec.plan import DecodePlan, LayerRoute, OraclePlanner, Planner, PrerouterPlanner, QualityGuard, StageStats
from edge0.exec.rows import ExpertRows
from edge0.io_sched.reader import ExpertReader, SlotStore
from edge0.worker import EventLoopThread
from edge0.io_sched.scheduler import READY_TIMEOUT_S, LayerPlan, PrefetchScheduler, StepPlan


WAIT_FAILED = "edge0: the slots of staged layer"  # how a failed wait reads when its graph is evaluated


class SlotPool:
    """The staged layers' slots and the scheduler that fills them: each layer's S slots (an
    ``ExpertRows``), read into by the ``PrefetchScheduler`` on its own event-loop thread
    (``portal`` calls into it from the compute thread). A layer's slots grow, doubling up to
    ``max_slots``, while a batch's union of experts needs more, and go back to S when the
    batch empties. The Stager plans the steps and computes on them."""

    def __init__(self, index: CheckpointIndex, layers: list[int], slots: int, reader: ExpertReader, *,
                 readers: int, prefetch_depth: int, max_slots: int | None = None, log=None):
        self.index, self.log = index, log
        self.slots = slots  # per layer, at open and after a batch empties
        self.max_slots = max(slots, min(max_slots or slots, index.spec.num_experts))
        self.rows = {l: ExpertRows(index.layers[l], slots) for l in layers}
        # each staged layer's readiness, two flags (a step's, and the next one's submitted
        # ahead): set by the reader that fills its slots, awaited inside the step's graph
        self.flags = B.ReadyFlags(2 * len(layers), READY_TIMEOUT_S)
        self.flag_of = {l: 2 * i for i, l in enumerate(layers)}
        self.tickets: dict[int, int] = {}  # step -> the value its flags take when ready (unique per pool)
        self._ticket = 0
        self.loop = EventLoopThread(name="edge0-io")
        self.portal = self.loop.portal
        self.scheduler = PrefetchScheduler(SlotStore(reader, {l: r.buffers for l, r in self.rows.items()}),
                                           {l: slots for l in layers}, readers=readers,
                                           prefetch_depth=prefetch_depth, log=log, signal=self._signal)
        self._entered = self.portal.wrap_async_context_manager(self.scheduler)
        self._entered.__enter__()

    def ticket(self, step: int) -> int:
        """The value ``step``'s flags take when its layers are ready (given once per step)."""
        if step not in self.tickets:
            self._ticket += 1
            self.tickets[step] = self._ticket
            for old in [s for s in self.tickets if s < step - 2]:
                del self.tickets[old]
        return self.tickets[step]

    def flag(self, layer: int, step: int) -> tuple[int, int]:
        """(flag index, value) that says ``layer``'s slots are ready for ``step``."""
        ticket = self.ticket(step)
        return self.flag_of[layer] + ticket % 2, ticket

    def _signal(self, layer: int, step: int, ok: bool) -> None:  # a reader thread or the loop
        ticket = self.tickets.get(step)
        if ticket is not None:
            self.flags.set(self.flag_of[layer] + ticket % 2, ticket if ok else -ticket)

    def nbytes(self) -> int:
        """Bytes the slots hold now (more than at open while a batch grew them)."""
        return sum(r.nbytes for r in self.rows.values())

    def resize(self, layer: int, n: int) -> bool:
        """Give ``layer`` ``n`` slots, keeping the experts of those kept; False (nothing
        changed) while a step still uses its slots."""
        if not self.portal.call(self.scheduler.idle, layer):
            return False
        old = self.rows[layer]
        new = ExpertRows(self.index.layers[layer], n)
        keep = min(n, old.capacity)
        for src, dst in zip(old.buffers, new.buffers):
            dst.host[:keep] = src.host[:keep]
        self.portal.call(self.scheduler.resize, layer, n, new.buffers)
        self.rows[layer] = new
        if self.log is not None:
            self.log.info("stage.slots", layer=layer, slots=n, was=old.capacity, mib=round(new.nbytes / 2**20, 1))
        return True

    def fits(self, layer: int, need: int) -> bool:
        """Whether ``need`` experts fit ``layer``'s slots, growing them (doubling, at most
        ``max_slots``) when they do not and the layer is idle."""
        have = self.rows[layer].capacity
        if need > have and have < self.max_slots:
            self.resize(layer, min(self.max_slots, max(need, 2 * have)))
        return need <= self.rows[layer].capacity

    def shrink(self) -> None:
        """Grown slots go back to ``slots``: memory follows the batch."""
        for layer, rows in self.rows.items():
            if rows.capacity > self.slots:
                self.resize(layer, self.slots)

    def close(self) -> None:
        if self.portal is None:
            return
        try:
            self._entered.__exit__(None, None, None)
        finally:
            self.loop.close()
            self.portal = None


@dataclass
class StepState:
    """The Stager's current step: its number, the plan it runs, the steps submitted to the
    scheduler and, per step, the slot map of each staged layer claimed for it, the current
    step's lookup tables (expert -> slot, on the device), the oracle's plans submitted
    ahead, the staged outputs to be evaluated before their slots are reused, the
    routing-miss count on device, and what the flags had waited and the scheduler's
    counters at its start."""

    misses: object  # staged routing indices that found no slot, counted on device
    step: int = -1
    plan: DecodePlan | None = None  # the current step's, when it was planned
    predicted: dict = field(default_factory=dict)  # the plan's flush: layer -> (indices, logits)
    submitted: set = field(default_factory=set)
    maps: dict = field(default_factory=dict)  # submitted step -> {layer: {expert: slot}} claimed for it
    tables: dict = field(default_factory=dict)  # the current step's layer -> lookup row (device)
    ahead: dict = field(default_factory=dict)  # oracle plans submitted ahead of their step
    outputs: list = field(default_factory=list)  # staged outputs, evaluated before their slots are reused
    waited0: object = None  # the flags' waited nanoseconds at the step's start
    io0: tuple = ()


class Stager:
    """Owns the staged layers' slots, the scheduler (on its own event-loop thread), the
    step's plan and the step bookkeeping. One per engine."""

    def __init__(self, index: CheckpointIndex, layers: list[int], slots: int, reader: ExpertReader,
                 oracle: OracleRouting | None, *, readers: int, prefetch_depth: int, log=None,
                 prerouter=None, fallback=None, guard_every: int = 0, routing: str = "replace",
                 max_slots: int | None = None):
        """``routing`` (with a prerouter): "replace", the prediction is the staged layers'
        routing; "select", the prerouter stages candidates (its ``width``) and each staged
        layer's own router chooses among them (``LayerRoute``). ``max_slots``: how far a
        layer's ``slots`` may grow when a step's set outgrows them (a batch's union; back to
        ``slots`` at ``reset``); None = never."""
        spec = index.spec
        if slots < spec.k:
            raise ConfigError(f"slots_per_layer must be >= k = {spec.k}, got {slots}")
        self.index = index
        self.layers = list(layers)
        self.oracle = oracle
        self.log = log
        self.pool = SlotPool(index, self.layers, slots, reader, readers=readers, prefetch_depth=prefetch_depth,
                             max_slots=max_slots, log=log)  # the slots and the scheduler that fills them
        self.now = StepState(misses=self._zero_misses())  # the step being run and what it submitted
        self.check_routing = True  # off only for timing runs that compute on unread slots
        # prediction as routing: the prerouter plans each step, and its prediction is the
        # staged layers' routing; a step it cannot plan (no state yet) runs on ``fallback``
        self.prerouter = prerouter
        self.fallback = fallback
        self.routing = routing
        self.planner: Planner | None = (PrerouterPlanner(prerouter, self.layers, routing) if prerouter is not None
                        else OraclePlanner(oracle, self.layers) if oracle is not None else None)
        self.guard = QualityGuard(self.layers, guard_every, self._route_of, log=log)
        self._stats = StageStats()
        self.over_slot_layers = 0  # layer-steps run on the fallback: the set did not fit max_slots

    # the step's and the pool's, for whoever reads them through the Stager
    step = property(lambda self: self.now.step)
    plan = property(lambda self: self.now.plan)
    predicted = property(lambda self: self.now.predicted)
    rows = property(lambda self: self.pool.rows)
    slots = property(lambda self: self.pool.slots)
    portal = property(lambda self: self.pool.portal)
    scheduler = property(lambda self: self.pool.scheduler)

    def _route_of(self, layer: int, logits):
        return self.prerouter.route(layer, logits)

    # -- what the engine reads ---------------------------------------------------------------
    def stats(self) -> StageStats:
        return StageStats(self._stats.steps_run, self._stats.stall_seconds,
                          {l: tuple(v) for l, v in self.guard.recall.items()})

    @property
    def guard_recall(self) -> dict[int, list[float]]:
        return self.guard.recall

    def layer_route(self, layer: int) -> LayerRoute | None:
        """What ``layer``'s router does at this step (None: it was not planned)."""
        return self.now.plan.route(layer) if self.now.plan is not None else None

    def planned_logits(self, layer: int):
        """The predicted router logits of ``layer`` for this step, or None when this step
        was not planned."""
        pred = self.now.predicted.get(layer)
        return pred[1] if pred is not None else None

    # -- step boundaries (called by the engine's step hook) ------------------------------
    def reset(self, keep_report: bool = False) -> None:
        """Forget the previous generation: cancel its reads, unpin its slots (slots keep
        their experts: sticky across generations). ``keep_report`` keeps the quality guard's
        per-layer recall of the generation that just ended, for whoever reads it next."""
        self._settle()  # a step built and never evaluated (teacher forcing) computes on its slots first
        for step in sorted(self.now.submitted):
            self.portal.call(self.scheduler.cancel, step)
        self.now.submitted.clear()
        self.pool.tickets.clear()  # steps count from 0 again: their tickets are new ones
        self.now.maps.clear()
        self.now.tables = {}
        self.now.ahead.clear()
        if self.planner is not None:
            self.planner.reset()
        self._set_plan(None, {})
        self.guard.reset(keep_report)
        self.now.step = -1
        self.now.outputs = []
        self.now.misses = self._zero_misses()  # a mismatch raised last time must not poison the next run
        self.pool.shrink()

    @staticmethod
    def _zero_misses():
        zero = B.zeros((), dtype=B.int32)
        B.eval(zero)
        return zero

    def invalidate(self) -> None:
        """Forget every slot's expert (after a read error or a changed file): the next
        plans read them again. Call after ``reset`` (no step holds a slot)."""
        def forget():
            for table in self.scheduler.tables.values():
                table.invalidate()
        self.portal.call(forget)

    def pinned_slots(self) -> int:
        return self.portal.call(lambda: sum(t.pinned() for t in self.scheduler.tables.values()))

    def pending_reads(self) -> int:
        return self.portal.call(self.scheduler.pending_reads)

    def _set_plan(self, plan: DecodePlan | None, predicted: dict) -> None:
        """Make ``plan`` the current step's."""
        self.now.plan, self.now.predicted = plan, predicted

    def routes(self):
        """The current step's routes, staged layer -> ``LayerRoute`` (empty: the layers route
        on their own gates): what the step's ``Step`` gives the staged routers."""
        return self.now.plan.routes if self.now.plan is not None else {}

    def slot_bytes(self) -> int:
        """Bytes the staged layers' slots hold now (more than at open while a batch grew them)."""
        return self.pool.nbytes()

    def _stage(self, release: int | None, plans: list[DecodePlan]) -> None:
        """The step's one call into the scheduler: unpin step ``release``'s slots, submit
        ``plans``' expert sets (layers in execution order) with their slots claimed, and take
        the slot maps claimed. A layer whose set does not fit its slots (a batch's union of
        many rows' sets), even grown to ``max_slots``, is not staged at that step: it
        computes on its fallback path, routed by the same plan."""
        if release is not None and any(len(p.experts[l]) > self.pool.rows[l].capacity for p in plans for l in self.layers):
            self.portal.call(self.scheduler.stage, release, [])  # unpinned first: the slots may grow
            self._released(release)
            release = None
        steps = []
        for plan in plans:
            fits = [l for l in self.layers if self.pool.fits(l, len(plan.experts[l]))]
            self.over_slot_layers += len(self.layers) - len(fits)
            if len(fits) < len(self.layers) and self.log is not None:
                self.log.info("stage.over_slots", step=plan.step, max_slots=self.pool.max_slots,
                              layers={l: len(plan.experts[l]) for l in self.layers if l not in fits})
            self.pool.ticket(plan.step)
            steps.append(StepPlan(plan.step, tuple(LayerPlan(l, plan.experts[l]) for l in fits)))
        if release is not None or steps:
            claimed = self.portal.call(self.scheduler.stage, release, steps)
            self._released(release)
            self.now.submitted.update(p.step for p in plans)
            for (step, layer), slot_of in claimed.items():
                self.now.maps.setdefault(step, {})[layer] = slot_of
        self._tables()  # (a step submitted ahead has its maps already)

    def _released(self, step: int | None) -> None:
        """Forget step ``step`` (None: none), whose slots the scheduler has unpinned."""
        if step is not None:
            self.now.submitted.discard(step)
            self.now.maps.pop(step, None)

    def _tables(self) -> None:
        """The current step's lookup rows (expert -> slot, -1: not staged), one device array
        for the layers whose slots were claimed since."""
        maps = self.now.maps.get(self.now.step, {})
        new = [l for l in self.layers if l in maps and l not in self.now.tables]
        if not new:
            return
        table = np.full((len(new), self.index.spec.num_experts), -1, dtype=np.int32)
        for i, l in enumerate(new):
            table[i, list(maps[l])] = list(maps[l].values())
        rows = B.array(table)
        self.now.tables.update({l: rows[i] for i, l in enumerate(new)})

    def _predict_and_plan(self, inputs) -> None:
        """One batched flush of every head, one host read of all predicted sets (with the
        miss count and the guard's counts of the step before), one plan, one call into the
        scheduler."""
        planner = self.planner
        preds = planner.flush(inputs)
        parts = [self.now.misses.reshape(1), *self.guard.device_counts()]
        if preds is not None:
            parts += planner.device_parts(preds)
        host = B.to_host(B.concat([p.astype(B.int32) for p in parts]))
        self._check_misses(int(host[0]))
        pos = 1 + self.guard.collect(host[1:], self.now.step)
        release = self._next_step()
        self._set_plan(None, {})
        if preds is None:  # nothing observed yet: this step runs on the fallback path
            self._stage(release, [])
            return
        observe = self.guard.observer({l: preds[l][0] for l in self.layers}) if self.guard.arm(self.now.step) else None
        plan = planner.plan(self.now.step, host[pos:].reshape(len(self.layers), -1), preds, observe)
        self._stage(release, [plan])
        self._set_plan(plan, preds)

    def _check_misses(self, misses: int) -> None:
        if self.check_routing and misses:
            raise RoutingMismatchError(
                f"step {self.now.step}: a staged layer routed to an expert its plan did not stage; the oracle "
                "routing does not belong to this prompt, model and sampling")

    def begin_step(self, inputs) -> None:
        if inputs.shape[-1] != 1:
            return  # prefill: staged layers run their prefill path
        if self.planner is None:
            raise ConfigError("a staged decode path needs a routing source: prerouter heads "
                              "(`edge0 train heads`) or an oracle_file (`edge0 record-routing`)")
        # the previous step is done (its staged layers' outputs too, even when this step's
        # input does not depend on them: teacher forcing), so its slots may be unpinned;
        # after a sampled token was read they are, and nothing is evaluated here
        self._settle()
        if not self.planner.ahead:
            self._predict_and_plan(inputs)
            return
        self._check_misses(int(B.to_host(self.now.misses)))
        self.advance_step()

    def _settle(self) -> None:
        """Evaluate the staged outputs not evaluated yet (none, once a sampled token was read)."""
        pending = [o for o in self.now.outputs if not B.evaluated(o)]
        self.now.outputs = []
        if pending:
            try:
                B.eval(*pending)
            except RuntimeError as e:
                if not str(e).startswith(WAIT_FAILED):
                    raise  # a failed read was reported where the step was evaluated

    def advance_step(self, plan: bool = True) -> None:
        """Close the previous step and, with an oracle (``plan``), submit this step's plan
        and the next one's so its reads can start as soon as slots are free (one call into
        the scheduler, which also unpins the previous step's slots)."""
        release = self._next_step()
        if not plan or self.planner is None or not self.planner.ahead:
            self._stage(release, [])
            return
        self.now.ahead.pop(self.now.step - 1, None)
        plans = []
        for s in (self.now.step, self.now.step + 1):  # this step, and the next one ahead of time
            if s not in self.now.submitted and self.planner.covers(s):
                self.now.ahead[s] = self.planner.plan(s)
                plans.append(self.now.ahead[s])
        self._stage(release, plans)
        if self.now.step not in self.now.submitted:
            self.planner.refuse(self.now.step)  # raises the "covers N steps" error
        self._set_plan(self.now.ahead.get(self.now.step), {})

    def _next_step(self) -> int | None:
        """Close the current step (its statistics) and start the next; the step whose slots
        may now be unpinned (None: there was none)."""
        release = None
        if self.now.step >= 0:
            self._end_step()
            if self.now.step in self.now.submitted:
                release = self.now.step
        self.now.step += 1
        self.now.tables = {}
        self.now.waited0 = self.pool.flags.waited_ns()
        self.now.io0 = (self.scheduler.stats.reads, self.scheduler.stats.bytes, self.scheduler.stats.hits,
                        self.scheduler.stats.misses)
        return release

    def _end_step(self) -> None:
        waited = self.pool.flags.waited_ns() - self.now.waited0  # (set when the step started)
        stall = float(waited.sum()) / 1e9
        self._stats = StageStats(self._stats.steps_run + 1, self._stats.stall_seconds + stall)
        if self.log is None:
            return
        st = self.scheduler.stats
        r0, b0, h0, m0 = self.now.io0
        for layer in self.now.maps.get(self.now.step, {}):
            i = self.pool.flag_of[layer]
            self.log.debug("stage.wait", step=self.now.step, layer=layer, ms=round(float(waited[i:i + 2].sum()) / 1e6, 3))
        self.log.info("step", step=self.now.step, stall_ms=round(1e3 * stall, 3),
                      reads=st.reads - r0, bytes=st.bytes - b0, hits=st.hits - h0, misses=st.misses - m0)

    def explain(self, error: BaseException) -> BaseException:
        """A staged layer's failed wait, raised at evaluation, as the typed error its reads
        failed with (``ExpertReadError``), or a ``SchedulerError``; any other error as is."""
        if not (isinstance(error, RuntimeError) and str(error).startswith(WAIT_FAILED)):
            return error
        for step in sorted(self.now.maps, reverse=True):
            for layer in self.now.maps[step]:
                found = self.scheduler.job_error(step, layer)
                if found is not None:
                    return found
        return SchedulerError(str(error))

    def wait_planned(self) -> None:
        """Wait in this thread until every staged layer of the current step is ready (a
        step of reads without compute: the read-only benchmark arm)."""
        for layer in self.now.maps.get(self.now.step, {}):
            self.pool.flags.wait(*self.pool.flag(layer, self.now.step))

    def close(self) -> None:
        if self.portal is None:
            return
        try:
            self.reset()
        finally:
            self.pool.close()

    # -- the layer computation --------------------------------------------------------------
    def compute(self, layer: int, x, inds):
        """Layer ``layer``'s staged computation, built into the step's graph: its slots' rows
        gated on the layer's readiness flag (the wait happens where the rows are consumed),
        its routing mapped to slots through the plan's lookup row, the layer's own switch
        module run on the slots' rows."""
        table = self.now.tables.get(layer)
        if table is None:  # an unplanned step (no prerouter state yet), or a batch's union over the layer's slots
            return self.fallback(layer, x, inds)
        index, ticket = self.pool.flag(layer, self.now.step)
        raw = B.take(table, inds)
        self.now.misses = self.now.misses + (raw < 0).sum()
        out = self.rows[layer].run(self.fallback.split, self.fallback.templates[layer], x, B.maximum(raw, 0),
                                   gate=lambda view: self.pool.flags.gate(view, index, ticket))
        self.now.outputs.append(out)
        return out


class StagedExecutor:
    """Executor adapter: a staged layer's decode path."""

    def __init__(self, stager: Stager):
        self.stager = stager

    def __call__(self, layer: int, x, inds):
        return self.stager.compute(layer, x, inds)
