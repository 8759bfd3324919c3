"""Full-size checks at the paper's 35B expert shapes (slow: ``pytest -m slow``).

A 2-layer checkpoint with the 35B tier's expert shapes (hidden 2048, 256 experts of width
512, k = 8, 1,769,472 bytes per expert per layer: 0.9 GB of experts) is written to a
temporary directory. On it, the exact path reproduces mlx-lm's resident model bit for bit
(both in float32), and every other path reproduces exact bit for bit, at decode and
prefill, with the kernel running over 256-expert stacks and 16-slot tensors as in the
benchmarks rather than over the tiny models of the default suite.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from edge0 import Engine, EngineConfig
from edge0.backend import nn as bnn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def full_size(tmp_path_factory):
    from edge0.benchmark.checkpoint import BenchShape, make_bench_checkpoint

    out = tmp_path_factory.mktemp("full-size") / "bench-35b-2L"
    make_bench_checkpoint(out, BenchShape(layers=2), overwrite=True)
    return out


def _replay(model_dir, config, ids, continuation, oracle=None):
    from tests.test_paths import replay_logits

    return replay_logits(model_dir, config, ids, continuation, oracle=oracle)


def test_exact_equals_resident_at_35b_shapes(full_size):
    from edge0.loader import load_streaming_model

    ref = bnn.load_full_model(full_size)
    bnn.cast_model(ref, mx.float32)
    s = load_streaming_model(full_size, EngineConfig())
    try:
        tokens = mx.array([[5, 17, 33, 2, 99, 41, 7, 250, 13, 77, 101, 3]])
        ours, theirs = s.model(tokens), ref(tokens)
        assert mx.array_equal(ours, theirs).item(), f"max diff {mx.abs(ours - theirs).max().item()}"
    finally:
        s.close()


@pytest.mark.parametrize("config", [
    dict(decode_path="staged"),
    dict(decode_path="hot", hot_experts=16),
    dict(decode_path="whole_layer"),
    dict(prefill_path="whole_layer"),
])
def test_paths_equal_exact_at_35b_shapes(full_size, config):
    ids = [5, 17, 33, 2, 99, 41, 7, 250, 13, 77, 101, 3]
    with Engine(full_size) as e:
        oracle = e.record_routing(ids, max_tokens=6)
        continuation = [ev.token for ev in e.stream(ids, max_tokens=6)]
    base = _replay(full_size, EngineConfig(), ids, continuation)
    other = _replay(full_size, EngineConfig(**config), ids, continuation, oracle=oracle)
    assert len(base) == len(other) == len(continuation) + 1
    for step, (a, b) in enumerate(zip(base, other)):
        assert mx.array_equal(a, b).item(), f"step {step}: max diff {mx.abs(a - b).max().item()}"
