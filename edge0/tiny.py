"""Small random int4 MoE checkpoints in the exact layout mlx-lm saves.

The checkpoints are built with mlx-lm's own model classes, cast to ``dtype``
(honouring the model's ``cast_predicate``), quantized with
``mlx_lm.utils.quantize_model`` (group 64, 4 bits, affine, honouring the
model's ``quant_predicate``) and written with ``mlx_lm.utils.save_model`` and
``save_config``, which is what ``mlx_lm.convert -q`` does.  Every directory
loads with ``mlx_lm.load`` and generates.

Routers are re-randomised with a large enough scale that routing is spread over
the experts and differs between tokens (mlx-lm initialises deepseek-style
``MoEGate`` weights to zeros), and the expert-bias vectors
(``e_score_correction_bias`` / ``expert_bias``) get small random values so
that code path is exercised.  ``make_tiny`` checks, on a short random token
sequence, that every MoE layer uses at least half of its experts.

The tokenizer is a byte-level BPE trained offline, in about 0.1 s, on a fixed
list of Python standard-library sources (with a built-in fallback text), and
cached per process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sysconfig
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_map_with_path, tree_unflatten

__all__ = [
    "FAMILIES",
    "EOS_TOKEN",
    "EOS_TOKEN_ID",
    "GROUP_SIZE",
    "BITS",
    "tiny_config",
    "make_tiny",
    "build_tokenizer",
    "expert_usage",
]

FAMILIES: tuple[str, ...] = (
    "qwen3_moe",
    "qwen3_5_moe",
    "mixtral",
    "deepseek_v3",
    "bailing_moe",
    "glm4_moe_lite",
)

GROUP_SIZE = 64
BITS = 4

EOS_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = 0  # the trainer puts special tokens first
DEFAULT_VOCAB = 512

# Families with sigmoid group routing (n_group / topk_group).
_GROUPED = ("deepseek_v3", "glm4_moe_lite", "bailing_moe")
N_GROUP = 4
TOPK_GROUP = 2

# Router weights ~ N(0, (ROUTER_STD / sqrt(hidden))^2): with unit-RMS inputs
# (they follow an RMSNorm) the router logits have a std of about ROUTER_STD.
ROUTER_STD = 2.0
# Expert-bias vectors ~ N(0, EXPERT_BIAS_STD^2), added to sigmoid scores.
EXPERT_BIAS_STD = 0.05
# Token embeddings ~ N(0, EMBED_STD^2) (see _randomize_routing).
EMBED_STD = 1.0

_DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}

_SHAPE_KEYS = ("layers", "experts", "k", "hidden", "moe_intermediate", "vocab_size")


# --------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(
            f"unknown family {family!r}; supported families: {', '.join(FAMILIES)}"
        )


def _mult64(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0 or value % GROUP_SIZE:
        raise ValueError(
            f"{name}={value!r} must be a positive multiple of {GROUP_SIZE} "
            "(quantized input dims need whole groups)"
        )


def tiny_config(
    family: str,
    *,
    layers: int = 4,
    experts: int = 16,
    k: int = 4,
    hidden: int = 128,
    moe_intermediate: int = 64,
    vocab_size: int | None = None,
) -> dict:
    """A complete config.json dict (before quantization) for ``family``.

    Derived sizes: attention head_dim 32 (``hidden // 32`` heads, half as many
    KV heads), dense / first-layer MLP intermediate ``2 * moe_intermediate``,
    shared experts ``moe_intermediate`` wide.  For the MLA families:
    ``max(2, hidden // 64)`` heads, q_lora_rank = kv_lora_rank =
    qk_nope_head_dim = v_head_dim = 64, qk_rope_head_dim = 32.
    """
    _check_family(family)
    _mult64("hidden", hidden)
    _mult64("moe_intermediate", moe_intermediate)
    if vocab_size is None:
        vocab_size = DEFAULT_VOCAB
    if not isinstance(vocab_size, int) or vocab_size < 300:
        raise ValueError(f"vocab_size={vocab_size!r} must be an int >= 300")
    if not isinstance(experts, int) or experts < 2:
        raise ValueError(f"experts={experts!r} must be an int >= 2")
    if not isinstance(k, int) or not 1 <= k <= experts:
        raise ValueError(f"k={k!r} must be in [1, experts={experts}]")
    min_layers = 2 if family in ("deepseek_v3", "glm4_moe_lite", "bailing_moe") else 1
    if family == "qwen3_5_moe":
        min_layers = 2  # at least one linear-attention and one full-attention layer
    if not isinstance(layers, int) or layers < min_layers:
        raise ValueError(f"layers={layers!r} must be an int >= {min_layers} for {family}")
    if family in _GROUPED:
        if experts % N_GROUP or experts // N_GROUP < 2:
            raise ValueError(
                f"experts={experts} must be divisible by n_group={N_GROUP} with at "
                f"least 2 experts per group for {family}"
            )
        if k > (experts // N_GROUP) * TOPK_GROUP:
            raise ValueError(
                f"k={k} exceeds the experts reachable through topk_group={TOPK_GROUP} "
                f"groups of {experts // N_GROUP}"
            )

    head_dim = 32
    heads = hidden // head_dim
    kv_heads = max(1, heads // 2)
    dense_intermediate = 2 * moe_intermediate
    common = {
        "eos_token_id": EOS_TOKEN_ID,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }

    if family == "qwen3_moe":
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            **common,
            "intermediate_size": dense_intermediate,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "num_experts": experts,
            "num_experts_per_tok": k,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": moe_intermediate,
            "norm_topk_prob": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "attention_bias": False,
        }

    if family == "qwen3_5_moe":
        interval = 2
        text = {
            "model_type": "qwen3_5_moe_text",
            **common,
            "intermediate_size": dense_intermediate,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "full_attention_interval": interval,
            "layer_types": [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(layers)
            ],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "num_experts": experts,
            "num_experts_per_tok": k,
            "moe_intermediate_size": moe_intermediate,
            "shared_expert_intermediate_size": moe_intermediate,
            "norm_topk_prob": True,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
                "mrope_interleaved": True,
                "mrope_section": [11, 11, 10],
            },
        }
        return {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "eos_token_id": EOS_TOKEN_ID,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "text_config": text,
        }

    if family == "mixtral":
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            **common,
            # mixtral's experts are ``intermediate_size`` wide
            "intermediate_size": moe_intermediate,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "num_local_experts": experts,
            "num_experts_per_tok": k,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "sliding_window": None,
        }

    if family in ("deepseek_v3", "glm4_moe_lite"):
        mla_heads = max(2, hidden // 64)
        cfg = {
            "architectures": [
                "DeepseekV3ForCausalLM"
                if family == "deepseek_v3"
                else "Glm4MoeLiteForCausalLM"
            ],
            "model_type": family,
            **common,
            "intermediate_size": dense_intermediate,
            "moe_intermediate_size": moe_intermediate,
            "num_attention_heads": mla_heads,
            "num_key_value_heads": mla_heads,
            "n_shared_experts": 1,
            "n_routed_experts": experts,
            "num_experts_per_tok": k,
            "routed_scaling_factor": 2.5 if family == "deepseek_v3" else 1.8,
            "q_lora_rank": 64,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 32,
            "v_head_dim": 64,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "n_group": N_GROUP,
            "topk_group": TOPK_GROUP,
            "moe_layer_freq": 1,
            "first_k_dense_replace": 1,
            "num_nextn_predict_layers": 0,
            "rms_norm_eps": 1e-6 if family == "deepseek_v3" else 1e-5,
            "rope_theta": 10000.0 if family == "deepseek_v3" else 1000000.0,
            "rope_scaling": None,
            "attention_bias": False,
        }
        if family == "glm4_moe_lite":
            cfg["partial_rotary_factor"] = 1.0
        return cfg

    # bailing_moe
    return {
        "architectures": ["BailingMoeForCausalLM"],
        "model_type": "bailing_moe",
        **common,
        "intermediate_size": dense_intermediate,
        "moe_intermediate_size": moe_intermediate,
        "moe_shared_expert_intermediate_size": moe_intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_experts": experts,
        "num_experts_per_tok": k,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_enable_routed_scaling": True,
        "routed_scaling_factor": 2.5,
        "n_group": N_GROUP,
        "topk_group": TOPK_GROUP,
        "use_bias": False,
        "use_qkv_bias": False,
        "use_qk_norm": True,
        # norm_head=True makes sanitize renormalise lm_head.weight on every load,
        # which zeroes a quantized (uint32) lm_head: keep it off.
        "norm_head": False,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-6,
        "rope_theta": 600000.0,
    }


def _apply_overrides(family: str, cfg: dict, overrides: dict[str, Any]) -> None:
    """Raw config keys: for qwen3_5_moe they go into text_config unless they are
    top-level keys already."""
    for key, value in overrides.items():
        if family != "qwen3_5_moe":
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
# tokenizer
# --------------------------------------------------------------------------

_CORPUS_MODULES = (
    "textwrap",
    "string",
    "bisect",
    "heapq",
    "colorsys",
    "fnmatch",
    "keyword",
    "functools",
    "abc",
    "copy",
    "pprint",
    "dataclasses",
    "enum",
    "types",
    "contextlib",
    "operator",
    "shlex",
    "glob",
    "posixpath",
)

_FALLBACK_TEXT = '''\
def f(x):
    """Return x plus one."""
    return x + 1


class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def __repr__(self):
        return f"Point({self.x!r}, {self.y!r})"


for i in range(10):
    if i % 2 == 0:
        print("even", i)
    else:
        print("odd", i)
'''

_tok_lock = threading.Lock()
_tok_cache: dict[int, str] = {}


def _corpus() -> list[str]:
    import keyword

    texts = []
    stdlib = sysconfig.get_paths().get("stdlib", "")
    for name in _CORPUS_MODULES:
        path = os.path.join(stdlib, name + ".py")
        try:
            with open(path, encoding="utf-8") as fh:
                texts.append(fh.read())
        except OSError:
            continue
    texts.append(_FALLBACK_TEXT)
    texts.append(" ".join(keyword.kwlist))
    return texts


def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with at most ``vocab_size`` tokens and
    ``<|endoftext|>`` as id 0, trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    if tok.token_to_id(EOS_TOKEN) != EOS_TOKEN_ID:
        raise RuntimeError(f"tokenizer: {EOS_TOKEN} did not get id {EOS_TOKEN_ID}")
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens > vocab_size {vocab_size}")
    return tok


def _tokenizer_json(vocab_size: int) -> str:
    with _tok_lock:
        cached = _tok_cache.get(vocab_size)
        if cached is None:
            cached = _tok_cache[vocab_size] = train_tokenizer(_corpus(), vocab_size).to_str()
        return cached


# A ChatML-style template, so that tiny models exercise chat-template handling as instruct
# models do (the role markers are plain text to this tokenizer).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out_dir, *, vocab_size: int = DEFAULT_VOCAB) -> None:
    """Write a byte-level BPE ``tokenizer.json`` (at most ``vocab_size`` tokens,
    EOS ``<|endoftext|>`` = id 0), ``tokenizer_config.json`` (with a chat template) and
    ``special_tokens_map.json`` into ``out_dir``."""
    if not isinstance(vocab_size, int) or vocab_size < 300:
        raise ValueError(f"vocab_size={vocab_size!r} must be an int >= 300")
    write_tokenizer(_tokenizer_json(vocab_size), out_dir, chat_template=CHAT_TEMPLATE)


def write_tokenizer(tokenizer_json: str, out_dir, chat_template: str | None = None) -> None:
    """``tokenizer.json`` plus the two small config files mlx-lm's loader reads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    if chat_template is not None:
        tok_cfg["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2), encoding="utf-8")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}, indent=2), encoding="utf-8")


# --------------------------------------------------------------------------
# routing check
# --------------------------------------------------------------------------


def expert_usage(
    model: nn.Module,
    *,
    n_tokens: int = 64,
    seed: int = 0,
    vocab_size: int | None = None,
    float32: bool = True,
) -> dict[str, int]:
    """Run ``n_tokens`` random tokens through ``model`` (one forward pass, no
    cache) and return, for each MoE layer (path of its ``SwitchGLU``), how many
    distinct experts were selected.

    With ``float32`` (default) the float parameters (norms, quantization scales
    and biases, ...) are cast to float32 for the pass and then restored: on CPU
    bf16 activations make the quantized matmuls about 8x slower.

    Temporarily patches ``SwitchGLU.__call__`` at class level to record the
    routing indices, so do not run other mlx-lm forwards concurrently.
    """
    from mlx_lm.models.switch_layers import SwitchGLU

    paths = {}
    for name, m in model.named_modules():
        if isinstance(m, SwitchGLU):
            paths[id(m)] = name
        elif vocab_size is None and isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)):
            vocab_size = int(m.weight.shape[0])
    if vocab_size is None:
        raise ValueError("expert_usage: no embedding found; pass vocab_size")
    rng = np.random.default_rng(seed)
    tokens = mx.array(rng.integers(0, vocab_size, size=(1, n_tokens)).astype(np.int32))

    seen: dict[int, list[mx.array]] = {}
    original = SwitchGLU.__call__

    def recording_call(self, x, indices):
        seen.setdefault(id(self), []).append(indices)
        return original(self, x, indices)

    saved = model.parameters()
    if float32:
        model.update(
            tree_map(
                lambda v: v.astype(mx.float32)
                if mx.issubdtype(v.dtype, mx.floating)
                else v,
                saved,
            )
        )
    SwitchGLU.__call__ = recording_call
    try:
        logits = model(tokens)
        mx.eval(logits, [i for v in seen.values() for i in v])
    finally:
        SwitchGLU.__call__ = original
        if float32:
            model.update(saved)

    usage = {}
    for mid, name in paths.items():
        used: set[int] = set()
        for idx in seen.get(mid, []):
            used.update(np.array(idx).reshape(-1).tolist())
        usage[name] = len(used)
    return usage


# --------------------------------------------------------------------------
# building
# --------------------------------------------------------------------------


def _randomize_routing(model: nn.Module, hidden: int) -> None:
    updates = []
    for path, value in tree_flatten(model.parameters()):
        parts = path.split(".")
        is_router = (
            len(parts) >= 3
            and parts[-1] == "weight"
            and (
                (parts[-2] == "gate" and parts[-3] in ("mlp", "block_sparse_moe"))
                or (parts[-2] == "gate_proj" and parts[-3] == "gate")
            )
        )
        if is_router:
            std = ROUTER_STD / hidden**0.5
            updates.append((path, std * mx.random.normal(value.shape)))
        elif parts[-1] in ("e_score_correction_bias", "expert_bias"):
            updates.append((path, EXPERT_BIAS_STD * mx.random.normal(value.shape)))
    if not updates:
        raise RuntimeError("no router weights found to randomise")
    # Token embeddings: mlx initialises them with std 1/sqrt(hidden), so after a
    # few layers the residual stream is dominated by the (nearly token-independent)
    # attention averages and every token routes alike.  Unit-std embeddings keep
    # the token identity dominant and routing spread in every layer.
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding):
            updates.append(
                (f"{name}.weight", EMBED_STD * mx.random.normal(m.weight.shape))
            )
    model.update(tree_unflatten(updates))


def _mute_eos(model: nn.Module) -> None:
    """Zero the lm_head row of EOS: its logit is then exactly 0 while the others
    are spread around 0, so greedy decoding practically never ends early and
    tests can compare a fixed number of tokens.  (Tied heads are left alone.)"""
    updates = []
    for path, value in tree_flatten(model.parameters()):
        if path == "lm_head.weight" or path.endswith(".lm_head.weight"):
            row = mx.arange(value.shape[0])[:, None] == EOS_TOKEN_ID
            updates.append((path, mx.where(row, mx.zeros_like(value), value)))
    if updates:
        model.update(tree_unflatten(updates))


def _cast(model: nn.Module, dtype: mx.Dtype) -> None:
    cast_predicate = getattr(model, "cast_predicate", lambda _: True)

    def set_dtype(path, v):
        if cast_predicate(path) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(dtype)
        return v

    model.update(tree_map_with_path(set_dtype, model.parameters()))


_OUR_FILES = (
    "config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists():
        if not out.is_dir():
            raise FileExistsError(f"{out} exists and is not a directory")
        if any(out.iterdir()) and not overwrite:
            raise FileExistsError(
                f"{out} already exists and is not empty; pass overwrite=True "
                "(--overwrite) to replace the checkpoint in it"
            )


def _clear_out_dir(out: Path) -> None:
    """Remove the files a checkpoint consists of (stale shards included, since
    mlx-lm globs ``model*.safetensors``); anything else is left alone."""
    if not out.exists():
        out.mkdir(parents=True)
        return
    for entry in out.iterdir():
        if entry.is_file() and (
            entry.name in _OUR_FILES
            or (entry.name.startswith("model") and entry.name.endswith(".safetensors"))
        ):
            entry.unlink()


def make_tiny(
    family: str,
    out_dir,
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    **config_overrides,
) -> Path:
    """Build a random int4 ``family`` checkpoint in ``out_dir`` and return its path.

    ``config_overrides`` may hold the shape keywords of :func:`tiny_config`
    (layers, experts, k, hidden, moe_intermediate, vocab_size) and any raw
    config.json keys (for qwen3_5_moe, keys that are not top-level go into
    ``text_config``), e.g. ``mlp_only_layers=[0]`` or ``full_attention_interval=4``.
    The same ``seed`` gives byte-identical safetensors files.

    Besides the routers, the token embeddings are re-drawn with unit std (keeps
    routing spread in deep layers) and the lm_head row of EOS is zeroed (greedy
    decoding does not stop early).  Raises FileExistsError if ``out_dir`` is not
    empty and ``overwrite`` is false; with ``overwrite`` only checkpoint files
    (config, ``model*.safetensors``, index, tokenizer files) are replaced.
    Raises RuntimeError if routing is degenerate (some MoE layer uses fewer
    than half its experts over 64 random tokens); nothing is written then.

    Not thread-safe: reseeds MLX's global random generator and briefly patches
    ``SwitchGLU.__call__`` (see :func:`expert_usage`).
    """
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    _check_family(family)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; supported: {', '.join(_DTYPES)}")
    shape = {key: config_overrides.pop(key) for key in _SHAPE_KEYS if key in config_overrides}
    cfg = tiny_config(family, **shape)
    cfg["torch_dtype"] = dtype
    if family == "qwen3_5_moe":
        cfg["text_config"]["torch_dtype"] = dtype
    _apply_overrides(family, cfg, config_overrides)

    out = Path(out_dir)
    _check_out_dir(out, overwrite)

    text_cfg = cfg.get("text_config", cfg)
    hidden = text_cfg["hidden_size"]
    vocab_size = text_cfg["vocab_size"]
    n_experts = text_cfg.get(
        "num_experts", text_cfg.get("n_routed_experts", text_cfg.get("num_local_experts"))
    )

    # Reseeds MLX's global generator (its state cannot be saved and restored).
    # The family is mixed in so that families with identical parameter trees
    # (deepseek_v3 / glm4_moe_lite) do not get byte-identical weights.
    mx.random.seed((int(seed) * 16 + FAMILIES.index(family)) % 2**63)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    _randomize_routing(model, hidden)
    _mute_eos(model)
    _cast(model, _DTYPES[dtype])
    with contextlib.redirect_stdout(io.StringIO()):
        model, qcfg = quantize_model(model, cfg, GROUP_SIZE, BITS, mode="affine")
    mx.eval(model.parameters())

    usage = expert_usage(model, n_tokens=64, seed=seed, vocab_size=vocab_size)
    if not usage:
        raise RuntimeError(f"{family}: no MoE layer found in the built model")
    degenerate = {p: n for p, n in usage.items() if 2 * n < n_experts}
    if degenerate:
        raise RuntimeError(
            f"{family}: degenerate routing, fewer than half of {n_experts} experts "
            f"used over 64 random tokens: {degenerate}"
        )

    _clear_out_dir(out)
    save_model(out, model)
    save_config(qcfg, out / "config.json")
    build_tokenizer(out, vocab_size=min(vocab_size, DEFAULT_VOCAB))
    return out
