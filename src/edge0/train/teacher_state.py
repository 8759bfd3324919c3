"""The teacher's resumable training state, in ``OUT/resume``: ``model.safetensors`` (all
weights), ``optimizer.safetensors`` (AdamW's moments, step and learning rate) and
``state.json`` (the run's config, counters, loss histories, log records and the batch
sampler's state), written with :func:`edge0.train.loop.write_state`."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from edge0.train.loop import restore_optimizer, write_state
from edge0.train.teacher_config import RESUMABLE_CHANGES, TeacherConfig


def save_state(resume: Path, model: nn.Module, optimizer, rng: np.random.Generator, meta: dict) -> None:
    """Write the training state (weights, optimizer moments, sampler state, counters) to
    ``resume``: into a temp directory first, then renamed, so a kill leaves the old state."""
    write_state(resume, {"model": dict(tree_flatten(model.parameters())),
                         "optimizer": dict(tree_flatten(optimizer.state))},
                dict(meta, rng=rng.bit_generator.state))


def load_state(resume: Path, tc: TeacherConfig, model: nn.Module, optimizer, rng: np.random.Generator) -> dict:
    """Restore what :func:`save_state` wrote; refuses a state written for another config."""
    meta = json.loads((resume / "state.json").read_text(encoding="utf-8"))
    mine = {k: v for k, v in asdict(tc).items() if k not in RESUMABLE_CHANGES}
    theirs = {k: v for k, v in meta["train_config"].items() if k not in RESUMABLE_CHANGES}
    if mine != theirs:
        diff = sorted(k for k in mine if mine.get(k) != theirs.get(k))
        raise ValueError(f"{resume} holds a run with other settings ({', '.join(diff)}); "
                         "start afresh with --overwrite or resume with the same settings")
    model.load_weights(str(resume / "model.safetensors"), strict=True)
    restore_optimizer(resume, optimizer, rng, meta)
    return meta
