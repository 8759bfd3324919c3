"""The streamed expert stack against a float64 NumPy reference built from the file bytes.

Independent of MLX, mlx-lm and Edge0's reader: the reference slices each expert's int4
words straight from the file at the header's offsets, dequantizes in float64 and applies
SwiGLU. The six classic families all use SwiGLU experts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from edge0 import EngineConfig
from edge0.loader import load_streaming_model
from tests.reference import expert_matrix, rel_l2, swiglu_expert


@pytest.mark.parametrize("tokens,capacity", [(3, 32), (40, 1)])
def test_streamed_experts_match_float64_reference(tiny_model, tokens, capacity):
    """capacity 1: any call needs more distinct experts than the bundle holds (chunking)."""
    s = load_streaming_model(tiny_model, EngineConfig(bundle_capacity=capacity))
    spec = s.spec
    rng = np.random.default_rng(1234 + tokens)
    try:
        for layer_id, switch in s.switches().items():
            width = switch.template["gate_proj"]["weight"].shape[-1] * 32 // spec.quant.bits
            x_np = rng.standard_normal((1, tokens, width)).astype(np.float32)
            inds_np = np.stack([rng.choice(spec.num_experts, spec.k, replace=False) for _ in range(tokens)])[None]
            y = np.array(switch(mx.array(x_np), mx.array(inds_np.astype(np.uint32))), dtype=np.float64)
            y = y.reshape(1, tokens, spec.k, -1)
            ref = np.zeros_like(y)
            cache = {}
            for t in range(tokens):
                for j, e in enumerate(inds_np[0, t]):
                    if e not in cache:
                        cache[e] = [expert_matrix(tiny_model, f"{spec.switch_path(layer_id)}.{p}", int(e),
                                                  spec.quant.bits, spec.quant.group_size)
                                    for p in ("gate_proj", "up_proj", "down_proj")]
                    ref[0, t, j] = swiglu_expert(x_np[0, t].astype(np.float64), *cache[e])
            err = rel_l2(y, ref)
            assert err <= 1e-3, f"layer {layer_id}: relative L2 {err:.2e}"
    finally:
        s.close()
