"""KV cache quantization (mlx-lm's --kv-bits, --kv-group-size, --quantized-kv-start): a
generation's attention cache is quantized once it holds quantized_kv_start tokens, as
mlx-lm's generation loop does it, on every executor path; such a generation runs alone,
the others still batch."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.utils import load_model, load_tokenizer

from edge0 import ConfigError, Engine, EngineConfig
from edge0.backend import nn as bnn

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


@pytest.mark.parametrize("bits", [4, 8])
def test_the_cache_quantizes_as_mlx_lm_s_does(tiny, bits):
    """On MLX's kernels Edge0's greedy tokens and their log-probabilities equal mlx-lm's
    with the same KV settings, on every path, and quantizing changes the log-probabilities
    (the cache really is quantized)."""
    tokenizer = load_tokenizer(tiny)
    ref, _ = load_model(tiny)
    bnn.cast_model(ref, mx.float32)
    kv = dict(kv_bits=bits, kv_group_size=32, quantized_kv_start=8)

    def theirs(**extra):
        out = list(stream_generate(ref, tokenizer, PROMPT, max_tokens=24, prefill_step_size=8, **extra))
        return [r.token for r in out], [r.logprobs[r.token].item() for r in out]

    tokens, logprobs = theirs(**kv)
    _, plain = theirs()
    assert max(abs(a - b) for a, b in zip(logprobs, plain)) > 1e-4
    with Engine(tiny, EngineConfig(kernels="mlx", prefill_step_size=8, **kv)) as e:
        oracle = e.record_routing(PROMPT, max_tokens=24)  # the staged path replays this generation's routing
    for path in ("exact", "hot", "whole_layer", "staged"):
        cfg = EngineConfig(kernels="mlx", decode_path=path, prefill_path="exact" if path == "staged" else path,
                           prefill_step_size=8, **kv)
        with Engine(tiny, cfg, oracle=oracle if path == "staged" else None) as e:
            events = list(e.stream(PROMPT, max_tokens=24, logprobs=True))
        assert [ev.token for ev in events] == tokens, path
        assert max(abs(ev.logprob - lp) for ev, lp in zip(events, logprobs)) < 1e-5, path


def test_a_group_size_the_heads_do_not_divide_is_refused_at_open(tiny):
    with pytest.raises(ConfigError, match="kv_group_size 128 does not divide"):
        Engine(tiny, EngineConfig(kv_bits=4, kv_group_size=128))


def test_a_quantizing_generation_runs_alone_and_the_others_batch(tiny):
    """Two generations that stay below quantized_kv_start share the batch (one step, two
    tokens); one that passes it runs alone; each has its tokens alone."""
    kv = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=40)
    short = ["x = 1", "import os"]
    with Engine(tiny, EngineConfig(max_batch=1, **kv)) as e:
        alone = {p: [ev.token for ev in e.stream(p, max_tokens=6)] for p in short}
        long_alone = [ev.token for ev in e.stream(PROMPT, max_tokens=30)]
    with Engine(tiny, EngineConfig(**kv)) as e:
        async def one(prompt, n):
            return [ev.token async for ev in e.generate(prompt, max_tokens=n) if ev is not None]

        async def main():
            return await asyncio.gather(one(short[0], 6), one(short[1], 6), one(PROMPT, 30))

        before = e.metrics()
        a, b, c = asyncio.run(main())
        after = e.metrics()
    assert (a, b, c) == (alone[short[0]], alone[short[1]], long_alone)
    steps = after.decode_steps - before.decode_steps
    tokens = after.decode_tokens - before.decode_tokens
    assert steps < tokens  # the two short ones stepped together


def test_bad_kv_settings_are_refused():
    for kw, name in ((dict(kv_bits=7), "kv_bits"), (dict(kv_group_size=48), "kv_group_size"),
                     (dict(quantized_kv_start=-1), "quantized_kv_start")):
        with pytest.raises(ConfigError, match=name):
            EngineConfig(**kw)
