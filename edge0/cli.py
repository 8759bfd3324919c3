"""The ``edge0`` command line: generate, demo, make-tiny.

Flags follow mlx_lm.generate's names (--model, --prompt, --max-tokens, --temp, --top-p,
--seed) so that switching between the two is a matter of the program name.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from edge0.config import EngineConfig
from edge0.errors import Edge0Error

DEMO_FAMILY = "qwen3_moe"
DEMO_PROMPT = "import os\n\n\ndef read_lines(path):"
DEMO_VERSION = 1


def cache_dir() -> Path:
    root = os.environ.get("EDGE0_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "edge0")
    return Path(root)


PACKAGED_DEMO = Path(__file__).resolve().parent / "data" / "demo_model"


def demo_model_dir() -> Path:
    """The default model: the small MoE trained on Python sources that ships with Edge0
    (edge0/data/demo_model, int4). Without it (a source tree that lacks the data), a random
    tiny model is built once in a child process and cached: nothing is downloaded."""
    if (PACKAGED_DEMO / "config.json").exists():
        return PACKAGED_DEMO
    path = cache_dir() / f"demo-{DEMO_FAMILY}-v{DEMO_VERSION}"
    if not (path / "config.json").exists():
        print(f"[edge0] building a random demo model once into {path} ...", file=sys.stderr)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        shape = ["--layers", "8", "--experts", "64", "--k", "4", "--hidden", "256", "--moe-intermediate", "256"]
        subprocess.run([sys.executable, "-m", "edge0", "make-tiny", DEMO_FAMILY, str(tmp), "--overwrite", *shape],
                       check=True, stdout=subprocess.DEVNULL)
        if path.exists():  # another process built it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.replace(path)
    return path


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    from edge0.config_sources import add_config_flags

    p.add_argument("--prompt", "-p", default=None, help="prompt text (default: a short code prompt)")
    p.add_argument("--max-tokens", "-m", type=int, default=100, help="tokens to generate (default 100)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    add_config_flags(p)  # every EngineConfig field (docs/CONFIG.md)


def _engine_config(args) -> EngineConfig:
    from edge0.config_sources import resolve_config

    return resolve_config(args)


def _run_generation(model_dir: Path, args) -> int:
    from edge0.engine import Engine

    config = _engine_config(args)
    prompt = args.prompt if args.prompt is not None else DEMO_PROMPT
    with Engine(model_dir, config) as engine:
        print("=" * 10)
        print(prompt, end="", flush=True)
        stats = None
        for event in engine.stream(prompt, max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p,
                                   seed=args.seed):
            print(event.text, end="", flush=True)
            stats = event.stats or stats
        print()
        print("=" * 10)
        spec = engine.spec
        print(f"model: {model_dir} ({spec.model_type}, {len(spec.moe_layers)} MoE layers x "
              f"{spec.num_experts} experts, k={spec.k}; experts on disk "
              f"{engine.index.expert_bytes_total / 2**20:.1f} MiB of {engine.index.total_bytes / 2**20:.1f} MiB)")
        if stats is not None:
            print(stats.line())
    return 0


def cmd_record_routing(args) -> int:
    from edge0.engine import Engine

    config = _engine_config(args)
    with Engine(Path(args.model), config) as engine:
        routing = engine.record_routing(args.prompt if args.prompt is not None else DEMO_PROMPT,
                                        max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p,
                                        seed=args.seed)
    routing.save(args.out)
    print(f"recorded {len(routing)} decode steps x {len(routing.steps[0]) if routing.steps else 0} MoE layers "
          f"to {args.out}")
    return 0


def cmd_generate(args) -> int:
    return _run_generation(Path(args.model), args)


def cmd_demo(args) -> int:
    return _run_generation(demo_model_dir(), args)


def cmd_make_tiny(args) -> int:
    from edge0.tiny import make_tiny

    try:
        path = make_tiny(args.family, args.out, seed=args.seed, dtype=args.dtype, overwrite=args.overwrite,
                         layers=args.layers, experts=args.experts, k=args.k, hidden=args.hidden,
                         moe_intermediate=args.moe_intermediate)
    except (ValueError, FileExistsError) as e:
        print(f"edge0: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from edge0.spec import SUPPORTED_MODEL_TYPES

    parser = argparse.ArgumentParser(prog="edge0", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, streaming routed experts from disk")
    g.add_argument("--model", required=True, help="an mlx-lm int4 MoE checkpoint directory")
    _add_engine_flags(g)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="generate from the built-in default model (nothing downloaded)")
    _add_engine_flags(d)
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser("record-routing", help="record a generation's routing (the oracle for --decode-path staged)",
                       description="Runs the generation on the exact path and writes, per decode step and MoE "
                                   "layer, the experts it routed to. A staged run of the same model, prompt and "
                                   "sampling replays it with --decode-path staged --oracle-file FILE.")
    r.add_argument("--model", required=True, help="an mlx-lm int4 MoE checkpoint directory")
    r.add_argument("--out", required=True, help="the routing file to write (JSON)")
    _add_engine_flags(r)
    r.set_defaults(func=cmd_record_routing)

    sub.add_parser("eval", help="held-out perplexity, top-1 agreement and KL vs a teacher (edge0 eval --help)",
                   add_help=False)
    from edge0.train.commands import add_parsers as add_train_parsers

    add_train_parsers(sub)

    t = sub.add_parser("make-tiny", help="write a small random int4 MoE checkpoint of a supported family")
    t.add_argument("family", choices=SUPPORTED_MODEL_TYPES)
    t.add_argument("out", help="output directory")
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--experts", type=int, default=16)
    t.add_argument("--k", type=int, default=4)
    t.add_argument("--hidden", type=int, default=128)
    t.add_argument("--moe-intermediate", type=int, default=64)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    t.add_argument("--overwrite", action="store_true")
    t.set_defaults(func=cmd_make_tiny)

    from edge0.benchmark.command import add_parser as add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["eval"]:  # its own parser: held-out quality (docs/TEACHER.md)
        from edge0.train.eval_cli import main as eval_main

        return eval_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv[2:]  # recorded in the provenance of what `train` writes
    try:
        return args.func(args)
    except Edge0Error as e:
        print(f"edge0: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
