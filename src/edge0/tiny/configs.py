"""config.json of a tiny checkpoint, for every architecture Edge0 streams.

``tiny_config(model_type, layers=, experts=, k=, hidden=, moe_intermediate=,
vocab_size=)`` builds a complete config (before quantization) that mlx-lm's own class for
that model type accepts. The first six families (``edge0.tiny.classic``) keep their exact
shapes (tests depend on them); every other architecture has a builder below that fills its
own fields (attention layout, layer patterns of hybrid models, routing
parameters) around the shared shape. ``ARCHITECTURES`` is the list the test suite runs
and the table of docs/MODELS.md shows.
"""

from __future__ import annotations

from typing import Any, Callable

from edge0.model.families import SUPPORTED_MODEL_TYPES
from edge0.tiny.tokenizer import DEFAULT_VOCAB, EOS_TOKEN_ID

GROUP_SIZE = 64
BITS = 4

from edge0.tiny.classic import CLASSIC, CLASSIC_BUILDERS, CLASSIC_MIN_LAYERS, N_GROUP, TOPK_GROUP, check_groups  # noqa: F401 (CLASSIC: re-exported)


def _check_family(family: str) -> None:
    if family not in ARCHITECTURES:
        raise ValueError(f"unknown model type {family!r}; tiny checkpoints exist for: {', '.join(ARCHITECTURES)}")


def _mult64(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0 or value % GROUP_SIZE:
        raise ValueError(
            f"{name}={value!r} must be a positive multiple of {GROUP_SIZE} "
            "(quantized input dims need whole groups)"
        )


def _apply_overrides(family: str, cfg: dict, overrides: dict[str, Any]) -> None:
    """Raw config keys: where the config nests a text_config, they go into it unless they
    are top-level keys already."""
    for key, value in overrides.items():
        if not isinstance(cfg.get("text_config"), dict):
            cfg[key] = value
            continue
        text = cfg["text_config"]
        if key in cfg:
            cfg[key] = value
        if key in text or key not in cfg:
            text[key] = value
        if key == "full_attention_interval":
            text["layer_types"] = [
                "full_attention" if (i + 1) % value == 0 else "linear_attention"
                for i in range(text["num_hidden_layers"])
            ]


# --------------------------------------------------------------------------
# every other architecture: one builder each, from the shared shape
# --------------------------------------------------------------------------


def _common(s: dict) -> dict:
    return {"eos_token_id": EOS_TOKEN_ID, "tie_word_embeddings": False, "max_position_embeddings": 4096,
            "vocab_size": s["vocab"], "hidden_size": s["hidden"], "num_hidden_layers": s["layers"],
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16"}


def _attn(s: dict) -> dict:
    heads = s["hidden"] // 32
    return {"num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "head_dim": 32}


def _mla(s: dict) -> dict:
    heads = max(2, s["hidden"] // 64)
    return {"num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": 64, "kv_lora_rank": 64,
            "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64}


def _groups(s: dict) -> dict:
    return {"n_group": N_GROUP, "topk_group": TOPK_GROUP} if s["experts"] % N_GROUP == 0 else \
        {"n_group": 1, "topk_group": 1}


def _pattern(s: dict, first: str, rest: str, every: int = 2) -> list[str]:
    """Layer kinds: ``rest`` at every ``every``-th layer, ``first`` elsewhere."""
    return [rest if (i + 1) % every == 0 else first for i in range(s["layers"])]


def _deepseek_family(model_type: str, s: dict, **extra) -> dict:
    return {"model_type": model_type, **_common(s), **_mla(s), "intermediate_size": 2 * s["moe"],
            "moe_intermediate_size": s["moe"], "n_shared_experts": 1, "n_routed_experts": s["experts"],
            "num_experts_per_tok": s["k"], "routed_scaling_factor": 2.5, "norm_topk_prob": True,
            "moe_layer_freq": 1, "first_k_dense_replace": 1, "rope_scaling": None, "attention_bias": False,
            **_groups(s), **extra}


BUILDERS: dict[str, Callable[[dict], dict]] = {
    "phimoe": lambda s: {"model_type": "phimoe", **_common(s), **_attn(s), "intermediate_size": s["moe"],
                         "num_local_experts": s["experts"], "num_experts_per_tok": s["k"], "rope_scaling": None},
    "phixtral": lambda s: {"model_type": "phixtral", "num_vocab": s["vocab"], "model_dim": s["hidden"],
                           "num_heads": s["hidden"] // 32, "num_layers": s["layers"], "rotary_dim": 16,
                           "num_local_experts": s["experts"], "num_experts_per_tok": s["k"],
                           "eos_token_id": EOS_TOKEN_ID},
    "olmoe": lambda s: {"model_type": "olmoe", **_common(s), **_attn(s), "intermediate_size": s["moe"],
                        "num_experts": s["experts"], "num_experts_per_tok": s["k"], "norm_topk_prob": False},
    "qwen2_moe": lambda s: {"model_type": "qwen2_moe", **_common(s), **_attn(s), "intermediate_size": 2 * s["moe"],
                            "num_experts": s["experts"], "num_experts_per_tok": s["k"],
                            "moe_intermediate_size": s["moe"], "shared_expert_intermediate_size": s["moe"]},
    "qwen3_next": lambda s: {"model_type": "qwen3_next", **_common(s), **_attn(s),
                             "intermediate_size": 2 * s["moe"], "linear_num_value_heads": 4,
                             "linear_num_key_heads": 2, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
                             "linear_conv_kernel_dim": 4, "num_experts": s["experts"],
                             "num_experts_per_tok": s["k"], "decoder_sparse_step": 1,
                             "shared_expert_intermediate_size": s["moe"], "mlp_only_layers": [],
                             "moe_intermediate_size": s["moe"], "partial_rotary_factor": 0.25,
                             "norm_topk_prob": True, "full_attention_interval": 2},
    "deepseek": lambda s: {"model_type": "deepseek", **_common(s), **_attn(s), "intermediate_size": 2 * s["moe"],
                           "moe_intermediate_size": s["moe"], "n_shared_experts": 1,
                           "n_routed_experts": s["experts"], "num_experts_per_tok": s["k"], "moe_layer_freq": 1,
                           "first_k_dense_replace": 1},
    "deepseek_v2": lambda s: _deepseek_family(
        "deepseek_v2", s, topk_method="group_limited_greedy", routed_scaling_factor=1.0,
        rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.0}),
    "deepseek_v32": lambda s: _deepseek_family("deepseek_v32", s, topk_method="noaux_tc", scoring_func="sigmoid",
                                               index_head_dim=32, index_n_heads=4, index_topk=16,
                                               indexer_rope_interleave=False),
    "glm4_moe": lambda s: {"model_type": "glm4_moe", **_common(s), **_attn(s), "intermediate_size": 2 * s["moe"],
                           "moe_intermediate_size": s["moe"], "norm_topk_prob": True, "n_shared_experts": 1,
                           "n_routed_experts": s["experts"], "routed_scaling_factor": 2.5,
                           "num_experts_per_tok": s["k"], "first_k_dense_replace": 1, "rope_scaling": None,
                           "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5,
                           **_groups(s)},
    "dots1": lambda s: {"model_type": "dots1", **_common(s), **_attn(s), "intermediate_size": 2 * s["moe"],
                        "first_k_dense_replace": 1, "moe_intermediate_size": s["moe"],
                        "n_routed_experts": s["experts"], "n_shared_experts": 1, "norm_topk_prob": True,
                        "num_experts_per_tok": s["k"], "routed_scaling_factor": 2.5, **_groups(s)},
    "Klear": lambda s: {"model_type": "Klear", **_common(s), **_attn(s), "intermediate_size": 2 * s["moe"],
                        "attention_bias": False, "mlp_only_layers": [], "num_experts": s["experts"],
                        "num_experts_per_tok": s["k"], "decoder_sparse_step": 1, "n_shared_experts": 1,
                        "moe_intermediate_size": s["moe"], "norm_topk_prob": True},
    "afmoe": lambda s: {"model_type": "afmoe", **_common(s), **_attn(s), "intermediate_size": 2 * s["moe"],
                        "layer_types": _pattern(s, "full_attention", "sliding_attention"),
                        "moe_intermediate_size": s["moe"], "num_experts": s["experts"],
                        "num_experts_per_tok": s["k"], "num_shared_experts": 1, "num_dense_layers": 1,
                        "sliding_window": 16, "n_group": 1, "topk_group": 1},
    "ernie4_5_moe": lambda s: {"model_type": "ernie4_5_moe", **_common(s), **_attn(s),
                               "intermediate_size": 2 * s["moe"], "use_bias": False,
                               "moe_num_experts": s["experts"], "moe_layer_start_index": 1,
                               "moe_intermediate_size": s["moe"], "moe_k": s["k"], "moe_layer_interval": 1,
                               "moe_num_shared_experts": 1},
    "exaone_moe": lambda s: {"model_type": "exaone_moe", **_common(s), **_attn(s), "intermediate_size": 2 * s["moe"],
                             "moe_intermediate_size": s["moe"], "num_experts": s["experts"],
                             "num_experts_per_tok": s["k"], "num_shared_experts": 1, "sliding_window": 16,
                             "layer_types": _pattern(s, "sliding_attention", "full_attention"),
                             "is_moe_layer": [i > 0 for i in range(s["layers"])], "n_group": 1, "topk_group": 1},
    "gemma4_text": lambda s: {"model_type": "gemma4_text", **_common(s), "num_attention_heads": 4, "head_dim": 32,
                              "global_head_dim": 32, "num_key_value_heads": 1, "num_kv_shared_layers": 0,
                              "hidden_size_per_layer_input": 0, "intermediate_size": 2 * s["moe"],
                              "vocab_size_per_layer_input": s["vocab"], "sliding_window": 16,
                              "sliding_window_pattern": 2, "use_double_wide_mlp": False, "enable_moe_block": True,
                              "num_experts": s["experts"], "top_k_experts": s["k"],
                              "moe_intermediate_size": s["moe"]},
    "gpt_oss": lambda s: {"model_type": "gpt_oss", **_common(s), **_attn(s), "num_local_experts": s["experts"],
                          "num_experts_per_tok": s["k"], "intermediate_size": s["moe"], "sliding_window": 16,
                          "layer_types": _pattern(s, "sliding_attention", "full_attention")},
    "granitemoe": lambda s: {"model_type": "granitemoe", **_common(s), **_attn(s), "intermediate_size": s["moe"],
                             "logits_scaling": 4.0, "attention_multiplier": 0.03125, "embedding_multiplier": 12.0,
                             "residual_multiplier": 0.22, "attention_bias": False,
                             "num_local_experts": s["experts"], "num_experts_per_tok": s["k"]},
    "granitemoehybrid": lambda s: {"model_type": "granitemoehybrid", **_common(s), **_attn(s),
                                   "intermediate_size": s["moe"], "attention_bias": False,
                                   "embedding_multiplier": 12.0, "attention_multiplier": 0.03125,
                                   "logits_scaling": 4.0, "residual_multiplier": 0.22,
                                   "layer_types": _pattern(s, "mamba", "attention"),
                                   "num_local_experts": s["experts"], "num_experts_per_tok": s["k"],
                                   "shared_intermediate_size": s["moe"], "mamba_n_heads": 2 * s["hidden"] // 32,
                                   "mamba_d_head": 32, "mamba_expand": 2,
                                   "mamba_proj_bias": False, "mamba_d_state": 16, "mamba_d_conv": 4,
                                   "mamba_n_groups": 1, "mamba_conv_bias": True, "position_embedding_type": "rope"},
    "hunyuan": lambda s: {"model_type": "hunyuan", **_common(s), **_attn(s), "intermediate_size": s["moe"],
                          "attention_bias": False, "moe_topk": s["k"], "num_experts": s["experts"],
                          "num_shared_expert": 1, "use_mixed_mlp_moe": True, "use_qk_norm": True,
                          "use_cla": False, "cla_share_factor": 2, "moe_intermediate_size": s["moe"],
                          "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    "jamba": lambda s: {"model_type": "jamba", **_common(s), **_attn(s), "intermediate_size": s["moe"],
                        "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
                        "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2,
                        "num_experts": s["experts"], "num_experts_per_tok": s["k"]},
    "kimi_linear": lambda s: {"model_type": "kimi_linear", **_common(s), "num_attention_heads": 4,
                              "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 2 * s["moe"],
                              "linear_attn_config": {"kda_layers": [i + 1 for i in range(s["layers"]) if i % 2 == 0],
                                                     "full_attn_layers": [i + 1 for i in range(s["layers"])
                                                                          if i % 2 == 1],
                                                     "num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4},
                              "model_max_length": 4096, "num_experts": s["experts"],
                              "moe_intermediate_size": s["moe"], "kv_lora_rank": 32, "qk_nope_head_dim": 32,
                              "qk_rope_head_dim": 16, "v_head_dim": 32, "mla_use_nope": True,
                              "num_experts_per_token": s["k"], "num_shared_experts": 1,
                              "routed_scaling_factor": 2.0, "first_k_dense_replace": 1, "num_expert_group": 1,
                              "topk_group": 1},
    "laguna": lambda s: {"model_type": "laguna", **_common(s), **_attn(s), "intermediate_size": 2 * s["moe"],
                         "layer_types": _pattern(s, "full_attention", "sliding_attention"), "sliding_window": 16,
                         "num_experts": s["experts"], "num_experts_per_tok": s["k"], "moe_intermediate_size": s["moe"],
                         "shared_expert_intermediate_size": s["moe"], "moe_routed_scaling_factor": 2.0,
                         "moe_router_logit_softcapping": 30.0},
    "lfm2_moe": lambda s: {"model_type": "lfm2_moe", **_common(s), **_attn(s), "intermediate_size": 2 * s["moe"],
                           "moe_intermediate_size": s["moe"], "num_experts": s["experts"],
                           "num_experts_per_tok": s["k"], "norm_topk_prob": True, "use_expert_bias": True,
                           "num_dense_layers": 1, "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3,
                           "layer_types": _pattern(s, "conv", "full_attention")},
    "llama4": lambda s: {"model_type": "llama4", "eos_token_id": EOS_TOKEN_ID, "text_config": {
        "model_type": "llama4_text", **_common(s), **_attn(s), "attention_bias": False, "attention_chunk_size": 16,
        "interleave_moe_layer_step": 2, "intermediate_size": s["moe"], "intermediate_size_mlp": 2 * s["moe"],
        "num_experts_per_tok": 1, "num_local_experts": s["experts"], "rope_scaling": None, "use_qk_norm": True}},
    "longcat_flash": lambda s: {"model_type": "longcat_flash", **_common(s), "attention_method": "MLA",
                                "zero_expert_type": "identity", "ffn_hidden_size": 2 * s["moe"], "moe_topk": s["k"],
                                "expert_ffn_hidden_size": s["moe"], "n_routed_experts": s["experts"],
                                "zero_expert_num": 2, "num_layers": s["layers"], "num_attention_heads": 4,
                                "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16,
                                "qk_nope_head_dim": 32, "v_head_dim": 32, "routed_scaling_factor": 1.0,
                                "mla_scale_q_lora": True, "mla_scale_kv_lora": True, "attention_bias": False,
                                "norm_topk_prob": False, "router_bias": False},
    "mellum": lambda s: {"model_type": "mellum", **_common(s), **_attn(s), "intermediate_size": 2 * s["moe"],
                         "num_experts": s["experts"], "num_experts_per_tok": s["k"], "moe_intermediate_size": s["moe"],
                         "norm_topk_prob": True, "sliding_window": 16,
                         "layer_types": _pattern(s, "full_attention", "sliding_attention"),
                         "rope_parameters": {"full_attention": {"rope_theta": 10000.0},
                                             "sliding_attention": {"rope_theta": 10000.0}}},
    "mimo_v2_flash": lambda s: {"model_type": "mimo_v2_flash", **_common(s), "num_experts_per_tok": s["k"],
                                "hybrid_layer_pattern": [i % 2 for i in range(s["layers"])],
                                "moe_layer_freq": [int(i > 0) for i in range(s["layers"])],
                                "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
                                "sliding_window_size": 16, "intermediate_size": 2 * s["moe"],
                                "moe_intermediate_size": s["moe"], "num_attention_heads": 4,
                                "num_key_value_heads": 2, "n_shared_experts": None,
                                "n_routed_experts": s["experts"], "routed_scaling_factor": None,
                                "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
                                "n_group": 1, "topk_group": 1, "layernorm_epsilon": 1e-5,
                                "swa_rope_theta": 10000.0, "swa_num_attention_heads": 4,
                                "swa_num_key_value_heads": 2, "head_dim": 32, "v_head_dim": 16,
                                "swa_head_dim": 32, "swa_v_head_dim": 16, "partial_rotary_factor": 0.5},
    "minimax": lambda s: {"model_type": "minimax", **_common(s), **_attn(s), "intermediate_size": s["moe"],
                          "num_experts_per_tok": s["k"], "num_local_experts": s["experts"],
                          "shared_intermediate_size": 0, "rotary_dim": 16, "use_qk_norm": True},
    "mistral4": lambda s: {"model_type": "mistral4", **_common(s), **_mla(s), "intermediate_size": 2 * s["moe"],
                           "moe_intermediate_size": s["moe"], "n_shared_experts": 1,
                           "n_routed_experts": s["experts"], "routed_scaling_factor": 1.0, "norm_topk_prob": True,
                           "topk_group": 1, "n_group": 1, "num_experts_per_tok": s["k"], "first_k_dense_replace": 1,
                           "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0,
                                               "original_max_position_embeddings": 4096, "beta_fast": 32,
                                               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                               "llama_4_scaling_beta": 0.1}},
    "nemotron_h": lambda s: {"model_type": "nemotron_h", **_common(s), **_attn(s), "intermediate_size": 2 * s["moe"],
                             "attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": 32,
                             "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1,
                             "mlp_bias": False, "layer_norm_epsilon": 1e-5, "use_bias": False,
                             "use_conv_bias": True,
                             "hybrid_override_pattern": ["M" if i % 4 == 0 else "*" if i % 4 == 2 else "E"
                                                         for i in range(s["layers"])],
                             "moe_intermediate_size": s["moe"], "moe_shared_expert_intermediate_size": s["moe"],
                             "n_group": 1, "n_routed_experts": s["experts"], "n_shared_experts": 1, "topk_group": 1,
                             "num_experts_per_tok": s["k"], "norm_topk_prob": True, "routed_scaling_factor": 2.5},
    "step3p5": lambda s: {"model_type": "step3p5", **_common(s), "num_attention_heads": 4,
                          "num_attention_groups": 2, "head_dim": 32, "intermediate_size": 2 * s["moe"],
                          "layer_types": _pattern(s, "full_attention", "sliding_attention"), "sliding_window": 16,
                          "moe_num_experts": s["experts"], "moe_top_k": s["k"], "moe_intermediate_size": s["moe"],
                          "share_expert_dim": s["moe"], "swiglu_limits": [0] + [7.0] * (s["layers"] - 1),
                          "swiglu_limits_shared": [0] + [16.0] * (s["layers"] - 1)},
    "bailing_moe_linear": lambda s: {"model_type": "bailing_moe_linear", **_common(s), "num_attention_heads": 4,
                                     "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 2 * s["moe"],
                                     "moe_intermediate_size": s["moe"], "num_experts": s["experts"],
                                     "num_shared_experts": 1, "norm_topk_prob": True, "num_experts_per_tok": s["k"],
                                     "first_k_dense_replace": 1, "layer_group_size": 2, "group_norm_size": 1,
                                     "score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                                     **_groups(s)},
    "bailing_hybrid": lambda s: {"model_type": "bailing_hybrid", **_common(s), "num_attention_heads": 4,
                                 "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 2 * s["moe"],
                                 "moe_intermediate_size": s["moe"], "num_experts": s["experts"],
                                 "num_experts_per_tok": s["k"], "num_shared_experts": 1, "first_k_dense_replace": 1,
                                 "layer_group_size": 2, "group_norm_size": 1, "routed_scaling_factor": 2.5,
                                 "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
                                 "q_lora_rank": 32, **_groups(s)},
}


def _text_of(model_type: str, inner: str, s: dict, text_extra: dict | None = None, **extra) -> dict:
    """A wrapper config (vision-language models, aliases with a nested text model) whose
    ``text_config`` is the tiny ``inner`` model; mlx-lm builds its language model only."""
    text = _builder(inner)(s)
    text.pop("architectures", None)
    text.update(text_extra or {})
    return {"model_type": model_type, "eos_token_id": EOS_TOKEN_ID, "vocab_size": s["vocab"],
            "text_config": text, **extra}


def _builder(model_type: str) -> Callable[[dict], dict]:
    return CLASSIC_BUILDERS.get(model_type) or BUILDERS[model_type]


def _renamed(model_type: str, inner: str):
    """An mlx-lm alias (or a sibling file taking the same config): another model type name
    over the same builder."""
    return lambda s: {**_builder(inner)(s), "model_type": model_type}


BUILDERS.update({
    # aliases mlx-lm maps onto another model file
    "phi-msft": _renamed("phi-msft", "phixtral"),
    "minimax_m2": _renamed("minimax_m2", "minimax"),
    "deepseek_v41_text": _renamed("deepseek_v41_text", "deepseek_v41"),
    "kimi_k2": _renamed("kimi_k2", "deepseek_v3"),
    "joyai_llm_flash": _renamed("joyai_llm_flash", "deepseek_v3"),
    # model files of their own, built around a sibling's MoE block
    "glm_moe_dsa": lambda s: _deepseek_family("glm_moe_dsa", s, topk_method="noaux_tc", scoring_func="sigmoid",
                                              index_head_dim=32, index_n_heads=4, index_topk=16,
                                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "solar_open": lambda s: {"model_type": "solar_open", **_common(s), **_attn(s), "intermediate_size": 2 * s["moe"],
                             "moe_intermediate_size": s["moe"], "n_shared_experts": 1,
                             "n_routed_experts": s["experts"], "routed_scaling_factor": 1.0,
                             "num_experts_per_tok": s["k"], "first_k_dense_replace": 1, "norm_topk_prob": True,
                             "partial_rotary_factor": 1.0},
    "longcat_flash_ngram": lambda s: {**BUILDERS["longcat_flash"](s), "model_type": "longcat_flash_ngram",
                                      "ngram_vocab_size_ratio": 2, "emb_neighbor_num": 3, "emb_split_num": 2},
    # wrappers whose language model is another model type's
    "qwen3_vl_moe": lambda s: _text_of("qwen3_vl_moe", "qwen3_moe", s),
    "qwen3_5": _renamed("qwen3_5", "qwen3_5_moe"),
    "kimi_vl": lambda s: _text_of("kimi_vl", "deepseek_v3", s),
    "kimi_k25": lambda s: _text_of("kimi_k25", "deepseek_v3", s),
    "mistral3": lambda s: _text_of("mistral3", "mistral4", s),
    "llava": lambda s: _text_of("llava", "mistral4", s),
    "gemma4": lambda s: _text_of("gemma4", "gemma4_text", s),
    "gemma4_unified": lambda s: _text_of("gemma4_unified", "gemma4_text", s),
    "kimi_k3": lambda s: _text_of("kimi_k3", "kimi_linear", s, text_extra=dict(
        hidden_act="situ", q_lora_rank=None, routed_expert_hidden_size=s["moe"], latent_moe_use_norm=True)),
    "deepseek_v41": lambda s: {"model_type": "deepseek_v41", **_common(s), "num_attention_heads": 4, "head_dim": 64,
                               "q_lora_rank": 64, "qk_rope_head_dim": 16, "o_groups": 2, "o_lora_rank": 32,
                               "moe_intermediate_size": s["moe"], "n_routed_experts": s["experts"],
                               "num_experts_per_tok": s["k"], "sliding_window": 16, "compress_ratios": [],
                               "kv_source_layer_ids": [], "index_source_layer_ids": []},
    "minimax_m3_vl": lambda s: {"model_type": "minimax_m3_vl", "eos_token_id": EOS_TOKEN_ID, "text_config": {
        **_common(s), **_attn(s), "intermediate_size": s["moe"], "dense_intermediate_size": 2 * s["moe"],
        "shared_intermediate_size": s["moe"], "num_local_experts": s["experts"], "num_experts_per_tok": s["k"],
        "partial_rotary_factor": 0.5, "mlp_layer_types": ["dense"] + ["sparse"] * (s["layers"] - 1)}},
})

# smallest layer counts that exercise each builder's layer pattern
MIN_LAYERS = {"kimi_k3": 2, "minimax_m3_vl": 2, "gemma4": 1, "kimi_vl": 2, "kimi_k25": 2, "mistral3": 2,
              "llava": 2, "glm_moe_dsa": 2, "solar_open": 2, "qwen3_next": 2, "granitemoehybrid": 2, "jamba": 4, "kimi_linear": 2, "lfm2_moe": 2, "llama4": 4,
              "nemotron_h": 4, "bailing_moe_linear": 4, "bailing_hybrid": 4, "exaone_moe": 2, "step3p5": 2,
              "mimo_v2_flash": 2, "deepseek": 2, "deepseek_v2": 2, "deepseek_v32": 2, "glm4_moe": 2, "dots1": 2,
              "afmoe": 2, "ernie4_5_moe": 2, "laguna": 2, "mistral4": 2, "gpt_oss": 2}
MIN_LAYERS.update(CLASSIC_MIN_LAYERS)
# One list: a builder for every supported model type, in its order (tests/test_tiny.py).
ARCHITECTURES: tuple[str, ...] = SUPPORTED_MODEL_TYPES


def tiny_config(family: str, *, layers: int = 4, experts: int = 16, k: int = 4, hidden: int = 128,
                moe_intermediate: int = 64, vocab_size: int | None = None) -> dict:
    """A complete config.json dict (before quantization) of a tiny ``family`` model."""
    _check_family(family)
    _mult64("hidden", hidden)
    _mult64("moe_intermediate", moe_intermediate)
    vocab = DEFAULT_VOCAB if vocab_size is None else vocab_size
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 300:
        raise ValueError(f"vocab_size={vocab!r} must be an int >= 300")
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 2:
        raise ValueError(f"experts={experts!r} must be an int >= 2")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= experts:
        raise ValueError(f"k={k!r} must be in [1, experts={experts}]")
    least = MIN_LAYERS.get(family, 1)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < least:
        raise ValueError(f"layers={layers!r} must be an int >= {least} for {family}")
    check_groups(family, experts, k)
    cfg = _builder(family)(dict(layers=layers, experts=experts, k=k, hidden=hidden, moe=moe_intermediate,
                                vocab=vocab))
    cfg.setdefault("architectures", [])
    return cfg
