"""Render a benchmark result document as a markdown table and (optionally) a PNG chart."""

from __future__ import annotations

import statistics
from pathlib import Path

from edge0.benchmark import machine

MIB = 2**20


def _fmt(fig: dict | None, scale: float = 1.0, digits: int = 1) -> str:
    if fig is None:
        return "n/a"
    m, lo, hi = fig["median"] / scale, fig["min"] / scale, fig["max"] / scale
    return f"{m:.{digits}f} [{lo:.{digits}f}–{hi:.{digits}f}]"


def markdown(doc: dict) -> str:
    s = doc["settings"]
    limit = s.get("memory_limit")
    size = (f"{limit / 2**30:.1f} GiB" if limit >= 2**30 else f"{limit / 2**20:.0f} MiB") if limit else ""
    capped = f", each arm capped at **{size}** (memory cgroup: anonymous + page cache)" if limit else ""
    lines = [
        f"Model `{Path(doc['model']).name}` ({doc['checkpoint_bytes'] / 1e9:.2f} GB), page cache **{s['cache']}**, "
        f"{s['rounds']} rounds, {s['prompt_tokens']} prompt + {s['decode_tokens']} decode tokens, "
        f"compute {s['compute_dtype']}, Edge0's arms on kernels {s.get('kernels', 'auto')}{capped}. "
        "Median [min–max] over rounds.",
        "",
        machine.line(doc.get("machine")),
        "",
        "| arm | decode tok/s | prefill tok/s | peak MLX active (MiB) | peak RSS (MiB) | expert MiB/token "
        "| disk MiB/token | read wait ms/step | load s | decode vs resident | active mem vs resident |"
        + (" peak cgroup (MiB) |" if limit else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if limit else ""),
    ]
    for name, a in doc["arms"].items():
        if "decode_tps" not in a:
            lines.append(f"| {name} | did not run: {a.get('did_not_run')} |" + " |" * (10 + bool(limit)))
            continue
        ratio = a.get("ratio_to_resident") or {}
        dec = ratio.get("decode_tps")
        mem = ratio.get("peak_active_memory")
        lines.append(
            f"| {name} | {_fmt(a['decode_tps'], digits=2)} | {_fmt(a['prefill_tps'], digits=2)} "
            f"| {_fmt(a.get('peak_active_memory'), MIB, 0)} | {_fmt(a['peak_rss'], MIB, 0)} "
            f"| {_fmt(a['expert_bytes_per_token'], MIB, 1)} | {_fmt(a.get('disk_bytes_per_token'), MIB, 1)} "
            f"| {_fmt(a.get('read_wait_ms_per_step'), digits=1)} "
            f"| {_fmt(a['load_seconds'], digits=1)} "
            f"| {'' if dec is None else f'{dec:.2f}x'} | {'' if mem is None else f'{mem:.1%}'} |"
            + (f" {_fmt(a['cgroup_peak_bytes'], MIB, 0)} |" if limit and "cgroup_peak_bytes" in a else
               " |" if limit else "")
            + (f" ({a['out_of_memory_runs']} of {len(a['runs'])} runs out of memory)" if a.get("out_of_memory_runs")
               else ""))
    variants = [(name, a["vs_base_arm"]) for name, a in doc["arms"].items() if a.get("vs_base_arm")]
    if variants:
        lines += ["", "Variants against their base arm, round by round (median [min–max] of the per-round figure):", ""]
    for name, v in variants:
        mem = v["peak_active_memory_delta"]
        what = []
        if v.get("adapter_bytes"):
            what.append(f"adapter {v['adapter_bytes'] / MIB:.3f} MiB")
        if v.get("experts_per_token") != v.get("base_experts_per_token"):
            what.append(f"{v['experts_per_token']} experts per token (base arm {v['base_experts_per_token']})")
        ratio = v["expert_bytes_per_token_ratio"]
        lines.append(
            f"- {name} vs {v['arm']}: decode {_fmt(v['decode_tps_ratio'], digits=3)}x, "
            + (f"expert bytes per token {_fmt(ratio, digits=3)}x, " if ratio else "")
            + ("peak MLX active "
               f"{mem['median'] / MIB:+.3f} MiB [{mem['min'] / MIB:+.3f}–{mem['max'] / MIB:+.3f}]" if mem else
               "no MLX memory")
            + (f" ({', '.join(what)})" if what else ""))
    if doc.get("gguf_bytes"):
        builds = {", ".join(r["info"]["build"]) for a in doc["arms"].values() for r in a.get("runs", [])
                  if r.get("info", {}).get("build")}
        built = f" Its build uses: {'; '.join(sorted(builds))}." if builds else ""
        lines += ["", f"llama.cpp runs the GGUF copy of the checkpoint (the same weights in Q4_1, "
                      f"{doc['gguf_bytes'] / 1e9:.2f} GB); its MiB/token is what the kernel read from the disk for "
                      "it per token (`/proc/self/io`: every weight a step touched that was not in the page cache), "
                      f"and its read wait is inside its step (page faults), n/a here.{built}"]
    lines += _forecast_lines(doc)
    ov = doc.get("overlap")
    if ov:
        lines += ["", f"Staged+oracle decode step {ov['staged_step_ms']:.1f} ms = {ov['staged_over_max']:.3f} x "
                      f"max(compute-only {ov['compute_only_step_ms']:.1f} ms, read-only {ov['read_only_step_ms']:.1f} ms)"
                      + (f"; exact {ov['exact_step_ms']:.1f} ms vs compute + read "
                         f"{ov['compute_only_step_ms'] + ov['read_only_step_ms']:.1f} ms" if "exact_step_ms" in ov else "")
                      + " (median step times)."]
    return "\n".join(lines) + "\n"


def _forecast_lines(doc: dict) -> list[str]:
    """``edge0 bench --forecast``: each arm's forecast beside what it measured, and the
    machine's speed during the arm's rounds against while the forecast measured its replica
    (the probe step's time there over its median time around the rounds), with the forecast's
    compute scaled by it."""
    s, lines = doc["settings"], []
    forecasts = [(name, a) for name, a in doc["arms"].items() if a.get("forecast") and "decode_tps" in a]
    if forecasts:
        lines = ["", "`edge0 plan --speed`'s forecast, made before the arm ran, beside what it measured:", "",
                 "| arm | forecast decode tok/s | measured | forecast / measured | forecast TTFT s | measured prefill s "
                 "| machine speed, rounds / forecast | forecast at the rounds' speed / measured |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, a in forecasts:
        f, dec = a["forecast"], a["decode_tps"]["median"]
        if f.get("unavailable"):
            lines.append(f"| {name} | none: {f['unavailable']} | {dec:.2f} | | | | | |")
            continue
        prefill = s["prompt_tokens"] / a["prefill_tps"]["median"]
        drift = ""
        if f.get("probe_ms") and a.get("probe_ms") and "compute_ms" in f:
            speed = f["probe_ms"] / statistics.median(a["probe_ms"])
            scaled = 1e3 / (f["step_ms"] - f["compute_ms"] + f["compute_ms"] / speed)
            drift = f"{speed:.2f}x | {scaled / dec:.2f}x"
        lines.append(f"| {name} | {f['decode_tok_s']:.2f} | {dec:.2f} | {f['decode_tok_s'] / dec:.2f}x "
                     f"| {f['ttft_s']:.2f} | {prefill:.2f} | {drift or ' |'} |")
    if forecasts:
        lines += ["", "The machine's speed is a fixed step of products (`edge0.backend.timing.probe_seconds`) timed "
                  "around each round and around the forecast's replica rounds; the last column scales the "
                  "forecast's compute (replica, kernels, heads' flush) by it, its reads as they were."]
    return lines


def chart(docs: list[dict], path: str | Path) -> None:
    """Decode tok/s and peak MLX active memory per arm (one group of bars per cache mode)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("the chart needs matplotlib: pip install 'edge0[plot]'") from e
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(len(docs), 1)
    for i, doc in enumerate(docs):
        names = list(doc["arms"])
        xs = [j + i * width for j in range(len(names))]
        tps = [doc["arms"][n]["decode_tps"] for n in names]
        mem = [doc["arms"][n].get("peak_active_memory") or {"median": 0} for n in names]
        label = doc["settings"]["cache"]
        ax1.bar(xs, [t["median"] for t in tps], width, label=label,
                yerr=[[t["median"] - t["min"] for t in tps], [t["max"] - t["median"] for t in tps]])
        ax2.bar(xs, [m["median"] / MIB for m in mem], width, label=label)
        for ax in (ax1, ax2):
            ax.set_xticks([j + width * (len(docs) - 1) / 2 for j in range(len(names))], names)
    ax1.set_title("decode tok/s (median, min-max)")
    ax2.set_title("peak MLX active memory (MiB)")
    ax2.set_yscale("log")
    ax1.legend()
    fig.suptitle(Path(docs[0]["model"]).name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
