"""The HTTP connections' bounds: a connection must send its request's headers within
``header_timeout_s`` (slowloris and silent sockets are closed), its body within
``body_timeout_s`` (408, ``edge0.server.app``), and at most ``max_connections`` are served at
once (uvicorn answers 503 beyond), at most ``max_per_client`` of them from one client
address: past its share a client's oldest idle connection is closed to make room, or, with
none idle, the new one is. When all ``max_connections`` are taken, a new connection closes
an idle one (no request in progress: a silent socket or a kept-alive one between requests)
of the client holding the most, so that silent sockets from one address cannot turn every
other client away; an address that keeps arriving at its full share is banned in the kernel
for a while (``edge0.server.address_gate``). Idle keep-alive connections close after 5 s (uvicorn's
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
from edge0.server.address_gate import AddressGate


SEND_BUFFER_BYTES = 64 * 1024


def _idle(p) -> bool:
    """No request in progress on connection ``p`` (nothing sent yet, or between requests)."""
    return (not p.transport.is_closing() and p.conn.their_state is h11.IDLE
            and (p.cycle is None or p.cycle.response_complete))


def _host(p) -> str:
    return p.client[0] if getattr(p, "client", None) else ""


def _close(p) -> None:
    """Abort connection ``p`` and take it out of the server's count now: uvicorn drops it only
    when its loss is processed, a loop iteration later, and counts it against
    ``max_connections`` meanwhile (a flood whose excess connections are closed as they come
    would otherwise turn other clients' requests into 503s)."""
    p.transport.abort()
    p.connections.discard(p)


def _make_room(new, max_connections: int | None, max_per_client: int | None, gate=None) -> bool:
    """Connection ``new``'s client within its share and the server within its bound, by
    closing idle connections; False when ``new`` itself was refused."""
    others = [p for p in new.connections if p is not new and not p.transport.is_closing()]
    mine = [p for p in others if _host(p) == _host(new)]
    if max_per_client is not None and len(mine) >= max_per_client:
        if gate is not None:
            gate.over_share(_host(new), new.loop)
        idle = sorted((p for p in mine if _idle(p)), key=lambda p: p.opened_at)
        if not idle:
            get_logger("edge0.server").warning("server.client_connections", client=_host(new),
                                               action="connection refused", limit=max_per_client)
            _close(new)
            return False
        _close(idle[0])
        others.remove(idle[0])
    if max_connections is not None and len(others) + 1 >= max_connections:
        counts: dict[str, int] = {}
        for p in others:
            counts[_host(p)] = counts.get(_host(p), 0) + 1
        idle = [p for p in others if _idle(p)]
        if idle:  # the most-connected client's oldest idle connection
            victim = min(idle, key=lambda p: (-counts[_host(p)], p.opened_at))
            get_logger("edge0.server").info("server.connections_full", action="idle connection closed",
                                            client=_host(victim))
            _close(victim)
    return True


def bounded_protocol(header_timeout_s: float, send_timeout_s: float | None = None, *,
                     max_connections: int | None = None, max_per_client: int | None = None,
                     gate: AddressGate | None = None) -> type:
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
            self.opened_at = self.loop.time()
            if not _make_room(self, max_connections, max_per_client, gate):
                return
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
    """uvicorn's configuration for ``app`` under ``settings`` (``ServerSettings``); the
    address gate it counts on is ``app.state.edge0.address_gate`` (``make_server`` gives it
    the listening sockets)."""
    state = app.state.edge0
    state.address_gate = AddressGate(settings.max_connections_per_client, settings.flood_ban_s, state.metrics)
    return uvicorn.Config(app, host=host, port=port, lifespan="on",
                          http=bounded_protocol(settings.header_timeout_s, settings.send_timeout_s,
                                                max_connections=settings.max_connections,
                                                max_per_client=settings.max_connections_per_client,
                                                gate=state.address_gate),
                          limit_concurrency=settings.max_connections, timeout_keep_alive=5, **kw)


def make_server(app, settings, *, host: str, port: int, **kw) -> uvicorn.Server:
    """A uvicorn server for ``app`` (``server_config``) whose listening sockets, once open,
    carry the address gate's filter."""
    server = uvicorn.Server(server_config(app, settings, host=host, port=port, **kw))
    startup = server.startup

    async def gated(sockets=None):
        await startup(sockets=sockets)
        app.state.edge0.address_gate.listen_on([s for srv in server.servers for s in srv.sockets])

    server.startup = gated
    return server
