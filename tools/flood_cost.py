#!/usr/bin/env python
"""What a connection flood costs the server, and what it costs the flooder.

    python tools/flood_cost.py [--model DIR] [--seconds 10] [--sockets 260] [-- SERVE FLAGS...]

Starts ``edge0 serve`` on a free port (the demo by default), then runs the flood of
tools/hostile_attacks.py from 127.0.0.2 in this process for ``--seconds``: ``--sockets``
silent connections, each reopened as soon as the server closes it. Prints the connections
made, and the CPU seconds the server's process and this one spent meanwhile (from
/proc and getrusage): on one machine the two share its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostile_attacks  # noqa: E402
import load_test  # noqa: E402


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(load_test.ROOT / "src" / "edge0" / "data" / "demo_model"))
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--sockets", type=int, default=260)
    ap.add_argument("serve_args", nargs="*", help="more `edge0 serve` flags, after --")
    args = ap.parse_args(argv)
    proc, url = load_test.start_server(args.model, args.serve_args)
    try:
        addr = (url.split("//")[1].rsplit(":", 1)[0], int(url.rsplit(":", 1)[1]))

        async def flood():
            stop = asyncio.Event()
            task = asyncio.ensure_future(hostile_attacks.flood(addr, stop, sockets=args.sockets))
            await asyncio.sleep(args.seconds)
            stop.set()
            return await task

        server0, own0, t0 = cpu_seconds(proc.pid), own_cpu_seconds(), time.monotonic()
        result = asyncio.run(flood())
        server1, own1, t1 = cpu_seconds(proc.pid), own_cpu_seconds(), time.monotonic()
    finally:
        proc.kill()
    print(f"{result['detail']} in {t1 - t0:.1f} s; CPU seconds meanwhile: server {server1 - server0:.2f}, "
          f"flooder {own1 - own0:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
