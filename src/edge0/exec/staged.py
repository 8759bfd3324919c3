"""The staged path: routing known before the step, experts read ahead into sticky slots.

Each staged layer owns S slots (one row buffer of S experts per stacked tensor; the
``SlotPool`` holds them, the scheduler that fills them and each layer's readiness flags).
Before a decode step the ``Stager`` makes the step's ``DecodePlan`` (edge0.exec.plan) from
its planner (the prerouter's heads, or an oracle file) and makes its one call into the
async ``PrefetchScheduler``: the step before unpinned, the plan's expert sets submitted,
every layer's slot map back (the misses are read into free slots while the step runs; the
reader that completes a layer sets its flag). The plan's routes and the slot routes made
from those maps are the step's (``Step.routes``, which the staged routers read, and
``Step.slots``, which the staged layers read). A staged layer then, inside the step's graph:

1. maps its routing indices to slots with ``take`` through its slot route's lookup row
   (made on the host from the slot maps; the indices never leave the device),
2. runs the same gather matmul as exact on its slots' rows, each passed through the
   layer's slot wait first (``core.ReadyFlags.gate``: an op that returns once the flag
   holds the step's ticket). The wait happens where the rows are consumed; the thread
   that builds the step never waits and evaluates nothing per layer.

Once per step the plan's predicted sets come to the host in one read. In the batch loop
that read is the step before's token read (``plan_ahead`` / ``take_ahead``: the next step's
flush is built into the step's graph, on its sampled tokens and the batch's heads' state
after it, and read with its tokens), and the next step's reads are submitted as soon as the
tokens are handed out; its ``begin_step`` finds it planned (a batch that changed in between
has that plan cancelled and planned anew). Elsewhere (one sequence through ``StepModel``)
``begin_step`` flushes and reads. Either way the step before was evaluated when its tokens
were read, so its slots may be unpinned.
Routed experts missing from the plan map to slot 0 and are counted on device; the count
is checked once per step and a mismatch raises (never silently wrong output). A verify pass
(speculative decoding) is planned by no one: each staged layer stages its positions' union.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edge0.backend import core as B
from edge0.model.checkpoint import CheckpointIndex
from edge0.errors import ConfigError, RoutingMismatchError, SchedulerError
from edge0.exec.oracle import OracleRouting
from edge0.exec.plan import (DecodePlan, LayerRoute, OraclePlanner, Planner, PrerouterPlanner, QualityGuard,
                             SlotRoute, StageStats)
from edge0.exec.rows import SlotPool
from edge0.exec.taps import StepContext
from edge0.exec.verify import VerifyStaging
from edge0.io_sched.reader import ExpertReader
from edge0.io_sched.slots import LayerPlan, StepPlan


WAIT_FAILED = "edge0: the slots of staged layer"  # how a failed wait reads when its graph is evaluated


@dataclass
class StepState:
    """The Stager's current step: its number, its plan, the steps submitted to the scheduler
    and each one's slot maps, the current step's lookup tables (expert -> slot, on the
    device), the oracle's plans submitted ahead, the staged outputs to evaluate before their
    slots are reused, the routing-miss count on device, the flags' and scheduler's counters
    at its start."""

    misses: object  # staged routing indices that found no slot, counted on device
    step: int = -1
    plan: DecodePlan | None = None  # the current step's, when it was planned
    predicted: dict = field(default_factory=dict)  # the plan's flush: layer -> (indices, logits)
    submitted: set = field(default_factory=set)
    maps: dict = field(default_factory=dict)  # submitted step -> {layer: {expert: slot}} claimed for it
    tables: dict = field(default_factory=dict)  # the current step's layer -> lookup row (device)
    ahead: dict = field(default_factory=dict)  # oracle plans submitted ahead of their step
    outputs: list = field(default_factory=list)  # staged outputs, evaluated before their slots are reused
    pending: tuple | None = None  # (heads, flush) of the next step, flushed ahead, read with the tokens
    verifying: bool = False  # a verify pass: each staged layer stages its positions' union when it runs
    planned_for: object = None  # the heads' state the current step was planned from at the end of the step before
    waited0: object = None  # the flags' waited nanoseconds at the step's start
    io0: tuple = ()


class Stager(VerifyStaging):
    """Owns the staged layers' slots, the scheduler (on its own event-loop thread), the
    step's plan and the step bookkeeping. One per engine. Its verify passes (speculative
    decoding): ``VerifyStaging``."""

    def __init__(self, index: CheckpointIndex, layers: list[int], slots: int, reader: ExpertReader,
                 oracle: OracleRouting | None, *, readers: int, prefetch_depth: int, log=None,
                 planner: PrerouterPlanner | None = None, fallback=None, guard_every: int = 0,
                 max_slots: int | None = None, in_place: bool = False, context: StepContext | None = None):
        """``planner``: the prerouter's (``PrerouterPlanner``: under "replace" routing the
        prediction is the staged layers' routing; under "select" it stages candidates and
        each staged layer's own router chooses among them); else ``oracle``'s, a recorded
        routing. ``max_slots``: how far a layer's ``slots`` may grow when a step's set
        outgrows them (a batch's union; back to ``slots`` at ``reset``); None = never.
        ``in_place``: the experts are computed where the checkpoint's mapping holds them
        (``fallback`` computes so): the Stager plans each step and reads nothing; it has no
        slots. ``context``: the model's ``StepContext``, whose ``Step`` gives each staged
        layer's slot route while it computes."""
        spec = index.spec
        if slots < spec.k:
            raise ConfigError(f"slots_per_layer must be >= k = {spec.k}, got {slots}")
        self.index, self.layers, self.oracle, self.log = index, list(layers), oracle, log
        self.context = context or StepContext()
        self.pool = None if in_place else SlotPool(index, self.layers, slots, reader, readers=readers,
                                                   prefetch_depth=prefetch_depth, max_slots=max_slots,
                                                   log=log)  # the slots and the scheduler that fills them
        self.now = StepState(misses=self._zero_misses())  # the step being run and what it submitted
        self.check_routing = True  # off only for timing runs that compute on unread slots
        # prediction as routing: the prerouter plans each step, and its prediction is the
        # staged layers' routing; a step it cannot plan (no state yet) runs on ``fallback``
        self.fallback = fallback
        self.planner: Planner | None = (planner if planner is not None
                                        else OraclePlanner(oracle, self.layers) if oracle is not None else None)
        self.guard = QualityGuard(self.layers, guard_every, self._route_of, log=log)
        self._stats = StageStats()
        self.over_slot_layers = 0  # layer-steps run on the fallback: the set did not fit max_slots

    # the step's and the pool's, for whoever reads them through the Stager
    step = property(lambda self: self.now.step)
    plan = property(lambda self: self.now.plan)
    predicted = property(lambda self: self.now.predicted)
    rows = property(lambda self: self.pool.rows if self.pool is not None else {})
    slots = property(lambda self: self.pool.slots if self.pool is not None else 0)
    portal = property(lambda self: self.pool.portal if self.pool is not None else None)
    scheduler = property(lambda self: self.pool.scheduler if self.pool is not None else None)

    def _route_of(self, layer: int, logits):
        return self.planner.route(layer, logits)

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
        if self.pool is not None:
            self.pool.tickets.clear()  # steps count from 0 again: their tickets are new ones
        self.now.maps.clear()
        self.now.tables = {}
        self.now.ahead.clear()
        self.now.pending, self.now.planned_for, self.now.verifying = None, None, False
        if self.planner is not None:
            self.planner.reset()
        self._set_plan(None, {})
        self.guard.reset(keep_report)
        self.now.step = -1
        self.now.outputs = []
        self.now.misses = self._zero_misses()  # a mismatch raised last time must not poison the next run
        if self.pool is not None:
            self.pool.shrink()

    @staticmethod
    def _zero_misses():
        zero = B.zeros((), dtype=B.int32)
        B.eval(zero)
        return zero

    def invalidate(self) -> None:
        """Forget every slot's expert (after a read error or a changed file): the next
        plans read them again. Call after ``reset`` (no step holds a slot)."""
        if self.pool is None:
            return

        def forget():
            for table in self.scheduler.tables.values():
                table.invalidate()
        self.portal.call(forget)

    def pinned_slots(self) -> int:
        if self.pool is None:
            return 0
        return self.portal.call(lambda: sum(t.pinned() for t in self.scheduler.tables.values()))

    def pending_reads(self) -> int:
        return self.portal.call(self.scheduler.pending_reads) if self.pool is not None else 0

    def _set_plan(self, plan: DecodePlan | None, predicted: dict) -> None:
        """Make ``plan`` the current step's."""
        self.now.plan, self.now.predicted = plan, predicted

    def routes(self):
        """The current step's routes, staged layer -> ``LayerRoute`` (empty: the layers route
        on their own gates): what the step's ``Step`` gives the staged routers."""
        return self.now.plan.routes if self.now.plan is not None else {}

    def slot_routes(self) -> dict:
        """The current step's slot routes, staged layer -> ``SlotRoute`` (the layers whose
        slots were claimed for it: the lookup rows made when its reads were issued, the flag
        its reads set): what the step's ``Step`` gives the staged layers."""
        return {l: SlotRoute(t, *self.pool.flag(l, self.now.step)) for l, t in self.now.tables.items()}

    def slot_bytes(self) -> int:
        """Bytes the staged layers' slots hold now (more than at open while a batch grew them)."""
        return self.pool.nbytes() if self.pool is not None else 0

    def _stage(self, release: int | None, plans: list[DecodePlan]) -> None:
        """The step's one call into the scheduler: unpin step ``release``'s slots, submit
        ``plans``' expert sets (layers in execution order) with their slots claimed, and take
        the slot maps claimed. A layer whose set does not fit its slots (a batch's union of
        many rows' sets), even grown to ``max_slots``, is not staged at that step: it
        computes on its fallback path, routed by the same plan. In place (no slots): nothing to
        read, every layer computes on its fallback path."""
        if self.pool is None:
            return
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

    def _predict_and_plan(self, inputs, heads, advance: bool = True) -> None:
        """One batched flush of every head, one host read of all predicted sets (with the
        miss count and the guard's counts of the step before), one plan, one call into the
        scheduler. ``advance`` False: plan the current step again (its plan made ahead was
        cancelled)."""
        preds = self.planner.flush(inputs, heads)
        parts = self._parts(preds)
        self._planned(B.to_host(B.concat(parts)), preds, advance)

    def _parts(self, preds: dict | None) -> list:
        """What a plan reads to the host: the miss count and the guard's counts of the step
        before, then ``preds``' predicted sets (int32)."""
        parts = [self.now.misses.reshape(1), *self.guard.device_counts()]
        if preds is not None:
            parts += self.planner.device_parts(preds)
        return [p.astype(B.int32) for p in parts]

    def _planned(self, host, preds: dict | None, advance: bool = True) -> None:
        """The step's plan from ``host`` (the host copy of ``_parts(preds)``): the step before
        closed and its slots unpinned (``advance``), this step's reads submitted."""
        self._check_misses(int(host[0]))
        pos = 1 + self.guard.collect(host[1:], self.now.step)
        release = self._next_step() if advance else None
        self._set_plan(None, {})
        if preds is None:  # nothing observed yet: this step runs on the fallback path
            self._stage(release, [])
            return
        observe = self.guard.observer({l: preds[l][0] for l in self.layers}) if self.guard.arm(self.now.step) else None
        plan = self.planner.plan(self.now.step, host[pos:].reshape(len(self.layers), -1), preds, observe)
        self._stage(release, [plan])
        self._set_plan(plan, preds)

    # -- the next step planned at the end of this one (the batch loop's step) ------------------
    def plan_ahead(self, tokens, heads) -> list:
        """Before this decode step's tokens are read: the next step's flush (lazy) from
        ``heads`` (the batch's ``Observed`` after this step) and ``tokens`` [R] (the tokens
        sampled, lazy: the next step's inputs), and what its plan reads to the host, to read
        with the tokens (one read for both). [] when the next step cannot be planned so (an
        oracle plans its own way; the heads have not seen every owner)."""
        if self.planner is None or self.planner.ahead or self.now.step < 0:
            return []
        preds = self.planner.flush(tokens.reshape(-1, 1), heads)
        if preds is None:
            return []
        self.now.pending = (heads, preds)
        return self._parts(preds)

    def take_ahead(self, host) -> None:
        """The next step planned from ``host`` (the host copy of ``plan_ahead``'s parts): this
        step closed, its slots unpinned and the next step's reads submitted, now; that step's
        ``begin_step`` finds it planned when its heads' state is the one it was planned from
        (else it is cancelled and planned anew)."""
        (heads, preds), self.now.pending = self.now.pending, None
        self._settle()
        self._planned(host, preds)
        self.now.planned_for = heads

    def drop_ahead(self) -> None:
        """The next step is not planned ahead (rows ended: the batch changes)."""
        self.now.pending = None

    def _replan(self) -> None:
        """The current step was planned ahead for a batch that changed since: its reads
        cancelled and its slots unpinned, so that it is planned again."""
        step = self.now.step
        if self.pool is not None:
            self.portal.call(self.scheduler.cancel, step)
            self.pool.tickets.pop(step, None)  # (its flags: a fresh ticket)
        self._released(step)
        self.now.tables = {}
        self._set_plan(None, {})
        self.guard.reset(keep_report=True)  # (its counts were read with the plan made ahead)

    def _check_misses(self, misses: int) -> None:
        if self.check_routing and misses:
            raise RoutingMismatchError(
                f"step {self.now.step}: a staged layer routed to an expert its plan did not stage; the oracle "
                "routing does not belong to this prompt, model and sampling")

    def begin_step(self, inputs, heads=None) -> None:
        """Before a decode step of ``inputs`` [rows, 1]: its plan (from ``heads``, what the
        prerouter observed of the batch's sequences, an ``Observed``) and its reads."""
        self.now.verifying = False
        if inputs.shape[-1] != 1:
            return  # prefill: staged layers run their prefill path
        if self.planner is None:
            raise ConfigError("a staged decode path needs a routing source: prerouter heads "
                              "(`edge0 train heads`) or an oracle_file (`edge0 record-routing`)")
        # the previous step is done (its staged layers' outputs too, even when this step's
        # input does not depend on them: teacher forcing), so its slots may be unpinned;
        # after a sampled token was read they are, and nothing is evaluated here
        self._settle()
        planned, self.now.planned_for = self.now.planned_for, None
        if planned is not None and planned is heads:
            return  # planned at the end of the step before, its reads submitted then
        if planned is not None:
            self._replan()
        if not self.planner.ahead:
            self._predict_and_plan(inputs, heads, advance=planned is None)
            return
        self._check_misses(int(B.to_host(self.now.misses)))
        self.advance_step()

    def _run(self, layer: int, route: SlotRoute, x, raw):
        """``layer``'s switch on its slots' rows for the slot indices ``raw`` (-1: computed on
        slot 0), gated on its flag."""
        out = self.rows[layer].run(self.fallback.split, self.fallback.templates[layer], x, B.maximum(raw, 0),
                                   gate=lambda view: self.pool.flags.gate(view, route.flag, route.ticket))
        self.now.outputs.append(out)
        return out

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
        if self.pool is not None:
            self.now.waited0 = self.pool.flags.waited_ns()
            self.now.io0 = (self.scheduler.stats.reads, self.scheduler.stats.bytes, self.scheduler.stats.hits,
                            self.scheduler.stats.misses)
        return release

    def _end_step(self) -> None:
        waited = self.pool.flags.waited_ns() - self.now.waited0 if self.pool is not None else None  # (from its start)
        stall = float(waited.sum()) / 1e9 if waited is not None else 0.0
        self._stats = StageStats(self._stats.steps_run + 1, self._stats.stall_seconds + stall)
        if self.log is None or waited is None:  # (in place: nothing read, nothing waited)
            if self.log is not None:
                self.log.info("step", step=self.now.step, stall_ms=0.0, reads=0, bytes=0, hits=0, misses=0)
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
    def __call__(self, layer: int, x, inds):
        """Layer ``layer``'s staged computation, built into the step's graph: its slots' rows
        gated on the layer's readiness flag (the wait happens where the rows are consumed),
        its routing mapped to slots through the plan's lookup row, the layer's own switch
        module run on the slots' rows; all three from the step's ``SlotRoute``."""
        route = self.context.now.slots.get(layer)
        if route is None and self.now.verifying and self.pool is not None:
            return self._union(layer, x, inds)
        if route is None:  # an unplanned step (no prerouter state yet), or a batch's union over the layer's slots
            return self.fallback(layer, x, inds)
        raw = B.take(route.lookup, inds)
        self.now.misses = self.now.misses + (raw < 0).sum()
        return self._run(layer, route, x, raw)
