"""Threads an engine computes on, and the generation jobs they run.

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

A ``Job`` hands its events to one consumer through its buffer (``offer``: the compute
thread never waits on a consumer; one that leaves ``ahead`` events untaken for
``stall_timeout`` seconds is stopped). The consumer may leave at any
time from any thread or task: ``cancel()`` only sets a flag and wakes the producer, which
then closes the generation on the compute thread by itself. Nothing is released by the
consumer, so a consumer that is cancelled, breaks out of its loop or is garbage collected
in another task cannot leave a lock held or work half done.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

import anyio

from edge0.errors import StalledConsumerError

END = object()  # the last item a job hands out
TIMEOUT = object()  # Job.get's answer when nothing came within its timeout


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


class Job:
    """One generation's hand-off from the compute thread to its consumer."""

    def __init__(self, ahead: int = 2):
        self.ahead = ahead
        self._items: deque = deque()
        self._cond = threading.Condition()
        self.cancelled = False
        self.started = False  # the compute thread has begun it (it is no longer queued)
        self.finished = False
        self.error: BaseException | None = None
        self.admission = None  # the engine's Admission this generation was started with, if any
        self.stall_timeout: float | None = None  # longest wait for the consumer in put (None: no bound)
        self._wakers: list = []  # called (without arguments, any thread) whenever the job changes
        self._behind_since: float | None = None  # offer: since when ``ahead`` items wait for the consumer

    def add_waker(self, fn) -> None:
        """Call ``fn`` whenever an item, the start, the end or a cancellation happens: an
        async consumer's way to wait without holding a thread. ``fn`` must not block."""
        with self._cond:
            self._wakers.append(fn)

    def remove_waker(self, fn) -> None:
        with self._cond:
            if fn in self._wakers:
                self._wakers.remove(fn)

    def _changed(self) -> None:  # under the condition's lock
        self._cond.notify_all()
        for fn in self._wakers:
            fn()

    # -- producer (compute thread) --------------------------------------------------------
    def offer(self, item) -> bool:
        """Hand ``item`` to the consumer without waiting (a batch's step must not wait for
        one consumer): False when the consumer has left, or has taken nothing for
        ``stall_timeout`` seconds while ``ahead`` items waited for it (the job is then
        cancelled with ``StalledConsumerError``)."""
        with self._cond:
            if self.cancelled:
                return False
            now = time.monotonic()
            if len(self._items) < self.ahead:
                self._behind_since = None
            elif self._behind_since is None:
                self._behind_since = now
            elif self.stall_timeout is not None and now - self._behind_since >= self.stall_timeout:
                self.error = StalledConsumerError(
                    f"the consumer took no token for {self.stall_timeout:g} s; the generation was stopped")
                self.cancelled = True
                self._items.clear()
                self._changed()
                return False
            self._items.append(item)
            self._changed()
            return True

    def _took(self) -> None:  # under the condition's lock: the consumer took an item
        self._behind_since = None
        self._cond.notify_all()

    def start(self) -> None:
        with self._cond:
            self.started = True
            self._changed()

    def finish(self, error: BaseException | None = None) -> None:
        with self._cond:
            self.error = error or self.error
            self.finished = True
            self._changed()

    # -- consumer (any thread) --------------------------------------------------------------
    def get(self, timeout: float | None = None):
        """The next item, waiting for it; ``END`` once the job finished or was cancelled
        (then ``error`` holds what stopped it, if anything); ``TIMEOUT`` when ``timeout``
        seconds passed without either (nothing is consumed then)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items or self.finished or self.cancelled, timeout):
                return TIMEOUT
            if self._items and not self.cancelled:
                item = self._items.popleft()
                self._took()
                return item
            return END

    def poll(self):
        """The next item if one is waiting, ``END`` if none will come, else None."""
        with self._cond:
            if self._items and not self.cancelled:
                item = self._items.popleft()
                self._took()
                return item
            return END if (self.finished or self.cancelled) else None

    def cancel(self) -> None:
        with self._cond:
            self.cancelled = True
            self._items.clear()
            self._changed()


class DiscardingJob(Job):
    """A generation whose events nobody takes (a pipeline rank that follows rank 0, which
    answers the client): each is dropped as it comes."""

    def offer(self, item) -> bool:
        return not self.cancelled


class AsyncWaker:
    """An async consumer's wait for its job to change (``job.add_waker(waker)``): the
    compute thread schedules the event's ``set`` on the consumer's event loop (asyncio or
    trio, ``anyio.lowlevel.current_token()``), never blocking itself."""

    def __init__(self, token):
        self._token = token
        self._event = anyio.Event()

    def __call__(self) -> None:  # any thread
        try:
            self._token.backend_class.run_sync_soon(self._set, (), self._token.native_token)
        except Exception:  # noqa: BLE001 - the loop is gone: nobody is waiting
            pass

    def _set(self) -> None:
        self._event.set()

    async def wait(self, job: Job, timeout: float | None):
        """The job's next item or END, or TIMEOUT after ``timeout`` seconds."""
        while True:
            self._event = anyio.Event()  # armed before the check: a change after it sets this one
            event = job.poll()
            if event is not None:
                return event
            with anyio.move_on_after(timeout):
                await self._event.wait()
                continue
            return TIMEOUT
