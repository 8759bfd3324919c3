"""``edge0 train ...``: the command-line side of training (teacher, heads, sft, distill, recipe)."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
from dataclasses import fields
from pathlib import Path

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-serial/libopenblas.so.0"
_TEACHER_SKIP = ("time_budget_s", "fit_schedule_to_budget", "compile")


def warn_if_slow_blas(say) -> float:
    from edge0.train.teacher import matmul_gflops

    gflops = matmul_gflops()
    say(f"MLX float32 matmul: {gflops:.1f} GFLOP/s")
    if gflops < 20:
        say("WARNING: slow float32 matmul (MLX's bundled reference BLAS): training runs ~10x slower. "
            f"Fix: apt-get install libopenblas0-serial and run with LD_PRELOAD={OPENBLAS}")
    return gflops


def say(msg: str) -> None:
    print(f"[edge0 train] {msg}", file=sys.stderr, flush=True)


def add_teacher_parser(trs) -> None:
    from edge0.train.teacher import TeacherConfig

    p = trs.add_parser(
        "teacher", help="train the float32 teacher MoE on the Python standard library (the demo's source)",
        description="Trains a small qwen3_moe from scratch with mlx-lm's classes on the Python standard "
                    "library's sources (split by file), then writes OUT/teacher (float32), OUT/int4 (the "
                    "deployment checkpoint), the held-out tokens and the training log. Deterministic for a "
                    "given Python, seed, BLAS and CPU. The state is saved every --checkpoint-every steps; "
                    "--resume continues an interrupted run bit for bit. docs/TEACHER.md.")
    p.add_argument("--out", required=True, help="output directory (teacher/, int4/, held-out data)")
    p.add_argument("--deploy", default=None, help="also copy the int4 checkpoint to this directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out / --deploy")
    p.add_argument("--resume", action="store_true", help="continue the run whose state is in OUT/resume")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of training; the schedule is shrunk to fit after a calibration")
    p.add_argument("--no-fit-schedule", action="store_true",
                   help="with --time-budget: stop at the budget without shrinking the schedule")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N corpus files (testing)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for f in fields(TeacherConfig):
        if f.name in _TEACHER_SKIP:
            continue
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                       help=f"(default {f.default})")
    p.set_defaults(func=cmd_teacher)


def cmd_teacher(a) -> int:
    from edge0.errors import ConfigError
    from edge0.train.teacher import TeacherConfig, train_teacher

    kwargs = {f.name: getattr(a, f.name) for f in fields(TeacherConfig) if f.name not in _TEACHER_SKIP}
    tc = TeacherConfig(**kwargs, time_budget_s=a.time_budget, fit_schedule_to_budget=not a.no_fit_schedule,
                       compile=False)
    try:
        tc.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    out = Path(a.out)
    for d in (out, Path(a.deploy) if a.deploy else None):
        if d is not None and d.exists() and any(d.iterdir()) and not (a.overwrite or (a.resume and d == out)):
            raise ConfigError(f"{d} exists and is not empty; pass --overwrite to replace it or --resume")
    gflops = warn_if_slow_blas(say)
    files = None
    if a.max_files:
        from edge0.train.corpus import list_corpus_files

        files = list_corpus_files()[: a.max_files]
    command = shlex.join(["edge0", "train", "teacher", *a.argv])
    try:
        summary = train_teacher(tc, out, files=files, progress=not a.no_progress, command=command, say=say,
                                resume=a.resume)
    except (FileNotFoundError, FloatingPointError) as e:
        raise ConfigError(str(e)) from None
    if a.deploy:
        dest = Path(a.deploy)
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(summary["int4"], dest)
        summary["deployed"] = str(dest)
        say(f"copied the int4 checkpoint to {dest}")
    summary["matmul_gflops"] = round(gflops, 1)
    print(json.dumps(summary, indent=2))
    return 0


def add_parsers(sub) -> None:
    """``edge0 train {teacher,heads,...}``."""
    tr = sub.add_parser("train", help="train Edge0's artifacts (teacher, prerouter heads, recovery LoRA)")
    trs = tr.add_subparsers(dest="what", required=True, metavar="{teacher,heads}")
    add_teacher_parser(trs)
    add_heads_parser(trs)


def add_heads_parser(trs) -> None:
    h = trs.add_parser("heads", help="phase 1: train the prerouter heads to imitate the next layer's router",
                       description="Collects routing traces by running the frozen int4 base over text (teacher "
                                   "forcing), trains only the heads (warm-started from the next router) on the "
                                   "next router's distribution, reports held-out recall@k and top-1 agreement "
                                   "per layer before and after, and writes prerouter.safetensors beside the "
                                   "checkpoint (or --out).")
    h.add_argument("--model", required=True, help="an mlx-lm int4 MoE checkpoint directory")
    h.add_argument("--data", default=None, help="a text/.py file or directory (default: Python stdlib sources, "
                                                "held out by file)")
    h.add_argument("--tokens", type=int, default=20000, help="training tokens (default 20000)")
    h.add_argument("--heldout-tokens", type=int, default=4000, help="held-out tokens (default 4000)")
    h.add_argument("--seq-len", type=int, default=128, help="tokens per traced sequence (default 128)")
    h.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300; 0 = warm start only)")
    h.add_argument("--batch", type=int, default=256, help="pairs per optimizer step (default 256)")
    h.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    h.add_argument("--width", type=int, default=512, help="MLP hidden width (default 512)")
    h.add_argument("--owners", default=None, help="owner layers, e.g. 6-38 (default: every eligible layer)")
    h.add_argument("--out", default=None, help="heads file (default: MODEL/prerouter.safetensors)")
    h.add_argument("--seed", type=int, default=0, help="seed (default 0)")
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


class Progress:
    """A tqdm bar created on first use, showing the loss."""

    def __init__(self, desc: str):
        self.desc, self.bar = desc, None

    def __call__(self, step: int, total: int, loss: float) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=step - 1, desc=self.desc, unit="step", file=sys.stderr)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def cmd_heads(args) -> int:
    from edge0.train.heads import train_heads

    bar = Progress("heads")
    report = train_heads(args.model, data=args.data, tokens=args.tokens, heldout_tokens=args.heldout_tokens,
                         seq_len=args.seq_len, steps=args.steps, batch=args.batch, lr=args.lr, width=args.width,
                         owners=_owner_range(args.owners), out=args.out, seed=args.seed, progress=bar)
    bar.close()
    print(heads_report_table(report))
    return 0


def heads_report_table(report: dict) -> str:
    lines = ["| head (owner -> consumer) | recall@k before | recall@k after | top-1 before | top-1 after |",
             "|---|---:|---:|---:|---:|"]
    for owner, b in report["before"].items():
        a = report["after"][owner]
        lines.append(f"| {owner} -> {owner + 1} | {b['recall_at_k']:.3f} | {a['recall_at_k']:.3f} | "
                     f"{b['top1']:.3f} | {a['top1']:.3f} |")
    mean = lambda d, key: sum(v[key] for v in d.values()) / len(d)
    lines.append(f"mean recall@k {mean(report['before'], 'recall_at_k'):.3f} -> "
                 f"{mean(report['after'], 'recall_at_k'):.3f} (held-out {report['recipe']['heldout_tokens']} "
                 f"tokens); heads written to {report['path']}")
    return "\n".join(lines)
