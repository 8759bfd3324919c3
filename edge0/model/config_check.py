"""Check config.json's values before any model constructor sees them.

mlx-lm's model constructors trust their arguments: a wrong type, a zero or a huge size
surfaces as a TypeError deep inside, a hang while building a billion layers, or a crash
in MLX's quantizer. Edge0 checks first, using what mlx-lm itself declares and what the
checkpoint files hold:

- types: every value whose field the model's ``ModelArgs`` dataclass annotates must have
  that type (an int where ``int`` is declared, a finite number for ``float``, ...; a float
  is let through for an ``int`` field that is not a size or count, because mlx-lm
  annotates some float fields ``int``);
- sizes: integer fields that are sizes or counts may not be negative, and may not exceed
  what the checkpoint's tensors could hold (a layer count above the layers that have
  weights, a width above 32 x the largest tensor dimension); positions and windows are
  bounded by 2**26.

Each failure is one ``ConfigError`` naming config.json, the field and the value.
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
        for name, value in values.items():
            if name not in hints:
                continue
            hint = hints[name]
            if hint is not None and not _matches(value, hint) and not _number_for_int(name, value, hint):
                raise ConfigError(f"{where}: field {name!r} must be {_describe(hint)}, got {value!r:.80}")
            _check_range(name, value, size_limit, layers, where)


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


def _check_range(name: str, value: Any, size_limit: int, layers: int, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: field {name!r} must be finite, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        return
    if _POSITION_NAME.search(name):
        if value > POSITION_LIMIT:
            raise ConfigError(f"{where}: field {name!r} is {value}, over the limit of {POSITION_LIMIT}")
        return
    if not _SIZE_NAME.search(name):
        return
    if value < 0:
        raise ConfigError(f"{where}: field {name!r} must not be negative, got {value}")
    if value == 0 and _POSITIVE_NAME.search(name):
        raise ConfigError(f"{where}: field {name!r} must be at least 1, got 0")
    if name.endswith("_layers") and "hidden" in name and value > max(layers, 1):
        raise ConfigError(f"{where}: field {name!r} is {value}, but the checkpoint has tensors for "
                          f"{layers} layers")
    if value > size_limit:
        raise ConfigError(f"{where}: field {name!r} is {value}, larger than any tensor of the checkpoint "
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
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
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
