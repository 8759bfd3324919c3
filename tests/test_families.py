"""The exact streaming path against mlx-lm's resident model, for every family."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, load_tokenizer

from edge0 import Engine, EngineConfig
from edge0.backend import nn as bnn
from edge0.loader import load_streaming_model

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def resident_reference(model_dir, dtype=mx.float32):
    model, _ = load_model(model_dir)
    bnn.cast_model(model, dtype)
    return model


def prompt_ids(model_dir, n_repeat=1):
    tok = load_tokenizer(model_dir)
    return tok.encode(PROMPT * n_repeat)


@pytest.mark.parametrize("capacity", [32, None])
def test_first_step_logits_match_resident(tiny_model, capacity):
    """capacity None = k: any prompt has more distinct experts than the bundle (chunking)."""
    s = load_streaming_model(tiny_model, EngineConfig(bundle_capacity=capacity or 1))
    streaming, reader = s.model, s.reader
    try:
        ref = resident_reference(tiny_model)
        tokens = mx.array([prompt_ids(tiny_model)])
        ours, theirs = streaming(tokens), ref(tokens)
        diff = mx.abs(ours - theirs).max().item()
        assert diff <= 1e-5, f"max abs diff {diff}"
        # Stronger than the tolerance: the exact path reproduces the resident model bit for bit.
        assert mx.array_equal(ours, theirs).item()
        assert reader.stats.bytes > 0
    finally:
        s.close()


def test_greedy_generation_matches_mlx_lm(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    ref = resident_reference(tiny_model)
    expected = [r.token for r in stream_generate(ref, tokenizer, PROMPT, max_tokens=32)]
    with Engine(tiny_model) as engine:
        got = [e.token for e in engine.stream(PROMPT, max_tokens=32)]
    assert len(expected) == 32 and len(set(expected)) > 8  # a non-degenerate sequence to compare
    assert got == expected


def test_bf16_compute_matches_mlx_lm_in_bf16(tiny_model_factory):
    """Same compute dtype on both sides also holds for bfloat16 (the checkpoint's own dtype)."""
    d = tiny_model_factory("qwen3_moe")
    tokenizer = load_tokenizer(d)
    ref = resident_reference(d, mx.bfloat16)
    expected = [r.token for r in stream_generate(ref, tokenizer, PROMPT, max_tokens=16)]
    with Engine(d, EngineConfig(compute_dtype="bfloat16")) as engine:
        got = [e.token for e in engine.stream(PROMPT, max_tokens=16)]
    assert got == expected


def test_expert_tensors_never_materialised(tiny_model):
    """The model holds no routed-expert tensor; only the bundle (capacity rows) holds expert bytes."""
    s = load_streaming_model(tiny_model, EngineConfig(bundle_capacity=8))
    streaming, spec, index, executor = s.model, s.spec, s.index, s.exact
    try:
        streaming(mx.array([prompt_ids(tiny_model)]))
        params = tree_flatten(streaming.parameters())
        assert [k for k, _ in params if ".switch_mlp." in k] == []
        resident = sum(v.nbytes for _, v in params)
        # float32 compute doubles the stored bf16 tensors at most
        assert resident <= 2 * (index.total_bytes - index.expert_bytes_total)
        assert executor.resident_bytes == 8 * index.layers[spec.moe_layers[0]].expert_bytes
    finally:
        s.close()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("capacity", [32, 1])
def test_any_compute_threads_stay_bit_identical(tiny_model_factory, monkeypatch, threads, capacity):
    """The expert rows split over 1, 2 or 3 streams (capacity 1: the chunked prefill, split
    by rows), and every quantized projection's output rows too (the size floor lowered so
    the tiny model's are split), give mlx-lm's logits bit for bit, at prefill and at every
    decode path."""
    import edge0.backend.mlx.nn as mnn

    monkeypatch.setattr(mnn, "SPLIT_MIN_WEIGHTS", 0)
    d = tiny_model_factory("deepseek_v3")
    tokens = mx.array([prompt_ids(d)])
    ref = resident_reference(d)(tokens)
    cfg = EngineConfig(compute_threads=threads, bundle_capacity=capacity)
    s = load_streaming_model(d, cfg)
    try:
        assert len(s.exact.split.streams) == threads
        split = [m for _, m in s.model.named_modules() if isinstance(m, mnn.SplitQuantizedLinear)]
        assert (len(split) >= 8) if threads > 1 else not split
        assert mx.array_equal(s.model(tokens), ref).item()
    finally:
        s.close()
    tokenizer = load_tokenizer(d)
    expected = [r.token for r in stream_generate(resident_reference(d), tokenizer, PROMPT, max_tokens=12)]
    for path in ("exact", "hot", "whole_layer"):
        with Engine(d, EngineConfig(compute_threads=threads, decode_path=path)) as engine:
            assert [e.token for e in engine.stream(PROMPT, max_tokens=12)] == expected, path
