"""Client addresses that flood the server with connections are turned away by the kernel.

The per-client share (``edge0.server.connections``) keeps one address from holding every
connection, but an address that reconnects as fast as the server closes its surplus still
makes the event loop accept and close tens of thousands of connections a second: the
process must accept a connection to learn its address. So an address that arrives at its
full share more than ``share`` times within one second is banned for ``ban_s`` seconds
(doubled each time it is banned again within a minute of its last ban's end, up to
``MAX_BAN_S``): a classic BPF
filter on the listening sockets drops its packets before they reach the accept queue, so
its connects wait in the client's own SYN retries and cost this process nothing. Other
addresses, and the banned address's connections already open, are untouched.

Linux only (``SO_ATTACH_FILTER``); elsewhere the share alone applies, and the first ban
says so in the log once. A firewall's per-address rate limit in front of the server does
the same for every platform.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import struct
import sys
import time
from collections import deque

from edge0.logs import get_logger

SO_ATTACH_FILTER = 26 if sys.platform.startswith("linux") else None  # <asm-generic/socket.h>
MAX_BAN_S = 64.0
MAX_BANNED = 64  # addresses dropped at once (the oldest ban gives way beyond)
_WINDOW_S = 1.0
_STRIKE_MEMORY_S = 60.0
_TRACKED = 1024  # addresses remembered before the stale ones are forgotten
_NET = -0x100000  # SKF_NET_OFF: offsets from the network header
_LD_W, _LD_B, _RSH, _JEQ, _JA, _RET = 0x20, 0x30, 0x74, 0x15, 0x05, 0x06
_ACCEPT, _DROP = 0xFFFFFFFF, 0


def drop_program(addresses) -> bytes:
    """A classic BPF program that drops IPv4 and IPv6 packets whose source is one of
    ``addresses`` (``ipaddress`` objects; IPv4-mapped IPv6 ones count as IPv4) and keeps
    the rest. Each address is a block of word compares that falls through to a jump to the
    drop when all match, and skips to the next block at the first that does not."""
    plain = [getattr(a, "ipv4_mapped", None) or a for a in addresses]
    v4 = {a for a in plain if a.version == 4}
    v6 = {a for a in plain if a.version == 6}
    code: list = [(_LD_B, _NET), (_RSH, 4), (_JEQ, 4, 0, 1), (_JA, "v4"), (_JEQ, 6, 0, 1), (_JA, "v6"),
                  (_JA, "keep")]
    labels = {}
    for name, family, offset in (("v4", sorted(v4, key=str), 12), ("v6", sorted(v6, key=str), 8)):
        labels[name] = len(code)
        for a in family:
            words = struct.unpack(f"!{len(a.packed) // 4}I", a.packed)
            for n, w in enumerate(words):
                after = 2 * (len(words) - n - 1)  # compares left in this block
                code += [(_LD_W, _NET + offset + 4 * n), (_JEQ, w, 0, after + 1)]
            code.append((_JA, "drop"))
        code.append((_JA, "keep"))
    labels["keep"], labels["drop"] = len(code), len(code) + 1
    code += [(_RET, _ACCEPT), (_RET, _DROP)]
    out = []
    for i, (op, k, *jumps) in enumerate(code):
        if op == _JA:
            k = labels[k] - i - 1
        jt, jf = jumps or (0, 0)
        out.append(struct.pack("HBBI", op, jt, jf, k & 0xFFFFFFFF))
    return b"".join(out)


class AddressGate:
    """Counts, per client address, the connections that arrive while it holds its full
    share, and bans an address that does so more than ``share`` times in a second."""

    def __init__(self, share: int, ban_s: float, metrics=None):
        self.share, self.ban_s, self.metrics = share, ban_s, metrics
        self.listeners: list[socket.socket] = []
        self.banned: dict[str, float] = {}  # address -> monotonic time its ban ends
        self._arrivals: dict[str, deque] = {}
        self._strikes: dict[str, tuple[int, float]] = {}  # address -> (bans in a row, when the last ended)
        self._unsupported = SO_ATTACH_FILTER is None
        self._log = get_logger("edge0.server")

    def listen_on(self, sockets) -> None:
        self.listeners = [s for s in sockets if s.family in (socket.AF_INET, socket.AF_INET6)]

    def over_share(self, host: str, loop) -> None:
        """A connection from ``host`` arrived while it held its whole share."""
        if self.ban_s <= 0 or not host or not self.listeners:
            return
        now = time.monotonic()
        if len(self._arrivals) > _TRACKED or len(self._strikes) > _TRACKED:
            self._forget(now)
        seen = self._arrivals.setdefault(host, deque())
        seen.append(now)
        while seen and seen[0] < now - _WINDOW_S:
            seen.popleft()
        if len(seen) > self.share and host not in self.banned:
            self._ban(host, now, loop)

    def _ban(self, host: str, now: float, loop) -> None:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return
        count, ended = self._strikes.get(host, (0, 0.0))
        count = count + 1 if now - ended < _STRIKE_MEMORY_S else 1
        seconds = min(MAX_BAN_S, self.ban_s * 2 ** (count - 1))
        self._strikes[host] = (count, now + seconds)
        self.banned[host] = now + seconds
        while len(self.banned) > MAX_BANNED:
            del self.banned[min(self.banned, key=self.banned.get)]
        self._arrivals.pop(host, None)
        if self._apply():
            self._log.warning("server.address_banned", client=host, seconds=seconds,
                              reason=f"over its {self.share} connections more than {self.share} times in a second")
            if self.metrics is not None:
                self.metrics.address_bans += 1
            loop.call_later(seconds, self._expire)

    def _forget(self, now: float) -> None:
        self._arrivals = {h: q for h, q in self._arrivals.items() if q and q[-1] >= now - _WINDOW_S}
        self._strikes = {h: v for h, v in self._strikes.items() if v[1] >= now - _STRIKE_MEMORY_S}

    def _expire(self) -> None:
        now = time.monotonic()
        ended = [h for h, until in self.banned.items() if until <= now + 0.01]
        for h in ended:
            del self.banned[h]
        if ended:
            self._apply()

    def _apply(self) -> bool:
        if self._unsupported:
            return False
        code = drop_program([ipaddress.ip_address(h) for h in self.banned])
        buf = ctypes.create_string_buffer(code, len(code))
        prog = struct.pack("HP", len(code) // 8, ctypes.addressof(buf))
        try:
            for s in self.listeners:
                s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, prog)
        except OSError as e:
            self._unsupported = True
            self._log.warning("server.address_gate_unavailable", error=str(e),
                              effect="flooding addresses keep their share only; rate-limit them in front")
            return False
        return True
