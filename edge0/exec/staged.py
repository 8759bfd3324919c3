"""The staged path: routing known before the step, experts read ahead into sticky slots.

Each staged layer owns S slots (one row buffer of S experts per stacked tensor). Before a decode step the
``Stager`` hands that step's per-layer expert sets (from the oracle now, the prerouter
later) to the async ``PrefetchScheduler``, which reads the misses into free slots while
the step runs. A staged layer then:

1. starts computing everything below it (``async_eval`` of its input: not a host sync),
2. waits until its slots are READY (the only wait; logged as ``stage.wait``),
3. maps its routing indices to slots with ``take`` through a table built on the host from
   the plan (the indices never leave the device), and runs the same gather matmul as exact.

No host sync per staged layer. Once per step (``begin_step``) the previous step is awaited
so its slots can be unpinned: O(1) syncs per step, whatever the number of layers.
Routed experts missing from the plan map to slot 0 and are counted on device; the count
is checked once per step and a mismatch raises (never silently wrong output).
"""

from __future__ import annotations

import time

import numpy as np

from edge0.backend import core as B
from edge0.model.checkpoint import CheckpointIndex
from edge0.errors import ConfigError
from edge0.exec.exact import ExpertRows
from edge0.exec.oracle import OracleRouting
from edge0.exec.taps import LayerRoute
from edge0.io_sched.loop_thread import EventLoopThread
from edge0.io_sched.plan import LayerPlan, StepPlan
from edge0.io_sched.reader import ExpertReader
from edge0.io_sched.scheduler import PrefetchScheduler
from edge0.io_sched.store import SlotStore


class RoutingMismatchError(ConfigError):
    """A staged layer routed to an expert its plan did not stage."""


class Stager:
    """Owns the staged layers' slots, the scheduler (on its own event-loop thread), and the
    step bookkeeping. One per engine."""

    def __init__(self, index: CheckpointIndex, layers: list[int], slots: int, reader: ExpertReader,
                 oracle: OracleRouting | None, *, readers: int, prefetch_depth: int, log=None,
                 prerouter=None, fallback=None, guard_every: int = 0, routing: str = "replace"):
        """``routing`` (with a prerouter): "replace", the prediction is the staged layers'
        routing; "select", the prerouter stages candidates (its ``width``) and each staged
        layer's own router chooses among them (``LayerRoute``)."""
        spec = index.spec
        if slots < spec.k:
            raise ConfigError(f"slots_per_layer must be >= k = {spec.k}, got {slots}")
        self.index = index
        self.layers = list(layers)
        self.num_experts = spec.num_experts
        self.slots = slots
        self.oracle = oracle
        self.log = log
        self.rows = {l: ExpertRows(index.layers[l], slots) for l in self.layers}
        self._loop = EventLoopThread(name="edge0-io")
        self.portal = self._loop.portal
        self.scheduler = PrefetchScheduler(SlotStore(reader, {l: r.buffers for l, r in self.rows.items()}),
                                           {l: slots for l in self.layers}, readers=readers,
                                           prefetch_depth=prefetch_depth, log=log)
        self._sched_cm = self.portal.wrap_async_context_manager(self.scheduler)
        self._sched_cm.__enter__()
        self.step = -1
        self._submitted: set[int] = set()
        self._misses = self._zero_misses()
        self.check_routing = True  # off only for timing runs that compute on unread slots
        # prediction as routing: the prerouter plans each step, and its prediction is the
        # staged layers' routing; a step it cannot plan (no state yet) runs on ``fallback``
        self.prerouter = prerouter
        self.fallback = fallback
        self.predicted: dict[int, tuple] = {}
        self.routing = routing
        self._routes: dict[int, LayerRoute] = {}
        self.guard_every = guard_every
        self._guard = None  # per-layer recall sums of the current step (lazy), when guarded
        self._guard_n = 1
        self.guard_recall: dict[int, list[float]] = {}
        self.stall_seconds = 0.0
        self.steps_run = 0
        self._step_t0 = None
        self._step_stall = 0.0
        self._outputs: list = []  # this step's staged outputs: evaluated before their slots are reused

    # -- step boundaries (called by the engine's step hook) ------------------------------
    def reset(self, keep_report: bool = False) -> None:
        """Forget the previous generation: cancel its reads, unpin its slots (slots keep
        their experts: sticky across generations). ``keep_report`` keeps the quality guard's
        per-layer recall of the generation that just ended, for whoever reads it next."""
        for step in sorted(self._submitted):
            self.portal.call(self.scheduler.cancel, step)
        self._submitted.clear()
        if self.prerouter is not None:
            self.prerouter.reset()
        self.predicted = {}
        self._routes = {}
        self._guard = None
        if not keep_report:
            self.guard_recall = {}
        self.step = -1
        self._outputs = []
        self._misses = self._zero_misses()  # a mismatch raised last time must not poison the next run

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

    def planned_logits(self, layer: int):
        """The predicted router logits of ``layer`` for this step, or None when this step
        was not planned."""
        pred = self.predicted.get(layer)
        return pred[1] if pred is not None else None

    def layer_route(self, layer: int) -> LayerRoute | None:
        """What ``layer``'s router does at this step (None: it was not planned)."""
        return self._routes.get(layer)

    def _predict_and_plan(self, inputs) -> None:
        """One batched flush of every head, one host read of all predicted sets, one plan."""
        preds = self.prerouter.flush(inputs) if self.prerouter.ready() else None
        guard = self._guard
        parts = [self._misses.reshape(1)]
        if guard is not None:
            parts += [guard[l].reshape(1) for l in self.layers]
        if preds is not None:
            parts += [preds[l][0].reshape(-1).astype(B.int32) for l in self.layers]
        host = B.to_host(B.concat([p.astype(B.int32) for p in parts]))
        self._check_misses(int(host[0]))
        pos = 1
        if guard is not None:
            for l in self.layers:
                self.guard_recall.setdefault(l, []).append(float(host[pos]) / self._guard_n)
                pos += 1
            if self.log is not None:
                self.log.info("guard", step=self.step, recall={l: round(v[-1], 4) for l, v in self.guard_recall.items()})
        self._guard = None
        self.advance_step(plan=False)
        self.predicted, self._routes = {}, {}
        if preds is None:
            return  # nothing observed yet: this step runs on the fallback path
        n = host[pos:].reshape(len(self.layers), -1)
        plan = StepPlan(self.step, tuple(LayerPlan(l, tuple(sorted(set(n[i].tolist())))) for i, l in
                                         enumerate(self.layers)))
        self.portal.call(self.scheduler.submit, plan)
        self._submitted.add(self.step)
        self.predicted = preds
        for l in self.layers:
            inds, logits = preds[l]
            staged = B.one_hot_k(inds, logits.shape[-1], B.int32) > 0 if self.routing == "select" else None
            self._routes[l] = LayerRoute(self.routing, logits, staged)
        if self.guard_every and self.step % self.guard_every == 0:
            self._guard = {l: B.zeros((), dtype=B.float32) for l in self.layers}

    def guard_wanted(self, layer: int) -> bool:
        return self._guard is not None and layer in self._guard

    def guard_observe(self, layer: int, true_logits) -> None:
        """Quality guard: recall@k of the prediction against what the layer's own router
        would have routed to (on device); under select routing, the share of the router's
        own k that was staged."""
        if self._guard is None or layer not in self._guard or layer not in self.predicted:
            return
        predicted = self.predicted[layer][0]
        true = self.prerouter.streaming.route(layer, true_logits.reshape(-1, true_logits.shape[-1]))
        k = true.shape[-1]
        hit = (B.expand_dims(predicted, -1) == B.expand_dims(true, -2)).any(axis=-1).sum()
        self._guard[layer] = self._guard[layer] + hit.astype(B.float32)
        self._guard_n = k * max(1, true.size // k)

    def _check_misses(self, misses: int) -> None:
        if self.check_routing and misses:
            raise RoutingMismatchError(
                f"step {self.step}: a staged layer routed to an expert its plan did not stage; the oracle "
                "routing does not belong to this prompt, model and sampling")

    def begin_step(self, inputs) -> None:
        if inputs.shape[-1] != 1:
            return  # prefill: staged layers run their prefill path
        if self.oracle is None and self.prerouter is None:
            raise ConfigError("a staged decode path needs a routing source: prerouter heads "
                              "(`edge0 train heads`) or an oracle_file (`edge0 record-routing`)")
        # the previous step is done (its staged layers' outputs too, even when this step's
        # input does not depend on them: teacher forcing), so its slots may be unpinned
        B.eval(inputs, *self._outputs)
        self._outputs = []
        if self.oracle is None:
            self._predict_and_plan(inputs)
            return
        self._check_misses(int(B.to_host(self._misses)))
        self.advance_step()

    def advance_step(self, plan: bool = True) -> None:
        """Close the previous step (unpin its slots) and, with an oracle, submit this step's
        plan and the next one's so its reads can start as soon as slots are free."""
        if self.step >= 0:
            self._end_step()
            self.portal.call(self.scheduler.release, self.step)
            self._submitted.discard(self.step)
        self.step += 1
        self._step_t0, self._step_stall = time.perf_counter(), 0.0
        self._io0 = (self.scheduler.stats.reads, self.scheduler.stats.bytes, self.scheduler.stats.hits,
                     self.scheduler.stats.misses)
        if not plan:
            return
        for s in (self.step, self.step + 1):  # this step, and the next one ahead of time
            if s not in self._submitted and s < len(self.oracle):
                plan = StepPlan(s, tuple(LayerPlan(l, self.oracle.experts(s, l)) for l in self.layers))
                self.portal.call(self.scheduler.submit, plan)
                self._submitted.add(s)
        if self.step not in self._submitted:
            self.oracle.experts(self.step, self.layers[0])  # raises the "covers N steps" error

    def _end_step(self) -> None:
        self.steps_run += 1
        self.stall_seconds += self._step_stall
        if self.log is not None and self._step_t0 is not None:
            st = self.scheduler.stats
            r0, b0, h0, m0 = self._io0
            self.log.info("step", step=self.step, stall_ms=round(1e3 * self._step_stall, 3),
                          reads=st.reads - r0, bytes=st.bytes - b0, hits=st.hits - h0, misses=st.misses - m0)

    def close(self) -> None:
        if self.portal is None:
            return
        try:
            self.reset()
        finally:
            try:
                self._sched_cm.__exit__(None, None, None)
            finally:
                self._loop.close()
                self.portal = None

    # -- the layer computation --------------------------------------------------------------
    def compute(self, layer: int, x, inds):
        if self.step not in self._submitted:  # an unplanned step (no prerouter state yet)
            return self.fallback(layer, x, inds)
        B.async_eval(x)  # let the layers below run while this layer's reads finish
        t0 = time.perf_counter()
        slot_map = self.portal.call(self.scheduler.ready, self.step, layer)
        waited = time.perf_counter() - t0
        self._step_stall += waited
        if self.log is not None:
            self.log.debug("stage.wait", step=self.step, layer=layer, ms=round(1e3 * waited, 3),
                           hits=slot_map.hits, misses=slot_map.misses)
        table = np.full(self.num_experts, -1, dtype=np.int32)
        table[list(slot_map.slot_of)] = list(slot_map.slot_of.values())
        raw = B.take(B.array(table), inds)
        self._misses = self._misses + (raw < 0).sum()
        local = B.maximum(raw, 0)
        rows = self.rows[layer]
        out = self.fallback.split(rows.kernel(self.fallback.templates[layer]), x, local)
        self._outputs.append(out)
        return out


class StagedExecutor:
    """Executor adapter: a staged layer's decode path."""

    def __init__(self, stager: Stager):
        self.stager = stager

    def __call__(self, layer: int, x, inds):
        return self.stager.compute(layer, x, inds)
