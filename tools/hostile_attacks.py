"""The attacks of one client on the others, for ``tools/load_test.py --hostile``
(docs/SERVER.md, "Hostile clients"), beside the slow clients of tools/hostile_clients.py:

- ``abandoned_wait``: a streamed request with a long prompt, the socket closed 0.3 s after
  the request was sent (it is still waiting for a place behind a busy batch); they come
  ten a second;
- ``heavy_schema``: a ``response_format`` whose pattern is expensive to compile
  (``^(a{1000}){N}$``, N = 20, 21, ... distinct per client): the outcome wanted is a 400
  before generation where compiling passes the server's bounds, else a normal 200, and
  neither stalling the others;
- ``schema_loop``: requests, one after the other until the scenario ends, with the most
  expensive schema the server admits (compiled once, then served from its cache);
- ``cache_probe``: a victim (``user`` alice) sends a prompt holding a six-digit secret; the
  attacker (``user`` mallory) then sends the prefix with each possible next digit and reads
  ``usage.prompt_tokens_details.cached_tokens``: the outcome is how many digits it recovered
  (0 wanted: the prompt cache is shared within one tenant only);
- ``flood``: silent sockets from another address (127.0.0.2 by default), as many as
  ``flood_sockets``, each reopened as soon as the server closes it, until the scenario ends;
- ``template_injection``: a chat request whose ``chat_template_kwargs`` carry a whole
  template of nested loops (``range(100000)`` twice), its client leaving after 3 s: the
  outcome wanted is a quick 400 (the renderer's own parameter), and no place in line held;
- ``big_body``: a completion whose body is 4,000,028 bytes of two million token ids, just
  under the 4 MiB bound, three in a row per client: the outcome wanted is a 400 naming the
  prompt, without stalling the others (``/health`` and the streams).

Each returns a dict with ``outcome`` and ``seconds`` like the clients of
tools/hostile_clients.py (``detail`` where there is more to say).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

SECRET = "480213"
HEAVY_PATTERN = "^(a{1000}){%d}$"
ADMITTED_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                    "age": {"type": "integer"},
                                                    "tags": {"type": "array", "items": {"type": "string"}}},
                   "required": ["name", "age"]}


async def connect(addr, rcvbuf: int | None = None, source: str | None = None) -> socket.socket:
    """A non-blocking socket connected to ``addr`` (``rcvbuf``: its receive buffer, set
    before connecting; ``source``: the local address to connect from)."""
    sock = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:  # before connect, so that the advertised window is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    if source:
        sock.bind((source, 0))
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, addr)
    except BaseException:
        sock.close()
        raise
    return sock


def _request(addr, body: dict, path: str = "/v1/chat/completions") -> bytes:
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {addr[0]}:{addr[1]}\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\nContent-Length: {len(data)}\r\n\r\n")
    return head.encode() + data


async def _post(addr, body: dict, timeout: float = 120.0) -> tuple[str, dict | None]:
    """(status, JSON body or None) of a non-streamed request."""
    loop = asyncio.get_running_loop()
    sock = await connect(addr)
    try:
        await loop.sock_sendall(sock, _request(addr, body))
        data = b""
        async with asyncio.timeout(timeout):
            while chunk := await loop.sock_recv(sock, 65536):
                data += chunk
    except TimeoutError:
        return "open", None
    except (ConnectionResetError, BrokenPipeError):
        return "reset", None
    finally:
        sock.close()
    head, _, payload = data.partition(b"\r\n\r\n")
    parts = head.split(b"\r\n", 1)[0].split()
    status = parts[1].decode() if len(parts) > 1 else "closed"
    if b"chunked" in head.lower():
        payload = _unchunk(payload)
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, None


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size.split(b";")[0] or b"0", 16)
        if n == 0:
            break
        out, data = out + rest[:n], rest[n + 2:]
    return out


TEMPLATE_BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


async def template_injection(addr, i: int, leave_s: float = 3.0) -> dict:
    t0 = time.monotonic()
    body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 4,
            "chat_template_kwargs": {"chat_template": TEMPLATE_BOMB}}
    status, got = await _post(addr, body, timeout=leave_s)
    out = {"outcome": status, "seconds": time.monotonic() - t0}
    if got and status != "200":
        out["detail"] = str((got.get("error") or {}).get("message"))[:80]
    return out


BIG_BODY = ('{"prompt": [' + ",".join(["0"] * 2_000_000) + ",-1]}").encode()


async def big_body(addr, i: int, times: int = 3) -> dict:
    t0, statuses = time.monotonic(), []
    loop = asyncio.get_running_loop()
    for _ in range(times):
        sock = await connect(addr)
        try:
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: {addr[0]}:{addr[1]}\r\nContent-Type: application/json"
                    f"\r\nConnection: close\r\nContent-Length: {len(BIG_BODY)}\r\n\r\n").encode()
            await loop.sock_sendall(sock, head + BIG_BODY)
            data = b""
            async with asyncio.timeout(120):
                while chunk := await loop.sock_recv(sock, 65536):
                    data += chunk
            parts = data.split(b"\r\n", 1)[0].split()
            statuses.append(parts[1].decode() if len(parts) > 1 else "closed")
        except TimeoutError:
            statuses.append("open")
        finally:
            sock.close()
    bad = [s for s in statuses if s != "400"]
    return {"outcome": bad[0] if bad else "400", "detail": ",".join(statuses), "seconds": time.monotonic() - t0}


async def abandoned_wait(addr, i: int, prompt_chars: int = 4000, every: float = 0.1) -> dict:
    """The ``i``-th of them starts ``i * every`` seconds into the scenario."""
    await asyncio.sleep(i * every)
    t0 = time.monotonic()
    loop = asyncio.get_running_loop()
    sock = await connect(addr)
    try:
        body = {"messages": [{"role": "user", "content": ("x = 1\n" * (prompt_chars // 6))}], "max_tokens": 64,
                "stream": True}
        await loop.sock_sendall(sock, _request(addr, body))
        await asyncio.sleep(0.3)
    finally:
        sock.close()
    return {"outcome": "left", "seconds": time.monotonic() - t0}


async def heavy_schema(addr, i: int) -> dict:
    t0 = time.monotonic()
    body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "heavy", "schema": {"type": "string", "pattern": HEAVY_PATTERN % (20 + i)}}}}
    status, got = await _post(addr, body)
    out = {"outcome": status, "seconds": time.monotonic() - t0}
    if status.startswith("5") and got:  # what went wrong, for the report
        out["detail"] = str((got.get("error") or {}).get("message"))[:200]
    return out


async def schema_loop(addr, stop: asyncio.Event) -> dict:
    t0, statuses = time.monotonic(), {}
    body = {"messages": [{"role": "user", "content": "A person as JSON:"}], "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": ADMITTED_SCHEMA}}}
    while not stop.is_set():
        status, _ = await _post(addr, body)
        statuses[status] = statuses.get(status, 0) + 1
    detail = ", ".join(f"{k} x{v}" for k, v in sorted(statuses.items()))
    bad = [k for k in statuses if k != "200"]
    return {"outcome": bad[0] if bad else "200", "detail": detail, "seconds": time.monotonic() - t0}


async def cache_probe(addr) -> dict:
    t0 = time.monotonic()
    prefix = "Remember this for later. The access code for the vault is "

    def body(text: str, user: str) -> dict:
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0, "user": user}

    status, _ = await _post(addr, body(prefix + SECRET + ". Keep it safe.", "alice"))
    if status != "200":
        return {"outcome": f"victim {status}", "seconds": time.monotonic() - t0}
    known = ""
    for _ in SECRET:
        cached = {}
        for d in "0123456789":
            status, got = await _post(addr, body(prefix + known + d, "mallory"))
            if status != "200" or got is None:
                return {"outcome": f"probe {status}", "seconds": time.monotonic() - t0}
            cached[d] = ((got.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        best = max(cached.values())
        if best == 0 or list(cached.values()).count(best) > 1:
            break  # no digit stands out: nothing learned
        known += max(cached, key=cached.get)
    right = sum(1 for a, b in zip(known, SECRET) if a == b)
    return {"outcome": f"{right} digits recovered", "seconds": time.monotonic() - t0}


async def flood(addr, stop: asyncio.Event, sockets: int = 260, source: str = "127.0.0.2") -> dict:
    t0, opened, refused = time.monotonic(), 0, 0
    loop = asyncio.get_running_loop()

    async def hold():
        nonlocal opened, refused
        while not stop.is_set():
            try:
                sock = await connect(addr, source=source)
            except OSError:
                refused += 1
                await asyncio.sleep(0.05)
                continue
            opened += 1
            try:
                reader = asyncio.ensure_future(loop.sock_recv(sock, 1024))
                waiter = asyncio.ensure_future(stop.wait())
                await asyncio.wait([reader, waiter], return_when=asyncio.FIRST_COMPLETED)
                for t in (reader, waiter):
                    t.cancel()
                await asyncio.gather(reader, waiter, return_exceptions=True)
            finally:
                sock.close()

    await asyncio.gather(*(hold() for _ in range(sockets)))
    return {"outcome": "held", "detail": f"{opened} connections, {refused} refused",
            "seconds": time.monotonic() - t0}
