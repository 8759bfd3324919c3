"""The scheduler driven from another thread, as the engine's compute thread drives it: the
scheduler on its own event-loop thread, ``stage`` called through the portal once a step,
readiness told by ``signal`` (from the reader thread that completed a layer), reads in
shares. A fake store: no MLX, no model."""

from __future__ import annotations

import errno
import threading
import time

import anyio.to_thread
import pytest

from edge0.errors import ExpertReadError, SchedulerError
from edge0.worker import EventLoopThread
from edge0.io_sched.scheduler import PrefetchScheduler
from edge0.io_sched.slots import LayerPlan, StepPlan
from tests.test_scheduler import FakeStore


def plan(step, layers):
    return StepPlan(step, tuple(LayerPlan(l, tuple(e)) for l, e in layers))


@pytest.fixture
def running():
    """``start(store, slots, **kw)`` -> (scheduler, loop thread), closed after the test."""
    opened = []

    def start(store, slots, **kw):
        loop = EventLoopThread(name="test-io")
        s = PrefetchScheduler(store, slots, **kw)
        cm = loop.portal.wrap_async_context_manager(s)
        cm.__enter__()
        opened.append((loop, cm))
        return s, loop

    yield start
    for loop, cm in opened:
        cm.__exit__(None, None, None)
        loop.close()


def drained(s, loop) -> None:
    """Until the loop has taken back every read (its counters are final)."""
    deadline = time.monotonic() + 10
    while loop.portal.call(s.pending_reads) and time.monotonic() < deadline:
        time.sleep(0.01)


class Signals:
    """What ``signal`` told: (layer, step, ok, thread name) in order, and a wait for them."""

    def __init__(self):
        self.told, self.cond = [], threading.Condition()

    def __call__(self, layer, step, ok):
        with self.cond:
            self.told.append((layer, step, ok, threading.current_thread().name))
            self.cond.notify_all()

    def wait(self, n, timeout=10.0):
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.told) >= n, timeout), self.told
        return self.told[:n]


def test_stage_answers_every_slot_map_at_once_and_signals_each_layer_from_its_reader(running):
    signals = Signals()
    store = FakeStore()
    s, loop = running(store, {l: 4 for l in range(4)}, readers=2, prefetch_depth=1, signal=signals)
    maps = loop.portal.call(s.stage, None, [plan(0, [(l, [l, l + 1]) for l in range(4)])])
    assert sorted(maps) == [(0, l) for l in range(4)]  # every layer's slots, claimed in the one call
    assert all(sorted(maps[0, l]) == [l, l + 1] and len(set(maps[0, l].values())) == 2 for l in range(4))
    told = signals.wait(4)
    # depth 1: one layer's reads at a time, in order; each told by the thread that read it
    assert [(l, st, ok) for l, st, ok, _ in told] == [(l, 0, True) for l in range(4)]
    assert all(name != "test-io" for *_, name in told)
    assert sorted(e for _, e, _ in store.log) == [0, 1, 1, 2, 2, 3, 3, 4]  # each layer's two misses
    # the next step: the step before unpinned in the same call; a resident expert is a hit,
    # signalled by the loop at once (nothing to read)
    maps = loop.portal.call(s.stage, 0, [plan(1, [(0, [0, 1])])])
    assert maps == {(1, 0): dict(maps[1, 0])} and sorted(maps[1, 0]) == [0, 1]
    assert signals.wait(5)[4][:3] == (0, 1, True)
    drained(s, loop)
    assert s.stats.hits == 2 and s.tables[1].pinned() == 0  # step 0's pins went with it


def test_a_read_error_is_signalled_and_kept_typed(running):
    signals = Signals()
    store = FakeStore(faults={(0, 7): [OSError(errno.EIO, "Input/output error")] * 3})
    s, loop = running(store, {0: 4}, readers=2, retries=2, signal=signals)
    loop.portal.call(s.stage, None, [plan(0, [(0, [7, 8])])])
    assert signals.wait(1)[0][:3] == (0, 0, False)
    err = s.job_error(0, 0)
    assert isinstance(err, ExpertReadError) and "Input/output error" in str(err)
    assert (err.layer, err.expert) == (0, 7)
    assert s.stats.retries == 2 and s.stats.failures == 1


def test_cancelling_a_staged_step_signals_its_layers_failed(running):
    signals = Signals()
    gate = threading.Event()
    store = FakeStore(gate=gate)
    s, loop = running(store, {0: 2}, readers=1, signal=signals)
    loop.portal.call(s.stage, None, [plan(0, [(0, [1, 2])])])
    deadline = time.monotonic() + 10
    while not store.concurrent and time.monotonic() < deadline:  # the read is in the store, held
        time.sleep(0.001)
    assert store.concurrent == 1
    cancelled = loop.portal.start_task_soon(s.cancel, 0)  # waits for the read in flight
    assert signals.wait(1)[0][:3] == (0, 0, False)  # at once: a graph waiting on it raises, never hangs
    assert isinstance(s.job_error(0, 0), SchedulerError)  # what the compute thread is told it failed with
    gate.set()
    cancelled.result(10)
    assert s.job_error(0, 0) is None  # forgotten with the step: a later step 0 is not blamed for it
    assert s.tables[0].pinned() == 0 and s.tables[0].loading() == 0


def test_a_layers_reads_go_to_the_readers_in_shares(running, monkeypatch):
    """Eight misses of one layer, two readers: two hand-offs to reader threads (one per
    share), not eight; the next layer's three in one or two; every read done."""
    handoffs = []
    real = anyio.to_thread.run_sync

    async def counting(fn, *args, **kw):
        handoffs.append(len(args[0]))
        return await real(fn, *args, **kw)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counting)
    signals = Signals()
    store = FakeStore()
    s, loop = running(store, {0: 8, 1: 8}, readers=2, prefetch_depth=2, signal=signals)
    loop.portal.call(s.stage, None, [plan(0, [(0, range(8)), (1, [20, 21, 22])])])
    assert sorted((l, ok) for l, _, ok, _ in signals.wait(2)) == [(0, True), (1, True)]
    assert handoffs[:2] == [4, 4] and sum(handoffs) == 11 and len(handoffs) <= 4
    assert sorted(e for l, e, _ in store.log if l == 0) == list(range(8))
    drained(s, loop)
    assert s.stats.reads == 11 and s.stats.bytes == 1100


def test_a_cancelled_steps_reads_not_yet_queued_leave_no_slot_loading(running):
    """A staged step's layers claim their slots at once but queue their reads only as they
    enter the ``prefetch_depth`` window; cancelling the step before its later layers did
    frees their slots (nobody else needs them), so the same step planned again, the same
    experts, reads them and is told ready (a slot left loading with no read behind it
    would hold that step forever)."""
    signals = Signals()
    gate = threading.Event()
    store = FakeStore(gate=gate)
    s, loop = running(store, {l: 4 for l in range(3)}, readers=1, prefetch_depth=1, signal=signals)
    layers = [(l, [l, l + 1]) for l in range(3)]
    loop.portal.call(s.stage, None, [plan(5, layers)])  # layer 0's reads held at the gate, 1 and 2 not queued
    cancelled = loop.portal.start_task_soon(s.cancel, 5)
    assert sorted(l for l, st, ok, _ in signals.wait(3) if not ok) == [0, 1, 2]
    gate.set()
    cancelled.result(10)
    assert all(s.tables[l].loading() == 0 and s.tables[l].pinned() == 0 for l in range(3))
    loop.portal.call(s.stage, None, [plan(5, layers)])  # planned again (a batch that changed in between)
    told = signals.wait(6)[3:]
    assert sorted((l, st, ok) for l, st, ok, _ in told) == [(l, 5, True) for l in range(3)]


def test_a_cancelled_steps_unqueued_read_goes_to_the_live_step_sharing_its_slot(running):
    """Step 1 claims an expert step 0 is about to read (a hit on a loading slot: it waits for
    step 0's read); step 0 is cancelled before that read was queued: step 1 reads it."""
    signals = Signals()
    gate = threading.Event()
    store = FakeStore(gate=gate)
    s, loop = running(store, {0: 4, 1: 4}, readers=1, prefetch_depth=1, signal=signals)
    loop.portal.call(s.stage, None, [plan(0, [(0, [1]), (1, [7, 8])])])  # layer 1's reads not queued yet
    loop.portal.call(s.stage, None, [plan(1, [(1, [7])])])  # expert 7: step 0's slot, loading
    cancelled = loop.portal.start_task_soon(s.cancel, 0)
    gate.set()
    cancelled.result(10)
    with signals.cond:  # (step 0's layer 0 may be told ready before it is cancelled: any order)
        assert signals.cond.wait_for(lambda: any(t[:3] == (1, 1, True) for t in signals.told), 10), signals.told
    drained(s, loop)
    assert sum(1 for l, e, _ in store.log if (l, e) == (1, 7)) == 1  # read once, for step 1
    assert s.tables[1].loading() == 0
