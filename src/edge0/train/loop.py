"""The training loop: every optimizer step Edge0 takes (the two adapter phases and the
teacher) runs through :func:`run_steps`.

One step draws a batch from the loop's NumPy generator, sets the learning rate of the
schedule, takes the gradient of the loss's first output, clips it, updates, and records
every output of the loss.  Around that core a run gets a time budget, hooks after each step
(progress bars, logging, a schedule that shrinks itself), and resumable checkpoints every
``checkpoint_every`` steps, written beside the last one and swapped in (:func:`write_state`)
so that a kill at any moment leaves a complete state.

:func:`train` is the adapters' use of it: AdamW on the trainable parameters only, a
warm-up-then-cosine schedule, and the state in ``<work>/state``; ``resume=True`` continues
from there with the same batches, so an interrupted phase ends where an uninterrupted one
would.  The teacher (``edge0.train.teacher_run``) brings its own schedule, loss outputs,
logging and state format.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from edge0.train.parallel import DataParallel, rows_weight


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


def lr_at(cfg: LoopConfig, step: int) -> float:
    """Linear warm-up (``lr / warmup`` at step 0, ``lr`` at step ``warmup - 1``), then cosine
    to a tenth of ``lr`` at the last step: mlx.optimizers' schedules."""
    return float(_schedule(cfg.lr, cfg.warmup, cfg.steps)(step))


@functools.lru_cache(maxsize=8)
def _schedule(lr: float, warmup: int, steps: int):
    cosine = optim.cosine_decay(lr, max(steps - warmup, 1), 0.1 * lr)
    if warmup < 1:
        return cosine
    warm = optim.linear_schedule(lr / warmup, lr, warmup - 1) if warmup > 1 else (lambda step: lr)
    return optim.join_schedules([warm, cosine], [warmup])


# --------------------------------------------------------------------------
# the shared core
# --------------------------------------------------------------------------


@dataclass
class Run:
    """Where a run stands.  :func:`run_steps` advances ``step`` towards ``total`` (an
    ``on_step`` hook may change ``total``) and appends the k-th output of the loss to
    ``histories[k]`` at every step."""

    step: int
    total: int
    histories: tuple[list[float], ...]
    seconds: float = 0.0  # training time so far, earlier sessions of a resumed run included
    started: float = 0.0  # the perf_counter() reading ``seconds`` counts from
    stopped_by_budget: bool = False


def make_step(model: nn.Module, loss_fn: Callable, optimizer, grad_clip: float, *,
              compile: bool = False, dp: DataParallel | None = None,
              weight: Callable[..., mx.array] = rows_weight) -> Callable[..., tuple]:
    """``step(*batch)``: one optimizer step on ``loss_fn(model, *batch)``, returning the
    loss's outputs as a tuple.  A loss that returns a tuple is minimised on its first
    element and reports the others; a loss that returns one array reports that array.
    ``compile=True`` compiles the whole step with the model's and optimizer's state.
    With a ``dp`` group of several ranks each computes on its part of the global batch and
    the gradients are averaged, weighed by ``weight(*part)`` (edge0.train.parallel)."""
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    dp = dp or DataParallel(None)
    if compile and dp.size > 1:
        raise ValueError("a compiled step does not run data parallel")

    def step(*batch):
        part = dp.shard(batch)
        value, grads = loss_and_grad(model, *part)
        outputs = tuple(value[1:]) if isinstance(value, (tuple, list)) else (value,)
        grads, outputs = dp.reduce(grads, outputs, weight(*part))
        grads, _ = optim.clip_grad_norm(grads, grad_clip)
        optimizer.update(model, grads)
        return outputs

    if compile:
        state = [model.state, optimizer.state]
        step = mx.compile(step, inputs=state, outputs=state)
    return step


def run_steps(model: nn.Module, step: Callable[..., tuple], batches: Callable[[np.random.Generator], tuple],
              rng: np.random.Generator, optimizer, run: Run, *, lr: Callable[[int, int], float],
              time_budget_s: float | None = None,
              on_step: Callable[[Run, Sequence[float]], None] | None = None,
              checkpoint: Callable[[Run], None] | None = None, checkpoint_every: int = 0,
              checkpoint_last: bool = True, dp: DataParallel | None = None) -> Run:
    """Take steps until ``run.step`` reaches ``run.total`` or the budget is spent.

    Each step: ``batches(rng)``, the learning rate ``lr(step, total)``, ``step(*batch)``,
    then ``on_step(run, values)`` with the outputs as floats, ``checkpoint(run)`` every
    ``checkpoint_every`` steps (at the last step too only with ``checkpoint_last``), and a
    stop once ``run.seconds`` reaches ``time_budget_s`` before the end (checkpointed then).
    Under a ``dp`` group the ranks stop together: at the first step where any rank's
    budget is spent."""
    run.started = time.perf_counter() - run.seconds
    while run.step < run.total:
        batch = batches(rng)
        optimizer.learning_rate = mx.array(lr(run.step, run.total), dtype=mx.float32)
        outputs = step(*batch)
        mx.eval(model.trainable_parameters(), optimizer.state, *outputs)
        values = [out.item() for out in outputs]
        if not math.isfinite(values[0]):
            raise FloatingPointError(f"training diverged: loss {values[0]} at step {run.step}")
        for history, value in zip(run.histories, values):
            history.append(value)
        run.step += 1
        run.seconds = time.perf_counter() - run.started
        if on_step is not None:
            on_step(run, values)
        if (checkpoint is not None and checkpoint_every and run.step % checkpoint_every == 0
                and (checkpoint_last or run.step < run.total)):
            checkpoint(run)
        if (time_budget_s is not None and run.step < run.total
                and (dp or DataParallel(None)).any(run.seconds >= time_budget_s)):
            run.stopped_by_budget = True
            if checkpoint is not None and not (checkpoint_every and run.step % checkpoint_every == 0):
                checkpoint(run)  # the state at the stop, so that a resumed run continues from here
            break
    return run


def write_state(state_dir: Path, arrays: dict[str, dict[str, mx.array]], meta: dict) -> None:
    """Write a training state: each ``arrays[name]`` (flat name -> array) as
    ``name.safetensors`` and ``meta`` as ``state.json``, into a directory beside
    ``state_dir``, synced to disk, then renamed into place; a kill at any moment leaves
    either the previous state or this one."""
    tmp = state_dir.with_name(state_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, flat in arrays.items():
        mx.save_safetensors(str(tmp / f"{name}.safetensors"), flat)
    (tmp / "state.json").write_text(json.dumps(meta), encoding="utf-8")
    for p in tmp.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    old = state_dir.with_name(state_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if state_dir.exists():
        state_dir.rename(old)
    tmp.rename(state_dir)
    shutil.rmtree(old, ignore_errors=True)


def restore_optimizer(state_dir: Path, optimizer, rng: np.random.Generator, meta: dict) -> None:
    """Put back the optimizer's moments and the batch sampler's state that :func:`write_state`
    saved (as ``optimizer.safetensors`` and ``meta["rng"]``)."""
    optimizer.state = tree_unflatten(list(mx.load(str(state_dir / "optimizer.safetensors")).items()))
    rng.bit_generator.state = meta["rng"]


# --------------------------------------------------------------------------
# the adapters' loop
# --------------------------------------------------------------------------


def train(model: nn.Module, loss_fn: Callable, batches: Callable[[np.random.Generator], tuple],
          cfg: LoopConfig, *, work: Path | None = None, resume: bool = False,
          progress: Callable[[int, int, float], None] | None = None, dp: DataParallel | None = None,
          weight: Callable[..., mx.array] = rows_weight) -> LoopResult:
    """Minimise ``loss_fn(model, *batch)`` over ``model``'s trainable parameters.

    ``batches(rng)`` draws one batch; the rng is the loop's, so batches are reproducible and
    resumable.  With a ``dp`` group every rank draws the same batch and steps on its part
    (:func:`make_step`); rank 0 alone writes the state."""
    dp = dp or DataParallel(None)
    opt = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
    rng = np.random.default_rng(cfg.seed)
    result = LoopResult(0)
    state_dir = work / "state" if work is not None else None
    if resume and state_dir is not None and (state_dir / "state.json").exists():
        result = _load(state_dir, model, opt, rng)
    run = Run(result.steps_done, cfg.steps, (result.losses,), result.seconds)

    def report(run: Run, values: Sequence[float]) -> None:
        result.steps_done, result.seconds = run.step, run.seconds
        if progress is not None:
            progress(run.step, cfg.steps, values[0])

    def save(run: Run) -> None:
        _save(state_dir, model, opt, rng, result)

    run_steps(model, make_step(model, loss_fn, opt, cfg.grad_clip, dp=dp, weight=weight), batches, rng, opt, run,
              lr=lambda step, total: lr_at(cfg, step), time_budget_s=cfg.time_budget_s, on_step=report,
              checkpoint=save if state_dir is not None and dp.is_main else None,
              checkpoint_every=cfg.checkpoint_every, dp=dp)
    result.stopped_by_budget = run.stopped_by_budget
    return result


def _save(state_dir: Path, model: nn.Module, opt, rng: np.random.Generator, result: LoopResult) -> None:
    write_state(state_dir, {"trainable": dict(tree_flatten(model.trainable_parameters())),
                            "optimizer": dict(tree_flatten(opt.state))},
                {"rng": rng.bit_generator.state, "steps": result.steps_done, "losses": result.losses,
                 "seconds": result.seconds})


def _load(state_dir: Path, model: nn.Module, opt, rng: np.random.Generator) -> LoopResult:
    meta = json.loads((state_dir / "state.json").read_text())
    model.update(tree_unflatten(list(mx.load(str(state_dir / "trainable.safetensors")).items())))
    restore_optimizer(state_dir, opt, rng, meta)
    return LoopResult(meta["steps"], meta["losses"], meta["seconds"])


def fit_adapter(student, loss: Callable, batches: Callable, fixed: tuple, cfg, *, name: str, phase: str,
                model_dir: Path, teacher_dir: Path, data_meta: dict, tokens: int, work: Path, out: Path,
                resume: bool = False, progress=None, provenance: dict | None = None,
                dp: DataParallel | None = None, weight: Callable[..., mx.array] = rows_weight) -> dict:
    """Train ``student``'s adapter with ``cfg`` (an SFT or distillation config), measure the
    loss on the batch ``fixed`` before and after, and save the adapter to ``out`` with its
    provenance (``provenance`` adds phase-specific fields; rank 0 saves under ``dp``)."""
    dp = dp or DataParallel(None)
    loop = LoopConfig(steps=cfg.steps, batch=cfg.batch, lr=cfg.lr, warmup=cfg.warmup, seed=cfg.seed,
                      checkpoint_every=cfg.checkpoint_every, time_budget_s=cfg.time_budget_s)
    before = loss(student.model, *fixed).item()
    result = train(student.model, loss, batches, loop, work=work / name, resume=resume,
                   progress=progress if dp.is_main else None, dp=dp, weight=weight)
    after = loss(student.model, *fixed).item()
    if dp.is_main:
        _save_adapter(student, out, cfg, result, before, after, model_dir, teacher_dir, data_meta, phase, provenance)
    return {"adapter": str(out), "losses": result.losses, "loss_before": before, "loss_after": after,
            "steps": result.steps_done, "seconds": result.seconds, "tokens": tokens,
            "stopped_by_budget": result.stopped_by_budget, "data": data_meta, "ranks": dp.size}


def _save_adapter(student, out: Path, cfg, result: LoopResult, before: float, after: float, model_dir: Path,
                  teacher_dir: Path, data_meta: dict, phase: str, provenance: dict | None) -> None:
    from dataclasses import asdict

    from edge0.prerouter.files import heads_identity
    from edge0.prerouter.files import checkpoint_identity

    student.save(out, {
        "base_identity": checkpoint_identity(model_dir),
        "heads_identity": heads_identity(student.heads_path) if student.heads_path else "",
        "heads_k": student.spec.k, "phase": phase,
        "routing": ({"routing": student.routing[0], "stage_extra": student.routing[1]} if student.routing else None),
        "recipe": {**asdict(cfg), "steps_done": result.steps_done, "loss_before": before, "loss_after": after,
                   "seconds": round(result.seconds, 1)},
        "data": data_meta, "teacher_identity": checkpoint_identity(teacher_dir), **(provenance or {}),
    })
