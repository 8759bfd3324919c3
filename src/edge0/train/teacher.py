"""Train a small real MoE language model (the "teacher") on Python standard-library source.

Random tiny checkpoints (``edge0.tiny``) prove the engine computes what mlx-lm computes;
they say nothing about quality.  This module trains a small qwen3_moe model from scratch
with mlx-lm's own model classes, so that quality can be measured (``edge0.train.evaluate``) and
the demo has a model whose output looks like Python.

Pipeline (every step deterministic for a given Python installation and seed), one module
per responsibility:

1-3. Corpus, split by file, tokenizer: ``edge0.train.corpus``.
4. Model: ``qwen3_moe`` from :func:`edge0.tiny.tiny_config` (head_dim 32), float32; the
   settings and the schedule: ``edge0.train.teacher_config``.
5. Training (``edge0.train.teacher_run``, through the shared loop ``edge0.train.loop``):
   random windows of ``seq_len + 1`` train tokens (NumPy generator seeded with ``seed``),
   AdamW with linear warm-up and cosine decay, gradient clipping, plus a Switch-style
   load-balancing loss ``E * sum_i f_i * P_i`` computed from each MoE block's router
   (``edge0.train.teacher_balance``: mlx-lm's block does not compute it, so
   :func:`balance_loss_capture` swaps the blocks' class for the duration of training only).
   The resumable state every ``checkpoint_every`` steps: ``edge0.train.teacher_state``.
6. Outputs (``edge0.train.teacher_outputs``): the float32 teacher and an int4 group-64
   deployment checkpoint (mlx-lm ``quantize_model`` with the model's ``quant_predicate``:
   routers stay 8-bit), both in mlx-lm layout with ``provenance.json``; the held-out token
   ids and the train-set unigram counts as ``.npy`` files for ``tools/eval_model.py``.

Like ``edge0.tiny``, this is a checkpoint builder: it uses MLX and mlx-lm directly; of the
engine's backend facade only the model-class lookup (``model_classes``).  The command line
is ``edge0.train.teacher_cli``.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx

from edge0.train.corpus import build_corpus
from edge0.train.teacher_balance import _AUX, balance_loss_capture
from edge0.train.teacher_config import FAMILY, TeacherConfig, lr_at, model_config
from edge0.train.teacher_outputs import (BITS, FILES_FILE, GROUP_SIZE, HELDOUT_FILE, UNIGRAM_FILE, dir_size,
                                         quantize_checkpoint, save_data, save_teacher)
from edge0.train.teacher_run import TrainResult, train

LOG_FILE = "train_log.jsonl"
RESUME_DIR = "resume"  # periodic training state: ``--resume`` continues from it

__all__ = ["BITS", "FAMILY", "FILES_FILE", "GROUP_SIZE", "HELDOUT_FILE", "LOG_FILE", "RESUME_DIR", "UNIGRAM_FILE",
           "TeacherConfig", "TrainResult", "_AUX", "balance_loss_capture", "dir_size", "lr_at", "matmul_gflops",
           "model_config", "quantize_checkpoint", "save_data", "save_teacher", "train", "train_teacher"]


def matmul_gflops(n: int = 512) -> float:
    """Measured float32 matmul speed of MLX on this machine (GFLOP/s): MLX's Linux CPU
    wheel bundles a reference BLAS; training wants an optimised one preloaded."""
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a @ b)
    t0 = time.perf_counter()
    for _ in range(3):
        mx.eval(a @ b)
    return 3 * 2 * n**3 / (time.perf_counter() - t0) / 1e9


def train_teacher(tc: TeacherConfig, out_dir: Path, *, files: Sequence[str] | None = None,
                  root: Path | None = None, progress: bool = True, command: str | None = None,
                  say: Callable[[str], None] = lambda s: None, resume: bool = False) -> dict:
    """The whole pipeline into ``out_dir``: ``teacher/`` (float32), ``int4/`` (deployment),
    ``heldout_tokens.npy``, ``train_unigram_counts.npy``, ``corpus_files.json`` and
    ``train_log.jsonl``.  Returns a summary dict (paths and the run's numbers)."""
    tc.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    corpus = build_corpus(tc.heldout_fraction, tc.vocab_size, root=root, files=files)
    say(f"corpus: {len(corpus.train_files)} train files ({corpus.train_tokens.size:,} tokens), "
        f"{len(corpus.heldout_files)} held-out files ({corpus.heldout_tokens.size:,} tokens), "
        f"built in {time.perf_counter() - t0:.1f} s")
    data = save_data(corpus, out)
    result = train(tc, corpus, progress=progress, log_path=out / LOG_FILE, resume_dir=out / RESUME_DIR,
                   resume=resume)
    say(f"trained {result.steps_done} steps ({result.tokens_seen:,} tokens) in {result.wall_time_s:.0f} s: "
        f"train loss {result.final_train_loss:.4f}, held-out loss {result.heldout_loss:.4f} "
        f"(ppl {math.exp(result.heldout_loss):.2f}), {result.tokens_per_s:.0f} tok/s")
    teacher = save_teacher(result, corpus, tc, out / "teacher", command=command)
    if result.steps_done < result.steps_planned:  # stopped by the budget: `--resume` continues the run
        say(f"stopped at step {result.steps_done} of {result.steps_planned} by the time budget; the state is in "
            f"{out / RESUME_DIR}: continue with --resume and a larger --time-budget (it counts the whole run) or none")
    else:
        shutil.rmtree(out / RESUME_DIR, ignore_errors=True)
    int4 = quantize_checkpoint(teacher, out / "int4")
    size = dir_size(int4)
    say(f"teacher: {teacher} ({dir_size(teacher) / 2**20:.1f} MiB); int4: {int4} ({size / 2**20:.2f} MiB)")
    return {"out": str(out), "teacher": str(teacher), "int4": str(int4), "int4_bytes": size,
            "heldout": str(data["heldout"]), "unigram": str(data["unigram"]),
            "steps": result.steps_done, "tokens_seen": result.tokens_seen,
            "final_train_loss": result.final_train_loss, "heldout_loss": result.heldout_loss,
            "wall_time_s": result.wall_time_s, "tokens_per_s": result.tokens_per_s,
            "stopped_by_budget": result.stopped_by_budget,
            "schedule_fitted_to_budget": result.schedule_fitted_to_budget}
