"""``edge0 train ...``: the command-line side of training (teacher, heads, sft, distill, recipe)."""

from __future__ import annotations

import json
from pathlib import Path

from edge0.cli_args import refuse_packaged_output
from edge0.train.console import Progress, say
from edge0.train.teacher_cli import add_teacher_parser


def add_parsers(sub) -> None:
    """``edge0 train {teacher,heads,sft,distill,recipe,quality}`` and ``edge0 adapter merge-report``."""
    tr = sub.add_parser("train", help="train Edge0's artifacts (teacher, prerouter heads, recovery LoRA)",
                        description="The recovery recipe runs heads -> sft -> distill, in that order "
                                    "(`edge0 train recipe` does all three); docs/QUALITY.md.")
    trs = tr.add_subparsers(dest="what", required=True, metavar="{teacher,heads,sft,distill,recipe,quality}")
    add_teacher_parser(trs)
    add_heads_parser(trs)
    add_lora_parsers(trs)
    add_quality_parser(trs)
    for name in ("teacher", "recipe", "quality"):
        one = trs.choices[name]
        one.set_defaults(func=_one_process(name, one.get_default("func")))
    ad = sub.add_parser("adapter", help="adapters: merge-report (what merging into int4 destroys), init (an "
                                        "untrained one)")
    ads = ad.add_subparsers(dest="what", required=True, metavar="{merge-report,init}")
    i = ads.add_parser("init", help="an untrained adapter (mlx-lm's LoRA initialisation) for a checkpoint",
                       description="Writes an adapter on every attention and shared-expert projection with "
                                   "mlx-lm's LoRA initialisation (A uniform in +-1/sqrt(in), B zero): it serves "
                                   "the base's output while computing what a trained adapter of the same rank "
                                   "computes. A starting point for mlx_lm.lora, or what a cost measurement needs "
                                   "(edge0 bench --adapter).")
    i.add_argument("--model", required=True, help="the int4 checkpoint")
    i.add_argument("--out", required=True, help="the adapter directory to write")
    i.add_argument("--rank", type=int, default=8, help="(default 8, the recipe's)")
    i.add_argument("--scale", type=float, default=10.0, help="(default 10, the recipe's)")
    i.add_argument("--seed", type=int, default=0, help="(default 0)")
    i.set_defaults(func=cmd_adapter_init)
    m = ads.add_parser("merge-report", help="weight- and logit-level retention of an adapter merged into the "
                                            "int4 base and re-quantized",
                       description="Merges the adapter's delta into the dequantized weight, re-quantizes with the "
                                   "checkpoint's bits and group size, and reports per projection "
                                   "<Q(W+dW)-W, dW>/||dW||^2 and on first-token logits of fixed prompts "
                                   "<z_merged-z_base, z_unmerged-z_base>/||z_unmerged-z_base||^2 (1.0 = the "
                                   "adapter's whole effect).")
    m.add_argument("--model", required=True, help="the int4 checkpoint")
    m.add_argument("--adapter", required=True, help="the adapter directory")
    m.add_argument("--json", default=None, help="also write the full report here")
    m.set_defaults(func=cmd_merge_report)


def _lora_flags(p, defaults, *, teacher: bool = True) -> None:
    p.add_argument("--model", required=True, help="the int4 checkpoint (the base stays frozen)")
    if teacher:
        p.add_argument("--teacher", required=True, help="the float32 teacher checkpoint")
    p.add_argument("--work", default=None, help="data, checkpoints and reports (default: ~/.cache/edge0/recipe-NAME)")
    p.add_argument("--heads", default=None, help="prerouter heads (default: MODEL/prerouter.safetensors)")
    p.add_argument("--experts-per-token", type=int, default=None, help="train for another routing width")
    p.add_argument("--time-budget", type=float, default=None, help="seconds of training before it stops")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --work")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    for name in ("rows", "steps", "batch", "lr", "rank", "scale", "seed", "temp"):
        if hasattr(defaults, name):
            value = getattr(defaults, name)
            what = {"temp": "sampling temperature of the continuations trained on "}.get(name, "")
            p.add_argument("--" + name, type=type(value), default=value, help=f"{what}(default {value})")
    if hasattr(defaults, "routing"):
        p.add_argument("--routing", choices=("auto", "replace", "select"), default="auto",
                       help="the routing the student trains on, as served (default auto: what the heads file records)")
        p.add_argument("--stage-extra", type=int, default=None,
                       help="with --routing select: experts staged beyond k (default: the heads file's record)")


def add_lora_parsers(trs) -> None:
    from edge0.train.settings import DistillConfig, SFTConfig

    s = trs.add_parser("sft", help="phase 2: the recovery LoRA by SFT on the teacher's text, on the student path",
                       description="The float32 teacher continues prompts from the model's training split; the "
                                   "int4 student, routed by the prerouter's prediction at every continuation "
                                   "position, learns them by cross-entropy. Only the LoRA trains.")
    _lora_flags(s, SFTConfig())
    s.add_argument("--text", choices=("teacher", "corpus"), default=SFTConfig.text,
                   help="what the student learns from: the teacher's sampled continuations by cross-entropy "
                        "(teacher), or the teacher's top-K distribution on windows of the training split by "
                        f"forward KL (corpus) (default {SFTConfig.text})")
    s.add_argument("--top-k", type=int, default=SFTConfig.top_k,
                   help=f"with --text corpus: the teacher's tokens kept per position (default {SFTConfig.top_k})")
    s.add_argument("--out", default=None, help="adapter directory (default: WORK/adapter-sft)")
    s.set_defaults(func=cmd_sft)
    d = trs.add_parser("distill", help="phase 3: on-policy reverse KL of the served student against the teacher",
                       description="The phase-2 student generates through the engine; the teacher scores the same "
                                   "tokens; the LoRA learns reverse KL over the teacher's top-K plus a tail bucket.")
    _lora_flags(d, DistillConfig())
    d.add_argument("--adapter", required=True, help="the phase-2 adapter to start from")
    d.add_argument("--out", default=None, help="adapter directory (default: MODEL/adapter)")
    d.set_defaults(func=cmd_distill)
    r = trs.add_parser("recipe", help="heads -> SFT -> distill -> report, end to end",
                       description="Phase 1 (heads), phase 2 (SFT), phase 3 (on-policy distillation), then the "
                                   "adapter's effect, the merge report and the quality table. --quick runs the "
                                   "chain on a tiny model in under a minute.")
    r.add_argument("--model", required=True, help="the int4 checkpoint")
    r.add_argument("--teacher", required=True, help="the float32 teacher checkpoint")
    r.add_argument("--work", default=None, help="data, checkpoints and reports (default: ~/.cache/edge0/recipe-NAME)")
    r.add_argument("--out", default=None, help="where heads and the adapter go (default: beside the checkpoint)")
    r.add_argument("--quick", action="store_true", help="tiny settings: the whole chain in under a minute")
    r.add_argument("--experts-per-token", type=int, default=None, help="train heads and adapter for this width")
    r.add_argument("--eval-tokens", type=int, default=None, help="held-out tokens of the quality table (0: none)")
    r.add_argument("--time-budget", type=float, default=None, help="seconds per LoRA phase before it stops")
    r.add_argument("--resume", action="store_true")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--routing", choices=("replace", "select"), default="replace",
                   help="the routing the heads are served with, and phases 2-3 train on (default replace)")
    r.add_argument("--stage-extra", type=int, default=0, help="with --routing select: experts staged beyond k")
    r.set_defaults(func=cmd_recipe)


def _work(args) -> Path:
    from edge0.cache import cache_dir

    return Path(args.work) if args.work else cache_dir() / f"recipe-{Path(args.model).resolve().name}"


def _configured(cfg, args):
    for name in ("rows", "steps", "batch", "lr", "rank", "scale", "seed", "temp", "text", "top_k"):
        if hasattr(cfg, name) and getattr(args, name, None) is not None:
            setattr(cfg, name, getattr(args, name))
    cfg.time_budget_s = args.time_budget
    cfg.experts_per_token = args.experts_per_token
    if hasattr(cfg, "routing") and getattr(args, "routing", None) is not None:
        if args.routing == "replace" and args.stage_extra:
            from edge0.errors import ConfigError

            raise ConfigError("--stage-extra applies to --routing select")
        cfg.routing, cfg.stage_extra = args.routing, args.stage_extra
    return cfg


_DATA_PARALLEL = ("heads", "sft", "distill")


def _one_process(name: str, func):
    """``func``, refused under ``mlx.launch`` with more than one rank (only the phases in
    ``_DATA_PARALLEL`` split their work over ranks)."""
    def run(args) -> int:
        from edge0.errors import ConfigError
        from edge0.train.parallel import DataParallel

        dp = DataParallel.current()
        if dp.size > 1:
            raise ConfigError(f"edge0 train {name} runs in one process, not over {dp.size} ranks: under mlx.launch "
                              f"run its phases, edge0 train {'|'.join(_DATA_PARALLEL)}")
        return func(args)
    return run


def _ranked(args, name: str):
    """The data-parallel group (``mlx.launch``), and the progress bar and ``say`` of this
    rank: rank 0 speaks, the others are silent."""
    from edge0.train.parallel import DataParallel

    dp = DataParallel.current()
    if not dp.is_main:
        return dp, None, lambda *a, **k: None
    no_progress = getattr(args, "no_progress", False)
    if dp.size > 1:
        say(f"{name}: {dp.describe()}")
    return dp, (None if no_progress else Progress(name)), say


def _finish(dp, bar, result: dict) -> int:
    if bar is not None:
        bar.close()
    if dp.is_main:
        print(json.dumps({k: v for k, v in result.items() if k != "losses"}, indent=1, default=str))
    return 0


def cmd_sft(args) -> int:
    from edge0.train.sft import SFTConfig, run_sft

    work = _work(args)
    refuse_packaged_output(args.out or work / "adapter-sft", "the adapter")
    dp, bar, talk = _ranked(args, "sft")
    result = run_sft(args.model, args.teacher, args.out or work / "adapter-sft", _configured(SFTConfig(), args),
                     work=work, heads_file=args.heads, resume=args.resume, progress=bar, say=talk, dp=dp)
    return _finish(dp, bar, result)


def cmd_distill(args) -> int:
    from edge0.adapters import ADAPTER_DIRNAME
    from edge0.train.distill import DistillConfig, run_distill

    work = _work(args)
    refuse_packaged_output(args.out or Path(args.model) / ADAPTER_DIRNAME, "the adapter")
    dp, bar, talk = _ranked(args, "distill")
    result = run_distill(args.model, args.teacher, args.adapter, args.out or Path(args.model) / ADAPTER_DIRNAME,
                         _configured(DistillConfig(), args), work=work, heads_file=args.heads, resume=args.resume,
                         progress=bar, say=talk, dp=dp)
    return _finish(dp, bar, result)


def cmd_recipe(args) -> int:
    import copy

    from edge0.train.recipe import QUICK, RecipeConfig, run_recipe

    refuse_packaged_output(args.out or args.model, "the heads and adapter's folder")
    cfg = copy.deepcopy(QUICK) if args.quick else RecipeConfig()
    cfg.experts_per_token = args.experts_per_token
    if args.eval_tokens is not None:
        cfg.eval_tokens = args.eval_tokens
    cfg.sft.time_budget_s = cfg.distill.time_budget_s = args.time_budget
    if args.routing == "replace" and args.stage_extra:
        from edge0.errors import ConfigError

        raise ConfigError("--stage-extra applies to --routing select")
    cfg.heads.routing, cfg.heads.stage_extra = args.routing, args.stage_extra
    bars: list[Progress] = []

    def progress(name):
        bars.append(Progress(name))
        return bars[-1]

    report = run_recipe(args.model, args.teacher, cfg, work=_work(args), out=args.out, resume=args.resume,
                        progress=None if args.no_progress else progress, say=say)
    for b in bars:
        b.close()
    print(recipe_summary(report))
    return 0


def recipe_summary(report: dict) -> str:
    ph = report["phases"]
    lines = [f"phase 1 heads: held-out recall@k {ph['heads']['recall_before']:.3f} -> "
             f"{ph['heads']['recall_after']:.3f} ({ph['heads']['tokens']} traced tokens)"]
    for name in ("sft", "distill"):
        p = ph[name]
        lines.append(f"phase {2 if name == 'sft' else 3} {name}: loss on a fixed batch {p['loss_before']:.4f} -> "
                     f"{p['loss_after']:.4f} over {p['losses']['steps']} steps, {p['tokens']} tokens, "
                     f"{p['seconds']:.0f} s")
    lines.append(f"adapter moves the served first-token logits by {report['adapter_effect']['relative_l2']:.4f} "
                 "(relative L2)")
    m = report["merge"]
    lines.append(f"merge report: weight-level retention {m['weight_retention_mean']:.3f}, logit-level retention "
                 f"merged {m['logit_retention']['merged']:.3f} (unmerged {m['logit_retention']['unmerged']:.3f})")
    if "quality" in report:
        from edge0.train.quality import markdown

        lines += ["", markdown(report["quality"])]
    lines.append(f"wall time {report['wall_seconds']:.0f} s")
    return "\n".join(lines)


def add_quality_parser(trs) -> None:
    q = trs.add_parser("quality", help="the quality table through the served path: teacher, int4, prerouter, "
                                       "adapters",
                       description="Perplexity, ratio to the teacher, top-1 agreement and KL(teacher || row) over "
                                   "the same held-out tokens of ordinary code, every int4 row decoded token by "
                                   "token through the engine: the float32 teacher, the int4 base on its own "
                                   "gates, the base routed by the heads' prediction, and that plus each "
                                   "--adapter. docs/QUALITY.md.")
    q.add_argument("--model", required=True, help="the int4 checkpoint")
    q.add_argument("--teacher", default=None,
                   help="the float32 teacher checkpoint (without it: no teacher row, and agreement and KL are "
                        "measured against the int4 base on its own gates)")
    q.add_argument("--heads", default=None, help="prerouter heads (default: MODEL/prerouter.safetensors)")
    q.add_argument("--adapter", action="append", default=[], metavar="[LABEL=]DIR",
                   help="a row served with this adapter (repeatable; LABEL names the row)")
    q.add_argument("--row", action="append", default=[], metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
                   help="a row served with these engine settings (repeatable), e.g. 'select m=8:routing=select,"
                        "stage_extra=8'; with --row, the default prerouter and --adapter rows are not added")
    q.add_argument("--experts-per-token", type=int, default=None, help="serve every int4 row at this width")
    q.add_argument("--tokens", type=int, default=4096, help="held-out tokens (default 4096)")
    q.add_argument("--text", default=None, metavar="PATH",
                   help="measure on this text instead of the model's held-out split: a file, or a directory "
                        "whose *.py files are read in sorted order (tokenized with the model's tokenizer, one "
                        "end-of-text token between files; the first --tokens of them)")
    q.add_argument("--json", default=None, help="also write the table here")
    q.set_defaults(func=cmd_quality)


def cmd_quality(args) -> int:
    from edge0.errors import ConfigError
    from edge0.prerouter.files import HEADS_FILENAME
    from edge0.train import data as D
    from edge0.train.quality import markdown, quality_table, served_rows

    model = Path(args.model)
    heads = Path(args.heads) if args.heads else model / HEADS_FILENAME
    if not heads.is_file():
        raise ConfigError(f"no prerouter heads at {heads} (--heads FILE)")
    adapters = []
    for spec in args.adapter:
        label, _, path = spec.rpartition("=")
        adapters.append((label or f"+ adapter {Path(path).name}", path))
    rows = served_rows(model, heads, adapters, args.experts_per_token)
    if args.row:
        rows = rows[:2] + [_settings_row(model, heads, text, args.experts_per_token) for text in args.row]
    if args.teacher is None:
        rows = rows[1:]
    if args.text:
        tokens = D.text_tokens(model, Path(args.text), args.tokens)
    else:
        _, held, _ = D.token_streams(model)
        tokens = D.ordinary_code(held, args.tokens)
    table = quality_table(args.teacher, rows, tokens, say=say)
    table["text"] = args.text or "the model's held-out split (ordinary code)"
    table["experts_per_token"] = args.experts_per_token
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    print(markdown(table))
    return 0


def _settings_row(model: Path, heads: Path, text: str, k):
    """``LABEL:KEY=VALUE,...`` -> a quality row served with those engine settings (on the
    heads, no adapter, unless the settings say otherwise)."""
    from edge0.config import EngineConfig
    from edge0.config_sources.settings_list import parse_settings
    from edge0.errors import ConfigError
    from edge0.train.quality import Row

    label, sep, rest = text.partition(":")
    if not sep or not label.strip():
        raise ConfigError(f"--row {text!r}: expected LABEL:KEY=VALUE[,KEY=VALUE]")
    values = dict(prerouter="on", prerouter_file=str(heads), adapter="off", experts_per_token=k)
    values.update(parse_settings(rest, f"--row {label}"))
    return Row(label.strip(), model, EngineConfig(**values))


def cmd_adapter_init(args) -> int:
    from edge0.errors import ConfigError
    from edge0.train.adapter_init import init_adapter

    if args.rank < 1:
        raise ConfigError(f"--rank must be >= 1, got {args.rank}")
    refuse_packaged_output(args.out, "the adapter")
    if Path(args.out).exists() and any(Path(args.out).iterdir()):
        raise ConfigError(f"{args.out} exists and is not empty; choose another --out")
    out = init_adapter(args.model, args.out, rank=args.rank, scale=args.scale, seed=args.seed)
    print(f"untrained adapter (rank {args.rank}, scale {args.scale}) written to {out}")
    return 0


def cmd_merge_report(args) -> int:
    from edge0.train.merge import merge_report

    report = merge_report(args.model, args.adapter)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print("| projection | weight-level retention |")
    print("|---|---:|")
    for kind, value in report["weight_retention_by_projection"].items():
        print(f"| {kind} | {value:.3f} |")
    lr = report["logit_retention"]
    print(f"logit-level retention: unmerged {lr['unmerged']:.3f}, merged and re-quantized {lr['merged']:.3f} "
          f"({len(report['prompts'])} prompts, first-token logits)")
    return 0


def add_heads_parser(trs) -> None:
    h = trs.add_parser("heads", help="phase 1: train the prerouter heads to imitate the next layer's router",
                       description="Collects routing traces by running the frozen int4 base over text (teacher "
                                   "forcing), trains only the heads (warm-started from the next router) on the "
                                   "next router's distribution, reports held-out recall@k and top-1 agreement "
                                   "per layer before and after, and writes prerouter.safetensors beside the "
                                   "checkpoint (or --out).")
    h.add_argument("--model", required=True, help="an mlx-lm int4 MoE checkpoint directory")
    h.add_argument("--data", default=None, help="a text/.py file or directory, or 'model': the model's own training "
                                                "split when its provenance names one (default: Python stdlib "
                                                "sources, held out by file)")
    h.add_argument("--tokens", type=int, default=20000, help="training tokens (default 20000)")
    h.add_argument("--heldout-tokens", type=int, default=4000, help="held-out tokens (default 4000)")
    h.add_argument("--seq-len", type=int, default=128, help="tokens per traced sequence (default 128)")
    h.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300; 0 = warm start only)")
    h.add_argument("--batch", type=int, default=256, help="pairs per optimizer step (default 256)")
    h.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    h.add_argument("--width", type=int, default=512, help="MLP hidden width (default 512)")
    h.add_argument("--owners", default=None, help="owner layers, e.g. 6-38 (default: every eligible layer)")
    h.add_argument("--out", default=None, help="heads file (default: MODEL/prerouter.safetensors)")
    h.add_argument("--no-progress", action="store_true", help="no progress bars")
    h.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    h.add_argument("--inputs", choices=("token", "base"), default="token",
                   help="what a head sees: 'token' (default) adds the embedding of the token the next step decodes "
                        "to 'base' (the owner's hidden state and its routing at t and t-1)")
    h.add_argument("--traces", default=None, metavar="DIR",
                   help="keep the routing traces in DIR and reuse them when the same text is traced again")
    h.add_argument("--report-extra", default="2,4,8", metavar="M,...",
                   help="also report held-out recall@(k+m) for these m (default 2,4,8)")
    h.add_argument("--routing", choices=("replace", "select"), default="replace",
                   help="the routing the file records as its default (default replace)")
    h.add_argument("--stage-extra", type=int, default=0,
                   help="with --routing select: experts staged beyond k (default 0)")
    h.add_argument("--over-memory", default=None, metavar="ROUTING",
                   help="the routing the file records for a checkpoint larger than the memory the process may use: "
                        "'replace' or 'select:M' (default: the same as --routing)")
    h.add_argument("--json", default=None, help="also write the report here")
    h.set_defaults(func=cmd_heads)


def _owner_range(text: str | None) -> list[int] | None:
    from edge0.errors import ConfigError

    if text is None:
        return None
    try:
        if "-" in text:
            a, b = (int(v) for v in text.split("-", 1))
            return list(range(a, b + 1))
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"--owners must look like 6-38 or 1,2,3, got {text!r}") from None


def cmd_heads(args) -> int:
    from edge0.errors import ConfigError
    from edge0.train import data as D
    from edge0.train.heads import train_heads

    try:
        extras = tuple(int(v) for v in args.report_extra.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"--report-extra must look like 2,4,8, got {args.report_extra!r}") from None
    if args.routing == "replace" and args.stage_extra:
        raise ConfigError("--stage-extra applies to --routing select")
    refuse_packaged_output(_heads_out(args), "the heads file")
    serving = {"routing": args.routing, "stage_extra": args.stage_extra}
    if args.over_memory is not None:
        from edge0.prerouter.files import parse_routing

        serving["over_memory"] = parse_routing(args.over_memory)
    streams = None
    if args.data == "model":
        if not (Path(args.model) / "provenance.json").exists():
            raise ConfigError(f"--data model: {args.model} has no provenance.json naming its training corpus")
        streams = D.token_streams(Path(args.model))
    dp, bar, _ = _ranked(args, "heads")
    report = train_heads(args.model, data=None if streams else args.data, tokens=args.tokens,
                         heldout_tokens=args.heldout_tokens, seq_len=args.seq_len, steps=args.steps, batch=args.batch,
                         lr=args.lr, width=args.width, owners=_owner_range(args.owners), out=args.out, seed=args.seed,
                         progress=bar, streams=streams, token_input=args.inputs == "token", traces_dir=args.traces,
                         extras=extras, serving=serving, dp=dp,
                         trace_say=None if bar is None else say)
    if bar is not None:
        bar.close()
    if not dp.is_main:
        return 0
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    print(heads_report_table(report))
    _say_adapter_superseded(args)
    return 0


def _say_adapter_superseded(args) -> None:
    """New heads beside a checkpoint whose adapter was trained under the ones they replace:
    the engine refuses that adapter from now on; say so, and what to do."""
    from edge0.adapters import ADAPTER_DIRNAME, WEIGHTS_FILE
    from edge0.model.safetensors_header import read_header
    from edge0.prerouter.files import HEADS_FILENAME, heads_identities

    model, heads = Path(args.model), _heads_out(args)
    weights = model / ADAPTER_DIRNAME / WEIGHTS_FILE
    if heads != model / HEADS_FILENAME or not weights.is_file():
        return
    trained_under = read_header(weights).metadata.get("heads_identity")
    if trained_under and trained_under not in heads_identities(heads):
        say(f"note: {weights.parent} was trained under the heads these replace, and the engine refuses it with "
            "these: generate with --adapter off, or retrain it on them (edge0 train sft)")


def _heads_out(args) -> Path:
    """Where ``train heads`` writes: --out, or prerouter.safetensors beside the checkpoint."""
    from edge0.prerouter.files import HEADS_FILENAME

    return Path(args.out) if args.out else Path(args.model) / HEADS_FILENAME


def heads_report_table(report: dict) -> str:
    wide = sorted((key for key in next(iter(report["after"].values())) if key.startswith("recall_at_k+")),
                  key=lambda key: int(key.rpartition("+")[2]))
    lines = ["| head (owner -> consumer) | recall@k before | recall@k after | top-1 before | top-1 after |"
             + "".join(f" {key.replace('recall_at_', 'recall@')} after |" for key in wide),
             "|---|---:|---:|---:|---:|" + "---:|" * len(wide)]
    for owner, b in report["before"].items():
        a = report["after"][owner]
        lines.append(f"| {owner} -> {report['recipe'].get('consumers', {}).get(str(owner), owner + 1)} | {b['recall_at_k']:.3f} | {a['recall_at_k']:.3f} | "
                     f"{b['top1']:.3f} | {a['top1']:.3f} |" + "".join(f" {a[key]:.3f} |" for key in wide))
    mean = lambda d, key: sum(v[key] for v in d.values()) / len(d)
    lines.append(f"mean recall@k {mean(report['before'], 'recall_at_k'):.3f} -> "
                 f"{mean(report['after'], 'recall_at_k'):.3f} (held-out {report['recipe']['heldout_tokens']} "
                 f"tokens); heads written to {report['path']}")
    return "\n".join(lines)
