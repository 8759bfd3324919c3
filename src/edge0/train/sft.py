"""Phase 2 of the recovery recipe: supervised fine-tuning of the LoRA on the student path.

The student (int4 base, prerouter routing at every continuation position, LoRA on
attention and shared-expert projections) learns from the float32 teacher in one of two
ways (``SFTConfig.text``):

- ``teacher``: the teacher continues prompts taken from the training split, and the
  student learns those sampled continuations by cross-entropy;
- ``corpus``: windows of the training split itself, and the student learns the teacher's
  whole next-token distribution at every continuation position, by forward KL over the
  teacher's top-K tokens plus a tail bucket (``forward_kl_topk``). No sampling noise: the
  target is the teacher's distribution, on the text the model is used for.

Only the adapter trains; heads and base are frozen. The result is an adapter directory
with provenance.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from edge0.errors import ConfigError
from edge0.prerouter.files import checkpoint_identity
from edge0.train import data as D
from edge0.train.settings import SFTConfig
from edge0.train.distill import teacher_topk
from edge0.train.loop import fit_adapter
from edge0.train.parallel import DataParallel, mask_weight
from edge0.train.student import StudentModel, continuation_ce


def teacher_rows(teacher_dir: Path, model_dir: Path, cfg: SFTConfig, work: Path, say=print,
                 dp: DataParallel | None = None) -> tuple[np.ndarray, dict]:
    """The teacher's continuations of training-split prompts (cached in ``work``; under a
    data-parallel group each rank writes its share, rank 0 the cache)."""
    from edge0.backend import nn as bnn

    dp = dp or DataParallel(None)
    identity = checkpoint_identity(teacher_dir)
    key = D.cache_key(identity, cfg.rows, cfg.prompt_len, cfg.new_tokens, cfg.temp, cfg.seed)
    path = work / f"sft_rows-{key}.npy"
    if not dp.any(not D.rows_cached(path)):
        rows, _, meta = D.load_rows(path)
        return rows, meta
    train_stream, _, corpus_desc = D.token_streams(model_dir)
    prompt_rows = D.prompts(train_stream, cfg.rows, cfg.prompt_len, seed=cfg.seed)
    teacher = bnn.load_teacher(teacher_dir)
    bnn.cast_model(teacher, mx.float32)
    t0 = time.perf_counter()
    rows = D.sample(teacher, prompt_rows, cfg.new_tokens, temp=cfg.temp, seed=cfg.seed, dp=dp,
                    progress=lambda done, total: say(f"teacher wrote {done}/{total} sequences"))
    meta = {"teacher": str(teacher_dir.name), "teacher_identity": identity,
            "prompts": f"{cfg.rows} random {cfg.prompt_len}-token windows of the training split (seed {cfg.seed})",
            "corpus": corpus_desc, "temp": cfg.temp,
            "seconds": round(time.perf_counter() - t0, 1)}
    if dp.is_main:
        D.save_rows(path, rows, cfg.prompt_len, meta)
    return rows, meta


SCORE_BLOCK = 1024  # windows the teacher scores per cached block


def corpus_targets(teacher_dir: Path, model_dir: Path, cfg: SFTConfig, work: Path, say=print,
                   dp: DataParallel | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """Windows of the training split and the teacher's top-K next-token ids and
    log-probabilities at every position of them. The teacher scores them in blocks of
    ``SCORE_BLOCK`` windows, each cached in ``work`` under the hash of its windows, so an
    interrupted scoring resumes at its first missing block and a longer run (``--rows``
    larger, same seed: the windows drawn first are the same) scores only the new ones.
    The rows are written last, so cached rows always have their targets."""
    dp = dp or DataParallel(None)
    identity = checkpoint_identity(teacher_dir)
    key = D.cache_key(identity, "corpus", cfg.rows, cfg.prompt_len, cfg.new_tokens, cfg.top_k, cfg.seed)
    path = work / f"corpus_rows-{key}.npy"
    train_stream, _, corpus_desc = D.token_streams(model_dir)
    rows = D.prompts(train_stream, cfg.rows, cfg.prompt_len + cfg.new_tokens, seed=cfg.seed)
    chunks = [rows[s:s + SCORE_BLOCK] for s in range(0, len(rows), SCORE_BLOCK)]
    blocks = [work / f"corpus_block-{D.cache_key(identity, cfg.top_k, c.shape, hashlib.sha256(c).hexdigest())}.npz"
              for c in chunks]
    t0 = time.perf_counter()
    sizes = [len(c) for c in chunks]
    cached = [not dp.any(not b.exists()) for b in blocks]  # a block every rank has
    if not all(cached):
        say(f"the teacher scores {sum(n for n, c in zip(sizes, cached) if not c)} of {cfg.rows} windows of the "
            f"training split ({sum(cached)} of {len(blocks)} blocks cached)")
    teacher = None
    parts = []
    for i, block in enumerate(blocks):
        if cached[i]:
            with np.load(block) as t:
                parts.append((t["ids"], t["lp"]))
            continue
        if teacher is None:
            teacher = _teacher(teacher_dir)
        ids, lp = teacher_topk(teacher, chunks[i], cfg.top_k, dp=dp)
        if dp.is_main:
            tmp = block.with_name(block.name + ".tmp.npz")
            np.savez(tmp, ids=ids, lp=lp)
            tmp.replace(block)
        parts.append((ids, lp))
        say(f"teacher scored block {i + 1}/{len(blocks)}")
    meta = {"teacher": str(teacher_dir.name), "teacher_identity": identity,
            "rows": f"{cfg.rows} random {cfg.prompt_len + cfg.new_tokens}-token windows of the training split "
                    f"(seed {cfg.seed}); the teacher's top-{cfg.top_k} at every position",
            "corpus": corpus_desc, "seconds": round(time.perf_counter() - t0, 1)}
    if dp.is_main and not D.rows_cached(path):
        D.save_rows(path, rows, cfg.prompt_len, meta)
    return rows, np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), meta


def _teacher(teacher_dir: Path):
    from edge0.backend import nn as bnn

    teacher = bnn.load_teacher(teacher_dir)
    bnn.cast_model(teacher, mx.float32)
    return teacher


def run_sft(model_dir: str | Path, teacher_dir: str | Path, out: str | Path, cfg: SFTConfig, *, work: str | Path,
            heads_file: str | Path | None = None, resume: bool = False, progress=None, say=print,
            dp: DataParallel | None = None) -> dict:
    """Phase 2 into the adapter directory ``out``; ``dp``: the data-parallel group
    (edge0.train.parallel; default: the one ``mlx.launch`` started, or one process)."""
    model_dir, teacher_dir, work, out = Path(model_dir), Path(teacher_dir), Path(work), Path(out)
    dp = dp or DataParallel.current()
    if cfg.text not in SFT_TEXTS:
        raise ConfigError(f"SFT text {cfg.text!r}: expected one of {', '.join(SFT_TEXTS)}")
    work.mkdir(parents=True, exist_ok=True)
    if cfg.text == "corpus":
        return _run_corpus_kl(model_dir, teacher_dir, out, cfg, work=work, heads_file=heads_file, resume=resume,
                              progress=progress, say=say, dp=dp)
    rows, data_meta = teacher_rows(teacher_dir, model_dir, cfg, work, say, dp)
    mask = D.continuation_mask(rows, cfg.prompt_len)
    student = _student(model_dir, heads_file, cfg)
    P = np.full(cfg.batch, cfg.prompt_len)

    def loss(model, tokens, m):
        return continuation_ce(student.logits(tokens, P[: tokens.shape[0]]), tokens, m)

    def batches(rng):
        idx = rng.integers(0, len(rows), size=cfg.batch)
        return mx.array(rows[idx]), mx.array(mask[idx])

    fixed = (mx.array(rows[: cfg.batch]), mx.array(mask[: cfg.batch]))  # the same batch before and after
    return fit_adapter(student, loss, batches, fixed, cfg, name="sft", phase="2 (SFT on the student path)",
                       model_dir=model_dir, teacher_dir=teacher_dir, data_meta=data_meta, tokens=int(mask.sum()),
                       work=work, out=out, resume=resume, progress=progress, dp=dp, weight=mask_weight(1))


SFT_TEXTS = ("teacher", "corpus")


def _student(model_dir: Path, heads_file, cfg: SFTConfig) -> StudentModel:
    return StudentModel(model_dir, heads_file=heads_file, rank=cfg.rank, scale=cfg.scale, seed=cfg.seed,
                        experts_per_token=cfg.experts_per_token, routing=cfg.routing, stage_extra=cfg.stage_extra)


def _run_corpus_kl(model_dir: Path, teacher_dir: Path, out: Path, cfg: SFTConfig, *, work: Path, heads_file,
                   resume: bool, progress, say, dp: DataParallel) -> dict:
    """Phase 2 on the training split: forward KL to the teacher's top-K + tail."""
    from edge0.train.distill import fit_topk, forward_kl_topk

    rows, top_idx, top_lp, data_meta = corpus_targets(teacher_dir, model_dir, cfg, work, say, dp)
    mask = D.continuation_mask(rows, cfg.prompt_len)
    student = _student(model_dir, heads_file, cfg)
    return fit_topk(student, forward_kl_topk, rows, top_idx, top_lp, mask, cfg, name="sft",
                    phase="2 (forward KL to the teacher on the training split, top-K + tail)",
                    model_dir=model_dir, teacher_dir=teacher_dir, data_meta=data_meta, work=work, out=out,
                    resume=resume, progress=progress, dp=dp)
