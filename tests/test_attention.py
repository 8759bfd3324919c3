"""The prompt's attention on Edge0's kernel (``edge0.backend.mlx.kernels.attention``): MLX's
fused attention's numbers within float32's rounding (causal after a cache's offset, grouped
queries, keys and values sliced out of a cache's buffer), the same result on any thread
count, typed errors; an engine on kernels edge0 prefills on it and decodes on MLX's, one on
kernels mlx never uses it, and both give the same text."""

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
         (1, 2, 2, 300, 300, 8)]  # (batch, query heads, key heads, queries, keys, head_dim)


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


def _generate(kernels: str, calls: list, max_tokens: int) -> list[int]:
    calls.clear()
    with Engine(DEMO, EngineConfig(kernels=kernels)) as e:
        ids = e.encode("def f(x):\n    return x + 1\n\n\n" * 24)
        return [ev.token for ev in e.stream(ids, max_tokens=max_tokens, temp=0.0)]


def test_an_engine_prefills_on_it_with_kernels_edge0_only(monkeypatch):
    calls = []
    real = A.attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(A, "attention", spy)
    short = _generate("edge0", calls, 2)
    prompt_calls = list(calls)
    assert prompt_calls and all(shape[2] > 1 for shape in prompt_calls)  # the prompt's queries
    longer = _generate("edge0", calls, 10)
    assert calls == prompt_calls  # decode steps (one query) stay on MLX's kernel
    reference = _generate("mlx", calls, 10)
    assert calls == []  # kernels mlx: mlx-lm's own attention
    assert longer == reference and longer[:2] == short
    assert not A._ON.get()  # nothing left switched on
