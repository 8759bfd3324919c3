"""The server's access log: one ``http.request`` event per request (method, path, status,
milliseconds, and for a generation its prompt and completion tokens), through Edge0's
structured logging (``edge0.logs.always_logger``, written at the default log level too).

uvicorn's own access log is off (``access_log=False`` in ``edge0.server.command``): it
goes through the standard library's logging in another format, logs a stream when its
headers are sent (before its tokens exist), and the server runs uvicorn at level warning,
which would hide it anyway. This middleware logs when the response has ended, a stream's
last event included; a generation writes its token counts into the request's entry
(``entry``).
"""

from __future__ import annotations

import time

_KEY = "edge0.access"


def entry(scope) -> dict:
    """The access log's entry for this request (the endpoint adds its token counts), or a
    dict nobody reads where the log is off."""
    return scope.get(_KEY, {})


class AccessLog:
    """ASGI middleware: an ``http.request`` event once each HTTP response has ended."""

    def __init__(self, app, log):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        record: dict = {}
        scope[_KEY] = record
        status = []

        async def sending(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.log.info("http.request", method=scope["method"], path=scope["path"],
                          status=status[0] if status else None, ms=round(1e3 * (time.perf_counter() - start), 1),
                          **record)
