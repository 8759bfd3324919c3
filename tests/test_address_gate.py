"""The kernel filter the address gate puts on listening sockets (edge0.server.address_gate):
it drops exactly the banned sources, IPv4 and IPv6, on IPv4 and dual-stack listeners."""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import struct
import sys

import pytest

from edge0.server.address_gate import SO_ATTACH_FILTER, drop_program

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel filter is Linux's")


def _listener(family, host):
    s = socket.socket(family)
    try:
        s.bind((host, 0))
    except OSError as e:
        s.close()
        pytest.skip(f"no {host} here: {e}")
    s.listen(16)
    return s


def _drop(listener, addresses) -> None:
    code = drop_program([ipaddress.ip_address(a) for a in addresses])
    buf = ctypes.create_string_buffer(code, len(code))
    listener.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("HP", len(code) // 8, ctypes.addressof(buf)))


def _connects(family, source, dest, port) -> bool:
    c = socket.socket(family)
    c.bind((source, 0))
    c.settimeout(0.3)
    try:
        c.connect((dest, port))
        return True
    except OSError:
        return False
    finally:
        c.close()


def test_the_filter_drops_the_banned_ipv4_sources_only():
    with _listener(socket.AF_INET, "127.0.0.1") as s:
        port = s.getsockname()[1]
        _drop(s, ["127.0.0.2", "127.0.0.5", "::1", "::ffff:127.0.0.7"])  # a mapped address counts as IPv4
        got = {a: _connects(socket.AF_INET, a, "127.0.0.1", port)
               for a in ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.5", "127.0.0.7")}
        assert got == {"127.0.0.1": True, "127.0.0.2": False, "127.0.0.3": True, "127.0.0.5": False,
                       "127.0.0.7": False}
        _drop(s, [])
        assert _connects(socket.AF_INET, "127.0.0.2", "127.0.0.1", port)


def test_the_filter_reads_both_families_on_a_dual_stack_listener():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    with _listener(socket.AF_INET6, "::") as s:
        port = s.getsockname()[1]
        _drop(s, ["127.0.0.2"])
        assert _connects(socket.AF_INET6, "::1", "::1", port)
        assert _connects(socket.AF_INET, "127.0.0.1", "127.0.0.1", port)
        assert not _connects(socket.AF_INET, "127.0.0.2", "127.0.0.1", port)
        _drop(s, ["::1"])
        assert not _connects(socket.AF_INET6, "::1", "::1", port)
        assert _connects(socket.AF_INET, "127.0.0.2", "127.0.0.1", port)


def test_a_ban_doubles_on_each_repeat_within_a_minute_up_to_its_bound(monkeypatch):
    """--flood-ban: 2 s, then 4, 8 ... while the address repeats within a minute, at most
    MAX_BAN_S; an address a minute quiet starts over at 2."""
    from edge0.server import address_gate as G

    clock = [1000.0]
    monkeypatch.setattr(G.time, "monotonic", lambda: clock[0])
    gate = G.AddressGate(share=1, ban_s=2.0)
    gate.listeners = [object()]
    monkeypatch.setattr(gate, "_apply", lambda: True)
    scheduled = []
    loop = type("Loop", (), {"call_later": lambda self, s, f: scheduled.append(s)})()

    def ban_seconds():
        gate.over_share("10.0.0.9", loop)
        gate.over_share("10.0.0.9", loop)  # over the share of 1 within the second: banned
        seconds = scheduled[-1]
        clock[0] += seconds
        gate._expire()
        assert "10.0.0.9" not in gate.banned
        return seconds

    assert [ban_seconds() for _ in range(7)] == [2, 4, 8, 16, 32, 64, 64]
    clock[0] += G._STRIKE_MEMORY_S + 1
    assert ban_seconds() == 2
