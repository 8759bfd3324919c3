#!/usr/bin/env python
"""Train the teacher MoE on the Python standard library and write its checkpoints.

    python tools/train_teacher.py --out DIR [--steps 400] [--time-budget SECONDS]
        [--deploy edge0/data/demo_model] [--layers 8 --experts 32 --k 4 --hidden 256 ...]

Writes into DIR: ``teacher/`` (float32, mlx-lm layout), ``int4/`` (int4 group-64
deployment checkpoint, routers 8-bit), ``heldout_tokens.npy``, ``train_unigram_counts.npy``,
``corpus_files.json`` and ``train_log.jsonl``; each checkpoint has a ``provenance.json``.
``--deploy`` copies the int4 checkpoint to another directory (e.g. the package's demo model).

Speed: MLX's Linux CPU wheel links a reference BLAS (about 3.5 GFLOPS for a float32
matmul here).  With Debian's ``libopenblas0-serial`` preloaded, MLX's float32 matmuls run
about 25x faster on one core, which is what makes training on a 2-core machine practical:

    apt-get install libopenblas0-serial
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-serial/libopenblas.so.0 python tools/train_teacher.py ...

The script warns when float32 matmuls are slow.  See docs/TEACHER.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from dataclasses import fields
from pathlib import Path

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-serial/libopenblas.so.0"


def matmul_gflops(n: int = 512) -> float:
    """Measured float32 matmul speed of MLX on this machine (GFLOP/s)."""
    import mlx.core as mx

    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a @ b)
    t0 = time.perf_counter()
    for _ in range(3):
        mx.eval(a @ b)
    return 3 * 2 * n**3 / (time.perf_counter() - t0) / 1e9


def main(argv=None) -> int:
    from edge0.teacher import TeacherConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output directory (teacher/, int4/, held-out data)")
    p.add_argument("--deploy", default=None, help="also copy the int4 checkpoint to this directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out / --deploy")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of training; the schedule is shrunk to fit after a calibration")
    p.add_argument("--no-fit-schedule", action="store_true",
                   help="with --time-budget: stop at the budget without shrinking the schedule")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N corpus files (testing)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    for f in fields(TeacherConfig):
        if f.name in ("time_budget_s", "fit_schedule_to_budget", "compile"):
            continue
        flag = "--" + f.name.replace("_", "-")
        p.add_argument(flag, type=type(f.default), default=f.default, help=f"default {f.default}")
    a = p.parse_args(argv)

    kwargs = {f.name: getattr(a, f.name) for f in fields(TeacherConfig)
              if f.name not in ("time_budget_s", "fit_schedule_to_budget", "compile")}
    tc = TeacherConfig(**kwargs, time_budget_s=a.time_budget, fit_schedule_to_budget=not a.no_fit_schedule,
                       compile=False)
    try:
        tc.validate()
    except ValueError as e:
        p.error(str(e))

    out = Path(a.out)
    for d in (out, Path(a.deploy) if a.deploy else None):
        if d is not None and d.exists() and any(d.iterdir()) and not a.overwrite:
            p.error(f"{d} exists and is not empty; pass --overwrite to replace it")

    def say(msg: str) -> None:
        print(f"[train_teacher] {msg}", file=sys.stderr, flush=True)

    gflops = matmul_gflops()
    say(f"MLX float32 matmul: {gflops:.1f} GFLOP/s")
    if gflops < 20:
        say("WARNING: slow float32 matmul (MLX's bundled reference BLAS). Training will be ~10x slower. "
            f"Fix: apt-get install libopenblas0-serial and run with LD_PRELOAD={OPENBLAS}")

    files = None
    if a.max_files:
        from edge0.teacher import list_corpus_files

        files = list_corpus_files()[: a.max_files]
    command = shlex.join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])])
    from edge0.teacher import train_teacher

    try:
        summary = train_teacher(tc, out, files=files, progress=not a.no_progress, command=command, say=say)
    except (ValueError, FileNotFoundError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
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


if __name__ == "__main__":
    sys.exit(main())
