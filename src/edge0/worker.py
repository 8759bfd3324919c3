"""Threads an engine computes on, and the thread its prefetch scheduler's event loop runs
on. (The generations they run hand their events to their consumers through a ``Job``:
``edge0.row``.)

MLX binds lazy arrays to the stream of the thread that built them, and one engine's
state (KV caches, slots, the prerouter's observations) must see one generation at a time.
So every MLX call of an engine, from loading to the last decode step, runs on one
thread, the engine's compute thread, and generations are jobs it runs one after the
other, in the order they were submitted.

Compute threads are pooled for the life of the process (``acquire`` / ``release``): MLX
keeps an OS thread for every Python thread that ever used it (its stream worker), even
after that Python thread ends, so a thread per engine would leak one OS thread per
engine opened; and a thread that used MLX and ended can make the process abort at exit.
A closed engine's thread goes back to the pool, named ``edge0-idle``.

``EventLoopThread`` is the thread the scheduler's event loop runs on, driven from the
compute thread: a daemon thread (``anyio.from_thread.start_blocking_portal`` runs its loop
in a non-daemon pool thread, which the interpreter joins at exit: an engine nobody closed
kept Python from exiting), which ``close`` stops cleanly. Its ``post(fn, *args)`` has the
loop call ``fn`` soon and returns at once, not waiting for the loop thread to be scheduled
(``portal.call`` waits twice: for the task to start, then for its result).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import anyio
from anyio.from_thread import BlockingPortal


class ComputeThread:
    """A daemon thread running submitted callables one at a time, in order.

    Daemon, so that an engine nobody closed never keeps the interpreter from exiting; the
    engine's finalizer closes it properly when it can."""

    def __init__(self, name: str = "edge0-compute"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_serve, args=(self._queue,), name=name, daemon=True)
        self.name = name
        self._thread.start()
        self._closed = False

    def submit(self, fn: Callable, *args) -> Future:
        if self._closed:
            raise RuntimeError("the compute thread is closed")
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def call(self, fn: Callable, *args) -> Any:
        """Run ``fn(*args)`` on the thread and wait for it (inline when already on it)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        return self.submit(fn, *args).result()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def rename(self, name: str) -> None:
        self.name = self._thread.name = name


_POOL: list[ComputeThread] = []
_POOL_LOCK = threading.Lock()


def acquire() -> ComputeThread:
    """A compute thread of the process-wide pool (a new one when none is idle)."""
    with _POOL_LOCK:
        while _POOL:
            thread = _POOL.pop()
            if thread.alive:
                thread.rename("edge0-compute")
                return thread
    return ComputeThread("edge0-compute")


def release(thread: ComputeThread) -> None:
    """Give a compute thread back to the pool once its engine is closed."""
    if thread.alive and not thread.closed:
        thread.rename("edge0-idle")
        with _POOL_LOCK:
            _POOL.append(thread)


def busy_threads() -> int:
    """Edge0 threads doing work for an open engine (idle pooled threads excluded)."""
    return sum(1 for t in threading.enumerate() if t.name.startswith("edge0-") and t.name != "edge0-idle")


def _serve(q: queue.SimpleQueue) -> None:
    while True:
        item = q.get()
        if item is None:
            return
        future, fn, args = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the waiter, never lost
            future.set_exception(e)
        else:
            future.set_result(result)
        del item, future, fn, args


class EventLoopThread:
    def __init__(self, name: str = "edge0-io"):
        handoff: queue.SimpleQueue = queue.SimpleQueue()

        def run() -> None:
            async def main() -> None:
                async with BlockingPortal() as portal:
                    handoff.put((portal, asyncio.get_running_loop(), contextvars.copy_context()))
                    await portal.sleep_until_stopped()

            try:
                anyio.run(main)
            except BaseException as e:  # reported to the creator, who is waiting
                handoff.put(e)

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()
        got = handoff.get()
        if isinstance(got, BaseException):
            raise got
        self.portal: BlockingPortal | None = got[0]
        # ``post(fn, *args)``: the loop calls ``fn`` soon, in the loop's (anyio's) context, so
        # that what ``fn`` calls knows its event loop; what it raises is the loop's exception
        # handler's to log. The loop's own method: no call of Edge0's on the way.
        self.post = functools.partial(got[1].call_soon_threadsafe, context=got[2])

    def close(self, timeout: float = 10.0) -> None:
        portal, self.portal = self.portal, None
        if portal is None:
            return
        try:
            portal.call(portal.stop, True)
        except RuntimeError:  # the loop is already gone
            pass
        self._thread.join(timeout)
