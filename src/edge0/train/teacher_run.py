"""One teacher training run: a fresh float32 qwen3_moe trained on the corpus's train tokens
through the shared loop (:func:`edge0.train.loop.run_steps`).

Random windows of ``seq_len + 1`` train tokens (NumPy generator seeded with ``seed``),
AdamW with linear warm-up and cosine decay, gradient clipping, and the load-balancing loss
of ``edge0.train.teacher_balance``.  Every ``log_every`` steps a record goes to the log
(with the held-out loss every ``eval_every`` steps); every ``checkpoint_every`` steps the
state goes to the resume directory (``edge0.train.teacher_state``); with a time budget the
schedule can shrink itself to fit after a calibration."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from edge0.backend import nn as bnn
from edge0.train.corpus import Corpus
from edge0.train.loop import Run, make_step, run_steps
from edge0.train.teacher_balance import balance_loss_capture, loss_with_balance
from edge0.train.teacher_config import TeacherConfig, lr_at, model_config
from edge0.train.teacher_state import load_state, save_state


@dataclass
class TrainResult:
    model: nn.Module
    config: dict  # config.json of the float32 teacher
    steps_planned: int
    steps_done: int
    tokens_seen: int
    final_train_loss: float  # mean cross-entropy of the last ``log_every`` steps (nats/token)
    final_balance_loss: float
    heldout_loss: float  # nats/token on the first ``final_eval_tokens`` held-out tokens
    heldout_tokens_evaluated: int
    wall_time_s: float
    tokens_per_s: float
    stopped_by_budget: bool
    schedule_fitted_to_budget: bool
    log: list[dict] = field(default_factory=list)


def _batch(tokens: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int):
    if tokens.size < seq_len + 2:
        raise ValueError(f"the train stream has {tokens.size} tokens, fewer than seq_len + 2 = {seq_len + 2}")
    starts = rng.integers(0, tokens.size - seq_len - 1, size=batch)
    win = np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int32)
    return mx.array(win[:, :-1]), mx.array(win[:, 1:])


def heldout_loss(model: nn.Module, tokens: np.ndarray, seq_len: int, max_tokens: int) -> tuple[float, int]:
    from edge0.train.evaluate import evaluate_tokens

    res = evaluate_tokens(model, tokens, seq_len=seq_len, max_tokens=max_tokens, batch_size=8)
    return res.nll, res.n_tokens


class TrainLog:
    """The run's log records: kept in a list (saved with the resume state), written one
    JSON line each to ``path`` (rewritten from the kept records on a resume) and passed to
    ``on_log``."""

    def __init__(self, records: list[dict], path: Path | None, on_log: Callable[[dict], None] | None):
        self.records, self.on_log = records, on_log
        self.fh = open(path, "w", encoding="utf-8") if path else None
        if self.fh:
            for record in records:
                self.fh.write(json.dumps(record) + "\n")
            self.fh.flush()  # a run stopped before its next record still shows the earlier ones

    def emit(self, record: dict) -> None:
        self.records.append(record)
        if self.fh:
            self.fh.write(json.dumps(record) + "\n")
            self.fh.flush()
        if self.on_log:
            self.on_log(record)

    def close(self) -> None:
        if self.fh:
            self.fh.close()
            self.fh = None


class _Hooks:
    """What the teacher does around each step of the shared loop: fit the schedule to the
    budget, log (and evaluate), show progress, checkpoint."""

    def __init__(self, tc: TeacherConfig, model: nn.Module, optimizer, rng: np.random.Generator,
                 heldout: np.ndarray, log: TrainLog, run: Run, *, fitted: bool, resume_dir: Path | None,
                 progress: bool):
        self.tc, self.model, self.optimizer, self.rng, self.heldout, self.log = tc, model, optimizer, rng, heldout, log
        self.fitted, self.resume_dir = fitted, resume_dir
        self.tokens_per_step = tc.batch_size * tc.seq_len
        self.start_step, self.seconds_before = run.step, run.seconds
        self.t_calib: tuple[float, int] | None = None
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=run.total, initial=run.step, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def on_step(self, run: Run, values: Sequence[float]) -> None:
        self._fit_schedule(run)
        tc = self.tc
        if run.step % tc.log_every == 0 or run.step == run.total:
            ce_hist, bal_hist = run.histories
            rec = {"step": run.step, "lr": lr_at(tc, run.step - 1, run.total),
                   "loss": float(np.mean(ce_hist[-tc.log_every:])),
                   "balance": float(np.mean(bal_hist[-tc.log_every:])),
                   "tokens": run.step * self.tokens_per_step, "elapsed_s": round(run.seconds, 2)}
            if tc.eval_every and run.step % tc.eval_every == 0 and run.step < run.total:
                rec["heldout_loss"], _ = heldout_loss(self.model, self.heldout, tc.seq_len, tc.eval_tokens)
            self.log.emit(rec)
        if self.bar is not None:
            rate = (run.step - self.start_step) * self.tokens_per_step / max(run.seconds - self.seconds_before, 1e-9)
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{values[0]:.3f}", bal=f"{values[1]:.3f}", tok_s=f"{rate:.0f}")

    def _fit_schedule(self, run: Run) -> None:
        """With a budget: after ``calibration_steps`` timed steps (the first two, which
        include compilation, not counted), shrink ``run.total`` to what the measured speed
        affords within 95% of the budget."""
        tc = self.tc
        if run.step == self.start_step + 2:
            self.t_calib = (time.perf_counter(), run.step)
        if (tc.time_budget_s is not None and tc.fit_schedule_to_budget and not self.fitted
                and self.t_calib is not None and run.step == self.t_calib[1] + tc.calibration_steps):
            per_step = (time.perf_counter() - self.t_calib[0]) / tc.calibration_steps
            affordable = int((0.95 * tc.time_budget_s - run.seconds) / per_step) + run.step
            if affordable < run.total:
                run.total = max(affordable, run.step + 1)
                self.fitted = True
                if self.bar is not None:
                    self.bar.total = run.total
                    self.bar.refresh()

    def checkpoint(self, run: Run) -> None:
        ce_hist, bal_hist = run.histories
        save_state(self.resume_dir, self.model, self.optimizer, self.rng,
                   dict(train_config=asdict(self.tc), step=run.step, total=run.total, fitted=self.fitted,
                        elapsed_s=run.seconds, ce=ce_hist, bal=bal_hist, log=self.log.records))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fresh_model(tc: TeacherConfig) -> tuple[nn.Module, dict]:
    cfg = model_config(tc)
    mx.random.seed(tc.seed)
    model_cls, args_cls = bnn.model_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    mx.eval(model.parameters())
    return model, cfg


def train(tc: TeacherConfig, corpus: Corpus, *, progress: bool = True,
          log_path: Path | None = None, on_log: Callable[[dict], None] | None = None,
          resume_dir: Path | None = None, resume: bool = False) -> TrainResult:
    """Train a fresh float32 qwen3_moe on ``corpus.train_tokens``; returns the model
    (in mlx-lm's own classes, ready for ``save_model``) and the run's numbers.

    With ``resume_dir`` the training state is written there every ``checkpoint_every``
    steps; ``resume=True`` continues from it. A resumed run is bit-identical to an
    uninterrupted one (same weights, moments, sampler state and schedule)."""
    tc.validate()
    model, cfg = _fresh_model(tc)
    rng = np.random.default_rng(tc.seed)
    optimizer = optim.AdamW(learning_rate=lr_at(tc, 0, tc.steps), betas=(0.9, tc.beta2),
                            weight_decay=tc.weight_decay)
    run, fitted, records = Run(0, tc.steps, ([], [])), False, []
    if resume and resume_dir is not None and (resume_dir / "state.json").exists():
        state = load_state(resume_dir, tc, model, optimizer, rng)
        run = Run(state["step"], state["total"], (state["ce"], state["bal"]), state["elapsed_s"])
        fitted, records = state["fitted"], state["log"]
    log = TrainLog(records, log_path, on_log)
    try:
        with balance_loss_capture(model):
            step = make_step(model, loss_with_balance(tc.balance_weight), optimizer, tc.grad_clip,
                             compile=tc.compile)
            hooks = _Hooks(tc, model, optimizer, rng, corpus.heldout_tokens, log, run, fitted=fitted,
                           resume_dir=resume_dir, progress=progress)
            try:
                run_steps(model, step, lambda g: _batch(corpus.train_tokens, g, tc.batch_size, tc.seq_len),
                          rng, optimizer, run, lr=lambda s, total: lr_at(tc, s, total),
                          time_budget_s=tc.time_budget_s, on_step=hooks.on_step,
                          checkpoint=hooks.checkpoint if resume_dir is not None else None,
                          checkpoint_every=tc.checkpoint_every, checkpoint_last=False)
            finally:
                hooks.close()
            train_time = time.perf_counter() - run.started
        result = _finish(tc, corpus, model, cfg, run, log, train_time, fitted=hooks.fitted)
    finally:
        log.close()
    return result


def _finish(tc: TeacherConfig, corpus: Corpus, model: nn.Module, cfg: dict, run: Run, log: TrainLog,
            train_time: float, *, fitted: bool) -> TrainResult:
    """The final held-out evaluation, the result and the log's closing record."""
    model.eval()
    heldout, n_eval = heldout_loss(model, corpus.heldout_tokens, tc.seq_len, tc.final_eval_tokens)
    wall = time.perf_counter() - run.started
    ce_hist, bal_hist = run.histories
    tokens_per_step = tc.batch_size * tc.seq_len
    tail = max(1, min(tc.log_every, len(ce_hist)))
    result = TrainResult(
        model=model, config=cfg, steps_planned=tc.steps, steps_done=run.step,
        tokens_seen=run.step * tokens_per_step,
        final_train_loss=float(np.mean(ce_hist[-tail:])),
        final_balance_loss=float(np.mean(bal_hist[-tail:])),
        heldout_loss=heldout, heldout_tokens_evaluated=n_eval, wall_time_s=wall,
        tokens_per_s=run.step * tokens_per_step / max(train_time, 1e-9),
        stopped_by_budget=run.stopped_by_budget, schedule_fitted_to_budget=fitted, log=log.records,
    )
    log.emit({"final": True, "steps": run.step, "train_loss": result.final_train_loss,
              "heldout_loss": heldout, "wall_time_s": round(wall, 2)})
    return result
