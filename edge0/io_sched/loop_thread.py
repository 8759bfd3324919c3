"""The scheduler's event loop on a daemon thread, driven from the compute thread.

``anyio.from_thread.start_blocking_portal`` runs its loop in a non-daemon pool thread,
which the interpreter joins at exit: an engine nobody closed then kept Python from
exiting. This loop runs on a daemon thread instead, and ``close`` stops it cleanly.
"""

from __future__ import annotations

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
                    handoff.put(portal)
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
        self.portal: BlockingPortal | None = got

    def close(self, timeout: float = 10.0) -> None:
        portal, self.portal = self.portal, None
        if portal is None:
            return
        try:
            portal.call(portal.stop, True)
        except RuntimeError:  # the loop is already gone
            pass
        self._thread.join(timeout)
