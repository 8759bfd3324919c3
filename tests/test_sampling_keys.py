"""A row's random draws come from its own key, (seed, step) -> key, passed to the sampler:
MLX's random state (its thread's) is neither read nor changed by a generation, and the tokens are
those mlx-lm's ``make_sampler`` draws right after ``mx.random.seed`` of the same value (what
a row drew before its key was passed, bit for bit)."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from edge0 import Engine, EngineConfig
from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.cli import PACKAGED_DEMO
from edge0.sampling import SamplingParams

CHAINS = [dict(temp=0.7), dict(temp=1.0, top_p=0.9), dict(temp=0.9, min_p=0.05), dict(temp=1.0, top_k=20),
          dict(temp=1.0, xtc_probability=0.5, xtc_threshold=0.05),
          dict(temp=0.8, top_p=0.95, min_p=0.02, top_k=50, xtc_probability=0.7, xtc_threshold=0.02), dict(temp=0.0)]


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_a_keyed_draw_is_mlx_lms_sampler_after_the_same_seed(chain):
    params = SamplingParams(**chain)
    special = [3, 7]
    ours, _ = bnn.row_sampling(params, xtc_special=tuple(special))
    theirs = make_sampler(params.temp, params.top_p if params.top_p < 1 else 0.0, params.min_p, params.min_tokens_to_keep,
                          top_k=params.top_k, xtc_probability=params.xtc_probability,
                          xtc_threshold=params.xtc_threshold, xtc_special_tokens=special)
    rng = np.random.default_rng(5)
    try:
        for _ in range(60):
            logits = mx.array(rng.normal(size=(1, 300)).astype(np.float32) * 3)
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            seed = int(rng.integers(0, 2**62))
            mx.random.seed(seed)
            assert ours(logprobs, mx.random.key(seed)).item() == theirs(logprobs).item()
    finally:
        mx.random.seed(0)


def test_draw_keys_are_per_row_and_step():
    keys = {(s, t): np.array(B.draw_key(s, t)).tobytes() for s in (1, 2) for t in (0, 1)}
    assert len(set(keys.values())) == 4
    assert np.array(B.draw_key(1, 0)).tobytes() == keys[(1, 0)]


def _compute_thread_state(engine) -> bytes:
    """The random state of the thread the engine samples on (MLX keeps one per thread)."""
    return engine._worker.call(lambda: np.array(mx.random.state[0]).tobytes())


@pytest.mark.parametrize("model", ["demo", "exact"])
def test_a_sampled_generation_leaves_the_random_state_alone(model, tiny_model_factory):
    """MLX's random state is the thread's (the engine's compute thread here); a sampled
    generation, sync or async, staged with heads and adapter or exact, neither reads nor
    changes it: every draw is from the row's key."""
    path, config = (PACKAGED_DEMO, EngineConfig()) if model == "demo" else (tiny_model_factory("qwen3_moe"),
                                                                            EngineConfig(prefill_path="exact", decode_path="exact"))
    sampling = dict(max_tokens=8, temp=1.0, top_p=0.9, xtc_probability=0.5, xtc_threshold=0.05, seed=11)
    with Engine(path, config) as engine:
        before = _compute_thread_state(engine)
        assert len(list(engine.stream("def f(x):", **sampling))) == 8
        assert _compute_thread_state(engine) == before

        async def one(prompt):
            return [e async for e in engine.generate(prompt, **sampling) if e is not None]

        async def two():
            return await asyncio.gather(one("import os\n"), one("def g(y):"))

        assert [len(o) for o in asyncio.run(two())] == [8, 8]
        assert _compute_thread_state(engine) == before
