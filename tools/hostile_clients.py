"""Slow and hostile clients for ``tools/load_test.py --hostile`` (docs/SERVER.md, "Hostile clients").

Each client is a raw, non-blocking socket on the event loop of this process, so that it
does exactly what it says and nothing more (an HTTP library reads what the server sends;
a silent stream here never does):

- ``silent_stream``: a streamed chat completion on a socket with a small receive buffer
  that is never read until the scenario ends;
- ``slowloris``: a request head sent one byte every ``interval`` seconds, never finished;
- ``unfinished_body``: a whole head with ``Content-Length`` N, half of the body, then nothing;
- ``silent_socket``: a connection that sends nothing;
- ``oversize``: a 4 MiB prompt (a body over the server's 4 MiB bound by Content-Length, the
  same sent chunked, or one just under the bound: 413, 413 and 400 expected, and fast).

A client's outcome is the status code it got, ``closed`` (the server closed the connection
without an answer, as it does to a head that takes too long), ``reset``, or ``open`` (still
open when the scenario ended and this tool closed it). ``run_scenario`` runs a mix at once
and closes every socket when it ends; ``run_hostile`` is the whole hostile phase: the quiet
run of the normal clients, the rounds of ``SCENARIOS`` while they stream, and the server's
state (``server_state``) before, during (``Sampler``) and after (``settle``).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import socket
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from urllib.parse import urlsplit

import hostile_attacks as attacks

MIB = 1 << 20
RCVBUF = 4096  # a silent stream's receive buffer (the kernel doubles it)
KINDS = ("silent_stream", "slowloris", "unfinished_body", "silent_socket", "oversize",  # slow clients
         "abandoned_wait", "heavy_schema", "schema_loop", "cache_probe", "flood",  # tools/hostile_attacks.py
         "template_injection", "big_body")
OVERSIZE_VARIANTS = ("content-length", "chunked", "under-limit")


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


_connect = attacks.connect


def _head(addr: tuple[str, int], path: str, length: int | None, chunked: bool = False) -> bytes:
    host = f"[{addr[0]}]" if ":" in addr[0] else addr[0]
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{addr[1]}", "Content-Type: application/json",
             "Accept: text/event-stream"]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _status(sock: socket.socket, timeout: float) -> tuple[str, bytes]:
    """The status code the server answered on ``sock`` (and what came with it), ``closed``
    (EOF before a status line), ``reset``, or ``open`` after ``timeout`` seconds."""
    loop, data = asyncio.get_running_loop(), b""
    try:
        async with asyncio.timeout(timeout):
            while b"\r\n" not in data:
                chunk = await loop.sock_recv(sock, 65536)
                if not chunk:
                    return "closed", data
                data += chunk
    except TimeoutError:
        return "open", data
    except (ConnectionResetError, BrokenPipeError):
        return "reset", data
    parts = data.split(b"\r\n", 1)[0].split()
    return (parts[1].decode() if len(parts) > 1 else "garbled"), data


async def silent_stream(addr, stop: asyncio.Event, max_tokens: int) -> dict:
    """A streamed chat completion nobody reads until ``stop``; then what the server made of
    it: the stream's status, and whether it had ended (``[DONE]``), ended on an error
    event (a stopped generation), been cut, or was still open."""
    t0 = time.monotonic()
    body = json.dumps({"messages": [{"role": "user", "content": "def walk(tree):"}], "max_tokens": max_tokens,
                       "temperature": 0.7, "stream": True}).encode()
    sock = await _connect(addr, RCVBUF)
    try:
        await asyncio.get_running_loop().sock_sendall(sock, _head(addr, "/v1/chat/completions", len(body)) + body)
        await stop.wait()
        status, data = await _status(sock, 1.0)
        rest = await _drain(sock, 1.0) if not data.endswith(b"\r\n0\r\n\r\n") else (b"", True)
        data += rest[0]
        end = ("complete" if b"data: [DONE]" in data else "error event" if b'"error"' in data
               else "cut" if rest[1] else "open")
        return {"outcome": status, "detail": f"stream {end}", "seconds": time.monotonic() - t0}
    finally:
        sock.close()


async def _drain(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """What is left on ``sock`` up to the end of its response (the closing chunk of a
    chunked body) within ``timeout`` s, and whether the server had closed it or ended it."""
    loop, data = asyncio.get_running_loop(), b""
    try:
        async with asyncio.timeout(timeout):
            while chunk := await loop.sock_recv(sock, 1 << 20):
                data += chunk
                if data.endswith(b"\r\n0\r\n\r\n"):
                    break
            return data, True
    except TimeoutError:
        return data, False
    except (ConnectionResetError, BrokenPipeError):
        return data, True


async def slowloris(addr, stop: asyncio.Event, interval: float = 1.0) -> dict:
    """A request head one byte every ``interval`` seconds, never finished; until the server
    closes the connection (or answers) or ``stop``."""
    t0 = time.monotonic()
    head = _head(addr, "/v1/chat/completions", 64)[:-2]  # never the final blank line
    sock = await _connect(addr)
    loop = asyncio.get_running_loop()
    try:
        for i in range(len(head)):
            try:
                await loop.sock_sendall(sock, head[i:i + 1])
            except (ConnectionResetError, BrokenPipeError):  # the server had closed it
                return {"outcome": "closed", "seconds": time.monotonic() - t0}
            status, _ = await _status(sock, interval)  # the server's answer or its close, if any
            if status != "open":  # a reset: a byte sent just as the server closed it
                return {"outcome": "closed" if status == "reset" else status, "seconds": time.monotonic() - t0}
            if stop.is_set():
                break
        return {"outcome": "open", "seconds": time.monotonic() - t0}
    finally:
        sock.close()


async def unfinished_body(addr, stop: asyncio.Event, length: int = 2048) -> dict:
    """A whole head with ``Content-Length: length``, half the body, then nothing."""
    t0 = time.monotonic()
    sock = await _connect(addr)
    try:
        body = b'{"messages": [{"role": "user", "content": "' + b"x" * length
        await asyncio.get_running_loop().sock_sendall(sock, _head(addr, "/v1/chat/completions", length)
                                                      + body[:length // 2])
        return await _until_stop(sock, stop, t0)
    finally:
        sock.close()


async def silent_socket(addr, stop: asyncio.Event) -> dict:
    """A connection that sends nothing."""
    t0 = time.monotonic()
    sock = await _connect(addr)
    try:
        return await _until_stop(sock, stop, t0)
    finally:
        sock.close()


async def _until_stop(sock: socket.socket, stop: asyncio.Event, t0: float) -> dict:
    """The server's answer or close on ``sock``, or ``open`` if ``stop`` comes first."""
    reader = asyncio.ensure_future(_status(sock, 1e9))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([reader, stopper], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not reader.done():
        reader.cancel()
        return {"outcome": "open", "seconds": time.monotonic() - t0}
    return {"outcome": reader.result()[0], "seconds": time.monotonic() - t0}


async def oversize(addr, variant: str, size: int = 4 * MIB, limit: int = 4 * MIB) -> dict:
    """A prompt of ``size`` characters (``under-limit``: a body just under ``limit`` bytes),
    sent while the answer is read, so that an early 413 is seen even if the server closes
    before the body is all sent."""
    t0 = time.monotonic()
    chars = limit - 1024 if variant == "under-limit" else size
    body = b'{"messages": [{"role": "user", "content": "' + b"a" * chars + b'"}], "max_tokens": 8}'
    chunked = variant == "chunked"
    sock = await _connect(addr)
    loop = asyncio.get_running_loop()

    async def send():
        await loop.sock_sendall(sock, _head(addr, "/v1/chat/completions", len(body), chunked))
        for i in range(0, len(body), 256 * 1024):
            piece = body[i:i + 256 * 1024]
            await loop.sock_sendall(sock, b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        if chunked:
            await loop.sock_sendall(sock, b"0\r\n\r\n")

    sender = asyncio.ensure_future(send())
    try:
        status, _ = await _status(sock, 60.0)
        return {"outcome": status, "detail": variant, "seconds": time.monotonic() - t0}
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        sock.close()


async def run_scenario(url: str, counts: dict[str, int], hold_s: float, silent_max_tokens: int,
                       max_body: int = 4 * MIB, silent_hold_s: float | None = None) -> list[dict]:
    """``counts[kind]`` clients of each kind at once, until each has its outcome or ``hold_s``
    seconds have passed (silent streams: ``silent_hold_s``, by default ``hold_s``); then every
    socket still open is closed. Returns one outcome per client (``kind``, ``outcome``,
    ``seconds``). ``max_body``: the server's bound on a request body (the oversize prompts')."""
    addr = host_port(url)
    loop = asyncio.get_running_loop()
    t0, stop, stop_silent = loop.time(), asyncio.Event(), asyncio.Event()
    makers = {"silent_stream": lambda i: silent_stream(addr, stop_silent, silent_max_tokens),
              "slowloris": lambda i: slowloris(addr, stop),
              "unfinished_body": lambda i: unfinished_body(addr, stop),
              "silent_socket": lambda i: silent_socket(addr, stop),
              "oversize": lambda i: oversize(addr, OVERSIZE_VARIANTS[i % len(OVERSIZE_VARIANTS)], max_body, max_body),
              "abandoned_wait": lambda i: attacks.abandoned_wait(addr, i),
              "heavy_schema": lambda i: attacks.heavy_schema(addr, i),
              "schema_loop": lambda i: attacks.schema_loop(addr, stop),
              "cache_probe": lambda i: attacks.cache_probe(addr),
              "flood": lambda i: attacks.flood(addr, stop),
              "template_injection": lambda i: attacks.template_injection(addr, i),
              "big_body": lambda i: attacks.big_body(addr, i)}
    tasks, others = [], []
    for kind in KINDS:
        for i in range(counts.get(kind, 0)):
            tasks.append(asyncio.ensure_future(_labelled(kind, makers[kind](i))))
            if kind != "silent_stream":
                others.append(tasks[-1])
    if others:
        await asyncio.wait(others, timeout=hold_s)
    stop.set()
    if counts.get("silent_stream"):
        await asyncio.sleep(max(0.0, t0 + (hold_s if silent_hold_s is None else silent_hold_s) - loop.time()))
    stop_silent.set()
    return list(await asyncio.gather(*tasks))


async def _labelled(kind: str, client) -> dict:
    try:
        result = await client
    except OSError as e:  # could not connect, or the connection failed outside a read
        result = {"outcome": type(e).__name__, "seconds": float("nan")}
    return {"kind": kind, **result}


def summarize(results: list[dict]) -> dict[str, dict]:
    """kind -> clients, outcome counts (with details), median and max seconds to the outcome."""
    out: dict[str, dict] = {}
    for kind in KINDS:
        rs = [r for r in results if r["kind"] == kind]
        if not rs:
            continue
        outcomes = Counter(r["outcome"] + (f" ({r['detail']})" if r.get("detail") else "") for r in rs)
        secs = [r["seconds"] for r in rs if r["seconds"] == r["seconds"]]
        out[kind] = {"clients": len(rs), "outcomes": dict(sorted(outcomes.items())),
                     "seconds_median": round(statistics.median(secs), 2) if secs else None,
                     "seconds_max": round(max(secs), 2) if secs else None}
    return out


# --- the hostile phase of tools/load_test.py: normal clients, scenarios, the server's state ---

SCENARIOS = [
    ("silent streams", {"silent_stream": 2}),
    ("slowloris", {"slowloris": 10}),
    ("unfinished bodies", {"unfinished_body": 5}),
    ("silent sockets", {"silent_socket": 20}),
    ("oversize prompts", {"oversize": 3}),
    ("burst", {"slowloris": 50, "unfinished_body": 20, "silent_socket": 100, "silent_stream": 8, "oversize": 4}),
    ("abandoned waiting requests", {"abandoned_wait": 100}),
    ("expensive schemas", {"heavy_schema": 6}),
    ("schema loops", {"schema_loop": 2}),
    ("prompt-cache probe", {"cache_probe": 1}),
    ("connection flood from 127.0.0.2", {"flood": 1}),
    ("templates from the client", {"template_injection": 33}),
    ("4 MB bodies of token ids", {"big_body": 2}),
]
STATE_KEYS = ("rss_kib", "prompt_cache_kib", "constraint_cache_kib", "rss_less_caches_kib", "mlx_cache_kib",
              "mlx_active_kib", "open_fds", "threads", "tasks")
# "back to baseline" allows this much over the state before the hostile phase (None: not judged).
# RSS as such is not: the prompt cache grows by design (up to --prompt-cache-mb), so do the
# compiled response formats kept for reuse (within 64 MiB); RSS less both caches may keep
# the allocator's high-water mark of a few 4 MiB bodies parsed at once.
# MLX's own memory (live arrays; freed buffers it keeps for reuse, up to 256 MiB) is shown, not
# judged: it says where a change of RSS less the cache lives.
TOLERANCE = {"rss_kib": None, "prompt_cache_kib": None, "constraint_cache_kib": None,
             "rss_less_caches_kib": 48 * 1024, "mlx_cache_kib": None, "mlx_active_kib": None, "open_fds": 2,
             "threads": 2, "tasks": 2}


def _kib(value) -> int | None:
    return None if value is None else int(value) // 1024


def server_state(url: str, pid: int | None, read_metrics) -> dict:
    """RSS (from /proc, when the server's pid is known), open fds, threads and event-loop
    tasks (from GET /metrics), requests in flight."""
    m = read_metrics(url)
    rss = None
    if pid is not None:
        with open(f"/proc/{pid}/status") as f:
            rss = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), None)
    cache = m.get("edge0_prompt_cache_bytes")
    cache = None if cache is None else int(cache) // 1024
    formats = _kib(m.get("edge0_constraint_cache_bytes", 0))  # compiled response formats, kept by design
    return {"rss_kib": rss, "prompt_cache_kib": cache, "constraint_cache_kib": formats,
            "rss_less_caches_kib": None if rss is None or cache is None else rss - cache - formats,
            "mlx_cache_kib": _kib(m.get("edge0_process_mlx_cache_bytes")),
            "mlx_active_kib": _kib(m.get("edge0_process_mlx_active_bytes")),
            "open_fds": m.get("edge0_process_open_fds"), "threads": m.get("edge0_process_threads"),
            "tasks": m.get("edge0_process_tasks"), "in_flight": m.get("edge0_in_flight_requests"),
            "server_5xx": sum(v for k, v in m.items() if k.startswith("edge0_requests_total") and 'status="5' in k)}


class Sampler(threading.Thread):
    """Polls ``server_state`` every ``period`` s; keeps the peak of each count and the
    /metrics reads that failed or took over a second (the event loop held up)."""

    def __init__(self, state, period: float = 0.5):
        super().__init__(daemon=True)
        self.state, self.period = state, period
        self.peak: dict = {}
        self.failures: Counter = Counter()
        self.slowest_s = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period):
            t0 = time.perf_counter()
            try:
                s = self.state()
            except Exception as e:  # noqa: BLE001 - counted and reported, never fatal
                self.failures[type(e).__name__] += 1
                continue
            self.slowest_s = max(self.slowest_s, time.perf_counter() - t0)
            for k in STATE_KEYS:
                if s.get(k) is not None:
                    self.peak[k] = max(self.peak.get(k, s[k]), s[k])


def settle(state, reference: dict, timeout: float, nudge) -> dict:
    """The server's state once nothing is in flight and fds, threads and tasks are back
    within ``TOLERANCE`` of ``reference``, or as it is after ``timeout`` seconds. The event
    loop's idle worker threads (anyio's) retire only when a later call into a worker thread
    finds them idle for 10 s: if only threads are over, one normal request (``nudge()``) is
    sent once the server has been idle 11 s; ``nudged`` in the state says so."""
    deadline = time.monotonic() + timeout
    idle_since, nudged = None, False
    while True:
        s = state()
        over = [k for k in ("open_fds", "threads", "tasks")
                if s[k] is not None and reference.get(k) is not None and s[k] > reference[k] + TOLERANCE[k]]
        idle = s["in_flight"] == 0
        idle_since = (idle_since or time.monotonic()) if idle else None
        if (idle and not over) or time.monotonic() > deadline:
            return {**s, "nudged": nudged}
        if over == ["threads"] and not nudged and idle_since and time.monotonic() - idle_since >= 11:
            nudge()
            nudged, idle_since = True, None
        time.sleep(0.5)


def normal_clients(request, clients: int, seed: int, requests: int | None = None,
                   stop: threading.Event | None = None) -> list[dict]:
    """``clients`` threads each sending ``request(rng)`` one after the other: ``requests``
    times, or until ``stop``."""
    def client(s: int) -> list[dict]:
        rng, out = random.Random(s), []
        while (requests is None or len(out) < requests) and not (stop is not None and stop.is_set()):
            out.append(request(rng))
        return out

    with ThreadPoolExecutor(clients) as pool:
        return [r for rs in pool.map(client, [seed * 1000 + i for i in range(clients)]) for r in rs]


def latency(results: list[dict]) -> dict:
    ok = [r for r in results if r["status"] == 200]
    q = lambda key, p: round(_pct([r[key] for r in ok], p), 3)  # noqa: E731
    return {"requests": len(results), "statuses": dict(sorted(Counter(str(r["status"]) for r in results).items())),
            "ttft_p50_s": q("ttft", 0.5), "ttft_p95_s": q("ttft", 0.95),
            "total_p50_s": q("total", 0.5), "total_p95_s": q("total", 0.95)}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _scenarios(url: str, hold_s: float, silent_hold_s: float, silent_max_tokens: int,
                     scenarios: list) -> tuple[list, dict]:
    windows, results = [], {}
    for name, counts in scenarios:
        t0 = time.perf_counter()
        results[name] = await run_scenario(url, counts, hold_s, silent_max_tokens, silent_hold_s=silent_hold_s)
        windows.append((name, t0, time.perf_counter()))
        await asyncio.sleep(1.0)
    return windows, results


def _scenarios_process(*args) -> tuple[list, dict]:
    return asyncio.run(_scenarios(*args))


def hostile_round(state, url: str, request, clients: int, seed: int, hold_s: float, silent_hold_s: float,
                  silent_max_tokens: int, scenarios: list):
    """Normal clients streaming while every scenario runs in turn; returns their results, the
    scenarios' time windows and outcomes, and the sampler (peaks). The hostile clients run
    in a process of their own, as they would on another machine: a flood of connections in
    this one would hold the normal clients' interpreter lock and count its own cost as the
    server's (the windows' clock, ``perf_counter``, is the system's monotonic clock on Linux,
    the same in both processes)."""
    sampler, stop = Sampler(state), threading.Event()
    sampler.start()
    try:
        with ThreadPoolExecutor(1) as background, \
                ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as hostile:
            normal = background.submit(normal_clients, request, clients, seed, None, stop)
            try:
                windows, outcomes = hostile.submit(_scenarios_process, url, hold_s, silent_hold_s, silent_max_tokens,
                                                   scenarios).result()
            finally:
                stop.set()
            return normal.result(), windows, outcomes, sampler
    finally:
        sampler.done.set()
        sampler.join()


def run_hostile(url: str, pid: int | None, request, read_metrics, *, clients: int = 8, requests: int = 4,
                hold_s: float = 10.0, silent_hold_s: float = 25.0, silent_max_tokens: int = 64,
                settle_s: float = 60.0, rounds: int = 2, seed: int = 0, only: list[str] | None = None) -> dict:
    """The quiet run of ``clients`` normal clients (``requests`` each), then ``rounds`` times:
    the same clients streaming while every scenario of ``SCENARIOS`` runs in turn (each for
    ``hold_s`` seconds, then its sockets are closed), and the server's state once it has
    settled. ``request(rng)`` is one normal request: {"status", "start", "ttft", "total"}.
    ``only``: the names of the scenarios to run (default: all)."""
    scenarios = [(n, c) for n, c in SCENARIOS if only is None or n in only]
    unknown = sorted(set(only or ()) - {n for n, _ in SCENARIOS})
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; known: {[n for n, _ in SCENARIOS]}")
    state = lambda: server_state(url, pid, read_metrics)  # noqa: E731
    nudge = lambda: request(random.Random(seed - 1))  # noqa: E731
    warm = request(random.Random(seed))
    if warm["status"] != 200:
        raise SystemExit(f"the first request failed: {warm}")
    first = settle(state, state(), settle_s, nudge)
    quiet = normal_clients(request, clients, seed, requests=requests)
    before = settle(state, first, settle_s, nudge)
    loaded, outcomes, afters, peak, reads = [], {}, [], {}, {"failed": Counter(), "slowest_s": 0.0}
    by_window: dict[str, list] = {}
    for n in range(rounds):
        results, windows, got, sampler = hostile_round(state, url, request, clients, seed + 1 + n, hold_s,
                                                       silent_hold_s, silent_max_tokens, scenarios)
        loaded += results
        for name, t0, t1 in windows:
            by_window.setdefault(name, []).extend(r for r in results if t0 <= r["start"] < t1)
            outcomes.setdefault(name, []).extend(got[name])
        for k, v in sampler.peak.items():
            peak[k] = max(peak.get(k, v), v)
        reads["failed"].update(sampler.failures)
        reads["slowest_s"] = round(max(reads["slowest_s"], sampler.slowest_s), 3)
        afters.append(settle(state, before, settle_s, nudge))
    last = request(random.Random(seed + 2))
    resources = {k: {"before": before[k], "after": [a[k] for a in afters], "tolerance": TOLERANCE[k],
                     "peak": None if before[k] is None else max([before[k], *(a[k] for a in afters)]
                                                               + ([peak[k]] if k in peak else []))}
                 for k in STATE_KEYS}
    report = {"quiet": latency(quiet), "hostile": latency(loaded),
              "by_scenario": {name: latency(rs) for name, rs in by_window.items()},
              "hostile_clients": {name: summarize(rs) for name, rs in outcomes.items()},
              "resources": resources, "nudged": [before["nudged"], *(a["nudged"] for a in afters)],
              "after_request": last["status"], "server_5xx": afters[-1]["server_5xx"],
              "metrics_reads": {"failed": dict(reads["failed"]), "slowest_s": reads["slowest_s"]},
              "settings": {"clients": clients, "requests_per_client_quiet": requests, "hold_s": hold_s,
                           "silent_hold_s": silent_hold_s,
                           "rounds": rounds, "silent_max_tokens": silent_max_tokens, "scenarios": dict(scenarios)}}
    return report
