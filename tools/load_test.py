"""Load and soak test of ``edge0 serve`` (or, as the anchor, mlx-lm's own server), on the
loopback interface only.

    python tools/load_test.py [--model DIR] [--requests 8] [--max-tokens 32] [--disconnects 200]
    python tools/load_test.py --server mlx-lm [--model DIR] [--requests 8] [--greedy]
    python tools/load_test.py --hostile [--serve-model DIR | --url URL] [--requests 4] [--out FILE]

Starts the server on 127.0.0.1 at a free port, sends one request (it warms the server up
and is the baseline of the leak check), then:

1. for each count of concurrent clients of ``--concurrency`` (1, 4 and 16), each client
   sends ``--requests`` streamed chat requests one after the other. Per level: p50 / p95
   time to first token, decode tok/s per request (tokens after the first over the time
   after the first), status counts, server RSS before and after; and, for a batching
   server, the aggregate decode tok/s (the completion tokens of all the level's requests
   over the level's wall time, from the first request's start to the last one's end; also
   without the first token of each request), the peak server RSS (VmRSS sampled every
   0.2 s while the level runs), the mean completion tokens per request (the OpenAI API
   has no ignore-EOS, so this shows whether two servers generated as much), and for an
   Edge0 server the expert bytes read per generated token (the deltas of
   ``edge0_expert_bytes_read_total`` over ``edge0_completion_tokens_total`` between
   ``/metrics`` read before and after the level) and the mean of the ``edge0_batch_size``
   gauge (``/metrics`` sampled every 0.5 s);
2. ``--disconnects`` clients that open a stream and go away after a random number of
   chunks (0 to 5), 8 at a time (Edge0 only);
3. a leak check once the server is idle: engine generations, pinned slots, reads in
   flight, open checkpoint files, process threads, file descriptors and event-loop tasks,
   against the same numbers after the first request (waiting up to 120 s for the event
   loop's idle worker threads to retire: anyio retires one idle for 10 s only at the next
   call into a worker thread, so while the server has more threads the wait sends a
   1-token request every 10.5 s); one more request must succeed.

Sampling: temperature 0.7 with a per-request seed by default; ``--greedy``: temperature 0
and no seed (outputs of comparable length). Token counts come from the stream's usage
chunk (``stream_options.include_usage``); a server that sends none has its content chunks
counted instead, and the report says so.

``--server mlx-lm`` (default ``edge0``) starts ``python -m mlx_lm server --model DIR`` on
a free port with batching on (``--decode-concurrency`` from ``--mlx-lm-decode-concurrency``,
32, and ``--prompt-concurrency`` from ``--mlx-lm-prompt-concurrency``, 8: mlx_lm.server's
own defaults) and waits for its ``/health``. mlx_lm.server decodes a request with a seed
on its own, outside the batch, so its requests never carry one (unseeded sampling at 0.7
unless ``--greedy``). It has no ``/metrics``: expert bytes and batch size are null, the
disconnects are skipped and the leak check keeps the process's threads and file
descriptors (from /proc); 5xx answers are the ones its clients got.

Everything is bounded: a request times out after ``--timeout`` seconds, the whole run after
``--budget``. Prints a markdown report (docs/SERVER.md holds a measured one) and writes
``--json`` (or ``--out``).

``--hostile`` (tools/hostile_clients.py, tools/hostile_report.py; docs/SERVER.md, "Hostile
clients"; Edge0 only): ``--clients`` (8) normal clients stream chat completions, first alone
(the quiet run, ``--requests`` each), then ``--rounds`` times while silent streams, slowloris
heads, unfinished bodies, silent sockets, 4 MiB prompts and a burst of them all run in turn;
the server's RSS, fds, threads and tasks are read once it has settled after each round,
against the state before. A server it starts gets short timeouts (``--send-timeout 5
--header-timeout 5 --body-timeout 5``; flags after ``--`` win).

The server: ``--serve-model DIR`` (``--model``; the demo model by default) starts it on a
free port and stops it after, with the flags after ``--`` added (``edge0 serve`` or
``mlx_lm server`` flags); ``--url URL`` targets a running one instead (its RSS only with
``--server-pid``; ``--server`` still says which kind it is). ``--memory-limit 8G`` starts it
in a memory cgroup of that size (anonymous memory and page cache together: a checkpoint
larger than the cap cannot sit in RAM; edge0/benchmark/cgroup.py, root only) and reports
the cgroup's peak and whether the kernel killed the server for memory; ``--cold`` drops the
checkpoint's files from the page cache before the server starts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostile_clients  # noqa: E402 - beside this file
import hostile_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from edge0.benchmark.cgroup import MemoryCap, parse_size  # noqa: E402
from edge0.benchmark.harness import checkpoint_files, evict  # noqa: E402
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n\ndef walk(path):", "def parse_args(argv):",
           "def merge_sorted(a, b):", "with open(path) as f:"]


HOSTILE_SERVE_FLAGS = ["--send-timeout", "5", "--header-timeout", "5", "--body-timeout", "5"]


def model_name(model: str) -> str:
    """How a report names the model: its path inside this repository, else its directory's
    name (a report never carries where a machine keeps its files)."""
    path = Path(model).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def rss_kib(pid: int | None) -> int | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def proc_state(pid: int | None) -> dict[str, int | None]:
    """The process's threads and open file descriptors, from /proc (None: unknown)."""
    if pid is None:
        return {"threads": None, "open_fds": None}
    try:
        threads = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("Threads:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return {"threads": None, "open_fds": None}
    return {"threads": threads, "open_fds": fds}


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r"^(edge0_[a-z_]+)(\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def serve_flags(extra: list[str]) -> list[str]:
    return ["--host", "127.0.0.1", "--port", "0", "--max-queue", "64", *extra]


def start_server(model: str, extra: list[str], preexec=None, log: str | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "edge0", "serve", "--model", model, *serve_flags(extra)],
                            stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
    line = proc.stderr.readline()
    if " on http://" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line}{proc.stderr.read()}")
    url = line.split(" on ")[1].split(" ")[0]
    threading.Thread(target=_drain, args=(proc.stderr, log), daemon=True).start()
    return wait_healthy(proc, url, "the server", lambda: "")


def _drain(stream, log: str | None) -> None:
    """Read the server's log as it comes (into ``log`` when given, else nowhere)."""
    if log is None:
        stream.read()
        return
    with open(log, "w") as f:
        for line in stream:
            f.write(line)
            f.flush()


def wait_healthy(proc: subprocess.Popen, url: str, name: str, tail) -> tuple[subprocess.Popen, str]:
    """Wait up to 120 s for ``url``'s /health to answer 200; ``tail()``: the server's last
    log lines, for the error when it exits or never becomes ready."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            time.sleep(0.5)  # the drain thread reads the last lines
            raise SystemExit(f"{name} exited ({proc.returncode}):\n{tail()}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{name} did not become ready in 120 s:\n{tail()}")


def free_port() -> int:
    """A port nothing listens on now (bound to port 0, read, closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlx_lm_flags(port: int, decode_concurrency: int, prompt_concurrency: int, extra: list[str]) -> list[str]:
    return ["--host", "127.0.0.1", "--port", str(port), "--decode-concurrency", str(decode_concurrency),
            "--prompt-concurrency", str(prompt_concurrency), *extra]


def start_mlx_lm_server(model: str, flags: list[str], preexec=None) -> tuple[subprocess.Popen, str]:
    """``python -m mlx_lm server`` with ``flags`` (those of ``mlx_lm_flags``), once ``/health``
    answers 200 (up to 120 s). It loads the model in its generation thread, so the first
    request may still wait for that."""
    port = flags[flags.index("--port") + 1]
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", model, *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=preexec)
    tail: deque[str] = deque(maxlen=40)
    threading.Thread(target=lambda: tail.extend(proc.stdout), daemon=True).start()  # drain, keep the end
    url = f"http://127.0.0.1:{port}"
    return wait_healthy(proc, url, "mlx_lm server", lambda: "".join(tail))


def one_request(url: str, max_tokens: int, timeout: float, rng: random.Random, *, temperature: float = 0.7,
                seed: bool = True) -> dict:
    """One streamed chat request; ``seed``: send a random one (drawn from ``rng`` either way,
    so the prompts drawn after stay the same)."""
    prompt, seed_value = rng.choice(PROMPTS), rng.randrange(1 << 30)
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    if seed:
        body["seed"] = seed_value
    t0 = time.perf_counter()
    first = None
    tokens = None
    chunks = 0
    usage: dict = {}
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
                    usage = chunk["usage"]
                    tokens = usage["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    chunks += 1
                    first = first or time.perf_counter()
        end = time.perf_counter()
        if error or not done:
            return {"status": "200 error event" if error else "200 without [DONE]", "start": t0, "total": end - t0}
    except httpx.HTTPError as e:
        return {"status": type(e).__name__, "start": t0, "total": time.perf_counter() - t0}
    counted = "usage" if tokens is not None else "chunks"  # no usage chunk: a content chunk a token
    tokens = tokens if tokens is not None else chunks
    out = {"status": 200, "start": t0, "ttft": (first or end) - t0, "total": end - t0, "tokens": tokens,
           "tokens_counted": counted, "prompt_tokens": usage.get("prompt_tokens"),
           "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}
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
    p.add_argument("--model", "--serve-model", dest="model", default=str(ROOT / "src" / "edge0" / "data" / "demo_model"),
                   help="checkpoint to serve on a free port, stopped after (default: the demo model)")
    p.add_argument("--server", choices=["edge0", "mlx-lm"], default="edge0",
                   help="the server to start (or, with --url, the kind running there): edge0 serve, or "
                        "mlx-lm's own server as the anchor (default edge0)")
    p.add_argument("--mlx-lm-decode-concurrency", type=int, default=32,
                   help="--server mlx-lm: its --decode-concurrency, requests decoded together (default 32, "
                        "mlx_lm.server's)")
    p.add_argument("--mlx-lm-prompt-concurrency", type=int, default=8,
                   help="--server mlx-lm: its --prompt-concurrency, prompts prefilled together (default 8, "
                        "mlx_lm.server's)")
    p.add_argument("--greedy", action="store_true",
                   help="temperature 0 and no seed (default: temperature 0.7, a seed per request where the "
                        "server batches seeded requests)")
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
    p.add_argument("--memory-limit", default=None,
                   help="run the server in a memory cgroup of this size (8G, 512M: anonymous memory and page "
                        "cache together, as `edge0 bench --memory-limit`; needs root); the cgroup's peak is reported")
    p.add_argument("--cold", action="store_true",
                   help="drop the checkpoint's files from the page cache before the server starts")
    p.add_argument("--server-log", default=None, help="write the started server's log here")
    p.add_argument("--scenarios", default=None,
                   help="--hostile: the scenarios to run, comma-separated names (default: all; "
                        "tools/hostile_clients.py SCENARIOS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", "--out", dest="json", default=None, help="write the results here too")
    p.add_argument("serve_args", nargs="*", help="more `edge0 serve` (or `mlx_lm server`) flags, after --")
    args = p.parse_args(argv)
    if args.hostile and args.server != "edge0":
        p.error("--hostile reads Edge0's /metrics: --server edge0 only")
    return args


def sampling(args: argparse.Namespace) -> dict:
    """one_request's sampling keywords: mlx_lm.server decodes a seeded request on its own,
    outside its batch, so it never gets a seed."""
    if args.greedy:
        return {"temperature": 0.0, "seed": False}
    return {"temperature": 0.7, "seed": args.server == "edge0"}


def main() -> int:
    args = parse_args()
    cap, preexec = None, None
    if args.cold and not args.url:
        evict(checkpoint_files(Path(args.model)))
    if args.memory_limit and not args.url:
        cap = MemoryCap(parse_size(args.memory_limit), f"edge0-load-test-{os.getpid()}")
        preexec = cap.prepare()
    try:
        return _run(args, cap, preexec)
    finally:
        if cap is not None:
            cap.remove()  # a server that never started leaves no cgroup behind (finish() removed it otherwise)


def _run(args: argparse.Namespace, cap, preexec) -> int:
    proc, flags = None, None
    load_start = os.getloadavg()
    if args.url:
        url, pid = args.url.rstrip("/"), args.server_pid
    elif args.server == "mlx-lm":
        flags = mlx_lm_flags(free_port(), args.mlx_lm_decode_concurrency, args.mlx_lm_prompt_concurrency,
                             args.serve_args)
        print(f"mlx_lm server --model {args.model} {' '.join(flags)}", file=sys.stderr, flush=True)
        proc, url = start_mlx_lm_server(args.model, flags, preexec)
        pid = proc.pid
    else:
        extra = (HOSTILE_SERVE_FLAGS if args.hostile else []) + args.serve_args
        flags = serve_flags(extra)
        print(f"edge0 serve --model {args.model} {' '.join(flags)}", file=sys.stderr, flush=True)
        proc, url = start_server(args.model, extra, preexec, args.server_log)
        pid = proc.pid
    try:
        if args.hostile:
            report = hostile_clients.run_hostile(
                url, pid, lambda rng: one_request(url, args.max_tokens, args.timeout, rng), metrics,
                clients=args.clients, requests=args.requests, hold_s=args.hold, silent_hold_s=args.silent_hold,
                silent_max_tokens=args.silent_max_tokens, settle_s=args.settle, rounds=args.rounds,
                seed=args.seed, only=args.scenarios.split(",") if args.scenarios else None)
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
                proc.wait()
        if cap is not None:
            cap_result = cap.finish(proc.returncode if proc is not None else 0)
    if cap is not None:
        report["memory_cap"] = cap_result
    report.update(cold=args.cold, model=model_name(args.model), max_tokens=args.max_tokens, url=url if args.url else None, server=args.server,
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
    edge0 = args.server == "edge0"
    kw = sampling(args)
    start = time.monotonic()
    report: dict = {"requests_per_client": args.requests, "phases": [], "temperature": kw["temperature"],
                    "seeded": kw["seed"]}
    rss_start = rss_kib(pid)
    warm = one_request(url, args.max_tokens, args.timeout, rng, **kw)
    assert warm["status"] == 200, warm
    report.update(rss_start_kib=rss_start, rss_after_first_kib=rss_kib(pid))
    baseline = metrics(url) if edge0 else {}
    base_proc = proc_state(pid)
    for clients in [int(c) for c in args.concurrency.split(",")]:
        if time.monotonic() - start > args.budget:
            break
        report["phases"].append(concurrency_phase(url, pid, args, clients, rng))
    outcomes: dict[str, int] = {}
    if edge0:
        with ThreadPoolExecutor(8) as pool:
            seeds = [rng.randrange(1 << 30) for _ in range(args.disconnects)]
            for o in pool.map(lambda s: disconnecting_client(url, random.Random(s), args.timeout), seeds):
                outcomes[o] = outcomes.get(o, 0) + 1
    report["disconnects"] = outcomes if edge0 else None
    deadline = time.monotonic() + 120
    nudged, nudges = time.monotonic(), 0
    while True:  # the server settles: every abandoned generation cancelled, idle worker
        if edge0:  # threads of the event loop's pool retired
            after = metrics(url)
            idle = after.get("edge0_in_flight_requests") == 0 and after.get("edge0_engine_generations") == 0
            if idle and after.get("edge0_process_threads", 0) <= baseline.get("edge0_process_threads", 0):
                break
            # anyio retires a worker thread idle for 10 s only at the next call into one: a
            # 1-token request makes that call (its prompt is tokenized in a worker thread)
            if idle and time.monotonic() - nudged > 10.5:
                one_request(url, 1, args.timeout, random.Random(0), temperature=0.0, seed=False)
                nudged, nudges = time.monotonic(), nudges + 1
        else:  # mlx_lm.server: a thread per connection, gone when it closes
            after_proc = proc_state(pid)
            if after_proc["threads"] is None or after_proc["threads"] <= base_proc["threads"]:
                break
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if edge0:
        keys = ["edge0_engine_generations", "edge0_engine_pinned_slots", "edge0_engine_pending_reads",
                "edge0_engine_open_files", "edge0_process_threads", "edge0_process_open_fds", "edge0_process_tasks",
                "edge0_in_flight_requests"]
        report["leak_check"] = {k.replace("edge0_", ""): [baseline.get(k), after.get(k)] for k in keys}
        report["settle_requests"] = nudges
    else:
        after_proc = proc_state(pid)
        report["leak_check"] = {f"process_{k}": [base_proc[k], after_proc[k]] for k in base_proc}
    report["after_soak_request"] = one_request(url, args.max_tokens, args.timeout, rng, **kw)["status"]
    report["rss_end_kib"] = rss_kib(pid)
    if edge0:
        report["server_5xx"] = sum(v for k, v in after.items() if k.startswith("edge0_requests_total")
                                   and 'status="5' in k)
    else:  # no /metrics: the 5xx answers its clients got
        report["server_5xx"] = sum(n for ph in report["phases"] for st, n in ph["statuses"].items()
                                   if st.startswith("5"))
    return report


class LevelSampler:
    """While a level runs: the server's VmRSS every 0.2 s and, for Edge0, ``/metrics``'
    ``edge0_batch_size`` gauge every 0.5 s, each in a thread of its own."""

    def __init__(self, url: str, pid: int | None, edge0: bool):
        self.url, self.pid = url, pid
        self.rss: list[int] = []
        self.batch: list[float] = []
        self.metrics_failed = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._sample_rss, daemon=True)]
        if edge0:
            self._threads.append(threading.Thread(target=self._sample_metrics, daemon=True))

    def _sample_rss(self):
        while self.pid is not None:
            try:
                kib = rss_kib(self.pid)
            except OSError:  # the process is gone
                return
            if kib is not None and kib >= 0:
                self.rss.append(kib)
            if self._stop.wait(0.2):
                return

    def _sample_metrics(self):
        while not self._stop.is_set():
            try:
                m = metrics(self.url)
                if "edge0_batch_size" in m:
                    self.batch.append(m["edge0_batch_size"])
            except httpx.HTTPError:
                self.metrics_failed += 1
            if self._stop.wait(0.5):
                return

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(35)


def idle_metrics(url: str, wait_s: float = 5.0) -> dict[str, float]:
    """``/metrics`` once no generation is in flight (up to ``wait_s``), so the counters hold
    every finished request of the level."""
    deadline = time.monotonic() + wait_s
    while True:
        m = metrics(url)
        if m.get("edge0_in_flight_requests", 0) == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def concurrency_phase(url: str, pid: int | None, args: argparse.Namespace, clients: int,
                      rng: random.Random) -> dict:
    """``clients`` clients each sending ``args.requests`` streamed requests one after the other."""
    edge0 = getattr(args, "server", "edge0") == "edge0"
    kw = sampling(args)
    before = rss_kib(pid)
    seeds = [rng.randrange(1 << 30) for _ in range(clients)]

    def client(seed):
        local = random.Random(seed)
        return [one_request(url, args.max_tokens, args.timeout, local, **kw) for _ in range(args.requests)]

    m_before = idle_metrics(url) if edge0 else None
    with LevelSampler(url, pid, edge0) as sampler:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            results = [r for rs in pool.map(client, seeds) for r in rs]
        wall = time.perf_counter() - t0
    m_after = idle_metrics(url) if edge0 else None
    ok = [r for r in results if r["status"] == 200]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    tokens = sum(r.get("tokens", 0) for r in ok)
    span = max(r["start"] + r["total"] for r in results) - min(r["start"] for r in results)  # first start, last end
    bytes_per_token = decode_bytes_per_token = None
    if edge0:
        d = {k: m_after.get(k, 0.0) - m_before.get(k, 0.0) for k in
             ("edge0_expert_bytes_read_total", "edge0_completion_tokens_total", "edge0_decode_tokens_total")}
        if d["edge0_completion_tokens_total"] > 0:
            bytes_per_token = round(d["edge0_expert_bytes_read_total"] / d["edge0_completion_tokens_total"], 1)
        # the gauge is decode bytes over decode tokens since start: its product, the decode bytes so far
        decode_bytes = (m_after.get("edge0_expert_bytes_per_token", 0.0) * m_after.get("edge0_decode_tokens_total", 0)
                        - m_before.get("edge0_expert_bytes_per_token", 0.0)
                        * m_before.get("edge0_decode_tokens_total", 0))
        if d["edge0_decode_tokens_total"] > 0:
            decode_bytes_per_token = round(decode_bytes / d["edge0_decode_tokens_total"], 1)
    counted = sorted({r["tokens_counted"] for r in ok})
    return {"clients": clients, "requests": len(results), "statuses": statuses, "wall_s": round(wall, 2),
            "ttft_p50_s": round(pct([r["ttft"] for r in ok], 0.5), 3),
            "ttft_p95_s": round(pct([r["ttft"] for r in ok], 0.95), 3),
            "decode_tps_p50": round(pct([r["decode_tps"] for r in ok if "decode_tps" in r], 0.5), 2),
            "tokens_per_s_total": round(tokens / wall, 2),
            "rss_before_kib": before, "rss_after_kib": rss_kib(pid),
            "level_wall_s": round(span, 3),
            "aggregate_decode_tps": round(tokens / span, 2) if span > 0 else None,
            "aggregate_decode_tps_after_first": round(sum(max(0, r.get("tokens", 0) - 1) for r in ok) / span, 2)
            if span > 0 else None,
            "completion_tokens": tokens,
            "tokens_per_request": round(tokens / len(ok), 2) if ok else None,
            "tokens_counted": counted[0] if len(counted) == 1 else counted,
            "prompt_tokens_per_request": mean([r["prompt_tokens"] for r in ok if r.get("prompt_tokens") is not None]),
            "cached_prompt_tokens_per_request": mean([r["cached_tokens"] for r in ok
                                                      if r.get("cached_tokens") is not None]),
            "peak_rss_kib": max(sampler.rss) if sampler.rss else None, "rss_samples": len(sampler.rss),
            "expert_bytes_per_token": bytes_per_token, "decode_expert_bytes_per_token": decode_bytes_per_token,
            "mean_batch_size": mean(sampler.batch), "batch_samples": len(sampler.batch) if edge0 else None,
            "metrics_failed": sampler.metrics_failed if edge0 else None}


def mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 2) if values else None


def markdown(r: dict) -> str:
    temp = r.get("temperature", 0.7)
    sampled = "greedy (temperature 0)" if temp == 0 else f"temperature {temp}" + (
        ", seeded" if r.get("seeded", True) else ", unseeded")
    lines = [f"server `{r.get('server', 'edge0')}`, model `{Path(r['model']).name}`, {r['max_tokens']} tokens per "
             f"request, {r['requests_per_client']} requests per client, streamed chat, {sampled}", "",
             "| clients | requests | statuses | TTFT p50 | TTFT p95 | decode tok/s p50 (per request) | "
             "tok/s all clients | RSS before -> after |", "|---:|---:|---|---:|---:|---:|---:|---|"]
    for ph in r["phases"]:
        lines.append(f"| {ph['clients']} | {ph['requests']} | {ph['statuses']} | {ph['ttft_p50_s']:.3f} s | "
                     f"{ph['ttft_p95_s']:.3f} s | {ph['decode_tps_p50']:.1f} | {ph['tokens_per_s_total']:.1f} | "
                     f"{mib(ph['rss_before_kib'])} -> {mib(ph['rss_after_kib'])} |")
    lines += ["", "| clients | aggregate decode tok/s | TTFT p50 s | TTFT p95 s | peak RSS MiB | "
              "expert bytes / token | mean batch | tokens / request |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for ph in r["phases"]:
        agg = ph.get("aggregate_decode_tps")
        after = ph.get("aggregate_decode_tps_after_first")
        counted = ph.get("tokens_counted")
        per_req = num(ph.get("tokens_per_request"), 1) + (
            "" if counted in ("usage", []) else " (content chunks counted: no usage chunk)" if counted == "chunks"
            else " (some from content chunks: no usage chunk)")
        lines.append(f"| {ph['clients']} | {num(agg, 1)} ({num(after, 1)} after the first) | "
                     f"{ph['ttft_p50_s']:.3f} | {ph['ttft_p95_s']:.3f} | "
                     f"{num(None if ph.get('peak_rss_kib') is None else ph['peak_rss_kib'] / 1024, 0)} | "
                     f"{num(ph.get('expert_bytes_per_token'), 0)} | {num(ph.get('mean_batch_size'), 2)} | {per_req} |")
    lines += ["", "prompt tokens per request (of them from the prompt cache), by clients: " + ", ".join(
        f"{ph['clients']}: {num(ph.get('prompt_tokens_per_request'), 1)} "
        f"({num(ph.get('cached_prompt_tokens_per_request'), 1)})" for ph in r["phases"])]
    disconnects = r["disconnects"] if r["disconnects"] is not None else "skipped (not an Edge0 server)"
    lines += ["", f"disconnecting clients: {disconnects}", "",
              "| after the first request -> after the soak | |", "|---|---|"]
    for k, (a, b) in r["leak_check"].items():
        lines.append(f"| {k} | {a} -> {b} |")
    lines += ["", f"server RSS: {mib(r['rss_start_kib'])} at start, {mib(r['rss_after_first_kib'])} "
              f"after the first request, {mib(r['rss_end_kib'])} at the end; 5xx answers: "
              f"{r['server_5xx']}; a request after the soak: {r['after_soak_request']}"]
    if r.get("memory_cap"):
        c = r["memory_cap"]
        peak = "n/a" if c["peak_bytes"] is None else f"{c['peak_bytes'] / 2**20:.0f} MiB"
        lines += ["", f"memory cgroup (anonymous memory and page cache): cap {c['limit_bytes'] / 2**30:.1f} GiB, "
                  f"peak {peak}{', killed for memory' if c['oom_killed'] else ''}; page cache "
                  f"{'dropped' if r.get('cold') else 'as found'} before the server started"]
    return "\n".join(lines)


def mib(kib: int | None) -> str:
    return "n/a" if kib is None else f"{kib / 1024:.0f} MiB"


def num(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    raise SystemExit(main())
