"""Threads an engine computes on. (The generations they run hand their events to their
consumers through a ``Job``: ``edge0.row``.)

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
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


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
