"""The prefetch scheduler against a fake store: no MLX, no model, no sleeps to wait."""

from __future__ import annotations

import errno
import threading
import time

import anyio
import pytest

from edge0.errors import ExpertReadError
from edge0.io_sched.scheduler import PrefetchScheduler
from edge0.io_sched.slots import EMPTY, READY, LayerPlan, StepPlan
from edge0.errors import SchedulerError

pytestmark = pytest.mark.asyncio


class FakeStore:
    """Records reads; injects latency (in the reader thread) and faults."""

    def __init__(self, latency: float = 0.0, faults=None, gate: threading.Event | None = None):
        self.latency = latency
        self.faults = dict(faults or {})  # (layer, expert) -> list of exceptions to raise, in turn
        self.gate = gate
        self.log: list[tuple[int, int, int]] = []
        self.lock = threading.Lock()
        self.concurrent = 0
        self.max_concurrent = 0

    def read(self, layer, expert, slot):
        with self.lock:
            self.concurrent += 1
            self.max_concurrent = max(self.max_concurrent, self.concurrent)
        try:
            if self.gate is not None:
                self.gate.wait(10)
            if self.latency:
                time.sleep(self.latency)  # the store's simulated disk latency, not a wait in a test
            pending = self.faults.get((layer, expert))
            if pending:
                raise pending.pop(0)
            with self.lock:
                self.log.append((layer, expert, slot))
            return 100
        finally:
            with self.lock:
                self.concurrent -= 1


def plan(step, layers):
    return StepPlan(step, tuple(LayerPlan(l, tuple(e)) for l, e in layers))


async def test_reads_follow_priority_order():
    store = FakeStore()
    async with PrefetchScheduler(store, {0: 4, 1: 4, 2: 4}, readers=1, prefetch_depth=8) as s:
        s.submit(plan(1, [(2, [9, 8]), (0, [1, 2]), (1, [5])]))  # plan order = execution order
        s.submit(plan(0, [(1, [3]), (2, [4])]))  # an earlier step outranks a later one
        for step, layer in [(0, 1), (0, 2), (1, 2), (1, 0), (1, 1)]:
            await s.ready(step, layer)
    # layer 2's reads (8, 9) were already in the single reader, as one share, when step 0
    # arrived; everything queued after them goes by (step, layer position in the plan, expert).
    assert [(l, e) for l, e, _ in store.log] == [(2, 8), (2, 9), (1, 3), (2, 4), (0, 1), (0, 2), (1, 5)]


async def test_n_reads_through_p_readers_take_about_n_l_over_p():
    n, latency, readers = 24, 0.02, 4
    store = FakeStore(latency=latency)
    async with PrefetchScheduler(store, {l: 8 for l in range(6)}, readers=readers, prefetch_depth=6) as s:
        t0 = time.perf_counter()
        s.submit(plan(0, [(l, range(l * 4, l * 4 + 4)) for l in range(6)]))
        for l in range(6):
            await s.ready(0, l)
        elapsed = time.perf_counter() - t0
    ideal = n * latency / readers
    assert len(store.log) == n and store.max_concurrent == readers
    assert ideal * 0.9 <= elapsed <= ideal * 2.0, f"{elapsed:.3f}s vs ideal {ideal:.3f}s"


async def test_sticky_slots_are_not_read_again():
    store = FakeStore()
    async with PrefetchScheduler(store, {0: 4}, readers=2) as s:
        s.submit(plan(0, [(0, [1, 2])]))
        m0 = await s.ready(0, 0)
        s.release(0)
        s.submit(plan(1, [(0, [2, 3])]))
        m1 = await s.ready(1, 0)
    assert (m0.hits, m0.misses) == (0, 2) and (m1.hits, m1.misses) == (1, 1)
    assert m1.slot_of[2] == m0.slot_of[2]
    assert sorted(e for _, e, _ in store.log) == [1, 2, 3]


async def test_pinned_slots_are_never_overwritten_and_s_equals_k_waits_for_release():
    store = FakeStore()
    async with PrefetchScheduler(store, {0: 2}, readers=2, prefetch_depth=4) as s:
        s.submit(plan(0, [(0, [1, 2])]))
        m0 = await s.ready(0, 0)
        s.submit(plan(1, [(0, [3, 4])]))  # both slots pinned by step 0: no victim yet
        await anyio.wait_all_tasks_blocked()
        assert s.tables[0].expert_of == [1, 2] and len(store.log) == 2
        s.release(0)
        m1 = await s.ready(1, 0)
    assert set(m1.slot_of.values()) == set(m0.slot_of.values())
    assert sorted(e for _, e, _ in store.log) == [1, 2, 3, 4]


async def test_injected_eio_gives_typed_error_and_next_step_succeeds():
    store = FakeStore(faults={(0, 7): [OSError(errno.EIO, "Input/output error")] * 3})
    async with PrefetchScheduler(store, {0: 4}, readers=2, retries=2) as s:
        s.submit(plan(0, [(0, [7, 8])]))
        with pytest.raises(ExpertReadError, match="Input/output error") as err:
            await s.ready(0, 0)
        assert err.value.layer == 0 and err.value.expert == 7
        assert s.stats.retries == 2 and s.stats.failures == 1
        assert s.tables[0].lookup(7) is None  # the failed slot is not READY
        s.release(0)
        s.submit(plan(1, [(0, [8, 9])]))
        m = await s.ready(1, 0)
        assert m.hits == 1 and m.misses == 1


async def test_short_read_is_retried_then_succeeds():
    short = ExpertReadError("short read: got 10 of 100 bytes", layer=0, expert=5)
    store = FakeStore(faults={(0, 5): [short]})
    async with PrefetchScheduler(store, {0: 2}, readers=1, retries=2) as s:
        s.submit(plan(0, [(0, [5])]))
        m = await s.ready(0, 0)
    assert m.misses == 1 and s.stats.retries == 1 and s.stats.failures == 0


async def test_persistent_short_read_fails_typed():
    short = ExpertReadError("short read: got 10 of 100 bytes (file truncated?)", layer=0, expert=5)
    store = FakeStore(faults={(0, 5): [short] * 3})
    async with PrefetchScheduler(store, {0: 2}, readers=1, retries=2) as s:
        s.submit(plan(0, [(0, [5])]))
        with pytest.raises(ExpertReadError, match="short read"):
            await s.ready(0, 0)


async def test_cancel_mid_read_leaks_no_slot_task_or_thread():
    gate = threading.Event()
    store = FakeStore(gate=gate)
    threads_before = threading.active_count()
    async with PrefetchScheduler(store, {0: 4, 1: 4}, readers=2, prefetch_depth=4) as s:
        s.submit(plan(0, [(0, [1, 2, 3]), (1, [4])]))
        await anyio.wait_all_tasks_blocked()
        assert store.concurrent == 2 and s.pending_reads() == 4  # two reads in threads, two queued
        assert s.tables[0].loading() == 3 and s.tables[1].loading() == 1
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.cancel, 0)
            await anyio.wait_all_tasks_blocked()
            gate.set()  # let the in-flight reads finish; cancel waits for them
        for table in s.tables.values():
            assert table.pinned() == 0 and table.loading() == 0
            assert READY not in table.state  # nothing half-written (or cancelled) is READY
        assert s.pending_reads() == 0
        with pytest.raises(SchedulerError, match="no pending plan"):
            await s.ready(0, 0)
        gate.clear()
        gate.set()
        s.submit(plan(1, [(0, [1])]))  # the scheduler keeps serving
        assert (await s.ready(1, 0)).misses == 1
    # reader threads are anyio's bounded worker pool: at most `readers` were ever added
    assert threading.active_count() <= threads_before + 2
    # layer 0's three reads went to the two readers as shares (1, 2) and (3): the two reads
    # in flight finished (then were discarded); expert 2 (queued behind 1 in its share) and
    # layer 1's read never ran
    assert sorted(e for _, e, _ in store.log) == [1, 1, 3]


async def test_cancelling_the_waiter_then_cancel_step_cleans_up():
    gate = threading.Event()
    store = FakeStore(gate=gate)
    async with PrefetchScheduler(store, {0: 2}, readers=1) as s:
        s.submit(plan(0, [(0, [1, 2])]))
        with anyio.move_on_after(0) as scope:
            await s.ready(0, 0)
        assert scope.cancelled_caught
        gate.set()
        await s.cancel(0)
        assert s.tables[0].pinned() == 0 and s.tables[0].loading() == 0
        assert all(st == EMPTY for st in s.tables[0].state)


async def test_prefetch_depth_bounds_the_window():
    gate = threading.Event()
    store = FakeStore(gate=gate)
    async with PrefetchScheduler(store, {l: 2 for l in range(4)}, readers=8, prefetch_depth=2) as s:
        s.submit(plan(0, [(l, [l]) for l in range(4)]))
        await anyio.wait_all_tasks_blocked()
        assert [s.tables[l].loading() for l in range(4)] == [1, 1, 0, 0]
        gate.set()
        for l in range(4):
            await s.ready(0, l)
    assert sorted(l for l, _, _ in store.log) == [0, 1, 2, 3]


async def test_bad_plans_are_refused():
    async with PrefetchScheduler(FakeStore(), {0: 2}) as s:
        with pytest.raises(SchedulerError, match="layer 3 has no slot table"):
            s.submit(plan(0, [(3, [1])]))
        with pytest.raises(SchedulerError, match="3 experts do not fit in 2 slots"):
            s.submit(plan(0, [(0, [1, 2, 3])]))
    with pytest.raises(SchedulerError, match="not running"):
        PrefetchScheduler(FakeStore(), {0: 2}).submit(plan(0, [(0, [1])]))


async def test_a_layers_slots_resize_only_while_no_step_uses_them():
    store = FakeStore()
    async with PrefetchScheduler(store, {0: 2, 1: 2}, readers=1, prefetch_depth=4) as s:
        s.submit(plan(0, [(0, [1, 2]), (1, [3])]))
        assert not s.idle(0)
        with pytest.raises(SchedulerError, match="layer 0: its slots cannot be resized while a step uses them"):
            s.resize(0, 4)
        await s.ready(0, 0)
        assert not s.idle(0)  # consumed, still pinned by step 0
        s.release(0)
        with anyio.fail_after(10):
            while s.pending_reads():  # layer 1's read done: only its unconsumed job holds it
                await anyio.sleep(0.01)
        assert s.idle(0) and not s.idle(1)
        s.resize(0, 4)  # grow: the experts already read stay hits
        s.submit(plan(1, [(0, [1, 2, 5, 6])]))
        got = await s.ready(1, 0)
        assert (got.hits, got.misses) == (2, 2) and s.tables[0].num_slots == 4
        s.release(1)
        s.resize(0, 1)  # shrink: what the cut-off slots held is forgotten
        table = s.tables[0]
        assert table.num_slots == 1 and len(table.state) == 1 and set(table.slot_of) <= {table.expert_of[0]}


class ManyStore(FakeStore):
    """A FakeStore that also reads several experts of a layer in one call (as ``SlotStore``
    does through the extension); a fault of any of them fails the whole call."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls: list[tuple[int, list[int]]] = []

    def read_many(self, layer, experts, slots):
        self.calls.append((layer, list(experts)))
        return [self.read(layer, e, s) for e, s in zip(experts, slots)]


async def test_a_share_is_read_in_one_call_where_the_store_can():
    store = ManyStore()
    async with PrefetchScheduler(store, {0: 8, 1: 8}, readers=1, prefetch_depth=4) as s:
        s.submit(plan(0, [(0, [1, 2, 3, 4]), (1, [5, 6])]))
        maps = [await s.ready(0, 0), await s.ready(0, 1)]
    assert sorted(store.calls) == [(0, [1, 2, 3, 4]), (1, [5, 6])]  # a share a call: one layer's reads
    assert [m.misses for m in maps] == [4, 2] and s.stats.reads == 6 and s.stats.bytes == 600
    assert all(s.tables[l].lookup(e) is not None for l, e in [(0, 1), (0, 4), (1, 6)])


async def test_a_failed_call_is_read_again_one_by_one_and_counts_as_the_named_reads_first_try():
    eio = ExpertReadError("Input/output error", layer=0, expert=2)
    store = ManyStore(faults={(0, 2): [eio]})  # transient: the call fails, the read alone succeeds
    async with PrefetchScheduler(store, {0: 4}, readers=1, retries=2) as s:
        s.submit(plan(0, [(0, [1, 2, 3])]))
        m = await s.ready(0, 0)
    assert len(store.calls) == 1 and m.misses == 3
    assert s.stats.retries == 1 and s.stats.failures == 0 and s.stats.reads == 3
    store = ManyStore(faults={(0, 2): [eio] * 3})  # persistent: retries=2 means three tries, the call's first
    async with PrefetchScheduler(store, {0: 4}, readers=1, retries=2) as s:
        s.submit(plan(0, [(0, [1, 2, 3])]))
        with pytest.raises(ExpertReadError, match="Input/output error") as err:
            await s.ready(0, 0)
        assert err.value.expert == 2 and s.stats.retries == 2 and s.stats.failures == 1
        assert not store.faults[(0, 2)]  # every fault met once: no fourth try
        assert s.tables[0].lookup(1) is not None and s.tables[0].lookup(2) is None
