"""Making room for a connection takes the connections it closes out of the server's count at
once: uvicorn answers 503 to a request while the count is at ``max_connections``, and drops a
closed connection from it only a loop iteration later."""

from __future__ import annotations

import h11

from edge0.server import connections as C


class _Transport:
    def __init__(self):
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        self.closing = True


class _Conn:
    def __init__(self, host: str, opened_at: float, connections: set):
        self.client, self.opened_at, self.connections = (host, 1), opened_at, connections
        self.transport, self.conn, self.cycle = _Transport(), h11.Connection(h11.SERVER), None
        connections.add(self)


def test_the_connections_closed_for_room_leave_the_count_at_once():
    live: set = set()
    flood = [_Conn("127.0.0.2", t, live) for t in range(8)]
    others = [_Conn("127.0.0.1", 10 + t, live) for t in range(3)]
    new = _Conn("127.0.0.2", 20, live)  # past its share of 8: its oldest idle one goes
    assert C._make_room(new, max_connections=None, max_per_client=8)
    assert flood[0].transport.closing and flood[0] not in live and len(live) == 11
    legit = _Conn("127.0.0.1", 30, live)  # all 12 taken: an idle one of the client holding the most goes
    assert C._make_room(legit, max_connections=12, max_per_client=8)
    gone = [c for c in flood[1:] + [new] if c.transport.closing]
    assert len(gone) == 1 and gone[0] not in live and len(live) == 11 and all(c in live for c in others)
