"""Smoke tests for edge0.tiny: random int4 MoE checkpoints in mlx-lm's own layout."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from edge0.tiny import (
    EOS_TOKEN_ID,
    FAMILIES,
    build_tokenizer,
    expert_usage,
    make_tiny,
    tiny_config,
)

E, K, HIDDEN, MOE_I, LAYERS = 16, 4, 128, 64, 4

# family -> (key prefix of decoder layers, name of the MoE block, MoE layer ids)
LAYOUT = {
    "qwen3_moe": ("model.layers", "mlp", [0, 1, 2, 3]),
    "qwen3_5_moe": ("language_model.model.layers", "mlp", [0, 1, 2, 3]),
    "mixtral": ("model.layers", "block_sparse_moe", [0, 1, 2, 3]),
    "deepseek_v3": ("model.layers", "mlp", [1, 2, 3]),
    "bailing_moe": ("model.layers", "mlp", [1, 2, 3]),
    "glm4_moe_lite": ("model.layers", "mlp", [1, 2, 3]),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            cache[family] = make_tiny(family, out, seed=0, overwrite=True)
        return cache[family]

    return get


def _weights(d: Path) -> dict[str, mx.array]:
    w = {}
    for f in sorted(d.glob("model*.safetensors")):
        w.update(mx.load(str(f)))
    return w


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_and_generates(built, family):
    import mlx_lm

    d = built(family)
    model, tokenizer = mlx_lm.load(str(d))
    text = mlx_lm.generate(model, tokenizer, prompt="def f(x):", max_tokens=8, verbose=False)
    assert isinstance(text, str)
    steps = list(mlx_lm.stream_generate(model, tokenizer, prompt="def f(x):", max_tokens=8))
    assert len(steps) == 8  # the EOS logit is muted, so greedy decoding runs to max_tokens
    assert EOS_TOKEN_ID in tokenizer.eos_token_ids

    # Routing is spread: every MoE layer uses at least half its experts.
    usage = expert_usage(model, n_tokens=64)
    prefix, block, moe_layers = LAYOUT[family]
    assert sorted(usage) == sorted(f"{prefix}.{i}.{block}.switch_mlp" for i in moe_layers)
    assert all(2 * n >= E for n in usage.values()), usage


@pytest.mark.parametrize("family", FAMILIES)
def test_config_and_expert_tensors(built, family):
    d = built(family)
    cfg = json.loads((d / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        q = cfg[key]
        assert q["group_size"] == 64 and q["bits"] == 4, q
    assert cfg["eos_token_id"] == EOS_TOKEN_ID
    assert (d / "model.safetensors.index.json").exists()
    text = cfg.get("text_config", cfg)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() <= text["vocab_size"]
    assert tok.token_to_id("<|endoftext|>") == EOS_TOKEN_ID

    w = _weights(d)
    prefix, block, moe_layers = LAYOUT[family]
    for i in moe_layers:
        for proj, (out_dim, in_dim) in {
            "gate_proj": (MOE_I, HIDDEN),
            "up_proj": (MOE_I, HIDDEN),
            "down_proj": (HIDDEN, MOE_I),
        }.items():
            base = f"{prefix}.{i}.{block}.switch_mlp.{proj}"
            assert w[f"{base}.weight"].dtype == mx.uint32
            assert w[f"{base}.weight"].shape == (E, out_dim, in_dim // 8)
            for part in ("scales", "biases"):
                assert w[f"{base}.{part}"].dtype == mx.bfloat16
                assert w[f"{base}.{part}"].shape == (E, out_dim, in_dim // 64)
    # dense layers carry no routed experts
    for i in set(range(LAYERS)) - set(moe_layers):
        assert not any(k.startswith(f"{prefix}.{i}.") and "switch_mlp" in k for k in w)

    # Routers, as mlx-lm saves them.
    i = moe_layers[0]
    mlp = f"{prefix}.{i}.{block}"
    if family in ("qwen3_moe", "qwen3_5_moe"):  # 8-bit gate via the model's quant_predicate
        assert w[f"{mlp}.gate.weight"].shape == (E, HIDDEN // 4)
        assert cfg["quantization"][f"{mlp}.gate"] == {"group_size": 64, "bits": 8}
        if family == "qwen3_5_moe":
            assert w[f"{mlp}.shared_expert_gate.weight"].shape == (1, HIDDEN // 4)
            assert f"{mlp}.shared_expert.gate_proj.weight" in w
    elif family == "mixtral":  # plain 4-bit gate
        assert w[f"{mlp}.gate.weight"].shape == (E, HIDDEN // 8)
    elif family == "bailing_moe":
        assert w[f"{mlp}.gate.gate_proj.weight"].shape == (E, HIDDEN // 4)
        assert w[f"{mlp}.gate.expert_bias"].dtype == mx.float32
        assert mx.any(w[f"{mlp}.gate.expert_bias"] != 0).item()
        assert f"{mlp}.shared_experts.gate_proj.weight" in w
    else:  # deepseek_v3, glm4_moe_lite: raw bf16 MoEGate + f32 correction bias
        assert w[f"{mlp}.gate.weight"].dtype == mx.bfloat16
        assert w[f"{mlp}.gate.weight"].shape == (E, HIDDEN)
        assert mx.any(w[f"{mlp}.gate.weight"] != 0).item()
        assert w[f"{mlp}.gate.e_score_correction_bias"].dtype == mx.float32
        assert mx.any(w[f"{mlp}.gate.e_score_correction_bias"] != 0).item()
        assert f"{mlp}.shared_experts.gate_proj.weight" in w
        assert f"{prefix}.{i}.self_attn.embed_q.scales" in w  # MLA absorbed heads, int4


def test_qwen3_5_is_hybrid(built):
    w = _weights(built("qwen3_5_moe"))
    assert "language_model.model.layers.0.linear_attn.in_proj_qkv.weight" in w
    assert "language_model.model.layers.1.self_attn.q_proj.weight" in w
    assert w["language_model.model.layers.0.linear_attn.A_log"].dtype == mx.float32


def test_deterministic(tmp_path):
    a = make_tiny("qwen3_moe", tmp_path / "a", seed=7)
    b = make_tiny("qwen3_moe", tmp_path / "b", seed=7)
    c = make_tiny("qwen3_moe", tmp_path / "c", seed=8)
    fa = (a / "model.safetensors").read_bytes()
    assert fa == (b / "model.safetensors").read_bytes()
    assert fa != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_memory_shape_is_expert_dominated(tmp_path):
    d = make_tiny("qwen3_moe", tmp_path / "m", layers=4, experts=64, hidden=256, moe_intermediate=256)
    w = _weights(d)
    total = sum(v.nbytes for v in w.values())
    experts = sum(v.nbytes for k, v in w.items() if ".switch_mlp." in k)
    assert experts / total >= 0.8


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="qwen3_moe"):
        make_tiny("llama", tmp_path / "x")
    with pytest.raises(ValueError, match="multiple of 64"):
        tiny_config("mixtral", hidden=96)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        make_tiny("mixtral", tmp_path / "full")
    d = make_tiny("mixtral", tmp_path / "full", overwrite=True, layers=2)
    assert (d / "keep.txt").exists() and (d / "config.json").exists()


def test_build_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path, vocab_size=400)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_id == EOS_TOKEN_ID
    assert len(tok) <= 400
    ids = tok.encode("def f(x):\n    return x + 1")
    assert tok.decode(ids) == "def f(x):\n    return x + 1"


def test_a_tiny_builder_for_every_supported_model_type_in_its_order():
    from edge0.model.families import SUPPORTED_MODEL_TYPES
    from edge0.tiny.configs import BUILDERS, CLASSIC

    assert CLASSIC + tuple(sorted(BUILDERS, key=str.lower)) == SUPPORTED_MODEL_TYPES
