"""Building a tiny checkpoint: mlx-lm's own model class, random weights, int4, saved as
``mlx_lm.convert -q`` saves.

The model is built from :func:`edge0.tiny.configs.tiny_config`, cast to ``dtype``
(honouring the model's ``cast_predicate``), quantized with ``mlx_lm.utils.quantize_model``
(group 64, 4 bits, affine, honouring the model's ``quant_predicate``) and written with
``mlx_lm.utils.save_model`` and ``save_config``. Every directory loads with
``mlx_lm.load`` and generates.

Which tensors are routers is not a table of names: :func:`edge0.model.arch.derive_spec` finds
them on the model itself, as the engine does when it loads. Routers are re-drawn with a
scale large enough that routing is spread over the experts and differs between tokens
(several mlx-lm gates start at zeros), expert-bias vectors get small random values so
that code path is exercised, token embeddings get unit std (keeps routing spread in deep
layers) and the lm_head row of EOS is zeroed (greedy decoding does not stop early).
``make_tiny`` checks, on a short random token sequence, that every MoE layer uses at
least half of its experts.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_map_with_path, tree_unflatten

from edge0.tiny.configs import ARCHITECTURES, BITS, GROUP_SIZE, _apply_overrides, _check_family, tiny_config
from edge0.tiny.tokenizer import DEFAULT_VOCAB, EOS_TOKEN_ID, build_tokenizer

# Router weights get std ROUTER_STD / sqrt(input width): logits of std about ROUTER_STD.
ROUTER_STD = 2.0
# Expert-bias vectors (e_score_correction_bias, expert_bias): small, so routing still
# follows the logits, but non-zero, so the bias path is exercised.
EXPERT_BIAS_STD = 0.05
# Token embeddings: mlx initialises them with std 1/sqrt(hidden), so after a few layers
# the residual stream is dominated by the (nearly token-independent) attention averages
# and every token routes alike. Unit-std embeddings keep the token identity dominant.
EMBED_STD = 1.0
_BIAS_NAMES = ("e_score_correction_bias", "expert_bias")

_DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
_SHAPE_KEYS = ("layers", "experts", "k", "hidden", "moe_intermediate", "vocab_size")


def _spec(model, cfg):
    from edge0.model.arch import derive_spec

    return derive_spec(model, cfg)


def expert_usage(
    model: nn.Module,
    *,
    n_tokens: int = 64,
    seed: int = 0,
    vocab_size: int | None = None,
    float32: bool = True,
) -> dict[str, int]:
    """Run ``n_tokens`` random tokens through ``model`` (one forward pass, no cache) and
    return, for each MoE layer (path of its expert stack), how many distinct experts were
    selected.

    With ``float32`` (default) the float parameters are cast to float32 for the pass and
    then restored: on CPU bf16 activations make the quantized matmuls about 8x slower.
    The expert stacks are intercepted per instance, so other models are not affected.
    """
    from edge0.backend import nn as bnn

    switches = [(name, m) for name, m in model.named_modules() if bnn.is_switch(m)]
    if vocab_size is None:
        vocab_size = next((int(m.weight.shape[0]) for _, m in model.named_modules()
                           if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))), None)
    if vocab_size is None:
        raise ValueError("expert_usage: no embedding found; pass vocab_size")
    rng = np.random.default_rng(seed)
    tokens = mx.array(rng.integers(0, vocab_size, size=(1, n_tokens)).astype(np.int32))

    seen: dict[str, list[mx.array]] = {name: [] for name, _ in switches}
    saved = model.parameters()
    if float32:
        model.update(tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v, saved))
    with contextlib.ExitStack() as stack:
        for name, m in switches:
            stack.enter_context(bnn.intercept(m, lambda x, inds, *a, _n=name, **kw: seen[_n].append(inds)))
        try:
            logits = model(tokens)
            mx.eval(logits, [i for v in seen.values() for i in v])
        finally:
            if float32:
                model.update(saved)
    return {name: len(set(np.concatenate([np.array(i).reshape(-1) for i in idx]).tolist())) if idx else 0
            for name, idx in seen.items()}


def _randomize_routing(model: nn.Module, routers: dict[str, int], blocks: tuple[str, ...]) -> None:
    """``routers``: parameter path of each router weight -> its input width."""
    updates = []
    for path, value in tree_flatten(model.parameters()):
        if path in routers:
            updates.append((path, ROUTER_STD / routers[path] ** 0.5 * mx.random.normal(value.shape)))
        elif path.rsplit(".", 1)[-1] in _BIAS_NAMES and path.startswith(blocks):
            updates.append((path, EXPERT_BIAS_STD * mx.random.normal(value.shape)))
    if not routers:
        raise RuntimeError("no router weights found to randomise")
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding):
            updates.append((f"{name}.weight", EMBED_STD * mx.random.normal(m.weight.shape)))
    model.update(tree_unflatten(updates))


def _routers(model: nn.Module, cfg: dict) -> tuple[dict[str, int], tuple[str, ...], int]:
    """(router weight path -> input width, block path prefixes, expert count)."""
    spec = _spec(model, cfg)
    routers = {}
    for layer in spec.layers.values():
        if layer.router_path is not None:
            routers[f"{layer.router_path}.weight"] = spec.hidden_size
    return routers, tuple(layer.block_path + "." for layer in spec.layers.values()), spec.num_experts


def _mute_eos(model: nn.Module) -> None:
    """Zero the lm_head row of EOS: its logit is then exactly 0 while the others are
    spread around 0, so greedy decoding practically never ends early and tests can
    compare a fixed number of tokens. (Tied heads are left alone.)"""
    updates = []
    for path, value in tree_flatten(model.parameters()):
        if "lm_head" in path.split(".") and path.endswith(".weight") and value.ndim == 2:
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
            raise FileExistsError(f"{out} already exists and is not empty; pass overwrite=True "
                                  "(--overwrite) to replace the checkpoint in it")


def _clear_out_dir(out: Path) -> None:
    """Remove the files a checkpoint consists of (stale shards included, since mlx-lm
    globs ``model*.safetensors``); anything else is left alone."""
    if not out.exists():
        out.mkdir(parents=True)
        return
    for entry in out.iterdir():
        if entry.is_file() and (entry.name in _OUR_FILES
                                or (entry.name.startswith("model") and entry.name.endswith(".safetensors"))):
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
    """Build a random int4 checkpoint of architecture ``family`` (an mlx-lm model type, one
    of :data:`ARCHITECTURES`) in ``out_dir`` and return its path.

    ``config_overrides`` may hold the shape keywords of :func:`tiny_config` (layers,
    experts, k, hidden, moe_intermediate, vocab_size) and any raw config.json keys (where
    the config nests a ``text_config``, keys that are not top-level go into it), e.g.
    ``mlp_only_layers=[0]`` or ``full_attention_interval=4``. The same ``seed`` gives
    byte-identical safetensors files.

    Raises FileExistsError if ``out_dir`` is not empty and ``overwrite`` is false; with
    ``overwrite`` only checkpoint files (config, ``model*.safetensors``, index, tokenizer
    files) are replaced. Raises RuntimeError if routing is degenerate (some MoE layer uses
    fewer than half its experts over 64 random tokens); nothing is written then.

    Not thread-safe: reseeds MLX's global random generator.
    """
    from mlx_lm.utils import quantize_model, save_config, save_model

    from edge0.backend import nn as bnn

    _check_family(family)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}; supported: {', '.join(_DTYPES)}")
    shape = {key: config_overrides.pop(key) for key in _SHAPE_KEYS if key in config_overrides}
    cfg = tiny_config(family, **shape)
    cfg["torch_dtype"] = dtype
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"]["torch_dtype"] = dtype
    _apply_overrides(family, cfg, config_overrides)

    out = Path(out_dir)
    _check_out_dir(out, overwrite)
    text_cfg = cfg.get("text_config", cfg)
    vocab_size = text_cfg.get("vocab_size", text_cfg.get("num_vocab"))

    # Reseeds MLX's global generator (its state cannot be saved and restored). The
    # architecture is mixed in so that architectures with identical parameter trees
    # (deepseek_v3 / glm4_moe_lite) do not get byte-identical weights.
    mx.random.seed((int(seed) * 16 + ARCHITECTURES.index(family)) % 2**63)
    model_cls, args_cls = bnn.model_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    routers, blocks, n_experts = _routers(model, cfg)
    _randomize_routing(model, routers, blocks)
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
        raise RuntimeError(f"{family}: degenerate routing, fewer than half of {n_experts} experts "
                           f"used over 64 random tokens: {degenerate}")

    _clear_out_dir(out)
    save_model(out, model)
    save_config(qcfg, out / "config.json")
    build_tokenizer(out, vocab_size=min(vocab_size, DEFAULT_VOCAB))
    return out
