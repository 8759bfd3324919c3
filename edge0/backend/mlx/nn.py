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

from edge0.backend.mlx.core import compute_streams
from edge0.errors import ConfigError, Edge0Error, LayoutError, TokenizerError, UnsupportedModelError

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


def is_linear(module) -> bool:
    return isinstance(module, (nn.Linear, nn.QuantizedLinear))


def is_switch(module) -> bool:
    """A stack of routed experts: mlx-lm's SwitchGLU or SwitchMLP (not a bare SwitchLinear:
    some attention projections are one)."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    return isinstance(module, (SwitchGLU, SwitchMLP))


def switch_experts(switch) -> int:
    """The number of experts stacked in a switch module (axis 0 of its weights)."""
    shapes = {v.shape[0] for k, v in tree_flatten(switch.parameters()) if k.endswith("weight")}
    if len(shapes) != 1:
        raise LayoutError(f"a switch stack whose weights stack different expert counts: {sorted(shapes)}")
    return shapes.pop()


def switch_output_width(switch) -> int:
    """Width of a switch module's output rows (its last projection's outputs)."""
    last = switch["down_proj"] if "down_proj" in switch else switch["fc2"] if "fc2" in switch else None
    if last is None:
        raise LayoutError(f"an expert stack of type {type(switch).__name__} without down_proj or fc2")
    return last["weight"].shape[1]


def children(module) -> dict:
    return module.children() if isinstance(module, nn.Module) else {}


def hidden_width(model) -> int:
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None)):
        for name in ("hidden_size", "model_dim", "d_model"):
            value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
            if isinstance(value, int):
                return value
    raise LayoutError("the model's config names no hidden_size")


class intercept:
    """``with intercept(module, fn):`` calls ``fn(*args)`` before each call of ``module``
    (by swapping the instance's class for the duration; ``module`` None does nothing)."""

    def __init__(self, module, fn):
        self.module, self.fn = module, fn

    def __enter__(self):
        if self.module is None:
            return self
        cls, fn = type(self.module), self.fn

        def call(inner, *args, **kwargs):
            fn(*args, **kwargs)
            return cls.__call__(inner, *args, **kwargs)

        self._cls = cls
        self.module.__class__ = type(f"Intercepted{cls.__name__}", (cls,), {"__call__": call})
        return self

    def __exit__(self, *exc):
        if self.module is not None:
            self.module.__class__ = self._cls


def dequantize_model(model: nn.Module, dtype=mx.float32) -> None:
    """Replace every quantized linear, switch linear and embedding by its float equivalent
    holding the dequantized weights (the "dequantized reconstruction" training runs on:
    the same numbers as the int4 kernels, through fast float matmuls)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    def deq(m):
        return mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits).astype(dtype)

    swaps = []
    for path, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            out_dim, in_dim = linear_dims(m)
            new = nn.Linear(in_dim, out_dim, bias="bias" in m)
        elif isinstance(m, QuantizedSwitchLinear):
            new = SwitchLinear(m.input_dims, m.output_dims, m.num_experts, bias="bias" in m)
        elif isinstance(m, nn.QuantizedEmbedding):
            new = nn.Embedding(m.num_embeddings, m.dims)
        else:
            continue
        new.weight = deq(m)
        if "bias" in m:
            new.bias = m.bias.astype(dtype)
        swaps.append((path, new))
    for path, new in swaps:
        set_module_at(model, path, new)


_ST_NAMES = {mx.uint32: "U32", mx.uint8: "U8", mx.int8: "I8", mx.int32: "I32", mx.uint16: "U16", mx.int16: "I16"}


def switch_layout(template) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, safetensors dtype) of a switch module's stacked tensors; "float" for
    any floating type (F16, BF16 or F32 are all accepted for scales, biases and float
    weights)."""
    return [(name, tuple(v.shape), "float" if mx.issubdtype(v.dtype, mx.floating) else _ST_NAMES.get(v.dtype, str(v.dtype)))
            for name, v in tree_flatten(template.parameters())]


def quantize_switch(template, header_shapes: dict, prefix: str, quantization: dict) -> None:
    """Quantize the switch module ``template`` (at module path ``prefix``) the way the
    checkpoint stores it: each projection whose ``scales`` the files hold, with config.json's
    bits, group size and mode for it (a per-module override first), else what its packed
    shape implies."""
    for name, child in list(template.children().items()):
        if not hasattr(child, "to_quantized"):
            continue
        key = f"{prefix}.{name}"
        if f"{key}.scales" not in header_shapes:
            continue
        override = quantization.get(key)
        spec = dict(override) if isinstance(override, dict) else {}
        in_dim = child.weight.shape[-1]
        packed, groups = header_shapes[f"{key}.weight"][-1], header_shapes[f"{key}.scales"][-1]
        bits = spec.get("bits", quantization.get("bits") or packed * 32 // max(in_dim, 1))
        group = spec.get("group_size", quantization.get("group_size") or in_dim // max(groups, 1))
        mode = spec.get("mode", quantization.get("mode", "affine"))
        if group not in (32, 64, 128) or bits not in (2, 3, 4, 5, 6, 8) or in_dim % group:
            raise LayoutError(f"the expert projection is {in_dim} wide: int{bits} quantization with group size "
                              f"{group} cannot hold it", tensor=f"{key}.weight")
        setattr(template, name, child.to_quantized(group_size=group, bits=bits, mode=mode))


def linear_modules(root: nn.Module):
    """(path, module) of every linear projection (float or quantized) under ``root``."""
    return [(p, m) for p, m in root.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """(out, in) of a linear projection, unquantized."""
    out_dim, in_dim = module.weight.shape
    if isinstance(module, nn.QuantizedLinear):
        in_dim = in_dim * 32 // module.bits
    return out_dim, in_dim


def token_embedding(model: nn.Module):
    """The model's input token embedding (an ``Embedding`` or ``QuantizedEmbedding``; the one
    named ``embed_tokens`` when there are several): ids [..] -> rows [.., D]. None when the
    model has none."""
    found = [(("embed_tokens" not in path), path.count("."), path, m) for path, m in model.named_modules()
             if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))]
    return min(found, key=lambda f: f[:3])[3] if found else None


def set_module_at(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = module_at(root, parent_path) if parent_path else root
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


def model_classes(config: dict):
    """(Model, ModelArgs) of mlx-lm for ``config``'s model_type."""
    model_type, arch = config.get("model_type"), config.get("architectures")
    if not isinstance(model_type, str):
        raise ConfigError(f"config.json: field 'model_type' must be a string, got {model_type!r:.60}")
    if arch is not None and not (isinstance(arch, str) or (isinstance(arch, list) and all(
            isinstance(a, str) for a in arch))):
        raise ConfigError(f"config.json: field 'architectures' must be a list of strings, got {arch!r:.60}")
    try:
        return _get_classes(config)
    except ValueError as e:
        raise UnsupportedModelError(f"mlx-lm has no model for model_type {config.get('model_type')!r}: {e}") from None


def arg_annotations(config: dict) -> list[tuple[dict, dict]]:
    """For ``config`` and each nested text config mlx-lm reads through a second args
    class: (the dict, {field: type annotation}) of the dataclass that consumes it."""
    import dataclasses
    import importlib
    import typing

    model_class, args_class = model_classes(config)

    def hints(cls) -> dict:
        try:
            types_ = typing.get_type_hints(cls)
        except Exception:  # an annotation mlx-lm itself cannot resolve: check nothing
            return {}
        if not dataclasses.is_dataclass(cls):
            return {}
        out = {}
        for f in dataclasses.fields(cls):
            hint = types_.get(f.name)
            # ``x: Dict = None``: mlx-lm's own default makes null a valid value
            out[f.name] = typing.Optional[hint] if hint is not None and f.default is None else hint
        return out

    out = [(config, hints(args_class))]
    module = importlib.import_module(model_class.__module__)
    text_cls = getattr(module, "TextModelArgs", None) or getattr(module, "TextArgs", None)
    nested = config.get("text_config")
    if isinstance(nested, dict) and text_cls is not None:
        out.append((nested, hints(text_cls)))
    return out


def build_model(config: dict, replace_blocks: Callable[[nn.Module], None] = lambda m: None,
                config_file: str = "config.json"):
    """Instantiate the mlx-lm model of ``config`` (its arrays stay lazy: nothing is
    allocated) and let ``replace_blocks`` swap modules. Whatever mlx-lm's constructors
    reject is a ConfigError naming config.json."""
    model_class, args_class = model_classes(config)
    try:
        model = model_class(args_class.from_dict(config))
    except Edge0Error:
        raise
    except (Exception, RecursionError) as e:
        raise ConfigError(f"{config_file}: mlx-lm's {config.get('model_type')} model rejects these values: "
                          f"{type(e).__name__}: {e}") from None
    replace_blocks(model)
    return model


def _check_quantizable(model: nn.Module, class_predicate, group_size: int, bits: int, model_dir) -> None:
    """Every module about to be quantized has an input width the group size divides (and
    no empty dimension): MLX's quantizer is not asked to divide by what it cannot."""
    for path, module in model.named_modules():
        if not hasattr(module, "to_quantized") or not hasattr(module, "weight"):
            continue
        spec = class_predicate(path, module)
        if not spec:
            continue
        g = spec.get("group_size", group_size) if isinstance(spec, dict) else group_size
        b = spec.get("bits", bits) if isinstance(spec, dict) else bits
        shape = tuple(module.weight.shape)
        if g not in (32, 64, 128) or b not in (2, 3, 4, 5, 6, 8):
            raise LayoutError(f"the checkpoint's tensors imply int{b} quantization with group size {g} for {path}, "
                              "which MLX does not support (its weight and scales shapes disagree with config.json)",
                              file=model_dir, tensor=f"{path}.scales")
        if not shape or min(shape) < 1 or shape[-1] % g:
            raise LayoutError(f"config.json gives {path} the shape {list(shape)}, which int quantization with "
                              f"group size {g} cannot hold (input width must be a positive multiple of {g})",
                              file=model_dir, tensor=f"{path}.weight")


def _check_dtypes(weights: dict, expected: dict, model_dir) -> None:
    """A tensor the model holds as floating point must be stored as a float (F32, or the
    checkpoint's own half type), an integer one with its exact dtype: a header that
    declares another type of the same width is refused, never served as garbage."""
    halves = [v.dtype for v in weights.values() if v.dtype in (mx.float16, mx.bfloat16)]
    half = max(set(halves), key=halves.count) if halves else None
    for key, value in weights.items():
        want = expected.get(key)
        if want is None:
            continue
        if mx.issubdtype(want.dtype, mx.floating):
            ok = value.dtype == mx.float32 or (value.dtype in (mx.float16, mx.bfloat16) and value.dtype == half)
            if not ok:
                raise LayoutError(f"dtype {value.dtype} where the model holds a floating-point tensor (the "
                                  f"checkpoint's floats are {half or mx.float32})", file=model_dir, tensor=key)
        elif value.dtype != want.dtype:
            raise LayoutError(f"dtype {value.dtype}, expected {want.dtype}", file=model_dir, tensor=key)


def load_resident(model: nn.Module, model_dir: Path, config: dict, files: list[str],
                  is_expert_key: Callable[[str], bool], compute_dtype=None) -> nn.Module:
    """Quantize ``model`` (built, its expert stacks already replaced) as config.json says
    and load every non-expert tensor.

    Loading is strict: a resident parameter missing from the files, or a resident tensor the
    model does not have, is an error naming the key.
    """
    weights: dict = {}
    for f in files:
        for key, value in mx.load(str(f)).items():
            if not is_expert_key(key):
                weights[key] = value
    if hasattr(model, "sanitize"):
        try:
            weights = model.sanitize(weights)
        except Exception as e:
            raise LayoutError(f"mlx-lm's {config.get('model_type')} sanitize step rejects the checkpoint's "
                              f"tensors: {type(e).__name__}: {e}", file=model_dir) from None
    quantization = config.get("quantization") or (config.get("text_config") or {}).get("quantization") or {}

    def class_predicate(path, module):
        if path in quantization:
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    group_size, bits = quantization.get("group_size", 64), quantization.get("bits", 4)
    _check_quantizable(model, class_predicate, group_size, bits, model_dir)
    nn.quantize(model, group_size=group_size, bits=bits, mode=quantization.get("mode", "affine"),
                class_predicate=class_predicate)
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
    _check_dtypes(weights, expected, model_dir)
    model.load_weights(list(weights.items()), strict=True)
    if compute_dtype is not None:
        cast_model(model, compute_dtype)
    mx.eval(model.parameters())
    return model


def load_tokenizer(model_dir: Path):
    """mlx-lm's tokenizer wrapper (with its streaming detokenizer) for a local directory.
    Anything the tokenizer libraries raise is a ``TokenizerError`` naming the directory."""
    from mlx_lm.utils import load_tokenizer as _load

    try:
        return _load(Path(model_dir))
    except Edge0Error:
        raise
    except (Exception, RecursionError) as e:
        raise TokenizerError(f"the tokenizer does not load: {type(e).__name__}: {str(e)[:500]}",
                             file=model_dir) from None


def generate_step(prompt, model, params, *, prefill_step_size: int, max_tokens: int | None = None,
                  prompt_cache=None):
    """mlx-lm's token generator (prefill in chunks, then one token per step, one step of
    look-ahead), with its sampler and logits processors built from ``params`` (a
    SamplingParams); yields (token, logprobs [V])."""
    from mlx_lm.generate import generate_step as _generate_step
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    sampler = make_sampler(params.temp, params.top_p if params.top_p < 1.0 else 0.0, params.min_p,
                           params.min_tokens_to_keep, top_k=params.top_k)
    processors = make_logits_processors(repetition_penalty=params.repetition_penalty,
                                        repetition_context_size=params.repetition_context_size)
    return _generate_step(mx.array(prompt), model, max_tokens=max_tokens or params.max_tokens, sampler=sampler,
                          logits_processors=processors or None, max_kv_size=params.max_kv_size,
                          prompt_cache=prompt_cache, prefill_step_size=prefill_step_size)


def load_full_model(model_dir: Path, experts_per_token: int | None = None) -> nn.Module:
    """mlx-lm's own loader: every weight, experts included, resident (the baseline);
    optionally at another routing width."""
    from mlx_lm.utils import load_model

    override = {}
    if experts_per_token is not None:
        import json

        text = json.loads((Path(model_dir) / "config.json").read_text()).get("text_config")
        override = ({"text_config": {**text, "num_experts_per_tok": experts_per_token}} if isinstance(text, dict)
                    else {"num_experts_per_tok": experts_per_token})
    return load_model(Path(model_dir), model_config=override)[0]


def make_cache(model: nn.Module) -> list:
    """A fresh KV / state cache for ``model`` (mlx-lm's, so hybrid models get theirs)."""
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def cache_nbytes(cache: list) -> int:
    """Bytes a prompt cache (one entry per layer) holds."""
    return sum(c.nbytes for c in cache)


def cache_trimmable(cache: list) -> bool:
    from mlx_lm.models.cache import can_trim_prompt_cache

    return can_trim_prompt_cache(cache)


def trim_cache(cache: list, n: int) -> bool:
    """Drop the last ``n`` tokens of a prompt cache; False when its layers cannot be trimmed
    (state-space and linear-attention layers keep a running state, rotating caches wrap)."""
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    if n == 0:
        return True
    if not can_trim_prompt_cache(cache):
        return False
    return trim_prompt_cache(cache, n) == n


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


def router_weight(router: nn.Module):
    """The router's [E, D] weight as a float32 array, dequantized if it is quantized
    (``router``: a RouterTap, or the router module itself)."""
    lin = router.original if hasattr(router, "original") else router
    if isinstance(lin, nn.QuantizedLinear):
        w = mx.dequantize(lin.weight, lin.scales, lin.biases, group_size=lin.group_size, bits=lin.bits)
    else:
        w = lin.weight
    return w.astype(mx.float32)

log_sigmoid = nn.log_sigmoid


# Below this many weights (out x in) a projection stays one op: cutting it costs more in
# cross-stream hand-offs than the second core gives back.
SPLIT_MIN_WEIGHTS = 1 << 20


class SplitQuantizedLinear(nn.QuantizedLinear):
    """An int4 (any quantized) projection whose output rows are cut into groups, each
    computed on its own stream (so on its own core), then put back in order.

    Each output element is the same quantized dot product over the same row of the weight
    as in one call, so the result is bit-identical; only which thread computes it changes.
    The instance keeps its parameters and stays a ``QuantizedLinear`` (adapters, training
    and merging see the module they expect)."""

    split_threads = 1

    def __call__(self, x):
        n = self.split_threads
        rows = self["weight"].shape[0]
        if n <= 1 or rows < 2 * n:
            return super().__call__(x)
        streams = compute_streams(n)
        bounds = [rows * i // n for i in range(n + 1)]
        biases = self.get("biases")
        outs = []
        for i in range(n):
            a, b = bounds[i], bounds[i + 1]
            with mx.stream(streams[i]):
                outs.append(mx.quantized_matmul(
                    x, self["weight"][a:b], scales=self["scales"][a:b],
                    biases=None if biases is None else biases[a:b], transpose=True,
                    group_size=self.group_size, bits=self.bits, mode=getattr(self, "mode", "affine")))
        y = mx.concatenate(outs, axis=-1)
        if "bias" in self:
            y = y + self["bias"]
        return y


def split_projections(model: nn.Module, threads: int, min_weights: int | None = None) -> int:
    """Let every quantized projection of ``model`` with at least ``min_weights`` weights
    run its output rows over ``threads`` streams (``SplitQuantizedLinear``); returns how
    many do. Expert stacks are not ``QuantizedLinear`` modules and are untouched."""
    if threads <= 1:
        return 0
    limit = SPLIT_MIN_WEIGHTS if min_weights is None else min_weights
    n = 0
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear and "scales" in m:
            out_dim, in_dim = linear_dims(m)
            if out_dim * in_dim >= limit and out_dim >= 2 * threads:
                m.__class__ = SplitQuantizedLinear
                m.split_threads = threads
                n += 1
    return n
