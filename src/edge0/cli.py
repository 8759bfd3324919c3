"""The ``edge0`` command line.

``edge0 generate`` takes mlx_lm.generate's flags with their meanings (--model as a
directory or a cached repo id, --prompt with ``-`` for standard input, the chat template
applied by default, --system-prompt, --ignore-chat-template, --chat-template-config,
--max-tokens, --temp, --top-p, --top-k, --min-p, --min-tokens-to-keep, --xtc-probability,
--xtc-threshold, --seed, --extra-eos-token, --max-kv-size, --verbose false to print only the
generated text) plus every engine setting; the few it does not implement are refused with
the reason (``edge0.cli_args``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

from edge0.cache import cache_dir
from edge0.cli_args import PACKAGED_DEMO
from edge0.config import EngineConfig
from edge0.errors import Edge0Error

DEMO_FAMILY = "qwen3_moe"
DEMO_PROMPT = "import os\n\n\ndef read_lines(path):"
DEMO_VERSION = 1


def demo_model_dir() -> Path:
    """The default model: the small MoE trained on Python sources that ships with Edge0
    (edge0/data/demo_model, int4). Without it (a source tree that lacks the data), a random
    tiny model is built once in a child process and cached: nothing is downloaded."""
    from edge0.child_python import python_module

    if (PACKAGED_DEMO / "config.json").exists():
        return PACKAGED_DEMO
    path = cache_dir() / f"demo-{DEMO_FAMILY}-v{DEMO_VERSION}"
    if not (path / "config.json").exists():
        print(f"[edge0] building a random demo model once into {path} ...", file=sys.stderr)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        shape = ["--layers", "8", "--experts", "64", "--k", "4", "--hidden", "256", "--moe-intermediate", "256"]
        subprocess.run(python_module("edge0", "make-tiny", DEMO_FAMILY, str(tmp), "--overwrite", *shape),
                       check=True, stdout=subprocess.DEVNULL)
        if path.exists():  # another process built it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.replace(path)
    return path


DEFAULT_MAX_TOKENS = 100


def _str2bool(text: str) -> bool:
    """mlx_lm.generate's --verbose: anything but 'false'/'f' (any case) is true."""
    return text.lower() not in ("false", "f")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    from edge0.cli_args import add_mlx_generate_flags
    from edge0.config_sources.cli_flags import add_config_flags

    p.add_argument("--prompt", "-p", default=None,
                   help="the prompt; '-' reads it from standard input (default: a short code prompt)")
    p.add_argument("--system-prompt", default=None, help="system message for the chat template")
    p.add_argument("--prefill-response", default=None, metavar="TEXT",
                   help="the start of the assistant's answer, written into the chat template: the model continues "
                        "it (mlx_lm.generate's flag; needs a chat template)")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="use the raw prompt, not the tokenizer's chat template (applied by default when the "
                        "tokenizer has one)")
    p.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens to generate (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (default 0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p sampling threshold in [0, 1) (default 0: off)")
    p.add_argument("--min-tokens-to-keep", type=int, default=1, help="tokens min-p always keeps (default 1)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--extra-eos-token", nargs="+", default=(), metavar="TOKEN",
                   help="more tokens that end the generation (the tokenizer's EOS always does)")
    p.add_argument("--max-kv-size", type=int, default=None, help="a rotating KV cache of this many tokens")
    p.add_argument("--verbose", type=_str2bool, default=True, metavar="BOOL",
                   help="'false' or 'f' prints only the generated text (nothing else on stdout), so it pipes; "
                        "otherwise the prompt, the text and the stats (default true)")
    add_mlx_generate_flags(p)
    add_config_flags(p)  # every EngineConfig field (docs/CONFIG.md)


def _engine_config(args) -> EngineConfig:
    from edge0.config_sources.resolve import resolve_config

    return resolve_config(args)


def _sampling(args) -> dict:
    """Every sampling value checked before anything loads or prints (and the flags refused)."""
    from edge0.cli_args import check_refused
    from edge0.sampling import SamplingParams

    check_refused(args)
    values = dict(max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                  min_tokens_to_keep=args.min_tokens_to_keep, seed=args.seed, max_kv_size=args.max_kv_size,
                  xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold)
    SamplingParams(**values)
    return values


def _add_cache_file_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-cache-file", default=None, metavar="FILE",
                   help="a prompt cache that mlx_lm.cache_prompt wrote (mlx_lm.generate's flag): the prompt "
                        "continues the prefix it holds (--model may then be left out: the file names it)")


def _cache_file(args, model: str | None) -> tuple[str, tuple | None]:
    """The model to open and (cache, metadata) of ``--prompt-cache-file`` (None without
    one): the file names its model, and a ``--model`` naming another is refused."""
    from edge0.errors import ConfigError

    if getattr(args, "prompt_cache_file", None) is None:
        if model is None:
            raise ConfigError("--model is required (or --prompt-cache-file, whose model is used)")
        return model, None
    from edge0.backend import nn as bnn

    cache, metadata = bnn.load_cache_file(args.prompt_cache_file)
    made_for = metadata.get("model")
    if model is None and not made_for:
        raise ConfigError(f"{args.prompt_cache_file} does not name its model: give --model")
    if model is not None and made_for and not _same_model(model, made_for):
        raise ConfigError(f"the prompt cache {args.prompt_cache_file} was made with the model {made_for}, not {model}")
    return model or made_for, (cache, metadata)


def _same_model(a: str, b: str) -> bool:
    from edge0.errors import Edge0Error
    from edge0.hub import resolve_model

    try:
        return resolve_model(a).resolve() == resolve_model(b).resolve()
    except Edge0Error:
        return a == b


def _prompt_ids(engine, args, after_cache: bool = False,
                template_kwargs: dict | None = None) -> tuple[list[int], str | None]:
    """The prompt as mlx_lm.generate builds it: escapes, '-' for stdin, the chat template
    (with ``template_kwargs``, --chat-template-config, as its variables). Returns the ids
    and, for a raw completion, the prompt text (to print before it)."""
    prompt = args.prompt if args.prompt is not None else DEMO_PROMPT
    prompt = prompt.replace("\\n", "\n").replace("\\t", "\t")
    if prompt == "-":
        prompt = sys.stdin.read()
    use_template = not args.ignore_chat_template and getattr(engine.tokenizer, "has_chat_template", False)
    if template_kwargs and use_template:
        _check_template_variables(engine, template_kwargs)
    ids = engine.prompt_ids(prompt, system_prompt=args.system_prompt, chat_template=not args.ignore_chat_template,
                            prefill_response=args.prefill_response, after_cache=after_cache,
                            template_kwargs=template_kwargs)
    if use_template:
        return ids, None
    joined = args.system_prompt is not None and not after_cache  # the text the model continues (prompt_ids)
    return ids, f"{args.system_prompt}\n{prompt}" if joined else prompt


def _check_template_variables(engine, template_kwargs: dict) -> None:
    """--chat-template-config names only variables the model's chat template reads (one it
    does not read would change nothing, silently)."""
    from edge0.backend import nn as bnn
    from edge0.errors import ConfigError
    from edge0.prompts import RENDERER_OWN, template_variables

    known = template_variables(*bnn.tokenizer_parts(engine.tokenizer))
    unknown = sorted(set(template_kwargs) - known) if known is not None else []
    if unknown:
        raise ConfigError(f"--chat-template-config: {unknown[0]!r} is not a variable of this model's chat template "
                          f"(it reads: {', '.join(sorted(known - RENDERER_OWN)) or 'none'})")


def _stop_ids(engine, tokens) -> tuple[int, ...]:
    from edge0.errors import ConfigError

    out = []
    for text in tokens:
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ConfigError(f"--extra-eos-token {text!r} is not a single token of this tokenizer ({ids})")
        out.append(ids[0])
    return tuple(out)


def _run_generation(model_dir: Path, args, start: tuple | None = None) -> int:
    """Generate and print as mlx_lm.generate does; ``start``: (a prompt cache, its
    metadata) that the prompt continues."""
    from edge0.engine import Engine

    from edge0.cli_args import template_config

    sampling = _sampling(args)
    template_kwargs = template_config(args.chat_template_config)
    config = _engine_config(args)
    with Engine(model_dir, config) as engine:
        ids, prompt = _prompt_ids(engine, args, after_cache=start is not None, template_kwargs=template_kwargs)
        eos = _cache_eos(start[1]) if start is not None else None
        sampling["stop_token_ids"] = _stop_ids(engine, [*args.extra_eos_token, *([eos] if eos else [])])
        engine.validate(ids, **sampling)  # before anything is printed
        say = print if engine.coordinator.leads else (lambda *a, **k: None)  # a pipeline: rank 0 prints
        verbose = args.verbose
        if verbose:
            say("=" * 10)
            say(prompt or "", end="", flush=True)
        text, stats = [], None
        for event in engine.stream(ids, prompt_cache=start[0] if start is not None else None, **sampling):
            if verbose:
                say(event.text, end="", flush=True)
            text.append(event.text)
            stats = event.stats or stats
        if not verbose:
            say("".join(text))
            return 0
        say()
        say("=" * 10)
        if stats is not None:  # mlx_lm.generate's three lines, as it prints them, for scripts that parse them
            say(f"Prompt: {stats.prompt_tokens - stats.cached_tokens} tokens, {stats.prefill_tps:.3f} tokens-per-sec")
            say(f"Generation: {stats.generated_tokens} tokens, {stats.decode_tps:.3f} tokens-per-sec")
            say(f"Peak memory: {stats.peak_active_memory / 1e9:.3f} GB")
        spec = engine.spec
        say(f"model: {_shown(model_dir)} ({spec.model_type}, {len(spec.moe_layers)} MoE layers x "
            f"{spec.num_experts} experts, k={spec.k}; experts on disk "
            f"{engine.index.expert_bytes_total / 2**20:.1f} MiB of {engine.index.total_bytes / 2**20:.1f} MiB)")
        if stats is not None:
            say(stats.line())
    return 0


def _shown(path: Path) -> str:
    """A path as the user would type it here: relative to the working directory when it is
    inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def cmd_record_routing(args) -> int:
    from edge0.engine import Engine

    from edge0.cli_args import refuse_packaged_output

    refuse_packaged_output(args.out, "the routing file")
    sampling = _sampling(args)
    config = _engine_config(args)
    if config.prerouter == "auto":  # the oracle is the router's own routing: heads beside the model stay unused
        config = dataclasses.replace(config, prerouter="off")
    with Engine(Path(args.model), config) as engine:
        routing = engine.record_routing(args.prompt if args.prompt is not None else DEMO_PROMPT, **sampling)
    routing.save(args.out)
    print(f"recorded {len(routing)} decode steps x {len(routing.steps[0]) if routing.steps else 0} MoE layers "
          f"to {args.out}")
    return 0


def _cache_eos(metadata: dict) -> str | None:
    """The end-of-sequence token mlx_lm.cache_prompt was given (its ``--eos-token``)."""
    import json

    try:
        return json.loads(metadata.get("tokenizer_config") or "{}").get("eos_token")
    except (ValueError, AttributeError):
        return None


def cmd_generate(args) -> int:
    from edge0.hub import resolve_model

    model, start = _cache_file(args, args.model)
    return _run_generation(resolve_model(model), args, start)


def cmd_demo(args) -> int:
    model, start = _cache_file(args, str(demo_model_dir()))
    return _run_generation(Path(model), args, start)


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
    from edge0.model.families import SUPPORTED_MODEL_TYPES as ARCHITECTURES

    from edge0.cli_args import Parser

    parser = Parser(
        prog="edge0", description="Edge0: streaming Mixture-of-Experts inference on MLX. The routed experts of an "
                                  "int4 checkpoint stay on disk and are read when a step needs them.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, streaming routed experts from disk (mlx_lm.generate's flags)")
    g.add_argument("--model", default=None,
                   help="an mlx-lm int4 MoE checkpoint: a directory, or a repo id (ORG/NAME) in the local Hugging "
                        "Face cache (required unless --prompt-cache-file names it)")
    _add_engine_flags(g)
    _add_cache_file_flag(g)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="generate from the built-in default model (nothing downloaded)",
                       description="Streams the default model that ships with Edge0 (a small MoE trained on the "
                                   "Python standard library, int4; docs/TEACHER.md) with its prerouter heads and "
                                   "recovery adapter when they are beside it. Takes generate's flags.")
    _add_engine_flags(d)
    _add_cache_file_flag(d)
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser("record-routing", help="record a generation's routing (the oracle for --decode-path staged)",
                       description="Runs the generation on the exact path (prerouter heads beside the model "
                                   "unused: the oracle is the router's own routing) and writes, per decode step and "
                                   "MoE layer, the experts it routed to. A staged run of the same model, prompt and "
                                   "sampling replays it with --decode-path staged --oracle-file FILE; saved as "
                                   "routing-trace.json beside the checkpoint, `edge0 plan` forecasts the disk's "
                                   "bytes per token from it. An adapter trained under the heads (the demo's) would "
                                   "run without them here, and says so (adapter.without_heads): give --adapter off "
                                   "to record the base's own routing, and the replay the same.")
    r.add_argument("--model", required=True, help="an mlx-lm int4 MoE checkpoint directory")
    r.add_argument("--out", required=True, help="the routing file to write (JSON)")
    _add_engine_flags(r)
    r.set_defaults(func=cmd_record_routing)

    sub.add_parser("eval", help="held-out perplexity, top-1 agreement and KL vs a teacher (edge0 eval --help)",
                   add_help=False)
    from edge0.train.commands import add_parsers as add_train_parsers

    add_train_parsers(sub)
    from edge0.server.command import add_parser as add_serve_parser

    add_serve_parser(sub)

    t = sub.add_parser("make-tiny", help="write a small random int4 MoE checkpoint of a supported architecture",
                       description="Builds the model with mlx-lm's own class, randomises its routers so routing "
                                   "varies, quantizes it (int4, group 64) and writes it with a small byte-level "
                                   "BPE tokenizer: a test checkpoint that needs no download.")
    t.add_argument("family", metavar="MODEL_TYPE", choices=ARCHITECTURES,
                   help=f"the mlx-lm model_type to build, one of: {', '.join(ARCHITECTURES)}")
    t.add_argument("out", help="output directory")
    t.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    t.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer (default 16)")
    t.add_argument("--k", type=int, default=4, help="experts per token (default 4)")
    t.add_argument("--hidden", type=int, default=128, help="hidden size, a multiple of 64 (default 128)")
    t.add_argument("--moe-intermediate", type=int, default=64,
                   help="width of each expert, a multiple of 64 (default 64)")
    t.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    t.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of the unquantized tensors (default bfloat16)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    t.set_defaults(func=cmd_make_tiny)

    from edge0.benchmark.command import add_parser as add_bench_parser
    from edge0.plan import add_parser as add_plan_parser

    add_bench_parser(sub)
    add_plan_parser(sub, demo_model_dir)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C at any point (the imports included) exits quietly with status 130."""
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        # CPython 3.11 marks a KeyboardInterrupt raised inside any eval() of a string (the
        # namedtuple factory runs one, so an import can) as "unhandled" even when it is
        # caught here, and then exits by re-raising SIGINT instead of returning 130. The
        # next string eval clears the mark; this one cannot fail.
        eval("None")
        _leave_now(130)
        return 130


def _leave_now(status: int) -> None:
    """After Ctrl-C with other threads alive (an engine's compute thread may be inside the
    array library): flush what was printed and exit at once. The interpreter's own exit
    would run the native libraries' static destructors while that thread still runs in
    them, which can abort the process (SIGABRT) instead of exiting with ``status``."""
    import threading

    if threading.active_count() == 1:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _main(argv: list[str]) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
