"""Load and soak test of ``edge0 serve``, on the loopback interface only.

    python tools/load_test.py [--model DIR] [--requests 8] [--max-tokens 32] [--disconnects 200]

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
``--json``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n\ndef walk(path):", "def parse_args(argv):",
           "def merge_sorted(a, b):", "with open(path) as f:"]


def rss_kib(pid: int) -> int:
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


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "edge0", "serve", "--model", model, "--host", "127.0.0.1",
                             "--port", "0", "--max-queue", "64", *extra], stderr=subprocess.PIPE, text=True)
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
                return {"status": r.status_code}
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["delta"].get("content") and first is None:
                    first = time.perf_counter()
        end = time.perf_counter()
    except httpx.HTTPError as e:
        return {"status": type(e).__name__}
    out = {"status": 200, "ttft": (first or end) - t0, "tokens": tokens}
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "edge0" / "data" / "demo_model"),
                   help="checkpoint to serve (default: the demo model)")
    p.add_argument("--requests", type=int, default=8, help="requests per client (default 8)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default 32)")
    p.add_argument("--concurrency", default="1,4,16", help="client counts (default 1,4,16)")
    p.add_argument("--disconnects", type=int, default=200, help="clients that leave mid-stream (default 200)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds (default 300)")
    p.add_argument("--budget", type=float, default=3600.0, help="whole-run limit, seconds (default 3600)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("serve_args", nargs="*", help="more `edge0 serve` flags, after --")
    args = p.parse_args()
    rng = random.Random(args.seed)
    start = time.monotonic()
    proc, url = start_server(args.model, args.serve_args)
    report: dict = {"model": args.model, "max_tokens": args.max_tokens, "requests_per_client": args.requests,
                    "phases": []}
    try:
        rss_start = rss_kib(proc.pid)
        warm = one_request(url, args.max_tokens, args.timeout, rng)
        assert warm["status"] == 200, warm
        rss_first = rss_kib(proc.pid)
        baseline = metrics(url)
        report.update(rss_start_kib=rss_start, rss_after_first_kib=rss_first)
        for clients in [int(c) for c in args.concurrency.split(",")]:
            if time.monotonic() - start > args.budget:
                break
            before = rss_kib(proc.pid)
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
            report["phases"].append({
                "clients": clients, "requests": len(results), "statuses": statuses, "wall_s": round(wall, 2),
                "ttft_p50_s": round(pct([r["ttft"] for r in ok], 0.5), 3),
                "ttft_p95_s": round(pct([r["ttft"] for r in ok], 0.95), 3),
                "decode_tps_p50": round(pct([r["decode_tps"] for r in ok if "decode_tps" in r], 0.5), 2),
                "tokens_per_s_total": round(sum(r.get("tokens", 0) for r in ok) / wall, 2),
                "rss_before_kib": before, "rss_after_kib": rss_kib(proc.pid)})
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
        last = one_request(url, args.max_tokens, args.timeout, rng)
        report["after_soak_request"] = last["status"]
        report["rss_end_kib"] = rss_kib(proc.pid)
        report["server_5xx"] = sum(v for k, v in after.items() if k.startswith("edge0_requests_total")
                                   and 'status="5' in k)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    leaks = {k: v for k, v in report["leak_check"].items() if v[0] is not None and v[1] is not None and v[1] > v[0]}
    return 0 if not leaks and report["server_5xx"] == 0 and report["after_soak_request"] == 200 else 1


def markdown(r: dict) -> str:
    lines = [f"model `{Path(r['model']).name}`, {r['max_tokens']} tokens per request, {r['requests_per_client']} "
             "requests per client, streamed chat, temperature 0.7", "",
             "| clients | requests | statuses | TTFT p50 | TTFT p95 | decode tok/s p50 (per request) | "
             "tok/s all clients | RSS before -> after |", "|---:|---:|---|---:|---:|---:|---:|---|"]
    for ph in r["phases"]:
        lines.append(f"| {ph['clients']} | {ph['requests']} | {ph['statuses']} | {ph['ttft_p50_s']:.3f} s | "
                     f"{ph['ttft_p95_s']:.3f} s | {ph['decode_tps_p50']:.1f} | {ph['tokens_per_s_total']:.1f} | "
                     f"{ph['rss_before_kib'] / 1024:.0f} -> {ph['rss_after_kib'] / 1024:.0f} MiB |")
    lines += ["", f"disconnecting clients: {r['disconnects']}", "",
              "| after the first request -> after the soak | |", "|---|---|"]
    for k, (a, b) in r["leak_check"].items():
        lines.append(f"| {k} | {a} -> {b} |")
    lines += ["", f"server RSS: {r['rss_start_kib'] / 1024:.0f} MiB at start, {r['rss_after_first_kib'] / 1024:.0f} "
              f"MiB after the first request, {r['rss_end_kib'] / 1024:.0f} MiB at the end; 5xx answers: "
              f"{r['server_5xx']}; a request after the soak: {r['after_soak_request']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
