"""Routing functions are bit-identical to mlx-lm's own gate math."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import bailing_moe, deepseek_v3, glm4_moe_lite
from mlx_lm.utils import _get_classes

from edge0.routing import make_route_fn, sigmoid_group, softmax_topk, topk_softmax
from edge0.spec import spec_from_config
from edge0.tiny import tiny_config


def quantized_config(family: str) -> dict:
    cfg = tiny_config(family, experts=16, k=4)
    q = {"group_size": 64, "bits": 4}
    if "text_config" in cfg:
        cfg["text_config"]["quantization"] = q
    cfg["quantization"] = q
    return cfg


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("module,kwargs", [
    (deepseek_v3, dict(denominator_eps=0.0)),
    (glm4_moe_lite, dict(denominator_eps=1e-20)),
])
def test_sigmoid_group_matches_deepseek_and_glm(module, kwargs, dtype):
    mx.random.seed(0)
    logits = (mx.random.normal((3, 7, 32)) * 3).astype(dtype)
    bias = mx.random.normal((32,)) * 0.1
    for n_group, topk_group, k in [(1, 1, 4), (4, 2, 6), (8, 3, 8)]:
        ref = module.group_expert_select(logits, bias, k, n_group, topk_group, 2.5, True)
        ours = sigmoid_group(logits, bias, k=k, n_group=n_group, topk_group=topk_group,
                             routed_scaling_factor=2.5, norm_topk_prob=True, **kwargs)
        assert mx.array_equal(ref[0], ours[0]).item() and mx.array_equal(ref[1], ours[1]).item()


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
def test_sigmoid_group_matches_bailing(score_function):
    spec = spec_from_config({**quantized_config("bailing_moe"), "score_function": score_function})
    route = make_route_fn(spec)
    mx.random.seed(1)
    logits = (mx.random.normal((2, 9, 16)) * 3).astype(mx.bfloat16)
    bias = mx.random.normal((16,)) * 0.1
    r = spec.routing
    for b in (bias, None):
        ref = bailing_moe.group_expert_select(logits, b, r.k, r.n_group, r.topk_group, r.routed_scaling_factor,
                                              r.norm_topk_prob, score_function)
        ours = route(logits, b)
        assert mx.array_equal(ref[0], ours[0]).item() and mx.array_equal(ref[1], ours[1]).item()
        assert ours[1].dtype == mx.bfloat16


class Probe(nn.Module):
    """Stands in for switch_mlp: expert e's output is the one-hot e (width D >= E), so the
    block's output is the dense map expert -> combine weight."""

    def __call__(self, x, inds):
        d = x.shape[-1]
        return (inds[..., None] == mx.arange(d)).astype(x.dtype)


@pytest.mark.parametrize("family,block_attr", [("qwen3_moe", "mlp"), ("mixtral", "block_sparse_moe")])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_softmax_routing_matches_the_model_block(family, block_attr, dtype):
    cfg = quantized_config(family)
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(2)
    model = model_class(args_class.from_dict(cfg))
    block = model.model.layers[1][block_attr]
    block.gate.weight = mx.random.normal(block.gate.weight.shape)
    block.set_dtype(dtype)
    block.switch_mlp = Probe()
    x = mx.random.normal((2, 5, cfg["hidden_size"])).astype(dtype)
    dense_ref = block(x)
    inds, scores = make_route_fn(spec_from_config(cfg))(block.gate(x))
    dense = ((inds[..., None] == mx.arange(x.shape[-1])).astype(dtype) * scores[..., None]).sum(-2)
    assert mx.array_equal(dense_ref, dense.astype(dense_ref.dtype)).item()
    assert (dense_ref > 0).sum(-1).max().item() == cfg["num_experts_per_tok"]


def test_softmax_helpers_select_k():
    logits = mx.array([[0.1, 3.0, -1.0, 2.0, 0.5]])
    inds, scores = softmax_topk(logits, k=2, norm_topk_prob=True)
    assert sorted(inds.tolist()[0]) == [1, 3]
    assert abs(scores.sum().item() - 1.0) < 1e-6
    inds, scores = topk_softmax(logits, k=2)
    assert sorted(inds.tolist()[0]) == [1, 3] and abs(scores.sum().item() - 1.0) < 1e-6
