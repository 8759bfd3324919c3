"""The server's memory across refused response formats: ``edge0 serve`` (the demo, or
``--serve-model DIR``) on a free loopback port is sent ``--schemas`` distinct schemas too
expensive to enforce (``^(a{N}){1000}$``, N = 1000, 1001, ...: each misses the compiled
formats' cache and is refused with a 400), and its RSS is read from /proc after each.

    python tools/schema_refusal_rss.py [--schemas 10] [--serve-model DIR] [--out FILE]

Prints the RSS after each refusal and its growth over the start (after one accepted
format); exits 1 if any answer was not a 400.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import httpx

from fuzz_bodies import serve
from load_test import rss_kib


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemas", type=int, default=10)
    p.add_argument("--serve-model", default=None, help="the model to serve (default: the demo model)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    from edge0.cli import demo_model_dir

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    rows, statuses = [], []
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "server.log"), "w") as log:
        proc, url = serve(Path(args.serve_model) if args.serve_model else demo_model_dir(), log)
        try:
            with httpx.Client(timeout=120) as c:
                c.post(url + "/v1/chat/completions", json={**chat, "response_format": {"type": "json_object"}})
                start = rss_kib(proc.pid) / 1024
                for i in range(args.schemas):
                    schema = {"type": "string", "pattern": "^(a{%d}){1000}$" % (1000 + i)}
                    t0 = time.perf_counter()
                    r = c.post(url + "/v1/chat/completions", json={**chat, "response_format": {
                        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
                    statuses.append(r.status_code)
                    now = rss_kib(proc.pid) / 1024
                    rows.append({"schema": i + 1, "status": r.status_code, "seconds": round(time.perf_counter() - t0, 2),
                                 "rss_mib": round(now), "over_start_mib": round(now - start)})
                    print(rows[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    report = {"start_rss_mib": round(start), "rows": rows,
              "after_mib": rows[-1]["over_start_mib"] if rows else None, "peak_over_start_mib":
              max((r["over_start_mib"] for r in rows), default=None)}
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if statuses and all(s == 400 for s in statuses) else 1


if __name__ == "__main__":
    raise SystemExit(main())
