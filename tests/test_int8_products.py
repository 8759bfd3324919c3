"""Integer products (``int8_products``): a decode step's one-row loops take x quantized to
int8 per 32 values and AVX-512 VNNI's integer dot products, 4- and 8-bit weights.

- the ops: within 1e-2 relative L2 of the float64 reference and farther than 1e-4 from it
  (they ran), 4 and 8 bits, every group size and scale dtype, gathered and dense; bit for bit
  the same at 1, 2 and 3 threads; what they do not cover (rows tiled against one expert) bit
  for bit the float loops' result; switched off, bit for bit the float loops again;
- the engine, sync and async, exact and staged with the demo's heads and adapter, over the
  mapping and over slots: the paths give the same tokens as each other, the stats line says
  ``int8 products``, an engine opened with them off switches them off;
- asked for where they cannot run (kernels mlx, a CPU without VNNI): a ConfigError.
"""

from __future__ import annotations

import anyio
import mlx.core as mx
import numpy as np
import pytest

from edge0 import Engine, EngineConfig
from edge0.backend.mlx import kernels as K
from edge0.errors import ConfigError
from tests.test_kernels import dequantized64, quantized, rel_l2

DEMO = "src/edge0/data/demo_model"
PROMPT = "def add(a, b):"


def _vnni() -> bool:
    if not K.available():
        return False
    was = K.int8_products()
    ok = K.set_int8_products(True)
    K.set_int8_products(was)
    return ok


needs_vnni = pytest.mark.skipif(not _vnni(), reason="needs Edge0's kernels on a CPU with AVX-512 VNNI")


@pytest.fixture
def int8():
    """The integer products on for the test, off after (they are process-wide)."""
    assert K.set_int8_products(True) and K.int8_products()
    yield
    K.set_int8_products(False)


def _gathered(bits, group_size, scale_dtype, rows=1, k=512):
    wq, s, b = quantized((16, 192, k), bits, group_size, scale_dtype)
    x = mx.random.normal((rows, 1, 1, k), key=mx.random.key(5))
    idx = mx.array(np.random.default_rng(1).integers(0, 16, size=(rows, 4)).astype(np.uint32))
    ref = np.einsum("rk,rjnk->rjn", np.array(x).reshape(rows, k).astype(np.float64),
                    dequantized64(wq, s, b, bits, group_size)[np.array(idx)])
    return (x, wq, s, b, idx), ref


@needs_vnni
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_one_row_products_are_within_their_rounding_of_the_reference(int8, bits, group_size, scale_dtype):
    (x, wq, s, b, idx), ref = _gathered(bits, group_size, scale_dtype)
    got = np.array(K.gather_qmm(x, wq, s, b, idx, bits=bits, group_size=group_size)).reshape(ref.shape)
    assert 1e-4 < rel_l2(got, ref) < 1e-2
    w = quantized((384, 1024), bits, group_size, scale_dtype, seed=3)
    xd = mx.random.normal((1, 1024), key=mx.random.key(6))
    dense = np.array(xd).astype(np.float64) @ dequantized64(*w, bits, group_size).T
    assert 1e-4 < rel_l2(K.quantized_matmul(xd, *w, bits=bits, group_size=group_size), dense) < 1e-2


@needs_vnni
def test_integer_products_do_not_depend_on_the_thread_count(int8):
    (x, wq, s, b, idx), _ = _gathered(4, 64, mx.bfloat16, rows=3)
    before = K.get_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            K.set_threads(n)
            outs.append(np.array(K.gather_qmm(x, wq, s, b, idx)))
    finally:
        K.set_threads(before)
    assert all(np.array_equal(o, outs[0]) for o in outs[1:])


@needs_vnni
def test_what_they_do_not_cover_is_the_float_loops_bit_for_bit_and_off_is_the_float_loops_again():
    (x8, *w8, idx8), _ = _gathered(8, 64, mx.bfloat16)
    (x4, *w4, idx4), _ = _gathered(4, 64, mx.bfloat16)
    many = mx.random.normal((12, 1, 512), key=mx.random.key(7))  # 12 rows against one expert: tiled
    one = mx.zeros((12,), dtype=mx.uint32)

    def run():
        return [np.array(K.gather_qmm(x8, *w8, idx8, bits=8)), np.array(K.gather_qmm(x4, *w4, idx4)),
                np.array(K.gather_qmm(many, *w4, one))]

    off = run()
    assert K.set_int8_products(True)
    try:
        on = run()
    finally:
        K.set_int8_products(False)
    again = run()
    assert np.array_equal(on[2], off[2])  # the tiles: float products
    assert not np.array_equal(on[0], off[0]) and not np.array_equal(on[1], off[1])  # the one-row loops took them
    assert all(np.array_equal(a, b) for a, b in zip(again, off))  # off again: the float loops


def _tokens(config: EngineConfig):
    with Engine(DEMO, config) as engine:
        events = list(engine.stream(PROMPT, max_tokens=16, temp=0.0))
    return [ev.token for ev in events], events[-1].stats


@needs_vnni
@pytest.mark.parametrize("setting", [{}, {"adapter": "off"}, {"prerouter": "off"}])
def test_the_paths_agree_with_integer_products_and_the_stats_line_says_so(setting):
    try:
        mapped, sm = _tokens(EngineConfig(int8_products="on", **setting))
        slots, ss = _tokens(EngineConfig(int8_products="on", expert_source="slots", **setting))
    finally:
        K.set_int8_products(False)
    assert mapped == slots and len(mapped) == 16
    assert "int8 products" in sm.line() and "int8 products" in ss.line() and sm.reads == "mapped"
    off, so = _tokens(EngineConfig(**setting))
    assert "int8 products" not in so.line() and not K.int8_products()  # the engine opened last decides


@needs_vnni
def test_async_generation_with_integer_products_equals_sync():
    async def run():
        async with Engine.open(DEMO, EngineConfig(int8_products="on")) as engine:
            return [ev.token async for ev in engine.generate(PROMPT, max_tokens=16, temp=0.0)]

    try:
        sync, _ = _tokens(EngineConfig(int8_products="on"))
        assert anyio.run(run) == sync
    finally:
        K.set_int8_products(False)


@pytest.mark.skipif(not K.available(), reason=f"kernels not built: {K.unavailable_reason()}")
def test_integer_products_asked_for_where_they_cannot_run_are_refused(monkeypatch):
    with pytest.raises(ConfigError, match="int8_products='on' is a mode of Edge0's kernels"):
        Engine(DEMO, EngineConfig(int8_products="on", kernels="mlx"))
    monkeypatch.setattr(K, "set_int8_products", lambda on: not on)  # a CPU without VNNI
    with pytest.raises(ConfigError, match="AVX-512 VNNI, which this CPU does not have"):
        Engine(DEMO, EngineConfig(int8_products="on"))
    with pytest.raises(ConfigError, match="int8_products"):
        EngineConfig(int8_products="yes")


@needs_vnni
def test_the_bench_runs_mlx_lms_model_on_them_as_an_arm_option():
    """``resident@X:kernels=edge0,int8_products=on``: mlx-lm's model on Edge0's kernels with
    integer products, named in the arm's kernels."""
    from edge0.benchmark.arms import ARMS

    try:
        loaded = ARMS["resident"](DEMO, {"compute_dtype": "float32", "arm": "resident@q", "arm_options": {
            "resident@q": {"kernels": "edge0", "int8_products": "on"}}})
        assert loaded.info["kernels"].endswith("int8 products)") and K.int8_products()
    finally:
        K.set_int8_products(False)
