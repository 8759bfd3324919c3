"""The layers' RMS norms and rotary embeddings on Edge0's row kernels
(``edge0.backend.mlx.kernels.attention``'s ``rms_norm``, ``rope`` and the twins ``use_edge0``
gives ``nn.RMSNorm`` and ``nn.RoPE``): a float64 reference's numbers within float32's
rounding (views as mlx-lm passes them, partial and traditional rotations, an offset per batch
entry, custom frequencies), a weight or position that lies as rows read without a copy node,
the same result on any thread count, typed errors; an engine on
kernels edge0 runs them in every pass (decode steps too), one on kernels mlx never does, and
the twins outside Edge0's forward pass are mlx-lm's modules."""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn

from edge0 import Engine, EngineConfig
from edge0.backend.mlx import kernels as K
from edge0.backend.mlx.kernels import attention as A
from edge0.errors import KernelError

pytestmark = pytest.mark.skipif(not K.available(), reason="Edge0's kernels are not built")

DEMO = "src/edge0/data/demo_model"


def _rel(a, ref) -> float:
    a = np.asarray(a, dtype=np.float64)
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def _norm64(x, w, eps):
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(w, dtype=np.float64)


def _rope64(x, dims, traditional, base, scale, offsets, freqs=None):
    x = np.asarray(x, dtype=np.float64)
    out = x.copy()
    half = dims // 2
    inv = 1.0 / np.asarray(freqs, dtype=np.float64) if freqs is not None else base ** (-2.0 * np.arange(half) / dims)
    L = x.shape[-2]
    for b in range(x.shape[0]):
        pos = (offsets[b if len(offsets) > 1 else 0] + np.arange(L)) * scale
        theta = pos[:, None] * inv[None, :]
        c, s = np.cos(theta), np.sin(theta)
        i1 = np.arange(0, dims, 2) if traditional else np.arange(half)
        i2 = i1 + 1 if traditional else i1 + half
        xb, ob = x[b], out[b]  # [..., L, D]
        x1, x2 = xb[..., i1], xb[..., i2]
        ob[..., i1] = x1 * c - x2 * s
        ob[..., i2] = x1 * s + x2 * c
    return out


@pytest.mark.parametrize("shape", [(2048,), (1, 1, 2048), (3, 5, 64), (2, 3, 7, 128)])
def test_rms_norm_gives_the_reference_numbers(shape):
    x = mx.random.normal(shape, key=mx.random.key(1)) * 3
    w = mx.random.normal((shape[-1],), key=mx.random.key(2))
    y = A.rms_norm(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == mx.float32
    assert _rel(y, _norm64(x, w, 1e-6)) < 1e-6
    assert _rel(y, np.array(mx.fast.rms_norm(x, w, 1e-6), dtype=np.float64)) < 1e-5


def test_rms_norm_reads_a_view_as_its_values():
    x = mx.random.normal((4, 64, 6), key=mx.random.key(3)).transpose(0, 2, 1)  # not row-contiguous
    w = mx.random.normal((64,), key=mx.random.key(4))
    assert _rel(A.rms_norm(x, w, 1e-5), _norm64(x, w, 1e-5)) < 1e-6


def _ops(y) -> list[str]:
    """The primitives of ``y``'s graph, by name."""
    import io
    import re

    buf = io.StringIO()
    mx.export_to_dot(buf, y)
    return re.findall(r'label ="?([A-Za-z_0-9]+)"?, shape=rectangle', buf.getvalue())


def test_a_weight_or_position_lying_as_rows_is_read_where_it_is_and_a_view_through_a_copy():
    x = mx.random.normal((1, 1, 64), key=mx.random.key(5))
    w = mx.random.normal((64,), key=mx.random.key(6))
    mx.eval(x, w)
    assert _ops(A.rms_norm(x, w, 1e-6)) == ["Edge0RmsNorm"]
    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(7))
    mx.eval(q)
    assert _ops(A.rope(q, 32, traditional=False, base=10000.0, scale=1.0, offset=9)) == ["Edge0Rope"]
    wide = mx.random.normal((64, 2), key=mx.random.key(8))
    mx.eval(wide)
    view = wide[:, 1]  # every other value: not rows
    y = A.rms_norm(x, view, 1e-6)
    assert "Contiguous" in _ops(y)
    assert _rel(y, _norm64(x, view, 1e-6)) < 1e-6


ROPE_CASES = [  # (shape made [B, L, H, D] then transposed as mlx-lm does, dims, traditional, offsets)
    ((1, 1, 16, 128), 128, False, [37]),
    ((1, 9, 4, 64), 64, True, [0]),
    ((2, 5, 3, 64), 32, False, [3, 4000]),  # partial rotation, an offset per batch entry, a far position
    ((3, 2, 2, 16), 16, True, [1, 2, 3]),
]


@pytest.mark.parametrize("shape, dims, traditional, offsets", ROPE_CASES)
def test_rope_gives_the_reference_numbers(shape, dims, traditional, offsets):
    x = mx.random.normal(shape, key=mx.random.key(5)).transpose(0, 2, 1, 3)  # [B, H, L, D], a view
    off = offsets[0] if len(offsets) == 1 else mx.array(offsets)
    y = A.rope(x, dims, traditional=traditional, base=10000.0, scale=0.5, offset=off)
    assert y.shape == x.shape and y.dtype == mx.float32
    assert _rel(y, _rope64(x, dims, traditional, 10000.0, 0.5, offsets)) < 1e-6
    if len(offsets) == 1:  # MLX's own, within its float32 angles' rounding
        theirs = mx.fast.rope(x, dims, traditional=traditional, base=10000.0, scale=0.5, offset=offsets[0])
        assert _rel(y, np.array(theirs, dtype=np.float64)) < 1e-5


def test_rope_with_frequencies_of_its_own():
    x = mx.random.normal((1, 4, 6, 32), key=mx.random.key(6))
    freqs = mx.array(np.linspace(1.0, 900.0, 16).astype(np.float32))
    y = A.rope(x, 32, traditional=False, base=None, scale=1.0, offset=11, freqs=freqs)
    assert _rel(y, _rope64(x, 32, False, None, 1.0, [11], np.array(freqs))) < 1e-6


def test_the_result_does_not_depend_on_the_thread_count():
    x = mx.random.normal((1, 16, 300, 128), key=mx.random.key(7))
    w = mx.random.normal((128,), key=mx.random.key(8))
    before = K.get_threads()
    try:
        got = []
        for t in (1, 2, 3):
            K.set_threads(t)
            got.append((A.rms_norm(x, w, 1e-6), A.rope(x, 128, traditional=False, base=1e6, scale=1.0, offset=5)))
            mx.eval(got[-1])
    finally:
        K.set_threads(before)
    for norm, rot in got[1:]:
        assert mx.array_equal(norm, got[0][0]).item() and mx.array_equal(rot, got[0][1]).item()


@pytest.mark.parametrize("call, match", [
    (lambda: A.rms_norm(mx.zeros((2, 8), dtype=mx.float16), mx.ones((8,)), 1e-6), "float32"),
    (lambda: A.rms_norm(mx.zeros((2, 8)), mx.ones((9,)), 1e-6), r"weight \(9,\) must be \[D\]"),
    (lambda: A.rope(mx.zeros((1, 2, 3, 8)), 7, traditional=False, base=1e4, scale=1.0, offset=0), "dims must be even"),
    (lambda: A.rope(mx.zeros((1, 2, 3, 8)), 16, traditional=False, base=1e4, scale=1.0, offset=0), "at most"),
    (lambda: A.rope(mx.zeros((2, 2, 3, 8)), 8, traditional=False, base=1e4, scale=1.0, offset=mx.array([1, 2, 3])),
     r"offsets must be int32 \[1\] or \[batch\]"),
    (lambda: A.rope(mx.zeros((1, 2, 3, 8)), 8, traditional=False, base=None, scale=1.0, offset=0), "base or freqs"),
])
def test_bad_inputs_are_typed_errors_naming_what_is_wrong(call, match):
    with pytest.raises(KernelError, match=match):
        call()


def test_the_twins_are_mlx_lms_modules_outside_edge0s_pass(monkeypatch):
    calls = []
    monkeypatch.setattr(A, "rms_norm", lambda *a, **k: calls.append("norm"))
    monkeypatch.setattr(A, "rope", lambda *a, **k: calls.append("rope"))
    norm, rope = nn.RMSNorm(8), nn.RoPE(8)
    K.use_edge0(nn.Sequential(norm, rope))
    assert type(norm) is A.Edge0RMSNorm and type(rope) is A.Edge0RoPE
    x = mx.random.normal((1, 2, 3, 8))
    assert mx.array_equal(norm(x), mx.fast.rms_norm(x, norm.weight, norm.eps)).item()
    assert mx.array_equal(rope(x, 4), mx.fast.rope(x, 8, traditional=False, base=10000, scale=1.0, offset=4)).item()
    assert calls == []
    with A.active(True):
        norm(x), rope(x, 4)
        norm(x.astype(mx.float16))  # another dtype: MLX's
    assert calls == ["norm", "rope"]


def _generate(kernels: str, max_tokens: int) -> list:
    with Engine(DEMO, EngineConfig(kernels=kernels)) as e:
        return [ev.token for ev in e.stream("def fibonacci(n):", max_tokens=max_tokens, temp=0.0)]


def test_an_engine_runs_them_in_every_pass_with_kernels_edge0_only(monkeypatch):
    calls = []
    real_norm, real_rope = A.rms_norm, A.rope

    def norm_spy(x, *a, **k):
        calls.append(("norm", x.shape[-2] if x.ndim > 1 else 1))
        return real_norm(x, *a, **k)

    def rope_spy(x, *a, **k):
        calls.append(("rope", x.shape[-2]))
        return real_rope(x, *a, **k)
    monkeypatch.setattr(A, "rms_norm", norm_spy)
    monkeypatch.setattr(A, "rope", rope_spy)
    tokens = _generate("edge0", 12)
    assert {"norm", "rope"} <= {c[0] for c in calls}
    assert ("rope", 1) in calls and ("norm", 1) in calls  # decode steps' single rows
    calls.clear()
    assert _generate("mlx", 12) == tokens and calls == []
    assert not A._ON.get()
