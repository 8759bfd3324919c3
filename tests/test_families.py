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


@pytest.mark.parametrize("kernels", ["mlx", "edge0"])
@pytest.mark.parametrize("capacity", [32, None])
def test_first_step_logits_match_resident(tiny_model, capacity, kernels):
    """capacity None = k: any prompt has more distinct experts than the bundle (chunking)."""
    from edge0.backend.mlx import kernels as K

    if kernels == "edge0" and not K.available():
        pytest.skip(f"kernels not built: {K.unavailable_reason()}")
    s = load_streaming_model(tiny_model, EngineConfig(bundle_capacity=capacity or 1, kernels=kernels,
                                                      expert_source="slots"))
    streaming, reader = s.model, s.reader
    try:
        ref = resident_reference(tiny_model)
        tokens = mx.array([prompt_ids(tiny_model)])
        ours, theirs = streaming(tokens), ref(tokens)
        diff = mx.abs(ours - theirs).max().item()
        assert diff <= 1e-4 * mx.abs(theirs).max().item(), f"max abs diff {diff}"
        if kernels == "mlx":  # stronger: on mlx-lm's kernels the exact path reproduces it bit for bit
            assert mx.array_equal(ours, theirs).item()
        else:
            assert s.kernels == "edge0"
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


@pytest.mark.parametrize("source", ["slots", "mapping"])
def test_expert_tensors_never_materialised(tiny_model, source):
    """The model holds no routed-expert tensor; only the bundle (capacity rows) holds expert
    bytes, and over the checkpoint's mapping not even the bundle."""
    s = load_streaming_model(tiny_model, EngineConfig(bundle_capacity=8, expert_source=source))
    streaming, spec, index, executor = s.model, s.spec, s.index, s.exact
    try:
        streaming(mx.array([prompt_ids(tiny_model)]))
        params = tree_flatten(streaming.parameters())
        assert [k for k, _ in params if ".switch_mlp." in k] == []
        resident = sum(v.nbytes for _, v in params)
        # float32 compute doubles the stored bf16 tensors at most
        assert resident <= 2 * (index.total_bytes - index.expert_bytes_total)
        assert executor.resident_bytes == (8 * index.layers[spec.moe_layers[0]].expert_bytes if source == "slots"
                                           else 0)
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
    cfg = EngineConfig(compute_threads=threads, bundle_capacity=capacity, kernels="mlx")  # MLX's streams
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
        with Engine(d, EngineConfig(compute_threads=threads, decode_path=path, kernels="mlx")) as engine:
            assert [e.token for e in engine.stream(PROMPT, max_tokens=12)] == expected, path


@pytest.mark.parametrize("capacity", [32, 1])
def test_edge0_kernels_give_the_same_logits_on_any_thread_count(tiny_model_factory, capacity):
    """Edge0's kernels split output rows over their threads, never a sum: the engine's logits
    at 1, 2 and 3 threads are bit for bit the same, at prefill and on every decode path."""
    from edge0.backend.mlx import kernels as K

    if not K.available():
        pytest.skip(f"kernels not built: {K.unavailable_reason()}")
    d = tiny_model_factory("deepseek_v3")
    tokens = mx.array([prompt_ids(d)])
    logits, texts = [], []
    for threads in (1, 2, 3):
        s = load_streaming_model(d, EngineConfig(compute_threads=threads, bundle_capacity=capacity, kernels="edge0"))
        try:
            assert K.get_threads() == threads and len(s.exact.split.streams) == 1
            logits.append(s.model(tokens))
            mx.eval(logits[-1])
        finally:
            s.close()
        for path in ("exact", "hot", "whole_layer"):
            with Engine(d, EngineConfig(compute_threads=threads, decode_path=path, kernels="edge0")) as engine:
                texts.append((path, [e.token for e in engine.stream(PROMPT, max_tokens=12)]))
    assert all(mx.array_equal(l, logits[0]).item() for l in logits[1:])
    assert all(t == texts[i % 3][1] for i, (_, t) in enumerate(texts))
