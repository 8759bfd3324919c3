"""``edge0 bench``: build (once) the 35B-shaped checkpoint and run the A/B harness."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from edge0.benchmark.harness import CACHE_MODES, BenchSettings, run_bench
from edge0.benchmark.report import chart, markdown
from edge0.config import COMPUTE_DTYPES


def default_bench_model(layers: int) -> Path:
    from edge0.benchmark.checkpoint import BenchShape, make_bench_checkpoint
    from edge0.cache import cache_dir

    path = cache_dir() / f"bench-35b-{layers}L"
    if not (path / "config.json").exists():
        shape = BenchShape(layers=layers)
        print(f"[edge0] writing the 35B-shaped bench checkpoint ({shape.expert_bytes / 1e9:.1f} GB of experts) "
              f"to {path} ...", file=sys.stderr)
        make_bench_checkpoint(path, shape, overwrite=True)
    return path


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="same-session A/B benchmark of resident vs streaming arms",
                       description="Each arm runs in its own process, arm order rotates every round, all arms "
                                   "replay one token sequence, the page cache is evicted or warmed before each "
                                   "run; figures are medians over rounds with their spread.")
    b.add_argument("--model", default=None,
                   help="checkpoint directory (default: the 35B-shaped bench checkpoint of random weights, "
                        "written once into Edge0's cache: 5.5 GB at 12 layers, 18.4 GB at 40)")
    b.add_argument("--layers", type=int, default=12, help="layers of the default bench checkpoint (default 12)")
    b.add_argument("--arms", default="resident,exact", help="comma-separated arms (default resident,exact)")
    b.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    b.add_argument("--cache", default="cold,warm", help="page cache before each run: cold, warm or both "
                                                        "(default cold,warm)")
    b.add_argument("--prompt-tokens", type=int, default=32)
    b.add_argument("--decode-tokens", type=int, default=16)
    b.add_argument("--compute-dtype", choices=[d for d in COMPUTE_DTYPES if d != "auto"], default="float32",
                   help="activation dtype of every arm (default float32)")
    b.add_argument("--forecast", action="store_true",
                   help="print edge0 plan's speed forecast (edge0 plan --speed) beside what each Edge0 arm "
                        "(exact, hot, staged+prerouter and their variants) measured, and the machine's speed "
                        "during the rounds against while the forecast measured (a fixed step timed around each)")
    b.add_argument("--kernels", choices=["auto", "edge0", "mlx"], default="auto",
                   help="kernels of every arm that runs Edge0 (default auto: Edge0's own on the CPU; "
                        "--arm-option ARM:kernels=mlx for one arm); the resident arm is mlx-lm's, on MLX's")
    b.add_argument("--cache-budget-mb", type=int, default=None,
                   help="the expert cache of every Edge0 arm, MiB (cache_mb; default: each arm's own, auto)")
    b.add_argument("--heads", default=None, help="prerouter heads for the staged+prerouter arm (default: "
                                                 "warm-start heads written for the run)")
    b.add_argument("--adapter", default=None, help="an adapter every prerouter arm applies (ARM@label variants "
                                                   "can override it)")
    b.add_argument("--arm-option", action="append", default=[], metavar="ARM:KEY=VALUE[,KEY=VALUE]",
                   help="engine settings of one arm, e.g. staged+prerouter@narrow:experts_per_token=3,"
                        "prerouter_file=H,adapter=D (repeatable; ARM@label runs ARM as a variant; source=DIR runs the "
                        "arm on the Edge0 of another source tree, its kernels built: two versions in one run)")
    b.add_argument("--memory-limit", default=None, metavar="SIZE",
                   help="run each arm in a memory cgroup capped at SIZE (e.g. 8G), anonymous memory and page cache "
                        "together, so a checkpoint larger than SIZE cannot stay in RAM (root; cgroup v2 or v1)")
    b.add_argument("--gguf", default=None, metavar="FILE",
                   help="the llama.cpp arm's GGUF copy of the checkpoint (converted into FILE if it does not exist; "
                        "default: one kept in Edge0's cache, converted once)")
    b.add_argument("--llama-threads", type=int, default=None, metavar="N",
                   help="threads of the llama.cpp arm (default: every core, llama.cpp's own default)")
    b.add_argument("--out", default="bench-results", help="directory for JSON, markdown and chart")
    b.add_argument("--chart", action=argparse.BooleanOptionalAction, default=None,
                   help="draw bench.png (default: when matplotlib is installed, pip install -e '.[plot]'; "
                        "--chart insists on it, --no-chart skips it)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar (one line per run instead)")
    b.set_defaults(func=run)


def run(args) -> int:
    from edge0.errors import ConfigError

    modes = [m.strip() for m in args.cache.split(",") if m.strip()]
    if not modes or any(m not in CACHE_MODES for m in modes):
        raise ConfigError(f"--cache must name {' and/or '.join(CACHE_MODES)}, got {args.cache!r}")
    if args.chart is not False:  # before minutes of work, not after
        try:
            import matplotlib  # noqa: F401
            args.chart = True
        except ImportError:
            if args.chart:
                raise ConfigError("--chart needs matplotlib: pip install 'edge0[plot]' (or drop --chart)") from None
    limit = None
    if args.memory_limit is not None:  # checked (and the cgroup controller found) before any work
        from edge0.benchmark.cgroup import MemoryCap, parse_size

        limit = parse_size(args.memory_limit)
        probe = MemoryCap(limit, f"edge0-bench-probe-{os.getpid()}")
        probe.prepare()
        probe.remove()
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    options = arm_options(args.arm_option, arms)
    if args.adapter:
        for a in arms:
            if a.split("@")[0] == "staged+prerouter":
                options.setdefault(a, {}).setdefault("adapter", str(Path(args.adapter).resolve()))
    model = Path(args.model) if args.model else default_bench_model(args.layers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    docs = []
    for mode in modes:
        settings = BenchSettings(arms=arms, rounds=args.rounds, arm_options=options,
                                 cache=mode, prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
                                 compute_dtype=args.compute_dtype, cache_budget_mb=args.cache_budget_mb,
                                 memory_limit=limit, extra=_extra(args))
        bar = _RunBar(mode, args.rounds * len(arms), enabled=not args.no_progress)
        try:
            doc = run_bench(model, settings, progress=bar.say, forecaster=forecasts if args.forecast else None,
                            probe=_probe() if args.forecast else None)
        finally:
            bar.close()
        (out / f"bench-{mode}.json").write_text(json.dumps(doc, indent=2))
        docs.append(doc)
        print(markdown(doc))
    (out / "bench.md").write_text("\n".join(markdown(d) for d in docs))
    if args.chart:
        chart(docs, out / "bench.png")
    print(f"[bench] results in {out}/", file=sys.stderr)
    return 0


FORECAST_ARMS = {"exact": {}, "hot": {"decode_path": "hot"}, "staged+prerouter": {"prerouter": "on"}}


def forecasts(model_dir: Path, settings: BenchSettings, arm_settings: dict, progress) -> dict:
    """``edge0 plan --speed``'s forecast for each Edge0 arm that has one, made before the arm
    runs, under the arm's settings and the run's memory cap, its bytes from the replay's
    routing (the oracle the exact path recorded) and its TTFT for the run's prompt."""
    from edge0.benchmark.arms import base_arm, engine_config
    from edge0.plan import make

    out = {}
    for name in settings.arms:
        paths = FORECAST_ARMS.get(base_arm(name))
        if paths is None:
            continue
        if base_arm(name) == "staged+prerouter":
            paths = {**paths, "prerouter_file": arm_settings["prerouter_file"]}
        progress(f"forecasting {name}'s speed (edge0 plan --speed)")
        config = engine_config({**arm_settings, "arm": name}, **paths)
        out[name] = make(model_dir, config, memory=settings.memory_limit, trace=arm_settings["oracle_file"],
                         speed=settings.prompt_tokens)["speed"]
    return out


def _probe():
    """The fixed step of products that says the machine's speed at a moment (its seconds)."""
    from edge0.backend import timing

    return timing.probe_seconds


def _extra(args) -> dict:
    """Settings every arm's process gets besides the engine's: files named by the command line."""
    extra = {"kernels": args.kernels}
    if args.heads:
        extra["prerouter_file"] = str(Path(args.heads).resolve())
    if args.gguf:
        extra["gguf_file"] = str(Path(args.gguf).resolve())
    if args.llama_threads is not None:
        if args.llama_threads < 1:
            from edge0.errors import ConfigError

            raise ConfigError(f"--llama-threads must be at least 1, got {args.llama_threads}")
        extra["llama_threads"] = args.llama_threads
    return extra


def arm_options(items: list[str], arms: tuple[str, ...]) -> dict:
    """``ARM:KEY=VALUE,KEY=VALUE`` -> {ARM: {KEY: typed VALUE}}, each checked as an
    EngineConfig value, but ``source``: the Edge0 source tree the arm runs on (a checkout of
    another version, with its kernels built), checked to hold one."""
    from edge0.config_sources.resolve import resolve_config
    from edge0.config_sources.settings_list import parse_settings
    from edge0.errors import ConfigError

    out: dict = {}
    for item in items:
        arm, sep, rest = item.partition(":")
        if not sep or arm not in arms:
            raise ConfigError(f"--arm-option {item!r}: expected ARM:KEY=VALUE with ARM one of {list(arms)}")
        pairs = re.split(r",(?=\s*[a-z_][a-z0-9_]*=)", rest)
        sources = [p.partition("=")[2].strip() for p in pairs if p.strip().startswith("source=")]
        rest = ",".join(p for p in pairs if not p.strip().startswith("source="))
        values = parse_settings(rest, f"--arm-option {item!r}") if rest.strip() else {}
        resolve_config(environ={}, **values)  # typed checks now, not in a child process later
        for source in sources[-1:]:
            # a clone (its package in src/, or at its root before the src layout) or the folder above the package
            tree = next((t for t in (Path(source) / "src", Path(source))
                         if (t / "edge0" / "benchmark" / "arms.py").is_file()), None)
            if tree is None:
                raise ConfigError(f"--arm-option {item!r}: source {source} is not an Edge0 source tree "
                                  "(no src/edge0/benchmark/arms.py or edge0/benchmark/arms.py in it)")
            values["source"] = str(tree.resolve())
        out.setdefault(arm, {}).update(values)
    return out


class _RunBar:
    """A progress bar over the benchmark's runs (rounds x arms), its description the run in
    progress; the harness's other messages printed above it."""

    def __init__(self, mode: str, total: int, enabled: bool = True):
        self.mode, self.total, self.running, self.bar = mode, total, False, None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"bench ({mode})", unit="run", file=sys.stderr)

    def say(self, message: str) -> None:
        if self.bar is None:
            print(f"[bench] {message}", file=sys.stderr)
        elif message.startswith("round "):  # a run starts: the one before it is done
            if self.running:
                self.bar.update(1)
            self.running = True
            self.bar.set_description(f"bench ({self.mode}) {message}")
        else:
            self.bar.write(f"[bench] {message}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            if self.running:
                self.bar.update(1)  # the last run
            self.bar.close()
