"""The HTTP connections' bounds: a connection must send its request's headers within
``header_timeout_s`` (slowloris and silent sockets are closed), its body within
``body_timeout_s`` (408, ``edge0.server.app``), and at most ``max_connections`` are served at
once (uvicorn answers 503 beyond). Idle keep-alive connections close after 5 s (uvicorn's
``timeout_keep_alive``). A connection whose client takes none of what is sent to it for
``send_timeout_s`` is closed: its socket's send buffer is capped (``SEND_BUFFER_BYTES``, so
a client that stops reading is noticed within that many bytes rather than the megabytes
a kernel grows a buffer to), and writes that stay blocked that long abort it, which frees
its connection slot, its task and its descriptor."""

from __future__ import annotations

import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from edge0.logs import get_logger


SEND_BUFFER_BYTES = 64 * 1024


def bounded_protocol(header_timeout_s: float, send_timeout_s: float | None = None) -> type:
    """uvicorn's h11 protocol with a timer on each request head: from the moment the
    connection opens (or, on a kept-alive one, the first byte of its next request) the head
    must be complete within ``header_timeout_s``, or the connection is closed. Bytes that
    trickle in do not restart it (uvicorn's own keep-alive timer stops at any byte). And
    with ``send_timeout_s``, a timer on blocked writes: the transport pauses writing when
    the client takes nothing (its buffers full); still paused after ``send_timeout_s``,
    the connection is aborted."""

    class BoundedH11(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)
            self._send_timer = None
            sock = transport.get_extra_info("socket")
            if send_timeout_s is not None and sock is not None:
                try:  # lowered, never raised (Linux reports twice the size it was set to)
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) > 2 * SEND_BUFFER_BYTES:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
                except OSError:  # not a socket that has one
                    pass

        def pause_writing(self) -> None:
            super().pause_writing()
            if send_timeout_s is not None and self._send_timer is None:
                self._send_timer = self.loop.call_later(send_timeout_s, self._send_stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def _send_stalled(self) -> None:
            self._send_timer = None
            if not self.transport.is_closing():
                get_logger("edge0.server").warning("server.client_not_reading", action="connection closed",
                                                   blocked_seconds=send_timeout_s)
                self.transport.abort()  # connection_lost follows: the response's task ends

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            waiting = self.conn.their_state is h11.IDLE  # no whole request head yet
            if waiting and self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)
            elif not waiting and self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def connection_lost(self, exc) -> None:
            for name in ("_head_timer", "_send_timer"):
                if getattr(self, name, None) is not None:
                    getattr(self, name).cancel()
                    setattr(self, name, None)
            super().connection_lost(exc)

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE:
                self.timeout_keep_alive_handler()

    return BoundedH11


def server_config(app, settings, *, host: str, port: int, **kw) -> uvicorn.Config:
    """uvicorn's configuration for ``app`` under ``settings`` (``ServerSettings``)."""
    return uvicorn.Config(app, host=host, port=port, lifespan="on",
                          http=bounded_protocol(settings.header_timeout_s, settings.send_timeout_s),
                          limit_concurrency=settings.max_connections, timeout_keep_alive=5, **kw)
