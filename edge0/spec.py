"""MoESpec: what Edge0 needs to know about a MoE checkpoint, derived from config.json.

The spec is plain data (no array library): expert count, k, the routing family and its
parameters, which layers are MoE, the int4 quantization of the routed experts, where the
routed-expert tensors live (key templates) and how the shared expert is combined. One
generic streaming layer (``edge0.exec.moe_layer``) serves every family from this data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from edge0.errors import ConfigError, UnsupportedModelError

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PARTS = ("weight", "scales", "biases")


@dataclass(frozen=True)
class SoftmaxTopK:
    """Softmax-top-k routing (Qwen3 / Qwen3.5 / Mixtral)."""

    k: int
    norm_topk_prob: bool
    # "softmax_topk": softmax over all experts, then top-k (Qwen);
    # "topk_softmax": top-k on the logits, then softmax over the k (Mixtral).
    order: str = "softmax_topk"
    family: str = field(default="softmax_topk", init=False)


@dataclass(frozen=True)
class SigmoidGroup:
    """Group-limited routing (DeepSeek-V3, GLM-4.x MoE, Ling/Bailing)."""

    k: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    score_function: str = "sigmoid"  # bailing may use "softmax"
    # Small differences between mlx-lm's three copies of this math, kept so that each
    # family's routing is bit-identical to its own model file:
    denominator_eps: float = 0.0  # glm4_moe_lite and bailing add 1e-20
    select: str = "neg_first_k"  # deepseek/glm: argpartition(-s)[:k]; bailing: "last_k"
    cast_to_input: bool = False  # bailing returns scores in the logits' dtype
    compiled: bool = False  # bailing's function is mx.compile'd
    family: str = field(default="sigmoid_group", init=False)


@dataclass(frozen=True)
class ExpertQuant:
    bits: int
    group_size: int
    mode: str = "affine"


@dataclass(frozen=True)
class MoESpec:
    model_type: str
    num_layers: int
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    k: int
    routing: SoftmaxTopK | SigmoidGroup
    moe_layers: tuple[int, ...]
    quant: ExpertQuant
    # "{prefix}layers.{layer}.{block}" is the MoE block's module path.
    layer_prefix: str  # "model." or "language_model.model."
    block_attr: str  # "mlp" or "block_sparse_moe"
    # How the router's logits are computed from the block's ``gate`` module:
    # "linear": gate(x); "matmul": x @ gate.weight.T; "gate_proj": gate.gate_proj(x).
    router_kind: str
    # Attribute on the gate module holding a score-correction bias, or None.
    router_bias_attr: str | None
    # "none", "plain" (y + shared_experts(x)) or "gated" (y + sigmoid(g(x)) * shared_expert(x)).
    shared_expert: str
    # Modules of the original block that stay resident (their weights keep their keys).
    resident_children: tuple[str, ...]
    # Quantization overrides by module path, from config.json's "quantization".
    quant_overrides: dict[str, dict] = field(default_factory=dict, compare=False)

    def block_path(self, layer: int) -> str:
        return f"{self.layer_prefix}layers.{layer}.{self.block_attr}"

    def expert_key(self, layer: int, proj: str, part: str) -> str:
        return f"{self.block_path(layer)}.switch_mlp.{proj}.{part}"

    def expert_keys(self, layer: int) -> dict[tuple[str, str], str]:
        return {(p, q): self.expert_key(layer, p, q) for p in PROJECTIONS for q in PARTS}

    def is_expert_key(self, key: str) -> bool:
        return ".switch_mlp." in key and key.startswith(self.layer_prefix + "layers.")

    def proj_shape(self, proj: str) -> tuple[int, int]:
        """(out, in) of one expert's projection, unquantized."""
        if proj == "down_proj":
            return self.hidden_size, self.moe_intermediate_size
        return self.moe_intermediate_size, self.hidden_size

    def expert_quant(self, layer: int, proj: str) -> ExpertQuant:
        override = self.quant_overrides.get(f"{self.block_path(layer)}.switch_mlp.{proj}")
        if isinstance(override, dict):
            return ExpertQuant(int(override.get("bits", self.quant.bits)),
                               int(override.get("group_size", self.quant.group_size)),
                               str(override.get("mode", self.quant.mode)))
        return self.quant


# --- families ---------------------------------------------------------------------------

def _req(cfg: dict, key: str, model_type: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"config.json for {model_type} lacks required field {key!r}")
    return cfg[key]


def _int(cfg: dict, key: str, model_type: str, default: Any = None) -> int:
    value = cfg.get(key, default) if default is not None else _req(cfg, key, model_type)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"config.json field {key!r} must be a non-negative integer, got {value!r}")
    return value


def _qwen3_moe(cfg: dict) -> dict:
    mt = "qwen3_moe"
    n = _int(cfg, "num_hidden_layers", mt)
    step = _int(cfg, "decoder_sparse_step", mt, 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    experts = _int(cfg, "num_experts", mt)
    layers = tuple(i for i in range(n) if i not in dense and experts > 0 and (i + 1) % step == 0)
    return dict(
        cfg=cfg, num_experts=experts, k=_int(cfg, "num_experts_per_tok", mt), moe_layers=layers,
        routing=SoftmaxTopK(k=_int(cfg, "num_experts_per_tok", mt),
                            norm_topk_prob=bool(cfg.get("norm_topk_prob", False))),
        layer_prefix="model.", block_attr="mlp", router_kind="linear", router_bias_attr=None,
        shared_expert="none", resident_children=("gate",),
    )


def _qwen3_5_moe(cfg: dict) -> dict:
    mt = "qwen3_5_moe"
    text = cfg.get("text_config", cfg)
    if not isinstance(text, dict):
        raise ConfigError("config.json field 'text_config' must be an object")
    n = _int(text, "num_hidden_layers", mt)
    experts = _int(text, "num_experts", mt)
    k = _int(text, "num_experts_per_tok", mt)
    return dict(
        cfg=text, num_experts=experts, k=k, moe_layers=tuple(range(n)) if experts > 0 else (),
        routing=SoftmaxTopK(k=k, norm_topk_prob=bool(text.get("norm_topk_prob", True))),
        layer_prefix="language_model.model.", block_attr="mlp", router_kind="linear",
        router_bias_attr=None, shared_expert="gated",
        resident_children=("gate", "shared_expert", "shared_expert_gate"),
    )


def _mixtral(cfg: dict) -> dict:
    mt = "mixtral"
    n = _int(cfg, "num_hidden_layers", mt, 32)
    k = _int(cfg, "num_experts_per_tok", mt, 2)
    return dict(
        cfg=cfg, num_experts=_int(cfg, "num_local_experts", mt, 8), k=k, moe_layers=tuple(range(n)),
        routing=SoftmaxTopK(k=k, norm_topk_prob=False, order="topk_softmax"),
        layer_prefix="model.", block_attr="block_sparse_moe", router_kind="linear",
        router_bias_attr=None, shared_expert="none", resident_children=("gate",),
        moe_intermediate_size=_int(cfg, "intermediate_size", mt, 14336),
    )


def _deepseek_like(mt: str, cfg: dict, eps: float) -> dict:
    n = _int(cfg, "num_hidden_layers", mt)
    experts = _req(cfg, "n_routed_experts", mt)
    first = _int(cfg, "first_k_dense_replace", mt, 0)
    freq = _int(cfg, "moe_layer_freq", mt, 1) or 1
    k = _int(cfg, "num_experts_per_tok", mt)
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ConfigError(f"{mt}: only topk_method 'noaux_tc' is supported, got {cfg.get('topk_method')!r}")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"{mt}: only scoring_func 'sigmoid' is supported, got {cfg.get('scoring_func')!r}")
    shared = cfg.get("n_shared_experts")
    return dict(
        cfg=cfg, num_experts=experts, k=k,
        moe_layers=tuple(i for i in range(n) if i >= first and i % freq == 0),
        routing=SigmoidGroup(k=k, n_group=_int(cfg, "n_group", mt, 1), topk_group=_int(cfg, "topk_group", mt, 1),
                             routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                             norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), denominator_eps=eps),
        layer_prefix="model.", block_attr="mlp", router_kind="matmul",
        router_bias_attr="e_score_correction_bias", shared_expert="plain" if shared else "none",
        resident_children=("gate", "shared_experts") if shared else ("gate",),
    )


def _deepseek_v3(cfg: dict) -> dict:
    return _deepseek_like("deepseek_v3", cfg, 0.0)


def _glm4_moe_lite(cfg: dict) -> dict:
    return _deepseek_like("glm4_moe_lite", cfg, 1e-20)


def _bailing_moe(cfg: dict) -> dict:
    mt = "bailing_moe"
    n = _int(cfg, "num_hidden_layers", mt)
    first = _int(cfg, "first_k_dense_replace", mt)
    k = _int(cfg, "num_experts_per_tok", mt)
    if cfg.get("use_bias", False):
        raise ConfigError("bailing_moe with use_bias=true (biased routed experts) is not supported")
    score_fn = cfg.get("score_function", "softmax")
    if score_fn not in ("sigmoid", "softmax"):
        raise ConfigError(f"bailing_moe: score_function must be 'sigmoid' or 'softmax', got {score_fn!r}")
    shared = (cfg.get("num_shared_experts", 0) or 0) > 0 and cfg.get("moe_router_enable_shared_expert", True)
    return dict(
        cfg=cfg, num_experts=_int(cfg, "num_experts", mt), k=k,
        moe_layers=tuple(i for i in range(n) if i >= first),
        routing=SigmoidGroup(k=k, n_group=_int(cfg, "n_group", mt, 1), topk_group=_int(cfg, "topk_group", mt, 4),
                             routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                             norm_topk_prob=bool(_req(cfg, "norm_topk_prob", mt)), score_function=score_fn,
                             denominator_eps=1e-20, select="last_k", cast_to_input=True, compiled=True),
        layer_prefix="model.", block_attr="mlp", router_kind="gate_proj",
        router_bias_attr="expert_bias" if cfg.get("moe_router_enable_expert_bias", False) else None,
        shared_expert="plain" if shared else "none",
        resident_children=("gate", "shared_experts") if shared else ("gate",),
    )


FAMILIES: dict[str, Callable[[dict], dict]] = {
    "qwen3_moe": _qwen3_moe,
    "qwen3_5_moe": _qwen3_5_moe,
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3,
    "glm4_moe_lite": _glm4_moe_lite,
    "bailing_moe": _bailing_moe,
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def _quantization(config: dict, model_type: str) -> tuple[ExpertQuant, dict]:
    q = config.get("quantization")
    if q is None and isinstance(config.get("text_config"), dict):
        q = config["text_config"].get("quantization")
    if not isinstance(q, dict):
        raise ConfigError(
            f"{model_type} checkpoint is not quantized (config.json has no 'quantization'): Edge0 "
            "streams int4 mlx-lm checkpoints; convert with `mlx_lm.convert -q --q-bits 4 --q-group-size 64`"
        )
    bits, group = q.get("bits"), q.get("group_size")
    mode = q.get("mode", "affine")
    if not isinstance(bits, int) or bits not in (2, 3, 4, 5, 6, 8):
        raise ConfigError(f"config.json quantization.bits must be one of 2,3,4,5,6,8, got {bits!r}")
    if not isinstance(group, int) or group not in (32, 64, 128):
        raise ConfigError(f"config.json quantization.group_size must be 32, 64 or 128, got {group!r}")
    if mode != "affine":
        raise ConfigError(f"config.json quantization.mode {mode!r} is not supported (only 'affine')")
    overrides = {k: v for k, v in q.items() if isinstance(v, dict)}
    return ExpertQuant(bits, group, mode), overrides


def spec_from_config(config: dict) -> MoESpec:
    """Build the MoESpec of a parsed config.json; raises UnsupportedModelError/ConfigError."""
    if not isinstance(config, dict):
        raise ConfigError("config.json must be a JSON object")
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    fam = FAMILIES[model_type](config)
    cfg = fam.pop("cfg")
    quant, overrides = _quantization(config, model_type)
    moe_inter = fam.pop("moe_intermediate_size", None) or _int(cfg, "moe_intermediate_size", model_type)
    spec = MoESpec(
        model_type=model_type,
        num_layers=_int(cfg, "num_hidden_layers", model_type, 32),
        hidden_size=_int(cfg, "hidden_size", model_type),
        moe_intermediate_size=moe_inter,
        quant=quant,
        quant_overrides=overrides,
        **fam,
    )
    if spec.num_experts < 1 or not spec.moe_layers:
        raise ConfigError(f"{model_type} config.json describes no MoE layer (num_experts={spec.num_experts})")
    if not 1 <= spec.k <= spec.num_experts:
        raise ConfigError(f"num_experts_per_tok must be in 1..{spec.num_experts}, got {spec.k}")
    r = spec.routing
    if isinstance(r, SigmoidGroup):
        if r.n_group < 1 or spec.num_experts % r.n_group:
            raise ConfigError(f"n_group {r.n_group} must divide the expert count {spec.num_experts}")
        if not 1 <= r.topk_group <= r.n_group:
            raise ConfigError(f"topk_group must be in 1..n_group={r.n_group}, got {r.topk_group}")
    return spec


def with_experts_per_token(config: dict, k: int | None) -> dict:
    """``config`` with its routing width replaced (the nested text config too): serving a
    narrower width is a file swap of heads and adapter, never a change of the base."""
    if k is None:
        return config
    cfg = dict(config)
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"] = dict(cfg["text_config"], num_experts_per_tok=k)
    else:
        cfg["num_experts_per_tok"] = k
    return cfg


def load_config(model_dir: str | Path) -> dict:
    """config.json of ``model_dir``, read through the model-directory gate (regular file
    inside the directory, size limit, UTF-8, bounded nesting)."""
    from edge0.model_files import read_json

    try:
        config = read_json(Path(model_dir), "config.json")
    except FileNotFoundError:
        raise ConfigError(f"{model_dir} is not a model directory: {Path(model_dir) / 'config.json'} does not "
                          "exist") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{Path(model_dir) / 'config.json'} must hold a JSON object")
    return config


def load_spec(model_dir: str | Path) -> MoESpec:
    return spec_from_config(load_config(model_dir))
