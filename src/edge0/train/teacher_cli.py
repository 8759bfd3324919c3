"""``edge0 train teacher``: the command line of the teacher pipeline (``edge0.train.teacher``):
its flags (one per :class:`~edge0.train.teacher_config.TeacherConfig` field, plus the run's
options) and the command that checks them, trains, and deploys the int4 checkpoint."""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import fields
from pathlib import Path

from edge0.train.console import say, warn_if_slow_blas

_TEACHER_SKIP = ("time_budget_s", "fit_schedule_to_budget", "compile")


def add_teacher_parser(trs) -> None:
    from edge0.train.teacher_config import TeacherConfig

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
                   help="with --time-budget: stop at the budget without shrinking the schedule; the state "
                        "at the stop stays in OUT/resume for --resume (with a larger budget, or none)")
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
    home = str(Path.home())  # recorded in provenance: the home directory written as ~
    command = shlex.join(["edge0", "train", "teacher", *a.argv]).replace(home + "/", "~/")
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
