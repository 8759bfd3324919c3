"""What one attacking client costs another on ``edge0 serve``: a victim's streamed chat
completion and ``/health``, quiet and while the attack runs.

    python tools/victim_stall.py [--attack big_bodies|templates|both] [--repeats 3] [--serve-model DIR] [--out FILE]

The server (the demo with a chat template, ``tools/fuzz_bodies.py``'s copy; or
``--serve-model``) is started on a free loopback port. Each repeat streams the victim's
completion (``--victim-tokens`` tokens, greedy) once quiet and once under each attack, while
``/health`` is polled every 20 ms; it reports the victim's total time and its longest gap
between two chunks, and ``/health``'s slowest answer. Attacks, from one client process:

- ``big_bodies``: two connections, each sending three completions whose bodies are
  4,000,028 bytes of two million token ids (the red team's);
- ``templates``: 33 chat requests whose ``chat_template_kwargs`` hold a whole template of
  nested loops, each client leaving after 3 s.

After the attacks: seconds until ``/metrics`` shows nothing in flight or queued, and the
server's RSS against its RSS after the quiet runs. Medians over the repeats; the raw runs
go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from fuzz_bodies import serve, with_template
from hostile_attacks import BIG_BODY, TEMPLATE_BOMB
from load_test import rss_kib

VICTIM = "Write a long story about a lighthouse keeper."


def victim(url: str, tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": VICTIM}], "max_tokens": tokens, "temperature": 0,
            "stream": True}
    t0 = last = time.perf_counter()
    gap, chunks = 0.0, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                now = time.perf_counter()
                gap, last, chunks = max(gap, now - last), now, chunks + 1
    return {"total_s": time.perf_counter() - t0, "longest_gap_s": gap, "chunks": chunks}


class HealthPoller(threading.Thread):
    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop, self.worst = url, threading.Event(), 0.0

    def run(self) -> None:
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                c.get(self.url + "/health")
                self.worst = max(self.worst, time.perf_counter() - t0)
                time.sleep(0.02)


def big_bodies(url: str) -> None:
    def one():
        for _ in range(3):
            httpx.post(url + "/v1/completions", content=BIG_BODY, headers={"Content-Type": "application/json"},
                       timeout=120)
    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def templates(url: str) -> None:
    body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 4,
            "chat_template_kwargs": {"chat_template": TEMPLATE_BOMB}}

    def one():
        try:
            httpx.post(url + "/v1/chat/completions", json=body, timeout=3)
        except httpx.HTTPError:
            pass  # the client gives up after 3 s
    threads = [threading.Thread(target=one) for _ in range(33)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


ATTACKS = {"big_bodies": big_bodies, "templates": templates}


def measured(url: str, tokens: int, attack: str | None = None) -> dict:
    poller = HealthPoller(url)
    poller.start()
    # the attacker in a process of its own, as on another machine (its threads would hold
    # this process's interpreter lock and delay the victim's reads here, not the server)
    attacker = subprocess.Popen([sys.executable, __file__, "--run-attack", attack, "--url", url]) if attack else None
    if attacker:
        time.sleep(0.2)  # the attack under way before the victim starts
    out = victim(url, tokens)
    if attacker:
        attacker.wait()
    poller.stop.set()
    poller.join()
    return {**out, "health_worst_s": poller.worst}


def settle_s(url: str, limit: float = 60.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        text = httpx.get(url + "/metrics", timeout=30).text
        busy = [line for line in text.splitlines() if line.startswith(("edge0_in_flight_requests ", "edge0_queue_depth "))
                and float(line.split()[-1]) > 0]
        if not busy:
            return time.monotonic() - t0
        time.sleep(0.1)
    return float("inf")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attack", choices=[*ATTACKS, "both"], default="both")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--victim-tokens", type=int, default=128)
    p.add_argument("--serve-model", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--run-attack", choices=list(ATTACKS), help=argparse.SUPPRESS)  # the attacker's process
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run_attack:
        ATTACKS[args.run_attack](args.url)
        return 0
    from edge0.cli import demo_model_dir

    attacks = list(ATTACKS) if args.attack == "both" else [args.attack]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "server.log"), "w") as log:
        model = Path(args.serve_model) if args.serve_model else with_template(demo_model_dir(), Path(tmp) / "m")
        proc, url = serve(model, log)
        try:
            measured(url, 8)  # warm-up
            for r in range(args.repeats):
                runs.append({"repeat": r, "arm": "quiet", **measured(url, args.victim_tokens)})
                base_rss = rss_kib(proc.pid) / 1024
                for name in attacks:
                    row = {"repeat": r, "arm": name, **measured(url, args.victim_tokens, name)}
                    row["settle_s"] = settle_s(url)
                    time.sleep(5)
                    row["rss_over_quiet_mib"] = rss_kib(proc.pid) / 1024 - base_rss
                    runs.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    summary = {}
    for arm in ["quiet", *attacks]:
        rows = [x for x in runs if x["arm"] == arm]
        summary[arm] = {k: round(statistics.median(x[k] for x in rows), 3)
                        for k in ("total_s", "longest_gap_s", "health_worst_s", "settle_s", "rss_over_quiet_mib")
                        if k in rows[0]}
    for arm in attacks:
        summary[arm]["total_over_quiet"] = round(statistics.median(
            a["total_s"] / q["total_s"] for a, q in zip([x for x in runs if x["arm"] == arm],
                                                        [x for x in runs if x["arm"] == "quiet"])), 2)
    print(json.dumps(summary, indent=1))
    if args.out:
        command = ["tools/victim_stall.py", *sys.argv[1:]]
        Path(args.out).write_text(json.dumps({"summary": summary, "runs": runs, "command": command}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
