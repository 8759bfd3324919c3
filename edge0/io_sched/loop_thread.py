"""The scheduler's event loop on a daemon thread, driven from the compute thread.

``anyio.from_thread.start_blocking_portal`` runs its loop in a non-daemon pool thread,
which the interpreter joins at exit: an engine nobody closed then kept Python from
exiting. This loop runs on a daemon thread instead, and ``close`` stops it cleanly.

``post(fn, *args)`` has the loop call ``fn`` soon and returns at once: where the caller needs
no answer, it does not wait for the loop thread to be scheduled (``portal.call`` waits twice:
for the task to start, then for its result).
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading

import anyio
from anyio.from_thread import BlockingPortal


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
        self._loop: asyncio.AbstractEventLoop = got[1]
        self._context = got[2]  # the loop's (anyio's) context: what ``fn`` calls knows its event loop

    def post(self, fn, *args) -> None:
        """Call ``fn(*args)`` on the loop soon, without waiting (what it raises is the
        loop's exception handler's to log)."""
        if self.portal is None:
            raise RuntimeError("the event loop thread is closed")
        self._loop.call_soon_threadsafe(fn, *args, context=self._context)

    def close(self, timeout: float = 10.0) -> None:
        portal, self.portal = self.portal, None
        if portal is None:
            return
        try:
            portal.call(portal.stop, True)
        except RuntimeError:  # the loop is already gone
            pass
        self._thread.join(timeout)
