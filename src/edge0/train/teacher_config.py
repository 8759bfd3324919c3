"""What determines a teacher training run: :class:`TeacherConfig` (recorded in
provenance.json and in the resume state), the model it describes (:func:`model_config`)
and its learning-rate schedule (:func:`lr_at`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from edge0.tiny import tiny_config

FAMILY = "qwen3_moe"


@dataclass(frozen=True)
class TeacherConfig:
    """Everything that determines a training run (recorded in provenance.json)."""

    # model (qwen3_moe; attention head_dim 32, hidden // 32 heads, half as many KV heads)
    layers: int = 8
    experts: int = 32
    k: int = 4
    hidden: int = 256
    moe_intermediate: int = 128
    vocab_size: int = 2048
    # data
    seq_len: int = 256
    batch_size: int = 16
    heldout_fraction: float = 0.05
    # optimisation
    steps: int = 1000
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    beta2: float = 0.95
    grad_clip: float = 1.0
    balance_weight: float = 0.01
    seed: int = 0
    # budget: stop after this many seconds of training; with ``fit_schedule_to_budget``
    # the step count (and so the cosine schedule) is shrunk after ``calibration_steps``
    # when the measured speed says ``steps`` would not fit.
    time_budget_s: float | None = None
    fit_schedule_to_budget: bool = True
    calibration_steps: int = 10
    # periodic held-out evaluation (0 = only at the end)
    eval_every: int = 0
    eval_tokens: int = 16384
    final_eval_tokens: int = 65536
    log_every: int = 10
    # write the resumable training state every N steps (0 = never)
    checkpoint_every: int = 50
    compile: bool = True

    def validate(self) -> None:
        def positive(name):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")

        for name in ("layers", "experts", "k", "hidden", "moe_intermediate", "vocab_size",
                     "seq_len", "batch_size", "steps", "eval_tokens", "final_eval_tokens",
                     "calibration_steps", "log_every"):
            positive(name)
        if self.k > self.experts:
            raise ValueError(f"k={self.k} exceeds experts={self.experts}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction={self.heldout_fraction!r} must be in (0, 1)")
        if self.vocab_size > 65535:
            raise ValueError("vocab_size must fit in uint16 (token files are stored as uint16)")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("lr must be > 0 and min_lr_ratio in [0, 1]")
        if self.warmup_steps < 0 or self.eval_every < 0 or self.balance_weight < 0:
            raise ValueError("warmup_steps, eval_every and balance_weight must be >= 0")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s={self.time_budget_s!r} must be > 0")
        # tiny_config validates hidden / moe_intermediate / vocab_size further
        model_config(self)


# Settings that may differ between a run and its resumption (they do not change the math).
RESUMABLE_CHANGES = ("time_budget_s", "eval_every", "log_every", "checkpoint_every", "compile")


def model_config(tc: TeacherConfig) -> dict:
    """The config.json dict (unquantized, float32) of the teacher described by ``tc``."""
    cfg = tiny_config(FAMILY, layers=tc.layers, experts=tc.experts, k=tc.k, hidden=tc.hidden,
                      moe_intermediate=tc.moe_intermediate, vocab_size=tc.vocab_size)
    cfg["torch_dtype"] = "float32"
    return cfg


def lr_at(tc: TeacherConfig, step: int, total_steps: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine to ``lr * min_lr_ratio``
    at ``total_steps`` (``step`` counts from 0). Written out in float64, not with
    mlx.optimizers' float32 schedules (which the adapter and head trainings use,
    ``edge0.train.loop``): the demo's teacher is rebuilt bit for bit against the sha256 its
    provenance records, and a learning rate one float32 rounding away changes every weight."""
    warm = min(tc.warmup_steps, max(total_steps - 1, 0))
    if step < warm:
        return tc.lr * (step + 1) / warm
    span = max(total_steps - warm, 1)
    progress = min((step - warm) / span, 1.0)
    floor = tc.lr * tc.min_lr_ratio
    return floor + 0.5 * (tc.lr - floor) * (1.0 + math.cos(math.pi * progress))
