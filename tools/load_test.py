"""Load and soak test of ``edge0 serve``, on the loopback interface only.

    python tools/load_test.py [--model DIR] [--requests 8] [--max-tokens 32] [--disconnects 200]
    python tools/load_test.py --hostile [--serve-model DIR | --url URL] [--requests 4] [--out FILE]

Starts ``edge0 serve`` on 127.0.0.1 at a free port, then:

1. for 1, 4 and 16 concurrent clients, each sends ``--requests`` streamed chat requests one
   after the other: p50 / p95 time to first token, decode tok/s per request (tokens after
   the first over the time after the first), status counts, server RSS before and after;
2. ``--disconnects`` clients that open a stream and go away after a random number of
   chunks (0 to 5), 8 at a time;
3. a leak check once the server is idle: engine generations, pinned slots, reads in
   flight, open checkpoint files, process threads, file descriptors and event-loop tasks,
   against the same numbers after the first request (waiting up to 120 s for the event
   loop's idle worker threads to retire); one more request must succeed.

Everything is bounded: a request times out after ``--timeout`` seconds, the whole run after
``--budget``. Prints a markdown report (docs/SERVER.md holds a measured one) and writes
``--json`` (or ``--out``).

``--hostile`` (tools/hostile_clients.py, tools/hostile_report.py; docs/SERVER.md, "Hostile
clients"): ``--clients`` (8) normal clients stream chat completions, first alone (the quiet
run, ``--requests`` each), then ``--rounds`` times while silent streams, slowloris heads,
unfinished bodies, silent sockets, 4 MiB prompts and a burst of them all run in turn; the
server's RSS, fds, threads and tasks are read once it has settled after each round, against
the state before. A server it starts gets short timeouts (``--send-timeout 5
--header-timeout 5 --body-timeout 5``; flags after ``--`` win).

The server: ``--serve-model DIR`` (``--model``; the demo model by default) starts ``edge0
serve`` on a free port and stops it after; ``--url URL`` targets a running one instead (its
RSS only with ``--server-pid``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostile_clients  # noqa: E402 - beside this file
import hostile_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n\ndef walk(path):", "def parse_args(argv):",
           "def merge_sorted(a, b):", "with open(path) as f:"]


HOSTILE_SERVE_FLAGS = ["--send-timeout", "5", "--header-timeout", "5", "--body-timeout", "5"]


def rss_kib(pid: int | None) -> int | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r"^(edge0_[a-z_]+)(\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def serve_flags(extra: list[str]) -> list[str]:
    return ["--host", "127.0.0.1", "--port", "0", "--max-queue", "64", *extra]


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "edge0", "serve", "--model", model, *serve_flags(extra)],
                            stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    if " on http://" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line}{proc.stderr.read()}")
    url = line.split(" on ")[1].split(" ")[0]
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # drain
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready in 120 s")


def one_request(url: str, max_tokens: int, timeout: float, rng: random.Random) -> dict:
    body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": max_tokens,
            "temperature": 0.7, "seed": rng.randrange(1 << 30), "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                return {"status": r.status_code, "start": t0, "total": time.perf_counter() - t0}
            done = error = False
            for line in r.iter_lines():
                done = done or line == "data: [DONE]"
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):  # a generation that failed after the stream began
                    error = True
                elif chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["delta"].get("content") and first is None:
                    first = time.perf_counter()
        end = time.perf_counter()
        if error or not done:
            return {"status": "200 error event" if error else "200 without [DONE]", "start": t0, "total": end - t0}
    except httpx.HTTPError as e:
        return {"status": type(e).__name__, "start": t0, "total": time.perf_counter() - t0}
    out = {"status": 200, "start": t0, "ttft": (first or end) - t0, "total": end - t0, "tokens": tokens}
    if first is not None and tokens > 1 and end > first:
        out["decode_tps"] = (tokens - 1) / (end - first)
    return out


def disconnecting_client(url: str, rng: random.Random, timeout: float) -> str:
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": 256, "stream": True}
    chunks = rng.randint(0, 5)
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return str(r.status_code)
            for i, _ in enumerate(r.iter_lines()):
                if i >= 2 * chunks:  # events and their blank separators
                    break
        return "left"
    except httpx.HTTPError as e:
        return type(e).__name__


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", "--serve-model", dest="model", default=str(ROOT / "edge0" / "data" / "demo_model"),
                   help="checkpoint to serve on a free port, stopped after (default: the demo model)")
    p.add_argument("--url", default=None, help="test the server running there instead of starting one")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: its pid, for its RSS")
    p.add_argument("--requests", type=int, default=8, help="requests per client (default 8)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default 32)")
    p.add_argument("--concurrency", default="1,4,16", help="client counts (default 1,4,16)")
    p.add_argument("--disconnects", type=int, default=200, help="clients that leave mid-stream (default 200)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds (default 300)")
    p.add_argument("--budget", type=float, default=3600.0, help="whole-run limit, seconds (default 3600)")
    p.add_argument("--hostile", action="store_true", help="the hostile-clients test instead of the soak")
    p.add_argument("--clients", type=int, default=8, help="--hostile: normal clients (default 8)")
    p.add_argument("--hold", type=float, default=10.0,
                   help="--hostile: longest a scenario's clients stay before they are closed (default 10 s)")
    p.add_argument("--silent-hold", type=float, default=25.0,
                   help="--hostile: how long silent streams stay unread before they are closed (default 25 s)")
    p.add_argument("--rounds", type=int, default=2,
                   help="--hostile: times the scenarios run, the state read after each (default 2)")
    p.add_argument("--silent-max-tokens", type=int, default=64,
                   help="--hostile: max_tokens of a silent stream (default 64)")
    p.add_argument("--settle", type=float, default=60.0,
                   help="--hostile: longest wait for the server to settle before a state is read (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", "--out", dest="json", default=None, help="write the results here too")
    p.add_argument("serve_args", nargs="*", help="more `edge0 serve` flags, after --")
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    proc, flags = None, None
    load_start = os.getloadavg()
    if args.url:
        url, pid = args.url.rstrip("/"), args.server_pid
    else:
        extra = (HOSTILE_SERVE_FLAGS if args.hostile else []) + args.serve_args
        flags = serve_flags(extra)
        print(f"edge0 serve --model {args.model} {' '.join(flags)}", file=sys.stderr, flush=True)
        proc, url = start_server(args.model, extra)
        pid = proc.pid
    try:
        if args.hostile:
            report = hostile_clients.run_hostile(
                url, pid, lambda rng: one_request(url, args.max_tokens, args.timeout, rng), metrics,
                clients=args.clients, requests=args.requests, hold_s=args.hold, silent_hold_s=args.silent_hold,
                silent_max_tokens=args.silent_max_tokens, settle_s=args.settle, rounds=args.rounds,
                seed=args.seed)
            report["targets"] = hostile_report.targets(report)
        else:
            report = soak(url, pid, args)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    report.update(model=args.model, max_tokens=args.max_tokens, url=url if args.url else None,
                  load_average_1m=[round(load_start[0], 2), round(os.getloadavg()[0], 2)], cpus=os.cpu_count(),
                  serve_flags=flags if flags is not None else "a running server (flags unknown)")
    if args.hostile:
        print(f"server: {'edge0 serve ' + ' '.join(flags) if flags else url}, model `{Path(args.model).name}`, "
              f"{args.max_tokens} tokens per normal request; load average (1 min) of this machine "
              f"({os.cpu_count()} CPUs): {report['load_average_1m'][0]} at the start, "
              f"{report['load_average_1m'][1]} at the end\n")
        print(hostile_report.markdown(report))
    else:
        print(markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.hostile:
        t = report["targets"]
        return 0 if t["no_5xx"] and t["p95_within_2x"] and t["all_back"] and t["after_request_ok"] else 1
    leaks = {k: v for k, v in report["leak_check"].items() if v[0] is not None and v[1] is not None and v[1] > v[0]}
    return 0 if not leaks and report["server_5xx"] == 0 and report["after_soak_request"] == 200 else 1


def soak(url: str, pid: int | None, args: argparse.Namespace) -> dict:
    """Concurrency phases, disconnecting clients, then the leak check (the module's doc)."""
    rng = random.Random(args.seed)
    start = time.monotonic()
    report: dict = {"requests_per_client": args.requests, "phases": []}
    rss_start = rss_kib(pid)
    warm = one_request(url, args.max_tokens, args.timeout, rng)
    assert warm["status"] == 200, warm
    report.update(rss_start_kib=rss_start, rss_after_first_kib=rss_kib(pid))
    baseline = metrics(url)
    for clients in [int(c) for c in args.concurrency.split(",")]:
        if time.monotonic() - start > args.budget:
            break
        report["phases"].append(concurrency_phase(url, pid, args, clients, rng))
    outcomes: dict[str, int] = {}
    with ThreadPoolExecutor(8) as pool:
        seeds = [rng.randrange(1 << 30) for _ in range(args.disconnects)]
        for o in pool.map(lambda s: disconnecting_client(url, random.Random(s), args.timeout), seeds):
            outcomes[o] = outcomes.get(o, 0) + 1
    report["disconnects"] = outcomes
    deadline = time.monotonic() + 120
    while True:  # the server settles: every abandoned generation cancelled, idle worker
        after = metrics(url)  # threads of the event loop's pool retired (anyio: after 10 s idle)
        if after.get("edge0_in_flight_requests") == 0 and after.get("edge0_engine_generations") == 0 \
                and after.get("edge0_process_threads", 0) <= baseline.get("edge0_process_threads", 0):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    keys = ["edge0_engine_generations", "edge0_engine_pinned_slots", "edge0_engine_pending_reads",
            "edge0_engine_open_files", "edge0_process_threads", "edge0_process_open_fds", "edge0_process_tasks",
            "edge0_in_flight_requests"]
    report["leak_check"] = {k.replace("edge0_", ""): [baseline.get(k), after.get(k)] for k in keys}
    report["after_soak_request"] = one_request(url, args.max_tokens, args.timeout, rng)["status"]
    report["rss_end_kib"] = rss_kib(pid)
    report["server_5xx"] = sum(v for k, v in after.items() if k.startswith("edge0_requests_total")
                               and 'status="5' in k)
    return report


def concurrency_phase(url: str, pid: int | None, args: argparse.Namespace, clients: int,
                      rng: random.Random) -> dict:
    """``clients`` clients each sending ``args.requests`` streamed requests one after the other."""
    before = rss_kib(pid)
    seeds = [rng.randrange(1 << 30) for _ in range(clients)]

    def client(seed):
        local = random.Random(seed)
        return [one_request(url, args.max_tokens, args.timeout, local) for _ in range(args.requests)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, seeds) for r in rs]
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["status"] == 200]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return {"clients": clients, "requests": len(results), "statuses": statuses, "wall_s": round(wall, 2),
            "ttft_p50_s": round(pct([r["ttft"] for r in ok], 0.5), 3),
            "ttft_p95_s": round(pct([r["ttft"] for r in ok], 0.95), 3),
            "decode_tps_p50": round(pct([r["decode_tps"] for r in ok if "decode_tps" in r], 0.5), 2),
            "tokens_per_s_total": round(sum(r.get("tokens", 0) for r in ok) / wall, 2),
            "rss_before_kib": before, "rss_after_kib": rss_kib(pid)}


def markdown(r: dict) -> str:
    lines = [f"model `{Path(r['model']).name}`, {r['max_tokens']} tokens per request, {r['requests_per_client']} "
             "requests per client, streamed chat, temperature 0.7", "",
             "| clients | requests | statuses | TTFT p50 | TTFT p95 | decode tok/s p50 (per request) | "
             "tok/s all clients | RSS before -> after |", "|---:|---:|---|---:|---:|---:|---:|---|"]
    for ph in r["phases"]:
        lines.append(f"| {ph['clients']} | {ph['requests']} | {ph['statuses']} | {ph['ttft_p50_s']:.3f} s | "
                     f"{ph['ttft_p95_s']:.3f} s | {ph['decode_tps_p50']:.1f} | {ph['tokens_per_s_total']:.1f} | "
                     f"{mib(ph['rss_before_kib'])} -> {mib(ph['rss_after_kib'])} |")
    lines += ["", f"disconnecting clients: {r['disconnects']}", "",
              "| after the first request -> after the soak | |", "|---|---|"]
    for k, (a, b) in r["leak_check"].items():
        lines.append(f"| {k} | {a} -> {b} |")
    lines += ["", f"server RSS: {mib(r['rss_start_kib'])} at start, {mib(r['rss_after_first_kib'])} "
              f"after the first request, {mib(r['rss_end_kib'])} at the end; 5xx answers: "
              f"{r['server_5xx']}; a request after the soak: {r['after_soak_request']}"]
    return "\n".join(lines)


def mib(kib: int | None) -> str:
    return "n/a" if kib is None else f"{kib / 1024:.0f} MiB"


if __name__ == "__main__":
    raise SystemExit(main())
