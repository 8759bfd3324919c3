"""The async prefetch scheduler: step plans in, byte-range reads out, readiness per layer.

Its data is plain (the tests drive it with a fake store, no MLX, no model; the types are
``edge0.io_sched.slots``'s): ``StepPlan`` / ``LayerPlan`` in, ``ReadRequest``s to a ``Store``
(``read(layer, expert, slot)``, in a reader thread), ``SlotMap``s out. A layer's
``SlotTable`` says what each slot holds: EMPTY, LOADING (being read) or READY. Steps *pin*
the slots they compute with; a pinned slot is never a victim (the least recently used
unpinned one is), so nothing a pending computation reads is overwritten (with 2k slots the
next step's misses land in the other half: double buffering).
A READY expert is a hit, not read again (sticky slots); a failed or cancelled read leaves
its slot EMPTY, never READY.

- ``submit(plan)`` queues one job per staged layer of a step, served in priority order
  (earlier step, then earlier layer), at most ``prefetch_depth`` unconsumed jobs at a time:
  a job entering that window claims its slots; its misses become ``ReadRequest``s.
  ``await ready(step, layer)`` returns the layer's ``SlotMap`` once every planned expert is
  READY, or raises the typed read error; consuming a job slides the window.
- ``stage(release, plans)``, the compute thread's one call a step (through the portal):
  unpins the step before, submits the plans with every layer's slots claimed at once (the
  slot maps are its answer), and tells ``signal(layer, step, ok)`` when each layer is ready
  or failed, from the reader thread that completed it (the loop is not waited for); such a
  job leaves the window when it is ready.
- Reader threads (``anyio.to_thread`` behind a ``CapacityLimiter`` of ``readers``) read,
  highest priority first, each a share of one layer's queued reads at a time (so the loop
  wakes once per share, not per expert; a store with ``read_many`` reads a share in one
  call); a share skips the reads of a cancelled step.
- ``release(step)`` unpins the step's slots once its computation has been evaluated;
  ``await cancel(step)`` drops its queued reads and those its jobs claimed but had not
  queued yet (outside the window), waits for those in flight, leaves their slots EMPTY and
  unpins all it held; a dropped read whose slot another live job also waits on becomes
  that job's read (``_hand_over``), so a step planned again is never left waiting on a
  slot nobody reads.
- Transient read errors are retried ``retries`` times, then fail that job with an
  ``ExpertReadError``; later steps are served.

State lives on the event loop, except what staged jobs share with the reader threads
(``_Staged``, under its lock); ``store.read`` runs in threads.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import anyio

from edge0.errors import ExpertReadError, SchedulerError
from edge0.io_sched.reader import Store
from edge0.io_sched.slots import LOADING, READY, ReadRequest, SlotMap, SlotTable, StepPlan


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
    staged: bool = False  # submitted by ``stage``: consumed once done, its readiness signalled
    reads: list = field(default_factory=list)  # its claimed reads, queued when it enters the window
    waiting: set = field(default_factory=set)  # slots whose reads it waits for (a staged job's)
    signalled: bool = False
    # its one readiness: set by the loop when every slot is READY, the job failed or its step
    # was cancelled (``error`` says which); awaited on the loop (``ready``), blocked on by
    # nobody (a staged job: ``signal`` tells)
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


@dataclass(eq=False)
class _Staged:
    """What jobs submitted by ``stage`` share with the reader threads: who is told of their
    readiness, which jobs wait for which slot's read, the slot maps claimed since the last
    ``stage``, the jobs that failed (for the compute thread), and the lock over them."""

    signal: object  # (layer, step, ok) -> None, or None
    waiters: dict = field(default_factory=dict)  # (layer, slot) -> staged jobs waiting for its read
    claimed: dict = field(default_factory=dict)  # (step, layer) -> {expert: slot}
    errors: dict = field(default_factory=dict)  # (step, layer) -> the error it failed with
    lock: threading.Lock = field(default_factory=threading.Lock)


READY_TIMEOUT_S = 120.0  # a layer waiting this long for its slots: an error, not a hang


class PrefetchScheduler:
    def __init__(self, store: Store, slots_per_layer: dict[int, int], *, readers: int = 2,
                 prefetch_depth: int = 4, retries: int = 2, log=None, signal=None):
        """``signal(layer, step, ok)``: called, from a reader thread or the loop, when a job
        submitted by ``stage`` has every slot READY (``ok``) or has failed."""
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
        self._staged = _Staged(signal)

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
        self._add(plan, staged=False)
        self._pump()

    def stage(self, release: int | None, plans=()) -> dict[tuple[int, int], dict[int, int]]:
        """A compute thread's one call a step (through the portal): unpin step ``release``'s
        slots (its computation has been evaluated), submit ``plans`` with every layer's slots
        claimed at once where free, and answer the slot maps claimed since the last call,
        {(step, layer): {expert: slot}}. Such a job is not awaited: ``signal`` says when it
        is ready (or failed), and it is consumed then (its reads still go in the window's
        order, ``prefetch_depth`` layers at a time)."""
        if release is not None:
            for table in self.tables.values():
                table.release(release)
        for plan in plans:
            self._add(plan, staged=True)
        self._pump()
        claimed, self._staged.claimed = self._staged.claimed, {}
        return claimed

    def _add(self, plan: StepPlan, staged: bool) -> None:
        if self._tg is None:
            raise SchedulerError("the scheduler is not running (use `async with scheduler:`)")
        for order, lp in enumerate(plan.layers):
            if lp.layer not in self.tables:
                raise SchedulerError(f"layer {lp.layer} has no slot table (not a staged layer)")
            experts = tuple(dict.fromkeys(int(e) for e in lp.experts))
            if len(experts) > self.tables[lp.layer].num_slots:
                raise SchedulerError(f"step {plan.step} layer {lp.layer}: {len(experts)} experts do not fit in "
                                     f"{self.tables[lp.layer].num_slots} slots")
            job = _Job(plan.step, lp.layer, order, experts, unclaimed=list(experts), staged=staged)
            self._jobs.append(job)
        self._jobs.sort(key=lambda j: (j.step, j.order))
        self._emit("io.plan", step=plan.step, layers=len(plan.layers),
                   experts=sum(len(lp.experts) for lp in plan.layers))

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

    def _consume(self, job: _Job) -> None:
        if job in self._jobs:
            self._jobs.remove(job)
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
            self._done(job)
        for job in dropped:  # reads claimed, never queued (the job had not entered the window)
            for req in job.reads:
                self._hand_over(req)
            job.reads = []
        self.stats.cancelled += len(dropped)
        if self._reads.in_flight.get(step):
            event = self._reads.drained.setdefault(step, anyio.Event())
            with anyio.CancelScope(shield=True):
                await event.wait()
        for table in self.tables.values():
            table.release(step)
        with self._staged.lock:  # told already (a step is cancelled once its failure was explained)
            for key in [k for k in self._staged.errors if k[0] == step]:
                del self._staged.errors[key]
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
        """Claim slots for the jobs in the window, start reads, wake finished jobs (again
        while finished staged jobs leave the window: the next ones enter it)."""
        while True:
            window = self._jobs[: self.prefetch_depth]
            for job in self._jobs:  # priority order: a staged job claims at once, others in the window
                if job.unclaimed and (job.staged or job in window):
                    self._claim(job)
            for job in window:
                for req in job.reads:
                    heapq.heappush(self._reads.heap, (req.priority, next(self._reads.seq), req))
                job.reads = []
            while self._reads.heap and self._reads.busy < self.readers and self._tg is not None:
                share = self._next_share()
                if not share:
                    continue
                for req in share:
                    self._reads.in_flight[req.step] = self._reads.in_flight.get(req.step, 0) + 1
                self._reads.busy += 1
                self._tg.start_soon(self._read, share)
            jobs = len(self._jobs)
            for job in list(self._jobs):
                self._check(job)
            if len(self._jobs) == jobs:
                return

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
            if job.staged and (needs_read or table.state[slot] == LOADING):
                with self._staged.lock:
                    job.waiting.add(slot)
                    self._staged.waiters.setdefault((job.layer, slot), []).append(job)
            if needs_read:
                job.misses += 1
                layer_stats["misses"] += 1
                self.stats.misses += 1
                job.reads.append(ReadRequest(job.step, job.layer, expert, slot, (job.step, job.order, expert)))
            else:
                job.hits += 1
                layer_stats["hits"] += 1
                self.stats.hits += 1
        job.unclaimed = still
        if job.staged and not still:
            self._staged.claimed[(job.step, job.layer)] = dict(job.slots)

    def _check(self, job: _Job) -> None:
        if job.done.done() or job.unclaimed:
            return
        table = self.tables[job.layer]
        states = [table.state[s] if table.expert_of[s] == e else None for e, s in job.slots.items()]
        if all(s == READY for s in states):
            self._done(job)
        elif any(s not in (READY, LOADING) for s in states):
            job.error = job.error or ExpertReadError("a slot this layer depends on failed to load",
                                                     layer=job.layer)
            self._done(job)

    def _done(self, job: _Job) -> None:
        """``job`` is ready or failed: its future set; a staged job signalled and consumed."""
        job.finish()
        if not job.staged:
            return
        if job in self._jobs:
            self._jobs.remove(job)
        with self._staged.lock:
            told, job.signalled = job.signalled, True
        if job.error is not None:
            with self._staged.lock:
                self._staged.errors[(job.step, job.layer)] = job.error
                while len(self._staged.errors) > 256:
                    self._staged.errors.pop(next(iter(self._staged.errors)))
        if self._staged.signal is not None and (not told or job.error is not None):
            self._staged.signal(job.layer, job.step, job.error is None)

    def job_error(self, step: int, layer: int) -> BaseException | None:
        """The error a staged job of (``step``, ``layer``) failed with, if it did (any thread)."""
        with self._staged.lock:
            return self._staged.errors.get((step, layer))

    def _filled(self, req: ReadRequest) -> None:
        """In a reader thread, a read done: a staged job waiting for nothing else is
        signalled from here, without waiting for the loop."""
        ready = []
        with self._staged.lock:
            for job in self._staged.waiters.pop((req.layer, req.slot), ()):
                job.waiting.discard(req.slot)
                if not job.waiting and not job.unclaimed and not job.signalled and job.error is None:
                    job.signalled = True
                    ready.append(job)
        for job in ready:
            self._staged.signal(job.layer, job.step, True)

    def _hand_over(self, req: ReadRequest) -> None:
        """A read of a cancelled step, not started: its slot (still loading) is another job's
        too, which then reads it (it waits on it), or nobody's, and freed."""
        heir = next((j for j in self._jobs if j.layer == req.layer and j.step != req.step and j.error is None
                     and j.slots.get(req.expert) == req.slot), None)
        if heir is None:
            self.tables[req.layer].complete(req.slot, False)
            return
        heir.reads.append(ReadRequest(heir.step, req.layer, req.expert, req.slot, (heir.step, heir.order, req.expert)))

    def _next_share(self) -> list[ReadRequest]:
        """The next reads for one reader thread: the top of the queue and the rest of its
        layer's queued reads, split evenly over the free readers (a cancelled step's reads
        are dropped here)."""
        _, _, top = heapq.heappop(self._reads.heap)
        if top.step in self._reads.cancelled:
            self._hand_over(top)
            return []
        same = sum(1 for _, _, r in self._reads.heap if (r.step, r.layer) == (top.step, top.layer))
        size = -(-(same + 1) // (self.readers - self._reads.busy))
        share = [top]
        while len(share) < size and self._reads.heap and (self._reads.heap[0][2].step, self._reads.heap[0][2].layer) == (top.step, top.layer):
            share.append(heapq.heappop(self._reads.heap)[2])
        return share

    def _read_share(self, share: list[ReadRequest]) -> list[tuple]:
        """In a reader thread: each read of ``share`` with its retries, in order; a read of a
        step cancelled meanwhile is skipped. Per read: (bytes or None, the errors met, seconds).
        A store with ``read_many`` reads the share's live reads (one layer's) in one call first;
        where that call fails, each is read again alone, and the read its error names has one
        try fewer left (the call was its first)."""
        done, failed = self._read_together(share) if len(share) > 1 and hasattr(self.store, "read_many") else ({}, {})
        out = []
        for req in share:
            if id(req) in done:
                out.append(done[id(req)])
                continue
            nbytes, errors, t0 = None, failed.get(id(req), []), time.perf_counter()
            for _ in range(self.retries + 1 - len(errors)):
                if req.step in self._reads.cancelled:
                    break
                try:
                    nbytes = self.store.read(req.layer, req.expert, req.slot)
                    if self._staged.signal is not None and req.step not in self._reads.cancelled:
                        self._filled(req)
                    break
                except OSError as e:  # ExpertReadError is an OSError too
                    errors.append(e if isinstance(e, ExpertReadError) else ExpertReadError(
                        str(e), layer=req.layer, expert=req.expert))
            out.append((nbytes, errors, time.perf_counter() - t0))
        return out

    def _read_together(self, share: list[ReadRequest]) -> tuple[dict, dict]:
        """The share's live reads in one ``store.read_many`` call: ({id(request): (bytes, [],
        seconds, each its share of the call's)}, {}); where the call failed, ({}, {id(the
        request its error names): [the error]})."""
        live = [req for req in share if req.step not in self._reads.cancelled]
        if len(live) < 2:
            return {}, {}
        t0 = time.perf_counter()
        try:
            sizes = self.store.read_many(live[0].layer, [r.expert for r in live], [r.slot for r in live])
        except OSError as e:
            named = next((r for r in live if getattr(e, "expert", None) == r.expert), None)
            error = e if isinstance(e, ExpertReadError) else ExpertReadError(str(e), layer=live[0].layer)
            return {}, ({id(named): [error]} if named is not None else {})
        seconds = (time.perf_counter() - t0) / len(live)
        out = {}
        for req, nbytes in zip(live, sizes):
            if self._staged.signal is not None and req.step not in self._reads.cancelled:
                self._filled(req)
            out[id(req)] = (nbytes, [], seconds)
        return out, {}

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
            if self._tg is not None:  # once a share: the loop's bookkeeping, not once a read
                self._pump()

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
            for job in list(self._jobs):
                if job.layer == req.layer and job.slots.get(req.expert) == req.slot and not job.done.done():
                    job.error = error
                    self._done(job)
