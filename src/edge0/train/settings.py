"""The settings of phases 2 and 3 of the recovery recipe (``edge0.train.sft``,
``edge0.train.distill``), in a module of their own that imports nothing heavy: the command
line reads their defaults to build its help without loading MLX or mlx-lm."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SFTConfig:
    rows: int = 4096  # teacher-written sequences
    prompt_len: int = 32
    new_tokens: int = 96
    temp: float = 0.8  # teacher sampling temperature (text "teacher")
    text: str = "teacher"  # "teacher": CE on its sampled continuations; "corpus": KL to it on the training split
    top_k: int = 32  # text "corpus": the teacher's tokens kept per position (the rest is one tail bucket)
    rank: int = 8
    scale: float = 10.0
    steps: int = 600
    batch: int = 16
    lr: float = 5e-4
    warmup: int = 30
    seed: int = 0
    checkpoint_every: int = 50
    time_budget_s: float | None = None
    experts_per_token: int | None = None
    routing: str = "auto"  # the student's routing: auto = what the heads file records
    stage_extra: int | None = None  # select routing: experts staged beyond k (None: the heads' record)


@dataclass
class DistillConfig:
    rows: int = 400  # student generations (about a tenth of phase 2's tokens)
    prompt_len: int = 32
    new_tokens: int = 96
    temp: float = 1.0  # the student samples from its own distribution
    top_k: int = 32
    steps: int = 150
    batch: int = 8
    lr: float = 2e-4
    warmup: int = 10
    seed: int = 1
    checkpoint_every: int = 25
    time_budget_s: float | None = None
    experts_per_token: int | None = None
    routing: str = "auto"  # the student's routing, in training and in its own continuations
    stage_extra: int | None = None
