"""The scheduler driven from another thread, as the engine's compute thread drives it: the
scheduler on its own event-loop thread, ``wait_ready`` from the caller's thread, reads in
shares. A fake store: no MLX, no model."""

from __future__ import annotations

import errno
import threading

import anyio.to_thread
import pytest

from edge0.errors import ExpertReadError, SchedulerError
from edge0.io_sched import scheduler as sched_mod
from edge0.worker import EventLoopThread
from edge0.io_sched.scheduler import LayerPlan, PrefetchScheduler, StepPlan
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


def test_a_thread_gets_each_layer_and_its_consumption_slides_the_window(running, monkeypatch):
    monkeypatch.setattr(sched_mod, "READY_TIMEOUT_S", 10.0)  # a window that never slides fails, not hangs
    store = FakeStore()
    s, loop = running(store, {l: 4 for l in range(4)}, readers=2, prefetch_depth=1)
    posted = []

    def post(fn, *args):
        posted.append(fn.__name__)
        loop.post(fn, *args)

    loop.portal.call(s.submit, plan(0, [(l, [l, l + 1]) for l in range(4)]))
    maps = [s.wait_ready(0, l, post) for l in range(4)]  # depth 1: layer l+1 is read after l is consumed
    assert [(m.layer, m.misses, sorted(m.slot_of)) for m in maps] == [(l, 2, [l, l + 1]) for l in range(4)]
    assert posted == ["_consume"] * 4  # one post per layer, nothing waited on
    loop.portal.call(s.release, 0)
    loop.portal.call(s.submit, plan(1, [(0, [0, 5])]))
    m = s.wait_ready(1, 0, loop.post)
    assert (m.hits, m.misses) == (1, 1)
    with pytest.raises(SchedulerError, match="no pending plan"):
        s.wait_ready(1, 0, loop.post)  # consumed already


def test_a_read_error_reaches_the_waiting_thread_typed(running):
    store = FakeStore(faults={(0, 7): [OSError(errno.EIO, "Input/output error")] * 3})
    s, loop = running(store, {0: 4}, readers=2, retries=2)
    loop.portal.call(s.submit, plan(0, [(0, [7, 8])]))
    with pytest.raises(ExpertReadError, match="Input/output error") as err:
        s.wait_ready(0, 0, loop.post)
    assert (err.value.layer, err.value.expert) == (0, 7)
    assert s.stats.retries == 2 and s.stats.failures == 1


def test_cancelling_a_step_wakes_the_thread_waiting_on_it(running):
    gate = threading.Event()
    store = FakeStore(gate=gate)
    s, loop = running(store, {0: 2}, readers=1)
    loop.portal.call(s.submit, plan(0, [(0, [1, 2])]))
    got = []

    def waiter():
        try:
            s.wait_ready(0, 0, loop.post)
        except SchedulerError as e:
            got.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    cancelled = loop.portal.start_task_soon(s.cancel, 0)  # waits for the read in flight
    gate.set()
    cancelled.result(10)
    t.join(10)
    assert not t.is_alive() and len(got) == 1  # "cancelled", or "no pending plan" if it came late
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
    store = FakeStore()
    s, loop = running(store, {0: 8, 1: 8}, readers=2, prefetch_depth=2)
    loop.portal.call(s.submit, plan(0, [(0, range(8)), (1, [20, 21, 22])]))
    m0, m1 = s.wait_ready(0, 0, loop.post), s.wait_ready(0, 1, loop.post)
    assert (m0.misses, m1.misses) == (8, 3)
    assert handoffs[:2] == [4, 4] and sum(handoffs) == 11 and len(handoffs) <= 4
    assert sorted(e for l, e, _ in store.log if l == 0) == list(range(8))
    assert s.stats.reads == 11 and s.stats.bytes == 1100
