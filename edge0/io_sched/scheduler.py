"""The async prefetch scheduler: step plans in, byte-range reads out, readiness per layer.

Its data is plain (the tests drive it with a fake store, no MLX, no model): ``StepPlan`` /
``LayerPlan`` in, ``ReadRequest``s to a ``Store`` (``read(layer, expert, slot)``, in a reader
thread), ``SlotMap``s out. A layer's ``SlotTable`` says what each slot holds: EMPTY, LOADING
(being read) or READY. Steps *pin* the slots they compute with; a pinned slot is never a
victim (the least recently used unpinned one is), so nothing a pending computation reads is
overwritten (with 2k slots the next step's misses land in the other half: double buffering).
A READY expert is a hit, not read again (sticky slots); a failed or cancelled read leaves
its slot EMPTY, never READY.

- ``submit(plan)`` queues one job per staged layer of a step, served in priority order
  (earlier step, then earlier layer), at most ``prefetch_depth`` unconsumed jobs at a time:
  a job entering that window claims its slots; its misses become ``ReadRequest``s.
- Reader threads (``anyio.to_thread`` behind a ``CapacityLimiter`` of ``readers``) read,
  highest priority first, each a share of one layer's queued reads at a time (so the loop
  wakes once per share, not per expert); a share skips the reads of a cancelled step.
- ``await ready(step, layer)`` returns the layer's ``SlotMap`` once every planned expert is
  READY, or raises the typed read error; consuming a job slides the window. ``wait_ready(step,
  layer, post)`` is the same for another thread (the compute thread): each job has one
  readiness, a future the loop resolves, awaited on the loop and blocked on elsewhere; the
  consumption goes back to the loop through ``post`` without waiting (on busy cores every
  wake-up of a thread the compute thread waits for can cost a time slice).
- ``release(step)`` unpins the step's slots once its computation has been evaluated;
  ``await cancel(step)`` drops its queued reads, waits for those in flight, leaves their
  slots EMPTY and unpins all it held.
- Transient read errors are retried ``retries`` times, then fail that job with an
  ``ExpertReadError``; later steps are served.

State lives on the event loop, except each job's future (resolved by the loop) and the
pending jobs' index (written by the loop under a lock); ``store.read`` runs in threads.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import anyio

from edge0.errors import ExpertReadError, SchedulerError
from edge0.io_sched.reader import Store


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


@dataclass(eq=False)
class _Job:
    step: int
    layer: int
    order: int
    experts: tuple[int, ...]
    slots: dict[int, int] = field(default_factory=dict)  # expert -> slot (claimed)
    unclaimed: list[int] = field(default_factory=list)
    hits: int = 0
    misses: int = 0
    error: BaseException | None = None
    # its one readiness: set by the loop when every slot is READY, the job failed or its step
    # was cancelled (``error`` says which); awaited on the loop (``ready``), blocked on by
    # the compute thread (``wait_ready``)
    done: Future = field(default_factory=Future)

    def finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def slot_map(self) -> SlotMap:  # once done: what ``ready`` answers, or the error it raises
        if self.error is not None:
            raise self.error
        return SlotMap(self.step, self.layer, dict(self.slots), self.hits, self.misses)


@dataclass(eq=False)
class _Reads:
    """The reads the scheduler owes: queued (a heap by priority), in flight per step (and
    the events of steps being cancelled, set once their reads have drained), the cancelled
    steps, and the reader threads' limiter and how many hold a share."""

    limiter: anyio.CapacityLimiter
    heap: list = field(default_factory=list)  # (priority, seq, ReadRequest)
    seq: itertools.count = field(default_factory=itertools.count)
    in_flight: dict = field(default_factory=dict)  # step -> reads in flight
    drained: dict = field(default_factory=dict)  # step -> anyio.Event, set when its reads drained
    cancelled: set = field(default_factory=set)
    busy: int = 0  # reader threads holding a share of reads


READY_TIMEOUT_S = 120.0  # a layer waiting this long for its slots: an error, not a hang


class PrefetchScheduler:
    def __init__(self, store: Store, slots_per_layer: dict[int, int], *, readers: int = 2,
                 prefetch_depth: int = 4, retries: int = 2, log=None):
        if readers < 1 or prefetch_depth < 1 or retries < 0:
            raise ValueError("readers and prefetch_depth must be >= 1, retries >= 0")
        self.store = store
        self.tables = {layer: SlotTable(layer, n) for layer, n in slots_per_layer.items()}
        self.readers = readers
        self.prefetch_depth = prefetch_depth
        self.retries = retries
        self.stats = SchedulerStats()
        self._log = log
        self._jobs: list[_Job] = []  # unconsumed, in priority order
        self._reads = _Reads(limiter=anyio.CapacityLimiter(readers))
        self._tg = None
        # the pending jobs by (step, layer), for a thread other than the loop's to find its
        # job's future; written by the loop under the lock
        self._pending: dict[tuple[int, int], _Job] = {}
        self._pending_lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------------------
    async def __aenter__(self) -> "PrefetchScheduler":
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc) -> bool | None:
        tg, self._tg = self._tg, None
        tg.cancel_scope.cancel()
        return await tg.__aexit__(*exc)

    # -- the interface ------------------------------------------------------------------
    def submit(self, plan: StepPlan) -> None:
        if self._tg is None:
            raise SchedulerError("the scheduler is not running (use `async with scheduler:`)")
        for order, lp in enumerate(plan.layers):
            if lp.layer not in self.tables:
                raise SchedulerError(f"layer {lp.layer} has no slot table (not a staged layer)")
            experts = tuple(dict.fromkeys(int(e) for e in lp.experts))
            if len(experts) > self.tables[lp.layer].num_slots:
                raise SchedulerError(f"step {plan.step} layer {lp.layer}: {len(experts)} experts do not fit in "
                                     f"{self.tables[lp.layer].num_slots} slots")
            job = _Job(plan.step, lp.layer, order, experts, unclaimed=list(experts))
            self._jobs.append(job)
            with self._pending_lock:
                self._pending[(plan.step, lp.layer)] = job
        self._jobs.sort(key=lambda j: (j.step, j.order))
        self._emit("io.plan", step=plan.step, layers=len(plan.layers),
                   experts=sum(len(lp.experts) for lp in plan.layers))
        self._pump()

    async def ready(self, step: int, layer: int) -> SlotMap:
        job = next((j for j in self._jobs if j.step == step and j.layer == layer), None)
        if job is None:
            raise SchedulerError(f"no pending plan for step {step}, layer {layer}")
        with anyio.move_on_after(READY_TIMEOUT_S):
            await asyncio.shield(asyncio.wrap_future(job.done))
        if not job.done.done():  # never in a sound state: say so rather than hang the engine
            pinned = {l: t.pinned() for l, t in self.tables.items()}
            raise SchedulerError(f"step {step}, layer {layer}: its slots were not ready after {READY_TIMEOUT_S:g} s "
                                 f"(slots pinned per layer: {pinned})")
        self._consume(job)
        return job.slot_map()

    def wait_ready(self, step: int, layer: int, post) -> SlotMap:
        """``ready`` for a thread other than the loop's: blocks until the job is done, then
        has the loop consume it through ``post(fn, *args)`` (a thread-safe call-soon that
        does not wait). Raises what ``ready`` raises."""
        with self._pending_lock:
            job = self._pending.get((step, layer))
        if job is None:
            raise SchedulerError(f"no pending plan for step {step}, layer {layer}")
        try:
            job.done.result(READY_TIMEOUT_S)
        except FutureTimeout:  # never in a sound state: say so rather than hang the engine
            raise SchedulerError(f"step {step}, layer {layer}: its slots were not ready after "
                                 f"{READY_TIMEOUT_S:g} s") from None
        with self._pending_lock:  # taken: waited for once (the loop consumes it when it gets to it)
            if self._pending.get((step, layer)) is job:
                del self._pending[(step, layer)]
        post(self._consume, job)
        return job.slot_map()

    def _consume(self, job: _Job) -> None:
        if job in self._jobs:
            self._jobs.remove(job)
        with self._pending_lock:
            if self._pending.get((job.step, job.layer)) is job:
                del self._pending[(job.step, job.layer)]
        self._pump()

    def release(self, step: int) -> None:
        for table in self.tables.values():
            table.release(step)
        self._pump()

    async def cancel(self, step: int) -> None:
        self._reads.cancelled.add(step)
        dropped = [j for j in self._jobs if j.step == step]
        for job in dropped:
            self._jobs.remove(job)
            job.error = job.error or SchedulerError(f"step {step} was cancelled")
            job.finish()
        with self._pending_lock:
            for key in [k for k in self._pending if k[0] == step]:
                del self._pending[key]
        self.stats.cancelled += len(dropped)
        if self._reads.in_flight.get(step):
            event = self._reads.drained.setdefault(step, anyio.Event())
            with anyio.CancelScope(shield=True):
                await event.wait()
        for table in self.tables.values():
            table.release(step)
        self._reads.cancelled.discard(step)
        self._emit("io.cancel", step=step, jobs=len(dropped))
        self._pump()

    def idle(self, layer: int) -> bool:
        """Nothing of ``layer``'s is queued, pinned or being read: its slots may be resized."""
        table = self.tables[layer]
        return not table.pinned() and not table.loading() and not any(j.layer == layer for j in self._jobs)

    def resize(self, layer: int, num_slots: int, buffers=None) -> None:
        """``layer`` now has ``num_slots`` slots, in ``buffers`` (the store's new buffers for
        it, holding the bytes of the slots kept) when given. Only while the layer is ``idle``."""
        if not self.idle(layer):
            raise SchedulerError(f"layer {layer}: its slots cannot be resized while a step uses them")
        self.tables[layer].resize(num_slots)
        if buffers is not None:
            self.store.buffers[layer] = buffers
        self._emit("io.resize", layer=layer, slots=num_slots)

    def pending_reads(self) -> int:
        return len(self._reads.heap) + sum(self._reads.in_flight.values())

    # -- internals ----------------------------------------------------------------------
    def _emit(self, event: str, **kw) -> None:
        if self._log is not None:
            self._log.debug(event, **kw)

    def _pump(self) -> None:
        """Claim slots for the jobs in the window, start reads, wake finished jobs."""
        window = self._jobs[: self.prefetch_depth]
        for job in window:
            if job.unclaimed:
                self._claim(job)
        while self._reads.heap and self._reads.busy < self.readers and self._tg is not None:
            share = self._next_share()
            if not share:
                continue
            for req in share:
                self._reads.in_flight[req.step] = self._reads.in_flight.get(req.step, 0) + 1
            self._reads.busy += 1
            self._tg.start_soon(self._read, share)
        for job in window:
            self._check(job)

    def _claim(self, job: _Job) -> None:
        table = self.tables[job.layer]
        layer_stats = self.stats.per_layer.setdefault(job.layer, {"hits": 0, "misses": 0})
        still = []
        for expert in job.unclaimed:
            got = table.claim(expert, job.step)
            if got is None:  # every slot pinned by other steps: retry after a release
                still.append(expert)
                continue
            slot, needs_read = got
            job.slots[expert] = slot
            if needs_read:
                job.misses += 1
                layer_stats["misses"] += 1
                self.stats.misses += 1
                req = ReadRequest(job.step, job.layer, expert, slot, (job.step, job.order, expert))
                heapq.heappush(self._reads.heap, (req.priority, next(self._reads.seq), req))
            else:
                job.hits += 1
                layer_stats["hits"] += 1
                self.stats.hits += 1
        job.unclaimed = still

    def _check(self, job: _Job) -> None:
        if job.done.done() or job.unclaimed:
            return
        table = self.tables[job.layer]
        states = [table.state[s] if table.expert_of[s] == e else None for e, s in job.slots.items()]
        if all(s == READY for s in states):
            job.finish()
        elif any(s not in (READY, LOADING) for s in states):
            job.error = job.error or ExpertReadError("a slot this layer depends on failed to load",
                                                     layer=job.layer)
            job.finish()

    def _next_share(self) -> list[ReadRequest]:
        """The next reads for one reader thread: the top of the queue and the rest of its
        layer's queued reads, split evenly over the free readers (a cancelled step's reads
        are dropped here)."""
        _, _, top = heapq.heappop(self._reads.heap)
        if top.step in self._reads.cancelled:
            self.tables[top.layer].complete(top.slot, False)
            return []
        same = sum(1 for _, _, r in self._reads.heap if (r.step, r.layer) == (top.step, top.layer))
        size = -(-(same + 1) // (self.readers - self._reads.busy))
        share = [top]
        while len(share) < size and self._reads.heap and (self._reads.heap[0][2].step, self._reads.heap[0][2].layer) == (top.step, top.layer):
            share.append(heapq.heappop(self._reads.heap)[2])
        return share

    def _read_share(self, share: list[ReadRequest]) -> list[tuple]:
        """In a reader thread: each read of ``share`` with its retries, in order; a read of a
        step cancelled meanwhile is skipped. Per read: (bytes or None, the errors met, seconds)."""
        out = []
        for req in share:
            nbytes, errors, t0 = None, [], time.perf_counter()
            for _ in range(self.retries + 1):
                if req.step in self._reads.cancelled:
                    break
                try:
                    nbytes = self.store.read(req.layer, req.expert, req.slot)
                    break
                except OSError as e:  # ExpertReadError is an OSError too
                    errors.append(e if isinstance(e, ExpertReadError) else ExpertReadError(
                        str(e), layer=req.layer, expert=req.expert))
            out.append((nbytes, errors, time.perf_counter() - t0))
        return out

    async def _read(self, share: list[ReadRequest]) -> None:
        results = []
        try:
            results = await anyio.to_thread.run_sync(self._read_share, share, limiter=self._reads.limiter)
        finally:
            self._reads.busy -= 1
            for i, req in enumerate(share):
                nbytes, errors, seconds = results[i] if i < len(results) else (None, [], 0.0)
                self.stats.read_seconds += seconds
                retried = len(errors) if nbytes is not None else max(len(errors) - 1, 0)  # errors another try followed
                for attempt, e in enumerate(errors[:retried]):
                    self.stats.retries += 1
                    self._emit("io.retry", layer=req.layer, expert=req.expert, attempt=attempt + 1, error=str(e))
                if nbytes is not None:
                    self.stats.reads += 1
                    self.stats.bytes += nbytes
                    self._emit("io.read", step=req.step, layer=req.layer, expert=req.expert, slot=req.slot,
                               bytes=nbytes, ms=round(1e3 * seconds, 3))
                self._finish(req, nbytes is not None and req.step not in self._reads.cancelled,
                             errors[-1] if errors else None)

    def _finish(self, req: ReadRequest, ok: bool, error: BaseException | None) -> None:
        table = self.tables[req.layer]
        if table.expert_of[req.slot] == req.expert:
            table.complete(req.slot, ok)
        self._reads.in_flight[req.step] -= 1
        if not self._reads.in_flight[req.step]:
            del self._reads.in_flight[req.step]
            if req.step in self._reads.drained:
                self._reads.drained.pop(req.step).set()
        if not ok and error is not None and req.step not in self._reads.cancelled:
            self.stats.failures += 1
            if self._log is not None:
                self._log.warning("io.read_error", step=req.step, layer=req.layer, expert=req.expert,
                                  error=str(error))
            for job in self._jobs:
                if job.layer == req.layer and job.slots.get(req.expert) == req.slot and not job.done.done():
                    job.error = error
                    job.finish()
        if self._tg is not None:
            self._pump()
