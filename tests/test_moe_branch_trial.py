"""tools/moe_branch_trial.py: the branch starts as nothing (the block's own output) and
adds down(silu(gate x) * up x) once trained."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import moe_branch_trial as mbt  # noqa: E402


def test_the_branch_adds_its_mlp_to_the_blocks_output_and_starts_at_zero():
    block = nn.Linear(8, 8)
    x = mx.random.normal((2, 3, 8), key=mx.random.key(1))
    branched = mbt.BranchedBlock(block, 8, 4, seed=0)
    assert mx.array_equal(branched(x), block(x))  # down starts at zero
    branched.down = mx.random.normal((4, 8), key=mx.random.key(2))
    want = block(x) + (nn.silu(x @ branched.gate) * (x @ branched.up)) @ branched.down
    assert mx.allclose(branched(x), want, atol=1e-5)
    names = {k for k, _ in nn.utils.tree_flatten(branched.trainable_parameters())}
    assert {"gate", "up", "down"} <= names
