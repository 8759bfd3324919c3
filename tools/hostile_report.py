"""The report of ``tools/load_test.py --hostile`` (tools/hostile_clients.py runs it): the
targets met or not, and the markdown table docs/SERVER.md quotes ("Hostile clients")."""

from __future__ import annotations


def targets(r: dict) -> dict:
    """No 5xx anywhere; the normal clients' p95 (TTFT and total) within 2x of the quiet run's;
    every count back within its tolerance of the state before the hostile phase."""
    normal_5xx = sum(n for s, n in r["hostile"]["statuses"].items() if s.startswith("5"))
    normal_5xx += sum(n for s, n in r["quiet"]["statuses"].items() if s.startswith("5"))
    hostile_5xx = sum(n for sc in r["hostile_clients"].values() for k in sc.values()
                      for o, n in k["outcomes"].items() if o.startswith("5"))
    ratio = {k: round(r["hostile"][k] / r["quiet"][k], 2) if r["quiet"][k] else None
             for k in ("ttft_p95_s", "total_p95_s")}
    back = {k: None if v["tolerance"] is None or None in (v["before"], v["after"][-1])
            else v["after"][-1] <= v["before"] + v["tolerance"] for k, v in r["resources"].items()}
    return {"normal_5xx": normal_5xx, "hostile_5xx": hostile_5xx, "server_5xx_counted": r["server_5xx"],
            "no_5xx": normal_5xx == 0 and hostile_5xx == 0 and not r["server_5xx"],
            "p95_ratio": ratio, "p95_within_2x": all(v is not None and v <= 2 for v in ratio.values()),
            "back_to_baseline": back, "all_back": all(v is not False for v in back.values()),
            "after_request_ok": r["after_request"] == 200}


def markdown(r: dict) -> str:
    s, t = r["settings"], r["targets"]
    lines = [f"{s['clients']} normal clients (streamed chat), quiet run {s['requests_per_client_quiet']} requests "
             f"each; {s['rounds']} rounds of the hostile scenarios (each client held up to {s['hold_s']:g} s, "
             f"silent streams {s.get('silent_hold_s', s['hold_s']):g} s, asking {s['silent_max_tokens']} tokens)",
             "", "| normal clients | requests | statuses | TTFT p50 | TTFT p95 | total p50 | total p95 |",
             "|---|---:|---|---:|---:|---:|---:|"]
    rows = [("quiet", r["quiet"]), ("under hostile clients", r["hostile"])]
    rows += [(f"&nbsp;&nbsp;started during {name}", v) for name, v in r["by_scenario"].items()]
    for name, v in rows:
        cells = [f"{v[k]:.2f} s" if v[k] == v[k] else "-" for k in ("ttft_p50_s", "ttft_p95_s", "total_p50_s",
                                                                     "total_p95_s")]
        lines.append(f"| {name} | {v['requests']} | {_fmt(v['statuses']) or '-'} | {' | '.join(cells)} |")
    lines += ["", "| scenario | hostile client | n | outcomes | seconds to outcome (median / max) |",
              "|---|---|---:|---|---|"]
    for name, kinds in r["hostile_clients"].items():
        for kind, v in kinds.items():
            lines.append(f"| {name} | {kind} | {v['clients']} | {_fmt(v['outcomes'])} | "
                         f"{v['seconds_median']} / {v['seconds_max']} |")
    rounds = len(next(iter(r["resources"].values()))["after"])
    lines += ["", "| server | before | peak during | " + " | ".join(f"after round {n + 1}" for n in range(rounds))
              + " | tolerance | back |", "|---|" + "---:|" * (rounds + 3) + "---|"]
    for k, v in r["resources"].items():
        cells = [_state(k, x) for x in (v["before"], v["peak"], *v["after"], v["tolerance"])]
        back = {True: "yes", False: "NO", None: "not judged"}[t["back_to_baseline"][k]]
        lines.append(f"| {k.replace('_kib', '').replace('_', ' ')} | {' | '.join(cells)} | {back} |")
    ratio = t["p95_ratio"]
    lines += ["", f"5xx: {t['normal_5xx']} seen by normal clients, {t['hostile_5xx']} by hostile ones, "
              f"{t['server_5xx_counted']} counted by the server; p95 under hostile clients / quiet: TTFT "
              f"{ratio['ttft_p95_s']}x, total {ratio['total_p95_s']}x (target 2x: "
              f"{'met' if t['p95_within_2x'] else 'NOT met'}); /metrics while hostile: slowest "
              f"{r['metrics_reads']['slowest_s']} s, failed {r['metrics_reads']['failed'] or 0}; "
              f"a request after: {r['after_request']}"]
    return "\n".join(lines)


def _state(key: str, value) -> str:
    if value is None:
        return "-"
    return f"{value / 1024:.0f} MiB" if key.endswith("_kib") else f"{value:g}"


def _fmt(counts: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counts.items())
