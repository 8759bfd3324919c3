"""MoESpec from config.json agrees with mlx-lm's own model classes."""

from __future__ import annotations

import pytest
from mlx_lm.utils import _get_classes

from edge0.backend import nn as bnn
from edge0.errors import ConfigError
from edge0.spec import SigmoidGroup, SoftmaxTopK, load_config, load_spec, spec_from_config


def test_spec_matches_model_class(tiny_model):
    config = load_config(tiny_model)
    spec = load_spec(tiny_model)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    moe = tuple(i for i in range(spec.num_layers)
                if (b := bnn.module_at(model, spec.block_path(i))) is not None and "switch_mlp" in b)
    assert moe == spec.moe_layers and moe
    block = bnn.module_at(model, spec.block_path(moe[0]))
    assert block.switch_mlp.up_proj.weight.shape == (spec.num_experts, spec.moe_intermediate_size, spec.hidden_size)
    for child in spec.resident_children:
        assert child in block, child
    assert spec.quant.bits == 4 and spec.quant.group_size == 64
    family = {"qwen3_moe": SoftmaxTopK, "qwen3_5_moe": SoftmaxTopK, "mixtral": SoftmaxTopK}.get(
        spec.model_type, SigmoidGroup)
    assert isinstance(spec.routing, family) and spec.routing.k == spec.k


def test_expert_keys(tiny_model_factory):
    spec = load_spec(tiny_model_factory("qwen3_5_moe"))
    assert spec.expert_key(2, "down_proj", "scales") == "language_model.model.layers.2.mlp.switch_mlp.down_proj.scales"
    assert spec.is_expert_key("language_model.model.layers.0.mlp.switch_mlp.up_proj.weight")
    assert not spec.is_expert_key("language_model.model.layers.0.mlp.shared_expert.up_proj.weight")


@pytest.mark.parametrize("change,match", [
    (dict(num_experts_per_tok=0), r"num_experts_per_tok must be in 1..16, got 0"),
    (dict(num_experts_per_tok=17), r"num_experts_per_tok must be in 1..16, got 17"),
    (dict(num_experts=-1), "'num_experts' must be a non-negative integer, got -1"),
    (dict(num_experts="16"), "'num_experts' must be a non-negative integer, got '16'"),
    (dict(quantization={"group_size": 64, "bits": 7}), "quantization.bits must be one of"),
    (dict(quantization={"group_size": 64, "bits": 4, "mode": "mxfp4"}), "mode 'mxfp4' is not supported"),
])
def test_bad_config_values(tiny_model_factory, change, match):
    config = {**load_config(tiny_model_factory("qwen3_moe")), **change}
    with pytest.raises(ConfigError, match=match):
        spec_from_config(config)


def test_bad_group_routing(tiny_model_factory):
    config = load_config(tiny_model_factory("deepseek_v3"))
    with pytest.raises(ConfigError, match="n_group 3 must divide the expert count 16"):
        spec_from_config({**config, "n_group": 3})
    with pytest.raises(ConfigError, match=r"topk_group must be in 1..n_group=4, got 5"):
        spec_from_config({**config, "topk_group": 5})
