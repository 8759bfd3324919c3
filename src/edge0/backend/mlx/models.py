"""Model classes and loading of the resident part of a model (MLX, mlx-lm).

Everything but the routed experts is built and loaded with mlx-lm's own model classes
and its quantization rules: ``model_classes`` finds the (model, args) classes of a
config, ``build_model`` instantiates them lazily, ``load_resident`` quantizes and loads
every non-expert tensor strictly (``_check_quantizable`` and ``_check_dtypes`` refuse
what MLX cannot hold), and ``load_full_model`` is mlx-lm's own loader for the baseline.
The routed-expert tensors are dropped from the lazy weight dict before anything is
evaluated, so they are never read into memory (``mx.load`` reads a whole tensor the
first time any of it is evaluated).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, infer_quant_config

from edge0.backend.mlx.convert import cast_model
from edge0.errors import ConfigError, Edge0Error, LayoutError, UnsupportedModelError


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
        per_layer = _per_layer_fields(cls)
        for f in dataclasses.fields(cls):
            hint = types_.get(f.name)
            if f.name in per_layer and hint is int:  # the model reads it as one value or one per layer
                hint = typing.Union[int, typing.List[int]]
            # ``x: Dict = None``: mlx-lm's own default makes null a valid value
            out[f.name] = typing.Optional[hint] if hint is not None and f.default is None else hint
        return out

    out = [(config, hints(args_class))]
    nested = config.get("text_config")
    if isinstance(nested, dict):
        text_cls = _text_args_class(model_class, args_class, nested)
        if text_cls is not None:
            out.append((nested, hints(text_cls)))
    return out


def _per_layer_fields(cls) -> set[str]:
    """Fields the model module passes through its ``_int_or_list(args.FIELD, layer)``
    helper (Hunyuan's ``moe_topk``, ``num_shared_expert``, ``moe_intermediate_size``):
    annotated ``int``, read as one value or as a list with one per layer."""
    import inspect
    import re
    import sys

    module = sys.modules.get(cls.__module__)
    if module is None or not hasattr(module, "_int_or_list"):
        return set()
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return set()
    return set(re.findall(r"_int_or_list\(\s*args\.(\w+)", source))


def _text_args_class(model_class, args_class, text_config: dict):
    """The dataclass mlx-lm builds ``text_config`` into: one named in the args class's
    ``text_config`` annotation (kimi_k25), else ``TextModelArgs`` / ``TextArgs`` of the
    model's module or of a module it inherits from (qwen3_5_moe's model is qwen3_5's), else
    the args class of ``text_config``'s own model_type (qwen3_vl_moe's text model is a
    qwen3_moe model); None when there is none."""
    import dataclasses
    import importlib
    import inspect
    import typing

    try:
        hint = typing.get_type_hints(args_class).get("text_config")
    except Exception:
        hint = None
    for h in (hint, *typing.get_args(hint)):
        if isinstance(h, type) and dataclasses.is_dataclass(h):
            return h
    for cls in inspect.getmro(model_class):
        if not cls.__module__.startswith("mlx_lm."):
            continue
        module = importlib.import_module(cls.__module__)
        found = getattr(module, "TextModelArgs", None) or getattr(module, "TextArgs", None)
        if found is not None:
            return found
    inner = text_config.get("model_type")
    if isinstance(inner, str) and inner != args_class.__module__.rpartition(".")[2]:
        try:
            return _get_classes({"model_type": inner})[1]
        except (ValueError, ImportError, AttributeError, KeyError):
            return None
    return None


def _model_args(args_class, config: dict):
    """``args_class.from_dict(config)``; where the class keeps mlx-lm's own ``from_dict``
    (which asks for the class's signature once per key) the keys it would ignore are
    dropped first, with one signature."""
    import inspect

    from mlx_lm.models.base import BaseModelArgs

    if getattr(args_class.from_dict, "__func__", None) is BaseModelArgs.from_dict.__func__:
        known = inspect.signature(args_class).parameters
        config = {k: v for k, v in config.items() if k in known}
    return args_class.from_dict(config)


def build_model(config: dict, replace_blocks: Callable[[nn.Module], None] = lambda m: None,
                config_file: str = "config.json"):
    """Instantiate the mlx-lm model of ``config`` (its arrays stay lazy: nothing is
    allocated) and let ``replace_blocks`` swap modules. Whatever mlx-lm's constructors
    reject is a ConfigError naming config.json."""
    model_class, args_class = model_classes(config)
    try:
        model = model_class(_model_args(args_class, config))
    except Edge0Error:
        raise
    except (Exception, RecursionError) as e:
        raise ConfigError(f"{config_file}: mlx-lm's {config.get('model_type')} model rejects these values: "
                          f"{type(e).__name__}: {e}") from None
    replace_blocks(model)
    return model


def rotary_dims(model: nn.Module) -> list[tuple[str, int]]:
    """(module path, rotated dimensions) of every rotary embedding of ``model`` (MLX's
    ``RoPE`` and mlx-lm's scaled variants: the classes named ``*RoPE``)."""
    out = []
    for path, module in model.named_modules():
        if type(module).__name__.endswith("RoPE"):
            dims = getattr(module, "dims", None)
            if isinstance(dims, int) and not isinstance(dims, bool):
                out.append((path, dims))
    return out


def kv_width(model: nn.Module) -> tuple[int, list[str]]:
    """(cached elements per token over every attention module, the paths of attention-like
    modules whose cache this cannot size): a module with ``k_proj`` and
    ``v_proj`` caches their outputs (keys and values) for every token; the shapes are the
    skeleton's, no weight is read."""
    width, unknown = 0, []
    for path, module in model.named_modules():
        k, v = getattr(module, "k_proj", None), getattr(module, "v_proj", None)
        if k is not None and v is not None and hasattr(k, "weight") and hasattr(v, "weight"):
            width += int(k.weight.shape[0]) + int(v.weight.shape[0])
        elif path.endswith(("self_attn", "attention", "attn")):
            unknown.append(path)
    return width, unknown


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
        if not hasattr(module, "to_quantized"):  # (a pipeline rank's stand-in for another rank's module)
            return False
        if path in quantization:
            return quantization[path]
        if f"{path}.scales" not in weights:
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


def load_teacher(model_dir: Path) -> nn.Module:
    """A teacher (a float checkpoint) for training and evaluation, computing in float32
    whatever dtype its file stores: a bfloat16 copy of a float32 teacher (what the repository
    keeps, ``tools/teacher_copy.py``) is read as the original is, its weights rounded once."""
    model = load_full_model(model_dir)
    cast_model(model, mx.float32)
    return model
