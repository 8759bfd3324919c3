"""Check config.json's values before any model constructor sees them.

mlx-lm's model constructors trust their arguments: a wrong type, a zero or a huge size
surfaces as a TypeError deep inside, a hang while building a billion layers, or a crash
in MLX's quantizer. Edge0 checks first, using what mlx-lm itself declares and what the
checkpoint files hold:

- types: every value whose field the model's ``ModelArgs`` dataclass (or the dataclass its
  ``text_config`` is built into) annotates must have that type (an int where ``int`` is declared, a finite number for ``float``, ...; a float
  is let through for an ``int`` field that is not a size or count, because mlx-lm
  annotates some float fields ``int``);
- sizes: integer fields that are sizes or counts may not be negative, and may not exceed
  what the checkpoint's tensors could hold (a layer count above the layers that have
  weights, a width above 32 x the largest tensor dimension); positions and windows are
  bounded by 2**26;
- numbers: a ``float`` field takes a finite float or an int of at most 64 bits (not
  10**400: MLX converts no larger Python int); an ``int`` field a 64-bit integer;
- every depth (``check_nested``): the objects mlx-lm reads whole (``text_config`` without
  an args class, ``rope_parameters``, ``rope_scaling``, ``linear_attn_config``, ...) have
  no annotations, so the fields every config names alike are checked by name wherever
  they sit: ``rope_theta``, ``factor``, the epsilons ... are finite numbers (positive
  where a kernel divides by them), rope types and dtypes are names, sizes and positions
  obey the bounds above, and no integer is beyond 64 bits;
- what a model reads only at the first token: the keys mistral4 / ministral3 read from
  ``rope_parameters`` (``check_required``), and, once the model is built, the rotary
  dimensions MLX's rope kernel takes (``check_rotary``: positive and even).

Each failure is one ``ConfigError`` naming config.json, the field (its dotted path,
``text_config.rope_parameters.rope_theta``) and the value.
"""

from __future__ import annotations

import math
import re
import types
import typing
from typing import Any

from edge0.errors import ConfigError

POSITION_LIMIT = 2**26
_SIZE_NAME = re.compile(r"(^num_|^n_|_size$|_dim$|_dims$|_heads$|_layers$|_experts$|_rank$|_tok$|^head_dim|"
                        r"^hidden_size|^vocab_size|^intermediate|^moe_|^topk|^top_k|_group$|_groups$)")
_POSITION_NAME = re.compile(r"(position|window|max_|length|context|chunk)")
# sizes that cannot be zero in any model (a zero here divides by zero inside a constructor)
_POSITIVE_NAME = re.compile(r"(heads$|^hidden_size$|^vocab_size$|head_dim$|^num_hidden_layers$|"
                            r"^intermediate_size$|^moe_intermediate_size$|^num_experts_per_tok$|_rank$)")
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_bound(tensor_names) -> int:
    """One more than the largest ``layers.N.`` index among the checkpoint's tensors."""
    best = -1
    for name in tensor_names:
        for m in _LAYER_KEY.finditer(name):
            best = max(best, int(m.group(1)))
    return best + 1


def check_values(config: dict, annotations: list[tuple[dict, dict]], *, max_dim: int, layers: int,
                 where: str = "config.json") -> None:
    """``annotations``: (a config dict, {field: annotation}) pairs, the top level first.
    ``max_dim``: the largest tensor dimension in the checkpoint; ``layers``: how many
    layers have tensors."""
    size_limit = max(32 * max_dim, 1)
    for values, hints in annotations:
        prefix = _prefix_of(config, values)
        for name, value in values.items():
            if name not in hints:
                continue
            hint, label = hints[name], prefix + str(name)
            if hint is not None and not _matches(value, hint) and not _number_for_int(name, value, hint):
                raise ConfigError(f"{where}: field {label!r} must be {_describe(hint)}, got {_show(value)}"
                                  + _range_note(value))
            _check_range(name, value, size_limit, layers, where, label)
            if isinstance(value, list) and hint is not None and typing.get_origin(hint) is not None:
                for i, item in enumerate(value):  # a per-layer list: each entry as the single value
                    _check_range(name, item, size_limit, layers, where, f"{label}[{i}]")


def _prefix_of(config: dict, values: dict) -> str:
    """'' for the top level, 'text_config.' for the nested text config."""
    if values is config:
        return ""
    return next((f"{k}." for k, v in config.items() if v is values), "")


INT64_MAX = 2**63 - 1
# fields that are numbers in every config that has them, at whatever depth (text_config,
# rope_parameters, rope_scaling, per-layer-type rope objects)
_NUMBER_NAME = re.compile(r"(^|_)rope_theta$|^factor$|^beta_fast$|^beta_slow$|^mscale$|^mscale_all_dim$|"
                          r"^low_freq_factor$|^high_freq_factor$|^attention_factor$|^rope_local_base_freq$|"
                          r"(^|_)eps$|(^|_)epsilon$|^routed_scaling_factor$|^llama_4_scaling_beta$|"
                          r"^original_max_position_embeddings$")
_NOT_NULL_NAME = re.compile(r"(^|_)rope_theta$|^factor$|^llama_4_scaling_beta$|^original_max_position_embeddings$")
# numbers a kernel divides by or takes the logarithm of: a norm's epsilon, rope scaling
_POSITIVE_NUMBER_NAME = re.compile(r"norm_eps$|norm_epsilon$|^eps$|^factor$|^beta_fast$|^beta_slow$|"
                                   r"^original_max_position_embeddings$")
_FACTOR_LIST_NAME = re.compile(r"^(short|long)_factor$")  # longrope: one factor per rotary frequency (or one)
_DTYPE_NAME = re.compile(r"^(torch_)?dtype$")
_ROPE_OBJECT = re.compile(r"(^|\.)rope_(scaling|parameters)\.")
_DTYPE_VALUE = re.compile(r"[a-z][a-z0-9_]{0,39}")
# objects Edge0 never builds from (vision and audio towers) or checks on their own (quantization)
_SKIPPED_NAME = re.compile(r"^quantization(_config)?$|vision|visual|audio|speech|image|video|projector")


def check_nested(config: dict, annotations: list[tuple[dict, dict]], *, max_dim: int, layers: int,
                 where: str = "config.json") -> None:
    """The fields at every depth, by name: a number field (``rope_theta``, ``factor``, an
    epsilon) holds a finite number (a positive one where a kernel divides by it), a
    ``dtype`` a dtype name; a size, count or position integer that no annotation covers
    obeys ``check_values``'s bounds; no integer inside a nested object or list, or inside
    an annotated field, is beyond 64 bits. Top-level fields without an annotation are not
    read by mlx-lm: only their name rules apply. Where an annotation allows null, null
    is left to it."""
    hints_of = {id(values): hints for values, hints in annotations}
    ctx = (max(32 * max_dim, 1), layers, where, hints_of)
    for name, value in config.items():
        if not isinstance(name, str) or _SKIPPED_NAME.search(name):
            continue
        read = name in hints_of.get(id(config), {})
        if not (read and value is None):
            _check_number(name, value, name, where)
        if read or isinstance(value, (dict, list)):
            _walk(value, name, name, ctx)


# what mlx-lm's models read unconditionally at the first token (after a constructor that
# does not): model_type -> (field, the keys it must hold)
_REQUIRED = {
    "mistral4": ("rope_parameters", ("llama_4_scaling_beta", "original_max_position_embeddings")),
    "ministral3": ("rope_parameters", ("llama_4_scaling_beta", "original_max_position_embeddings", "rope_theta")),
}


def check_required(config: dict, where: str = "config.json") -> None:
    """The objects a model reads whole at every token hold the keys it reads
    (``_REQUIRED``), at the top level and in ``text_config``."""
    text = config.get("text_config")
    for prefix, values in (("", config), ("text_config.", text if isinstance(text, dict) else {})):
        model_type = values.get("model_type")
        if not isinstance(model_type, str) or model_type not in _REQUIRED:
            continue
        field, keys = _REQUIRED[model_type]
        value = values.get(field)
        missing = [k for k in keys if not isinstance(value, dict) or k not in value]
        if missing:
            found = f"it lacks {', '.join(missing)}" if isinstance(value, dict) else f"got {_show(value)}"
            raise ConfigError(f"{where}: field {prefix + field!r} must be an object holding {', '.join(keys)} "
                              f"(mlx-lm's {model_type} model reads them at every token); {found}")


def _walk(value: Any, key: str, label: str, ctx) -> None:
    size_limit, layers, where, hints_of = ctx
    if isinstance(value, dict):
        hints = hints_of.get(id(value), {})
        for name, inner in value.items():
            if not isinstance(name, str) or _SKIPPED_NAME.search(name):
                continue
            at = f"{label}.{name}"
            if not (name in hints and inner is None):
                _check_number(name, inner, at, where)
            if name not in hints and isinstance(inner, int) and not isinstance(inner, bool) and abs(inner) <= INT64_MAX:
                _check_range(name, inner, size_limit, layers, where, at)
            _walk(inner, name, at, ctx)
    elif isinstance(value, list):
        for i, inner in enumerate(value[:4096]):
            _walk(inner, key, f"{label}[{i}]", ctx)
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
        raise ConfigError(f"{where}: field {label!r} is {_show(value)}, beyond the range of a 64-bit integer")


def _check_number(name: str, value: Any, label: str, where: str) -> None:
    """The rules by name: numbers, positive numbers, lists of numbers, dtype and rope
    type names."""
    if name == "rope_type" or (name == "type" and _ROPE_OBJECT.search(label)):
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{where}: field {label!r} must be a rope type name (a string), got {_show(value)}")
        return
    if _DTYPE_NAME.search(name):
        if value is not None and not isinstance(value, dict) and not (  # an object: one per sub-model
                isinstance(value, str) and _DTYPE_VALUE.fullmatch(value)):
            raise ConfigError(f"{where}: field {label!r} must be a dtype name (bfloat16, float16, ...), "
                              f"got {_show(value)}")
        return
    if _FACTOR_LIST_NAME.search(name) and value is not None:
        if not _finite_number(value) and not (isinstance(value, list) and all(_finite_number(v) for v in value)):
            raise ConfigError(f"{where}: field {label!r} must be a list of finite numbers, got {_show(value)}")
        return
    if not _NUMBER_NAME.search(name) or (value is None and not _NOT_NULL_NAME.search(name)):
        return
    if not _finite_number(value):
        raise ConfigError(f"{where}: field {label!r} must be a finite number, got {_show(value)}"
                          + _range_note(value))
    if _POSITIVE_NUMBER_NAME.search(name) and value <= 0:
        raise ConfigError(f"{where}: field {label!r} must be a positive number, got {_show(value)}")


def _finite_number(value: Any) -> bool:
    """A finite float, or an int (not a bool) of at most 64 bits: MLX converts a larger
    Python int to no array type (``std::bad_cast`` the first time it meets an array)."""
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= INT64_MAX


def _range_note(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) <= INT64_MAX:
        return ""
    return " (beyond the range of a 64-bit integer)"


def _show(value: Any) -> str:
    """A short rendering of a hostile value: a 400-digit integer by its length."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an integer of {len(str(abs(value)))} digits ({str(value)[:12]}...)"
    return f"{value!r:.80}"


# fractions of a dimension: a value outside (0, 1] gives rotary dimensions that no kernel takes
_FRACTION_NAME = re.compile(r"^partial_rotary_factor$")


def check_fractions(config: Any, where: str = "config.json", path: str = "") -> None:
    """Every field that is a fraction of a dimension (``partial_rotary_factor``), at any
    depth of config.json (``text_config``, ``rope_parameters``), is a number in (0, 1]."""
    if isinstance(config, dict):
        for name, value in config.items():
            at = f"{path}.{name}" if path else str(name)
            if isinstance(name, str) and _FRACTION_NAME.search(name) and value is not None:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1
                if not ok:
                    raise ConfigError(f"{where}: field {at!r} must be a fraction in (0, 1], got {value!r:.80}")
            else:
                check_fractions(value, where, at)
    elif isinstance(config, list):
        for i, value in enumerate(config[:4096]):
            check_fractions(value, where, f"{path}[{i}]")


def _number_for_int(name: str, value: Any, hint) -> bool:
    """mlx-lm annotates some float-valued fields ``int`` (gpt_oss ``rope_theta``, mimo_v2_flash
    ``partial_rotary_factor``) and real configs write floats there; a float is accepted for
    an ``int`` field unless the field is a size or count, where it would break a constructor."""
    ints = hint is int or int in typing.get_args(hint)
    return ints and isinstance(value, float) and not _SIZE_NAME.search(name)


def _check_range(name: str, value: Any, size_limit: int, layers: int, where: str, label: str | None = None) -> None:
    label = label or name
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: field {label!r} must be finite, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        return
    if _POSITION_NAME.search(name):
        if value < 0:
            raise ConfigError(f"{where}: field {label!r} must not be negative, got {_show(value)}")
        if value > POSITION_LIMIT:
            raise ConfigError(f"{where}: field {label!r} is {_show(value)}, over the limit of {POSITION_LIMIT}")
        return
    if not _SIZE_NAME.search(name):
        return
    if value < 0:
        raise ConfigError(f"{where}: field {label!r} must not be negative, got {_show(value)}")
    if value == 0 and _POSITIVE_NAME.search(name):
        raise ConfigError(f"{where}: field {label!r} must be at least 1, got 0")
    if name.endswith("_layers") and "hidden" in name and value > max(layers, 1):
        raise ConfigError(f"{where}: field {label!r} is {_show(value)}, but the checkpoint has tensors for "
                          f"{layers} layers")
    if value > size_limit:
        raise ConfigError(f"{where}: field {label!r} is {_show(value)}, larger than any tensor of the checkpoint "
                          f"could hold (limit {size_limit})")


def _matches(value: Any, hint) -> bool:
    origin = typing.get_origin(hint)
    if hint is typing.Any or hint is object:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is bool:
        return isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= INT64_MAX
    if hint is float:
        return isinstance(value, float) or _finite_number(value)  # NaN and inf: "must be finite" below
    if hint is str:
        return isinstance(value, str)
    if hint in (list, tuple) or origin in (list, tuple, typing.Sequence):
        if not isinstance(value, list):
            return False
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return len(args) != 1 or all(_matches(v, args[0]) for v in value)
    if hint is dict or origin is dict:
        return isinstance(value, dict)
    return True  # an annotation this check does not model (a class, a callable): mlx-lm decides


def _describe(hint) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object"}
    if hint in names:
        return names[hint]
    if hint in (list, tuple) or origin in (list, tuple, typing.Sequence):
        return "a list"
    return getattr(hint, "__name__", str(hint))


_ROTARY_NAME = re.compile(r"partial_rotary_factor|rotary_dim|rope_head_dim|rope_dim|^head_dim$")


def check_rotary(dims: list[tuple[str, int]], config: dict, where: str = "config.json") -> None:
    """Every rotary embedding of the built model rotates a positive, even number of
    dimensions (MLX's rope kernel refuses any other at the first token). ``dims``: (module
    path, dimensions) pairs; the message names the config fields that set them."""
    for path, d in dims:
        if d < 2 or d % 2:
            found = sorted(_fields(config, _ROTARY_NAME), key=lambda kv: kv[0].endswith("head_dim"))  # fractions first
            fields = ", ".join(f"{k} = {_show(v)}" for k, v in found[:6]) or "the head size"
            raise ConfigError(f"{where}: {fields} give the rotary embedding {path} {d} dimensions; MLX's rope kernel "
                              "takes a positive even number")


def _fields(config: Any, pattern, path: str = "") -> list[tuple[str, Any]]:
    out = []
    if isinstance(config, dict):
        for name, value in config.items():
            at = f"{path}.{name}" if path else str(name)
            if isinstance(name, str) and pattern.search(name) and not isinstance(value, (dict, list)):
                out.append((at, value))
            out += _fields(value, pattern, at) if isinstance(value, dict) else []
    return out


QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUPS = (32, 64, 128)
QUANT_MODES = ("affine",)


def check_quantization(config: dict, where: str = "config.json") -> None:
    """The ``quantization`` (and ``quantization_config``) objects, top level and nested
    text config: bits, group size and mode of the whole model and of every per-module
    override are values MLX's quantizer accepts."""
    blocks = [(k, config.get(k)) for k in ("quantization", "quantization_config")]
    text = config.get("text_config")
    if isinstance(text, dict):
        blocks += [(f"text_config.{k}", text.get(k)) for k in ("quantization", "quantization_config")]
    for name, q in blocks:
        if q is None:
            continue
        if not isinstance(q, dict):
            raise ConfigError(f"{where}: field {name!r} must be an object, got {q!r:.60}")
        _check_quant_params(q, name, where, top=True)
        for module, override in q.items():
            if module in ("bits", "group_size", "mode"):
                continue
            if isinstance(override, bool):
                continue  # True/False: quantize this module with the defaults / leave it unquantized
            if not isinstance(override, dict):
                raise ConfigError(f"{where}: {name}[{module!r}] must be an object or true/false, got {override!r:.60}")
            _check_quant_params(override, f"{name}[{module!r}]", where, top=False)


def _check_quant_params(q: dict, name: str, where: str, top: bool) -> None:
    for key, allowed in (("bits", QUANT_BITS), ("group_size", QUANT_GROUPS), ("mode", QUANT_MODES)):
        if key not in q and (not top or key == "mode"):
            continue
        value = q.get(key)
        if isinstance(value, bool) or value not in allowed:
            raise ConfigError(f"{where}: {name}.{key} must be one of {', '.join(map(str, allowed))}, got {value!r:.40}")
