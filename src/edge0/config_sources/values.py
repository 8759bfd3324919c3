"""Typed values of EngineConfig fields: checking a value that already has a Python type
(TOML, keyword overrides, a command's defaults), parsing a value given as text (environment,
``KEY=VALUE`` settings lists), and the ``LAYER:PHASE=PATH`` layer-path spec. Every mistake is
a ``ConfigError`` naming the source and the field.
"""

from __future__ import annotations

import re

from edge0.config_sources.fields import (
    INT,
    LAYER_PATH_SYNTAX,
    LAYER_PATHS,
    OPT_INT,
    OPT_STR,
    STR,
    STRS,
    none_word,
)
from edge0.errors import ConfigError

_NONE_WORDS = ("none", "")
_INT_RE = re.compile(r"[+-]?\d+")
_LAYER_PATH_RE = re.compile(r"\s*(\d+)\s*:\s*([A-Za-z_]+)\s*=\s*([A-Za-z_]+)\s*")


def expects(kind: str) -> str:
    """What a field of this kind takes, in words (for error messages)."""
    return {INT: "an integer", OPT_INT: "an integer or none", STR: "a string",
            OPT_STR: "a string or none", STRS: "a list of strings",
            LAYER_PATHS: f"a list of [layer, phase, path] entries or {LAYER_PATH_SYNTAX} strings"}[kind]


def check_native(name: str, kind: str, value, source: str):
    """A value that already has a Python type (TOML, keyword override): check it, return it."""
    def bad():
        return ConfigError(f"{source}: field {name} expects {expects(kind)}, got {value!r}")

    if kind in (OPT_INT, OPT_STR) and (value is None or (value == none_word(name) and value is not None)):
        return None
    if kind in (INT, OPT_INT):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if kind in (STR, OPT_STR):
        if not isinstance(value, str):
            raise bad()
        return value
    if kind == STRS:
        if isinstance(value, str):
            return (value,)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise bad()
        return tuple(value)
    # layer_paths
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise bad()
    return _native_layer_paths(name, value, source)


def _native_layer_paths(name: str, value, source: str) -> tuple[tuple[int, str, str], ...]:
    """layer_paths given as a list: ``[layer, phase, path]`` entries or ``LAYER:PHASE=PATH`` strings."""
    entries = []
    for entry in value:
        if isinstance(entry, str):
            entries.extend(parse_layer_paths(entry, f"{source}: field {name}"))
            continue
        if (not isinstance(entry, (list, tuple)) or len(entry) != 3
                or isinstance(entry[0], bool) or not isinstance(entry[0], int)
                or not isinstance(entry[1], str) or not isinstance(entry[2], str)):
            raise ConfigError(f"{source}: field {name} entries are [layer, phase, path] "
                              f"(integer, string, string) or {LAYER_PATH_SYNTAX} strings, got {entry!r}")
        entries.append((entry[0], entry[1], entry[2]))
    return tuple(entries)


def parse_layer_paths(text: str, where: str) -> tuple[tuple[int, str, str], ...]:
    """``"3:decode=hot,5:prefill=exact"`` -> ``((3, "decode", "hot"), (5, "prefill", "exact"))``."""
    entries = []
    for part in text.split(","):
        if not part.strip():
            continue
        m = _LAYER_PATH_RE.fullmatch(part)
        if m is None:
            raise ConfigError(f"{where}: expected {LAYER_PATH_SYNTAX} (e.g. 3:decode=hot), "
                              f"comma-separated for several, got {part.strip()!r}")
        entries.append((int(m.group(1)), m.group(2), m.group(3)))
    return tuple(entries)


def parse_text(name: str, kind: str, text: str, source: str):
    """A value given as text (environment): parse it strictly for the field's type."""
    if kind in (OPT_INT, OPT_STR) and text.strip().lower() in (*_NONE_WORDS, none_word(name)):
        return None
    if kind in (INT, OPT_INT):
        if not _INT_RE.fullmatch(text.strip()):
            raise ConfigError(f"{source}: field {name} expects {expects(kind)}, got {text!r}")
        return int(text.strip())
    if kind in (STR, OPT_STR):
        return text
    if kind == STRS:
        return tuple(part for part in (p.strip() for p in text.split(",")) if part)
    return parse_layer_paths(text, f"{source}: field {name}")
