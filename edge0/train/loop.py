"""The training loop both adapter phases share: AdamW on the adapter's parameters only,
a progress bar with the loss, a time budget, and resumable checkpoints.

Every ``checkpoint_every`` steps the trainable parameters, the optimizer's moments, the
batch sampler's state and the loss history go to ``<work>/state`` (written beside, then
renamed); ``resume=True`` continues from there with the same batches, so an interrupted
phase ends where an uninterrupted one would.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten


@dataclass
class LoopConfig:
    steps: int
    batch: int
    lr: float
    warmup: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 50
    time_budget_s: float | None = None


@dataclass
class LoopResult:
    steps_done: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    stopped_by_budget: bool = False

    def first_last(self, n: int = 10) -> tuple[float, float]:
        k = max(1, min(n, len(self.losses) // 2))
        return float(np.mean(self.losses[:k])), float(np.mean(self.losses[-k:]))


def lr_at(cfg: LoopConfig, step: int) -> float:
    """Linear warm-up, then cosine to a tenth."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    p = min((step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1), 1.0)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * p)))


def train(model: nn.Module, loss_fn: Callable, batches: Callable[[np.random.Generator], tuple],
          cfg: LoopConfig, *, work: Path | None = None, resume: bool = False,
          progress: Callable[[int, int, float], None] | None = None) -> LoopResult:
    """Minimise ``loss_fn(model, *batch)`` over ``model``'s trainable parameters.

    ``batches(rng)`` draws one batch; the rng is the loop's, so batches are reproducible and
    resumable."""
    opt = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
    rng = np.random.default_rng(cfg.seed)
    result = LoopResult(0)
    state_dir = work / "state" if work is not None else None
    if resume and state_dir is not None and (state_dir / "state.json").exists():
        result = _load(state_dir, model, opt, rng)
    step_fn = nn.value_and_grad(model, loss_fn)
    t0 = time.perf_counter() - result.seconds
    while result.steps_done < cfg.steps:
        batch = batches(rng)
        opt.learning_rate = mx.array(lr_at(cfg, result.steps_done), dtype=mx.float32)
        loss, grads = step_fn(model, *batch)
        grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
        opt.update(model, grads)
        mx.eval(model.trainable_parameters(), opt.state, loss)
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"training diverged: loss {value} at step {result.steps_done}")
        result.losses.append(value)
        result.steps_done += 1
        result.seconds = time.perf_counter() - t0
        if progress is not None:
            progress(result.steps_done, cfg.steps, value)
        if state_dir is not None and cfg.checkpoint_every and result.steps_done % cfg.checkpoint_every == 0:
            _save(state_dir, model, opt, rng, result)
        if cfg.time_budget_s is not None and result.seconds >= cfg.time_budget_s and result.steps_done < cfg.steps:
            result.stopped_by_budget = True
            break
    return result


def _save(state_dir: Path, model: nn.Module, opt, rng: np.random.Generator, result: LoopResult) -> None:
    tmp = state_dir.with_name(state_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "trainable.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
    (tmp / "state.json").write_text(json.dumps({"rng": rng.bit_generator.state, "steps": result.steps_done,
                                                "losses": result.losses, "seconds": result.seconds}))
    shutil.rmtree(state_dir, ignore_errors=True)
    tmp.rename(state_dir)


def _load(state_dir: Path, model: nn.Module, opt, rng: np.random.Generator) -> LoopResult:
    meta = json.loads((state_dir / "state.json").read_text())
    model.update(tree_unflatten(list(mx.load(str(state_dir / "trainable.safetensors")).items())))
    opt.state = tree_unflatten(list(mx.load(str(state_dir / "optimizer.safetensors")).items()))
    rng.bit_generator.state = meta["rng"]
    return LoopResult(meta["steps"], meta["losses"], meta["seconds"])


def fit_adapter(student, loss: Callable, batches: Callable, fixed: tuple, cfg, *, name: str, phase: str,
                model_dir: Path, teacher_dir: Path, data_meta: dict, tokens: int, work: Path, out: Path,
                resume: bool = False, progress=None, provenance: dict | None = None) -> dict:
    """Train ``student``'s adapter with ``cfg`` (an SFT or distillation config), measure the
    loss on the batch ``fixed`` before and after, and save the adapter to ``out`` with its
    provenance (``provenance`` adds phase-specific fields)."""
    from dataclasses import asdict

    from edge0.adapters import artifact_identity
    from edge0.prerouter.files import checkpoint_identity

    loop = LoopConfig(steps=cfg.steps, batch=cfg.batch, lr=cfg.lr, warmup=cfg.warmup, seed=cfg.seed,
                      checkpoint_every=cfg.checkpoint_every, time_budget_s=cfg.time_budget_s)
    before = loss(student.model, *fixed).item()
    result = train(student.model, loss, batches, loop, work=work / name, resume=resume, progress=progress)
    after = loss(student.model, *fixed).item()
    student.save(out, {
        "base_identity": checkpoint_identity(model_dir),
        "heads_identity": artifact_identity(student.heads_path) if student.heads_path else "",
        "heads_k": student.spec.k, "phase": phase,
        "recipe": {**asdict(cfg), "steps_done": result.steps_done, "loss_before": before, "loss_after": after,
                   "seconds": round(result.seconds, 1)},
        "data": data_meta, "teacher_identity": checkpoint_identity(teacher_dir), **(provenance or {}),
    })
    return {"adapter": str(out), "losses": result.losses, "loss_before": before, "loss_after": after,
            "steps": result.steps_done, "seconds": result.seconds, "tokens": tokens,
            "stopped_by_budget": result.stopped_by_budget, "data": data_meta}
