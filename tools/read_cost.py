"""What an expert read costs the CPU: buffered reads against direct (O_DIRECT) reads.

    python tools/read_cost.py [--model DIR] [--gb 2] [--modes buffered,direct-bounce,direct]
                              [--memory-limit 8G,none] [--repeats 3] [--threads 2] [--json FILE]
                              [--paths extension,python] [--calls layer|expert]

For each (memory cap, mode), ``--repeats`` times, one child process (in a memory cgroup of
the cap, anonymous memory and page cache together, as ``edge0 bench --memory-limit``; root
only) opens the checkpoint's ``ExpertReader`` with direct reads on or off (``direct``: into slot
buffers laid out as the engine's, so whole pages land in place; ``direct-bounce``: every byte
through the bounce buffer), drops the
checkpoint's files from the page cache, and reads ``--gb`` GB of experts the way a decode
step does: for one layer after another, 8 experts drawn at random (seeded, the same draw in
every run), each read whole into rows of slot buffers by ``--threads`` reader threads
(``--calls layer``: one ``read_experts`` call a layer, split over the threads; ``expert``: as the
staged path's scheduler reads, each thread a share of the layer, one call an expert). Each
``--paths`` entry reads through the extension's ``read_rows`` (one call an expert's ranges, the
interpreter's lock released) or the reader's Python path (one ``preadv`` a range). The
child's CPU time (user + system, its own and its threads', from ``getrusage``: a buffered
read's copy out of the page cache and the reclaim of pages under the cap are system time of
the process that reads) and wall time are reported per GB read, median over the repeats.
Prints a markdown table; ``--json`` writes every run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge0.benchmark.cgroup import MemoryCap, parse_size  # noqa: E402
from edge0.benchmark.harness import checkpoint_files, evict  # noqa: E402

DEFAULT_MODEL = Path(os.environ.get("EDGE0_CACHE", Path.home() / ".cache" / "edge0")) / "bench-35b-40L"


def child(model: str, mode: str, gb: float, threads: int, seed: int, path: str = "extension",
          calls: str = "layer") -> dict:
    """Runs in the capped process: the reads, and what they cost."""
    from edge0.backend import io as bio
    from edge0.io_sched import reader as reader_mod
    from edge0.io_sched.reader import ExpertReader
    from edge0.model.open import open_checkpoint

    spec, index, _ = open_checkpoint(model)  # checks, headers, byte ranges: no tensor read
    layers = sorted(index.layers)
    per_expert = index.layers[layers[0]].expert_bytes
    from edge0.exec.rows import row_phase

    place = mode != "direct-bounce"  # slots laid out as the engine's (direct reads land in place)
    buffers = {l: [bio.RowBuffer(8, t.row_bytes, row_phase(t) if place else None) for t in index.layers[l].tensors]
               for l in layers}
    rng = random.Random(seed)
    evict(checkpoint_files(Path(model)))
    direct = mode.startswith("direct")
    with ExpertReader(index, threads=threads, direct=direct, native=path == "extension") as reader, \
            ThreadPoolExecutor(threads) as pool:
        if direct != reader.direct:
            return {"error": f"direct reads were {'refused' if direct else 'used'} on this filesystem"}
        if path == "extension" and reader_mod._native_read_rows() is None:
            return {"error": "the extension is not built"}

        def share(layer, pairs):  # one reader thread's share of a layer, one call an expert
            return sum(reader.read_experts(layer, [e], [r], buffers[layer], parallel=False) for e, r in pairs)

        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        total, step = 0, 0
        while total < gb * 1e9:
            layer = layers[step % len(layers)]
            experts = sorted(rng.sample(range(spec.num_experts), 8))
            if calls == "layer":
                total += reader.read_experts(layer, experts, range(8), buffers[layer])
            else:
                pairs = list(zip(experts, range(8)))
                total += sum(pool.map(lambda i: share(layer, pairs[i::threads]), range(threads)))
            step += 1
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    user, system = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
    return {"bytes": total, "wall_s": wall, "user_s": user, "system_s": system, "expert_bytes": per_expert,
            "cpu_s_per_gb": (user + system) / (total / 1e9), "gb_per_s": total / 1e9 / wall,
            "major_faults": r1.ru_majflt - r0.ru_majflt, "in_place_reads": reader.stats.in_place_reads,
            "reads": reader.stats.reads}


def run_one(args, cap_text: str, mode: str, path: str, repeat: int) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--model", args.model, "--gb", str(args.gb),
           "--threads", str(args.threads), "--seed", str(args.seed), "--paths", path, "--calls", args.calls]
    cap = None if cap_text == "none" else MemoryCap(parse_size(cap_text), f"edge0-read-cost-{os.getpid()}-{repeat}")
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=cap.prepare() if cap else None)
    capped = cap.finish(proc.returncode) if cap else None
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}",
                "cap": capped}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["cap"] = capped
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint (default: the 40-layer bench one)")
    p.add_argument("--gb", type=float, default=2.0, help="GB of experts each run reads (default 2)")
    p.add_argument("--modes", default="buffered,direct-bounce,direct",
                   help="buffered (page cache), direct-bounce (O_DIRECT, every byte through the bounce buffer), "
                        "direct (O_DIRECT into slots laid out as the engine's: whole pages land in place)")
    p.add_argument("--memory-limit", default="8G,none", help="caps, comma-separated; none = no cap")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="reader threads (default 2, the engine's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paths", default="extension",
                   help="extension (the extension's read_rows), python (the reader's Python path), or both, "
                        "comma-separated (default extension)")
    p.add_argument("--calls", choices=["layer", "expert"], default="layer",
                   help="layer: one call a layer's 8 experts; expert: one call an expert, as the staged path's "
                        "scheduler reads (default layer)")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model, args.child, args.gb, args.threads, args.seed, args.paths, args.calls)))
        return 0
    if not Path(args.model, "config.json").is_file():
        p.error(f"no checkpoint at {args.model}: write it with tools/make_bench_checkpoint.py OUT --layers 40")
    caps, paths = args.memory_limit.split(","), args.paths.split(",")
    modes = [f"{m} {p}" if len(paths) > 1 else m for m in args.modes.split(",") for p in paths]
    runs: dict = {}
    for repeat in range(args.repeats):  # interleaved: every arm sees the same machine drift
        for cap in caps:
            for mode in modes:
                r = run_one(args, cap, *(mode.split(" ") if len(paths) > 1 else (mode, paths[0])), repeat)
                runs.setdefault(f"{cap}/{mode}", []).append(r)
                print(f"[read_cost] {cap} {mode} #{repeat + 1}: "
                      + (r["error"] if "error" in r else f"{r['cpu_s_per_gb']:.3f} CPU s/GB, {r['gb_per_s']:.2f} GB/s"),
                      file=sys.stderr, flush=True)
    print(f"model: {Path(args.model).name}, {args.gb} GB per run, 8 random experts per layer, one call "
          f"{'a layer' if args.calls == 'layer' else 'an expert'}, {args.threads} reader threads, read through "
          f"{' / '.join(paths)}, page cache dropped before each run, median of {args.repeats}\n")
    print(f"| cap | reads | CPU s / GB | user s / GB | system s / GB | GB/s | vs {modes[0]} (CPU) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for cap in caps:
        ok_base = [r for r in runs.get(f"{cap}/{modes[0]}", []) if "error" not in r]
        base = statistics.median(r["cpu_s_per_gb"] for r in ok_base) if ok_base else None
        for mode in modes:
            ok = [r for r in runs[f"{cap}/{mode}"] if "error" not in r]
            if not ok:
                print(f"| {cap} | {mode} | {runs[f'{cap}/{mode}'][0]['error']} | | | | |")
                continue
            gb = [r["bytes"] / 1e9 for r in ok]
            cpu = statistics.median(r["cpu_s_per_gb"] for r in ok)
            user = statistics.median(r["user_s"] / g for r, g in zip(ok, gb))
            system = statistics.median(r["system_s"] / g for r, g in zip(ok, gb))
            rate = statistics.median(r["gb_per_s"] for r in ok)
            base = base if base is not None else cpu  # the first mode failed: against this one
            print(f"| {cap} | {mode} | {cpu:.3f} | {user:.3f} | {system:.3f} | {rate:.2f} | {cpu / base:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": Path(args.model).name, "gb": args.gb, "threads": args.threads,
                                               "calls": args.calls, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
