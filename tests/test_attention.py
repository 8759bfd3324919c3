"""Attention on Edge0's kernel (``edge0.backend.mlx.kernels.attention``): MLX's fused
attention's numbers within float32's rounding (causal after a cache's offset, grouped
queries, keys and values sliced out of a cache's buffer, a decode step's one query, a
batch's boolean mask), a sequence padded in a batch computes what it computes alone bit for
bit, the same result on any thread count, typed errors; an engine on kernels edge0 prefills
and decodes on it, one on kernels mlx never uses it, and both give the same text."""

from __future__ import annotations

import pytest

import mlx.core as mx

from edge0 import Engine, EngineConfig
from edge0.backend.mlx import kernels as K
from edge0.backend.mlx.kernels import attention as A
from edge0.errors import KernelError

pytestmark = pytest.mark.skipif(not K.available(), reason="Edge0's kernels are not built")

DEMO = "src/edge0/data/demo_model"
CASES = [(1, 16, 2, 7, 7, 128), (1, 16, 2, 64, 100, 128), (2, 4, 4, 33, 33, 64), (1, 4, 1, 5, 9, 36),
         (1, 2, 2, 300, 300, 8), (1, 16, 2, 1, 600, 128), (3, 8, 2, 1, 45, 64)]
# (batch, query heads, key heads, queries, keys, head_dim); the last two: decode steps


def _inputs(b, hq, hkv, l, s, d, seed=0):
    key = mx.random.key(seed)
    kq, kk, kv = mx.random.split(key, 3)
    q = mx.random.normal((b, hq, l, d), key=kq)
    k = mx.random.normal((b, hkv, s + 16, d), key=kk)[:, :, :s, :]  # as a cache's buffer, sliced
    v = mx.random.normal((b, hkv, s + 16, d), key=kv)[:, :, :s, :]
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", CASES)
def test_the_kernel_gives_mlx_attentions_numbers(shape, causal):
    q, k, v = _inputs(*shape)
    scale = shape[-1] ** -0.5
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal" if causal else None)
    out = A.attention(q, k, v, scale=scale, causal=causal)
    assert out.shape == ref.shape and out.dtype == mx.float32
    assert mx.abs(out - ref).max().item() < 1e-5


def _left_padded(lengths, s):
    """A batch's boolean mask as mlx-lm's BatchKVCache makes it: [B, 1, 1, S], row b sees its
    last lengths[b] keys."""
    return mx.array([[[[j >= s - n for j in range(s)]]] for n in lengths])


@pytest.mark.parametrize("queries", [1, 6])
def test_a_boolean_mask_gives_mlx_attentions_numbers(queries):
    q, k, v = _inputs(3, 8, 2, queries, 40, 64, seed=2)
    mask = _left_padded([40, 25, 7], 40)
    if queries > 1:  # a batch's prompt chunk: left padding and the causal triangle
        causal = mx.arange(40)[None] <= mx.arange(40 - queries, 40)[:, None]
        mask = mask & causal[None, None]
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    out = A.attention(q, k, v, scale=0.125, causal=False, mask=mask)
    assert mx.abs(out - ref).max().item() < 1e-5


def test_a_sequence_padded_in_a_batch_computes_what_it_computes_alone():
    q, k, v = _inputs(2, 8, 2, 1, 50, 64, seed=3)
    batch = A.attention(q, k, v, scale=0.125, causal=False, mask=_left_padded([50, 21], 50))
    alone = A.attention(q[1:], k[1:, :, 29:], v[1:, :, 29:], scale=0.125, causal=False)
    assert mx.array_equal(batch[1:], alone).item()  # bit for bit
    full = A.attention(q[:1], k[:1], v[:1], scale=0.125, causal=False)
    assert mx.array_equal(batch[:1], full).item()


def test_the_result_does_not_depend_on_the_thread_count():
    q, k, v = _inputs(1, 8, 2, 96, 130, 64)
    before = K.get_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            K.set_threads(n)
            outs.append(A.attention(q, k, v, scale=0.125))
            mx.eval(outs[-1])
    finally:
        K.set_threads(before)
    assert all(mx.array_equal(outs[0], o).item() for o in outs[1:])


@pytest.mark.parametrize("change,match", [
    (lambda q, k, v: (q.astype(mx.float16), k, v), "float32"),
    (lambda q, k, v: (q[:, :3], k, v), "multiple of k's"),
    (lambda q, k, v: (q, k[:, :, :5], v[:, :, :5]), "at least as many keys as queries"),
    (lambda q, k, v: (q, k, v[:, :, :9]), "must have one shape"),
])
def test_bad_inputs_are_typed_errors_naming_what_is_wrong(change, match):
    q, k, v = change(*_inputs(1, 4, 2, 10, 10, 16))
    with pytest.raises(KernelError, match=match):
        A.attention(q, k, v, scale=0.25)


@pytest.mark.parametrize("mask, match", [
    (mx.ones((1, 1, 1, 9), dtype=mx.bool_), r"mask must be boolean .* got \(1, 1, 1, 9\)"),
    (mx.ones((1, 1, 1, 10)), "got a non-boolean"),
    (mx.ones((2, 1, 1, 10), dtype=mx.bool_), "mask must be boolean"),
])
def test_a_mask_of_other_shapes_or_type_is_a_typed_error(mask, match):
    q, k, v = _inputs(1, 4, 2, 1, 10, 16)
    with pytest.raises(KernelError, match=match):
        A.attention(q, k, v, scale=0.25, causal=False, mask=mask)


def _generate(kernels: str, calls: list, max_tokens: int) -> list[int]:
    calls.clear()
    with Engine(DEMO, EngineConfig(kernels=kernels)) as e:
        ids = e.encode("def f(x):\n    return x + 1\n\n\n" * 24)
        return [ev.token for ev in e.stream(ids, max_tokens=max_tokens, temp=0.0)]


def test_an_engine_prefills_and_decodes_on_it_with_kernels_edge0_only(monkeypatch):
    calls = []
    real = A.attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(A, "attention", spy)
    short = _generate("edge0", calls, 2)
    prompt_calls = [shape for shape in calls if shape[2] > 1]  # the prompt's queries
    assert prompt_calls
    longer = _generate("edge0", calls, 10)
    decode_calls = [shape for shape in calls if shape[2] == 1]  # a decode step's one query
    assert [shape for shape in calls if shape[2] > 1] == prompt_calls and len(decode_calls) > len(prompt_calls)
    reference = _generate("mlx", calls, 10)
    assert calls == []  # kernels mlx: mlx-lm's own attention
    assert longer == reference and longer[:2] == short
    assert not A._ON.get()  # nothing left switched on
