"""The six families Edge0 first supported, with the exact shapes the tests were written
for (their configs must not change: fixed checkpoints and measured numbers depend on them).

Derived sizes: attention head_dim 32 (``hidden // 32`` heads, half as many KV heads), dense
/ first-layer MLP intermediate ``2 * moe_intermediate``, shared experts ``moe_intermediate``
wide. For the MLA families: ``max(2, hidden // 64)`` heads, q_lora_rank = kv_lora_rank =
qk_nope_head_dim = v_head_dim = 64, qk_rope_head_dim = 32.
"""

from __future__ import annotations

from edge0.tiny.tokenizer import EOS_TOKEN_ID

# Families with sigmoid group routing (n_group / topk_group).
GROUPED = ("deepseek_v3", "glm4_moe_lite", "bailing_moe")
N_GROUP = 4
TOPK_GROUP = 2
HEAD_DIM = 32


def check_groups(family: str, experts: int, k: int) -> None:
    if family not in GROUPED:
        return
    if experts % N_GROUP or experts // N_GROUP < 2:
        raise ValueError(f"experts={experts} must be divisible by n_group={N_GROUP} with at least 2 experts per "
                         f"group for {family}")
    if k > (experts // N_GROUP) * TOPK_GROUP:
        raise ValueError(f"k={k} exceeds the experts reachable through topk_group={TOPK_GROUP} groups of "
                         f"{experts // N_GROUP}")


def _common(s: dict) -> dict:
    return {"eos_token_id": EOS_TOKEN_ID, "tie_word_embeddings": False, "max_position_embeddings": 4096,
            "vocab_size": s["vocab"], "hidden_size": s["hidden"], "num_hidden_layers": s["layers"],
            "hidden_act": "silu", "torch_dtype": "bfloat16"}


def _heads(s: dict) -> tuple[int, int]:
    heads = s["hidden"] // HEAD_DIM
    return heads, max(1, heads // 2)


def qwen3_moe(s: dict) -> dict:
    heads, kv = _heads(s)
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **_common(s),
            "intermediate_size": 2 * s["moe"], "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": HEAD_DIM, "num_experts": s["experts"], "num_experts_per_tok": s["k"],
            "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": s["moe"],
            "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
            "attention_bias": False}


def qwen3_5_moe(s: dict) -> dict:
    heads, kv = _heads(s)
    interval = 2
    text = {"model_type": "qwen3_5_moe_text", **_common(s), "intermediate_size": 2 * s["moe"],
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
            "attention_bias": False, "full_attention_interval": interval,
            "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                            for i in range(s["layers"])],
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
            "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": s["experts"],
            "num_experts_per_tok": s["k"], "moe_intermediate_size": s["moe"],
            "shared_expert_intermediate_size": s["moe"], "norm_topk_prob": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                "mrope_interleaved": True, "mrope_section": [11, 11, 10]}}
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "eos_token_id": EOS_TOKEN_ID, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "text_config": text}


def mixtral(s: dict) -> dict:
    heads, kv = _heads(s)
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **_common(s),
            "intermediate_size": s["moe"],  # mixtral's experts are ``intermediate_size`` wide
            "num_attention_heads": heads, "num_key_value_heads": kv, "num_local_experts": s["experts"],
            "num_experts_per_tok": s["k"], "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None}


def _mla_family(family: str, s: dict) -> dict:
    heads = max(2, s["hidden"] // 64)
    v3 = family == "deepseek_v3"
    cfg = {"architectures": ["DeepseekV3ForCausalLM" if v3 else "Glm4MoeLiteForCausalLM"], "model_type": family,
           **_common(s), "intermediate_size": 2 * s["moe"], "moe_intermediate_size": s["moe"],
           "num_attention_heads": heads, "num_key_value_heads": heads, "n_shared_experts": 1,
           "n_routed_experts": s["experts"], "num_experts_per_tok": s["k"],
           "routed_scaling_factor": 2.5 if v3 else 1.8, "q_lora_rank": 64, "kv_lora_rank": 64,
           "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "topk_method": "noaux_tc",
           "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": N_GROUP, "topk_group": TOPK_GROUP,
           "moe_layer_freq": 1, "first_k_dense_replace": 1, "num_nextn_predict_layers": 0,
           "rms_norm_eps": 1e-6 if v3 else 1e-5, "rope_theta": 10000.0 if v3 else 1000000.0, "rope_scaling": None,
           "attention_bias": False}
    if not v3:
        cfg["partial_rotary_factor"] = 1.0
    return cfg


def bailing_moe(s: dict) -> dict:
    heads, kv = _heads(s)
    return {"architectures": ["BailingMoeForCausalLM"], "model_type": "bailing_moe", **_common(s),
            "intermediate_size": 2 * s["moe"], "moe_intermediate_size": s["moe"],
            "moe_shared_expert_intermediate_size": s["moe"], "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": HEAD_DIM, "num_experts": s["experts"], "num_experts_per_tok": s["k"],
            "num_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
            "score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_enable_routed_scaling": True, "routed_scaling_factor": 2.5, "n_group": N_GROUP,
            "topk_group": TOPK_GROUP, "use_bias": False, "use_qkv_bias": False, "use_qk_norm": True,
            # norm_head=True makes sanitize renormalise lm_head.weight on every load, which
            # zeroes a quantized (uint32) lm_head: keep it off.
            "norm_head": False, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-6, "rope_theta": 600000.0}


CLASSIC_BUILDERS = {
    "qwen3_moe": qwen3_moe,
    "qwen3_5_moe": qwen3_5_moe,
    "mixtral": mixtral,
    "deepseek_v3": lambda s: _mla_family("deepseek_v3", s),
    "bailing_moe": bailing_moe,
    "glm4_moe_lite": lambda s: _mla_family("glm4_moe_lite", s),
}
CLASSIC = tuple(CLASSIC_BUILDERS)
# at least one layer of each kind: dense first layer + MoE, or linear + full attention
CLASSIC_MIN_LAYERS = {"deepseek_v3": 2, "glm4_moe_lite": 2, "bailing_moe": 2, "qwen3_5_moe": 2}
