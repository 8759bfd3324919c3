"""The streaming MoE layer against a float64 NumPy reference built from the file bytes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from edge0 import EngineConfig
from edge0.loader import load_streaming_model
from edge0.exec.moe_layer import StreamingMoE
from tests.reference import expert_matrix, rel_l2, swiglu_expert


def shared_output(layer: StreamingMoE, x):
    if layer.shared_kind == "plain":
        return layer.shared_experts(x)
    if layer.shared_kind == "gated":
        return mx.sigmoid(layer.shared_expert_gate(x)) * layer.shared_expert(x)
    return mx.zeros_like(x)


@pytest.mark.parametrize("tokens,capacity", [(3, 32), (40, 1)])
def test_streaming_layer_matches_float64_reference(tiny_model, tokens, capacity):
    s = load_streaming_model(tiny_model, EngineConfig(bundle_capacity=capacity))
    model, spec = s.model, s.spec
    rng = np.random.default_rng(1234 + tokens)
    try:
        for layer_id in spec.moe_layers:
            layer = model.layers[layer_id]
            block = layer[spec.block_attr] if spec.block_attr in layer else None
            assert isinstance(block, StreamingMoE)
            x_np = rng.standard_normal((1, tokens, spec.hidden_size)).astype(np.float32)
            x = mx.array(x_np)
            y = np.array(block(x), dtype=np.float64)
            inds, scores = block.routing(x)
            inds, scores = np.array(inds), np.array(scores.astype(mx.float32), dtype=np.float64)
            shared = np.array(shared_output(block, x).astype(mx.float32), dtype=np.float64)
            ref = shared.copy()
            cache = {}
            for t in range(tokens):
                for j in range(spec.k):
                    e = int(inds[0, t, j])
                    if e not in cache:
                        mats = [expert_matrix(tiny_model, spec.expert_key(layer_id, p, "weight")[:-len(".weight")], e,
                                              spec.quant.bits, spec.quant.group_size)
                                for p in ("gate_proj", "up_proj", "down_proj")]
                        cache[e] = mats
                    ref[0, t] += scores[0, t, j] * swiglu_expert(x_np[0, t].astype(np.float64), *cache[e])
            err = rel_l2(y, ref)
            assert err <= 1e-3, f"layer {layer_id}: relative L2 {err:.2e}"
    finally:
        s.close()
