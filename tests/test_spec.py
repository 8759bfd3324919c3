"""The MoESpec Edge0 derives from mlx-lm's own model, for every architecture."""

from __future__ import annotations

import pytest

from edge0.model.arch import NOT_STREAMABLE, derive_spec
from edge0.model.families import SUPPORTED_MODEL_TYPES
from edge0.backend import nn as bnn
from edge0.errors import ConfigError
from edge0.model.open import load_spec
from edge0.model.spec import load_config
from edge0.tiny import MIN_LAYERS, tiny_config
from tests.ckpt_tools import copy_model

# Architectures whose MoE block is the decoder layer itself (no module that routes on its
# own input): they stream on every path, without a prerouter.
NO_PREROUTER = {"gemma4_text", "gemma4", "gemma4_unified"}


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_spec_matches_the_model(model_type):
    """Layers with an expert stack, its expert count, k and the router, checked against the
    model mlx-lm builds for the config (a skeleton: nothing is evaluated)."""
    layers = max(4, MIN_LAYERS.get(model_type, 1))
    config = tiny_config(model_type, layers=layers, experts=16, k=3)
    model = bnn.build_model(config)
    spec = derive_spec(model, config)
    with_stack = tuple(i for i in range(spec.num_layers)
                       if any(bnn.is_switch(m) for _, m in bnn.module_at(model, f"{spec.layer_prefix}{i}")
                              .named_modules()))
    assert spec.moe_layers == with_stack and with_stack
    expected_k = 1 if model_type == "llama4" else 3  # llama4 routes one expert per token
    assert spec.k == expected_k and spec.num_experts == 16
    for layer in spec.moe_layers:
        m = spec.layers[layer]
        assert bnn.is_switch(bnn.module_at(model, m.switch_path))
        assert bnn.switch_experts(bnn.module_at(model, m.switch_path)) == 16
        assert m.switch_path.startswith(m.block_path + ".")
        router = bnn.module_at(model, m.router_path)
        assert router is not None and m.router_path.startswith(m.block_path + ".")
        assert m.router_outputs >= 16 and router["weight"].shape[0] == m.router_outputs
    assert (spec.prerouter_problem is not None) == (model_type in NO_PREROUTER)


def test_expert_keys(tiny_model_factory):
    spec = load_spec(tiny_model_factory("qwen3_5_moe"))
    assert spec.switch_path(2) == "language_model.model.layers.2.mlp.switch_mlp"
    assert spec.is_expert_key("language_model.model.layers.0.mlp.switch_mlp.up_proj.weight")
    assert not spec.is_expert_key("language_model.model.layers.0.mlp.shared_expert.up_proj.weight")
    assert not spec.is_expert_key("language_model.model.layers.0.mlp.gate.weight")


def test_quantization_is_read(tiny_model):
    spec = load_spec(tiny_model)
    assert spec.quant.bits == 4 and spec.quant.group_size == 64 and spec.quant.mode == "affine"


@pytest.mark.parametrize("family,change,match", [
    ("qwen3_moe", dict(num_experts_per_tok=0), r"field 'num_experts_per_tok' must be at least 1, got 0"),
    ("qwen3_moe", dict(num_experts_per_tok=17), r"qwen3_moe MoE block cannot route a token .* invalid kth"),
    ("qwen3_moe", dict(num_experts=-1), "field 'num_experts' must not be negative, got -1"),
    ("qwen3_moe", dict(num_experts="16"), "field 'num_experts' must be an integer, got '16'"),
    ("qwen3_moe", dict(quantization={"group_size": 64, "bits": 7}), "quantization.bits must be one of"),
    ("qwen3_moe", dict(quantization={"group_size": 64, "bits": 4, "mode": "mxfp4"}),
     "quantization.mode must be one of affine, got 'mxfp4'"),
    ("deepseek_v3", dict(n_group=3), r"deepseek_v3 MoE block cannot route a token .* \(3,5\)"),
])
def test_bad_config_values(tiny_model_factory, tmp_path, family, change, match):
    bad = copy_model(tiny_model_factory(family), tmp_path / "m", config=lambda c: c.update(change))
    with pytest.raises(ConfigError, match=match):
        load_spec(bad)


def test_unquantized_checkpoint_is_refused(tiny_model_factory, tmp_path):
    bad = copy_model(tiny_model_factory("qwen3_moe"), tmp_path / "m", config=lambda c: c.pop("quantization"))
    with pytest.raises(ConfigError, match="is not quantized"):
        load_spec(bad)


def test_not_streamable_types_name_their_reason():
    assert set(NOT_STREAMABLE) == {"muse_spark", "dbrx"}
    assert not set(NOT_STREAMABLE) & set(SUPPORTED_MODEL_TYPES)


def test_experts_per_token_override(tiny_model_factory):
    d = tiny_model_factory("mixtral")
    assert load_spec(d).k == 4 and load_spec(d, experts_per_token=2).k == 2
    assert load_config(d)["num_experts_per_tok"] == 4
