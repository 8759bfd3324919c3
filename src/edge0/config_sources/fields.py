"""EngineConfig's fields as the config sources see them: the names, the kind of value each
field takes (what its text is parsed as), its default as the docs show it, its doc and
choices (the ``setting``'s metadata in ``edge0/config.py``), and its environment variable
and CLI flag; plus the constants every
source shares (``EDGE0_`` prefix, ``EDGE0_CONFIG``, the ``[engine]`` table, ``--layer-path``).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing

from edge0.config import EngineConfig

ENV_PREFIX = "EDGE0_"
CONFIG_ENV = "EDGE0_CONFIG"          # the TOML file, when neither toml_path nor --config names one
TOML_TABLE = "engine"                # keys may sit at top level or under [engine]
LAYER_PATH_FLAG = "--layer-path"     # repeatable CLI flag for layer_paths
LAYER_PATH_SYNTAX = "LAYER:PHASE=PATH"

# Field kinds the sources know how to read from text.
INT, OPT_INT, STR, OPT_STR, LAYER_PATHS, STRS = "int", "int?", "str", "str?", "layer_paths", "strs"


def fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(EngineConfig)


def field_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields())


def kinds() -> dict[str, str]:
    """Field name -> its kind (``INT``, ``OPT_INT``, ``STR``, ``OPT_STR``, ``LAYER_PATHS``, ``STRS``)."""
    hints = typing.get_type_hints(EngineConfig)
    return {f.name: _kind(f.name, hints[f.name]) for f in fields()}


def none_word(name: str) -> str | None:
    """The word that stands for None in field ``name``'s text (``auto``, ``off``), where its
    ``setting`` names None by one word; else None."""
    word = next(f for f in fields() if f.name == name).metadata.get("none")
    return word if isinstance(word, str) and word.isalpha() else None


def _kind(name: str, hint) -> str:
    if hint is int:
        return INT
    if hint is str:
        return STR
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if rest == [int]:
            return OPT_INT
        if rest == [str]:
            return OPT_STR
    if name == "layer_paths":
        return LAYER_PATHS
    if origin is tuple and args == (str, Ellipsis):
        return STRS
    raise TypeError(f"edge0.config_sources cannot read EngineConfig.{name} of type {hint!r} from "
                    "TOML/environment/CLI; teach edge0/config_sources/fields.py this type")


def default(f: dataclasses.Field):
    """A field's default value (``dataclasses.MISSING`` when it has none)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def show(value) -> str:
    """A default as the docs show it: ``"float32"``, ``32``, ``None``, ``none`` (empty list)."""
    if isinstance(value, str):
        return json.dumps(value)
    if value == ():
        return "none"
    return repr(value)


def valid_names() -> str:
    return ", ".join(field_names())


def field_docs() -> dict[str, str]:
    """Field name -> its doc (the ``setting``'s, in ``edge0/config.py``)."""
    return {f.name: f.metadata["doc"] for f in fields()}


def choices(name: str) -> tuple:
    """The values a field takes when it has a fixed set (else empty)."""
    return next(f.metadata["choices"] for f in fields() if f.name == name)


def env_var(name: str) -> str:
    """The environment variable of a field: ``EDGE0_`` + NAME."""
    return ENV_PREFIX + name.upper()


def flag(name: str) -> str:
    """The CLI flag of a field: ``--`` + name with dashes (``layer_paths`` also has ``--layer-path``)."""
    return "--" + name.replace("_", "-")
