"""The HTTP connections' bounds: a connection must send its request's headers within
``header_timeout_s`` (slowloris and silent sockets are closed), its body within
``body_timeout_s`` (408, ``edge0.server.app``), and at most ``max_connections`` are served at
once (uvicorn answers 503 beyond). Idle keep-alive connections close after 5 s (uvicorn's
``timeout_keep_alive``)."""

from __future__ import annotations

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


def header_timeout_protocol(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol with a timer on each request head: from the moment the
    connection opens (or, on a kept-alive one, the first byte of its next request) the head
    must be complete within ``header_timeout_s``, or the connection is closed. Bytes that
    trickle in do not restart it (uvicorn's own keep-alive timer stops at any byte)."""

    class HeaderTimeoutH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            waiting = self.conn.their_state is h11.IDLE  # no whole request head yet
            if waiting and self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)
            elif not waiting and self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE:
                self.timeout_keep_alive_handler()

    return HeaderTimeoutH11


def server_config(app, settings, *, host: str, port: int, **kw) -> uvicorn.Config:
    """uvicorn's configuration for ``app`` under ``settings`` (``ServerSettings``)."""
    return uvicorn.Config(app, host=host, port=port, lifespan="on",
                          http=header_timeout_protocol(settings.header_timeout_s),
                          limit_concurrency=settings.max_connections, timeout_keep_alive=5, **kw)
