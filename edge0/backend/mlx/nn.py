"""Model classes and loading of the resident part of a model (MLX, mlx-lm).

Everything but the routed experts is built and loaded with mlx-lm's own model classes
and its quantization rules. The routed-expert tensors are dropped from the lazy weight
dict before anything is evaluated, so they are never read into memory (``mx.load`` reads
a whole tensor the first time any of it is evaluated).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes, infer_quant_config

from edge0.errors import LayoutError

Module = nn.Module


def module_at(root: nn.Module, path: str):
    """The submodule at dotted ``path`` (list indices as numbers), or None."""
    node = root
    for part in path.split("."):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                return None
            node = node[int(part)]
        elif isinstance(node, nn.Module) and part in node:
            node = node[part]
        else:
            return None
    return node


def set_module_at(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = module_at(root, parent_path)
    if parent is None:
        raise LayoutError(f"module path {parent_path!r} does not exist in the model")
    setattr(parent, name, module)


def cast_model(model: nn.Module, dtype, skip: Callable[[str], bool] = lambda _: False) -> None:
    """Cast floating parameters to ``dtype``, honouring the model's ``cast_predicate``
    (e.g. DeepSeek's e_score_correction_bias stays float32), as mlx_lm.convert does.
    Parameters whose path ``skip`` accepts keep their dtype."""
    keep = getattr(model, "cast_predicate", lambda _: True)
    params = tree_flatten(model.parameters())
    cast = [(k, v.astype(dtype)) for k, v in params
            if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype and keep(k) and not skip(k)]
    if cast:
        model.update(tree_unflatten(cast))


def build_model(config: dict, replace_blocks: Callable[[nn.Module], None]):
    """Instantiate the mlx-lm model of ``config`` and let ``replace_blocks`` swap modules."""
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    replace_blocks(model)
    return model


def load_resident(model_dir: Path, config: dict, files: list[str], is_expert_key: Callable[[str], bool],
                  replace_blocks: Callable[[nn.Module], None], compute_dtype=None) -> nn.Module:
    """Build the model, quantize it as config.json says and load every non-expert tensor.

    Loading is strict: a resident parameter missing from the files, or a resident tensor the
    model does not have, is an error naming the key.
    """
    model = build_model(config, replace_blocks)
    weights: dict = {}
    for f in files:
        for key, value in mx.load(str(f)).items():
            if not is_expert_key(key):
                weights[key] = value
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    quantization = config.get("quantization") or (config.get("text_config") or {}).get("quantization") or {}

    def class_predicate(path, module):
        if path in quantization:
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(model, group_size=quantization.get("group_size", 64), bits=quantization.get("bits", 4),
                mode=quantization.get("mode", "affine"), class_predicate=class_predicate)
    model.eval()
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing:
        raise LayoutError(f"resident tensors missing from the checkpoint: {missing[:8]}"
                          + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""),
                          file=model_dir, tensor=missing[0])
    if extra:
        raise LayoutError(f"checkpoint tensors the model does not have: {extra[:8]}"
                          + (f" and {len(extra) - 8} more" if len(extra) > 8 else ""),
                          file=model_dir, tensor=extra[0])
    for key, value in weights.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise LayoutError(f"shape {list(value.shape)}, the model expects {list(expected[key].shape)}",
                              file=model_dir, tensor=key)
    model.load_weights(list(weights.items()), strict=True)
    if compute_dtype is not None:
        cast_model(model, compute_dtype)
    mx.eval(model.parameters())
    return model


def load_tokenizer(model_dir: Path):
    """mlx-lm's tokenizer wrapper (with its streaming detokenizer) for a local directory."""
    from mlx_lm.utils import load_tokenizer as _load

    return _load(Path(model_dir))


def generate_step(prompt, model, *, max_tokens: int, temp: float, top_p: float, prefill_step_size: int):
    """mlx-lm's token generator (prefill in chunks, then one token per step, one step of
    look-ahead), with its sampler; yields (token, logprobs)."""
    from mlx_lm.generate import generate_step as _generate_step
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp, top_p if top_p < 1.0 else 0.0)
    return _generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler,
                          prefill_step_size=prefill_step_size)


def load_full_model(model_dir: Path) -> nn.Module:
    """mlx-lm's own loader: every weight, experts included, resident (the baseline)."""
    from mlx_lm.utils import load_model

    return load_model(Path(model_dir))[0]


def make_cache(model: nn.Module) -> list:
    """A fresh KV / state cache for ``model`` (mlx-lm's, so hybrid models get theirs)."""
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


# Building blocks for Edge0's own small trainable modules (the prerouter heads).
Linear = nn.Linear
silu = nn.silu
value_and_grad = nn.value_and_grad


def adamw(learning_rate: float, weight_decay: float = 0.0):
    import mlx.optimizers as optim

    return optim.AdamW(learning_rate=learning_rate, weight_decay=weight_decay)


def parameters_flat(module: nn.Module) -> dict:
    return dict(tree_flatten(module.parameters()))


def load_parameters_flat(module: nn.Module, flat: dict) -> None:
    module.update(tree_unflatten(list(flat.items())))


def router_weight(gate: nn.Module, kind: str):
    """The router's [E, D] weight as a float32 array, dequantized if it is quantized."""
    lin = gate.gate_proj if kind == "gate_proj" else gate
    if isinstance(lin, nn.QuantizedLinear):
        w = mx.dequantize(lin.weight, lin.scales, lin.biases, group_size=lin.group_size, bits=lin.bits)
    else:
        w = lin.weight
    return w.astype(mx.float32)

log_sigmoid = nn.log_sigmoid
