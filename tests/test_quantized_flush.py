"""The heads' flush on Edge0's kernels in 8-bit weights (``prerouter_flush edge0``).

- its logits are the float32 flush's within the 8-bit rounding of the weights, and the
  predicted top-k sets the same, on the demo's shipped heads (inputs drawn at random);
- through the engine, sync and async, under the demo's select routing and under replace: the
  same greedy text as the NumPy flush, the stats line naming the heads as before;
- its memory as planned (a quarter of NumPy's float32 copy, about);
- refused where it cannot run (no kernels, a float16 prerouter_dtype);
- the default on the CPU backend where the kernels resolve to edge0 and the heads quantize.
"""

from __future__ import annotations

import anyio
import mlx.core as mx
import numpy as np
import pytest

from edge0 import ConfigError, Engine, EngineConfig
from edge0.backend.mlx import kernels as K
from edge0.cli import PACKAGED_DEMO
from edge0.prerouter.files import load_heads
from edge0.prerouter.quantized import QuantizedHeads
from edge0.prerouter.runtime import HostHeads

pytestmark = pytest.mark.skipif(not K.available(), reason=f"kernels not built: {K.unavailable_reason()}")

PROMPT = "def add(a, b):"


def _inputs(heads, rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n, e = len(heads.owners), heads.experts
    h = rng.standard_normal((n, rows, heads.hidden)).astype(np.float32)
    inds = np.stack([np.stack([rng.choice(e, 4, replace=False) for _ in range(rows)]) for _ in range(n)])
    prev = np.stack([np.stack([rng.choice(e, 4, replace=False) for _ in range(rows)]) for _ in range(n)])
    prev[:, 0] = -1  # the first row: no previous token
    tok = rng.standard_normal((1, rows, heads.token_dim)).astype(np.float32)
    return h, inds, prev, tok


def test_the_8_bit_flush_predicts_the_float32_one_within_its_rounding():
    heads, _ = load_heads(PACKAGED_DEMO / "prerouter.safetensors", PACKAGED_DEMO)
    assert heads.token_dim  # the shipped heads see the token: its product is quantized too
    h, inds, prev, tok = _inputs(heads, rows=16)
    ref = HostHeads(heads).logits(h, inds, prev, tok[0])
    got = np.array(QuantizedHeads(heads).logits(mx.array(h), mx.array(inds), mx.array(prev), mx.array(tok)))
    assert got.shape == ref.shape
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert 0 < err < 0.01, err  # rounded (not the float32 numbers), by under 1% of the logits' range
    top = lambda a: np.sort(np.argsort(-a, axis=-1)[..., :6], axis=-1)  # noqa: E731 (select k+2 = 6)
    assert (top(got) == top(ref)).all(axis=-1).mean() >= 0.95


@pytest.mark.parametrize("routing", [{}, {"routing": "replace"}])
def test_the_engine_decodes_the_numpy_flushs_text_sync_and_async(routing):
    texts = {}
    for flush in ("numpy", "edge0"):
        with Engine(PACKAGED_DEMO, EngineConfig(prerouter_flush=flush, **routing)) as engine:
            assert (engine.streaming.prerouter.quantized is not None) == (flush == "edge0")
            events = list(engine.stream(PROMPT, max_tokens=48, temp=0.0))
            texts[flush] = "".join(e.text for e in events)
            heads = events[-1].stats.heads
        assert heads.startswith("prerouter.safetensors (7 heads")
    assert texts["edge0"] == texts["numpy"] and len(texts["numpy"]) > 20

    async def run():
        async with Engine.open(PACKAGED_DEMO, EngineConfig(prerouter_flush="edge0", **routing)) as engine:
            return "".join([e.text async for e in engine.generate(PROMPT, max_tokens=48, temp=0.0) if e is not None])

    assert anyio.run(run) == texts["numpy"]


def test_it_is_the_default_on_edge0s_kernels_where_the_heads_quantize(tiny_model_factory, tmp_path):
    """prerouter_flush auto on the CPU backend: the 8-bit flush where the kernels resolve to
    edge0 and the heads' widths are multiples of 32 (the demo's shipped heads); NumPy's on
    MLX's kernels, and for heads of another width; the plan counts the flush it runs."""
    from edge0.loader import lay_out
    from edge0.train.heads import make_warm_heads
    from tests.ckpt_tools import copy_model

    for config, quantized in ((EngineConfig(), True), (EngineConfig(kernels="mlx"), False)):
        with Engine(PACKAGED_DEMO, config) as engine:
            pr = engine.streaming.prerouter
            assert (pr.quantized is not None) == quantized and (pr.host is not None) == (not quantized)
        flush = "edge0" if quantized else "numpy"
        assert lay_out(PACKAGED_DEMO, config).plan.heads == lay_out(
            PACKAGED_DEMO, EngineConfig(kernels=config.kernels, prerouter_flush=flush)).plan.heads
    d = copy_model(tiny_model_factory("qwen3_moe"), tmp_path / "m")
    make_warm_heads(d, d / "prerouter.safetensors", width=24)  # fc1's 24 outputs: not in groups of 32
    with Engine(d, EngineConfig()) as engine:
        assert engine.streaming.prerouter.quantized is None and engine.streaming.prerouter.host is not None
    with pytest.raises(ConfigError, match="not multiples of 32"):
        Engine(d, EngineConfig(prerouter_flush="edge0"))


def test_its_memory_is_planned_and_its_settings_checked(monkeypatch):
    from edge0.loader import lay_out

    numpy_heads = lay_out(PACKAGED_DEMO, EngineConfig(prerouter_flush="numpy")).plan.heads
    edge0_heads = lay_out(PACKAGED_DEMO, EngineConfig(prerouter_flush="edge0")).plan.heads
    assert 0 < edge0_heads < numpy_heads / 2  # (the demo's small heads: their one-hot rows stay float32)
    with Engine(PACKAGED_DEMO, EngineConfig(prerouter_flush="edge0")) as engine:
        held = engine.streaming.prerouter.quantized.nbytes
    assert held == edge0_heads
    with pytest.raises(ConfigError, match="prerouter_flush edge0 computes in float32; prerouter_dtype float16"):
        Engine(PACKAGED_DEMO, EngineConfig(prerouter_flush="edge0", prerouter_dtype="float16"))
    monkeypatch.setattr(K, "available", lambda: False)
    monkeypatch.setattr(K, "unavailable_reason", lambda: "the extension is not built (test)")
    with pytest.raises(ConfigError, match=r"prerouter_flush edge0 runs on Edge0's kernels: the extension is not built"):
        Engine(PACKAGED_DEMO, EngineConfig(prerouter_flush="edge0", kernels="mlx"))
