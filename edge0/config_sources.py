"""Where an EngineConfig's values come from: defaults, a TOML file, EDGE0_* environment
variables, CLI flags and keyword overrides.

Each source turns its text into typed values (and says which source and which field when
it cannot); ``resolve_config`` merges them, lowest to highest precedence::

    dataclass defaults < TOML file < environment < CLI flags < keyword overrides

and builds one ``EngineConfig`` from the merged values, so that ``EngineConfig.__post_init__``
validates them once. When that validation fails, the error is re-raised with the source
that set the offending field appended.

Syntaxes (``docs/CONFIG.md`` has the table of every field):

- TOML: keys at top level or under ``[engine]``;
  ``layer_paths = [[3, "decode", "hot"], [5, "prefill", "exact"]]``.
- Environment: ``EDGE0_<FIELD>``; ``none`` or an empty value means None for fields that
  accept None; ``EDGE0_LAYER_PATHS="3:decode=hot,5:prefill=exact"``. ``EDGE0_CONFIG`` names
  the TOML file. Other ``EDGE0_*`` variables (``EDGE0_CACHE``, ...) are not config and are
  ignored.
- CLI: ``--<field-with-dashes> VALUE``; ``none`` for fields that accept None;
  ``--layer-path 3:decode=hot`` (repeatable); ``--config FILE``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path

from edge0 import config as _config_module
from edge0.config import EngineConfig
from edge0.errors import ConfigError

__all__ = [
    "field_docs", "env_var", "flag", "config_from_toml", "config_from_env", "add_config_flags",
    "config_from_args", "resolve_config", "config_table_markdown",
    "ENV_PREFIX", "CONFIG_ENV", "TOML_TABLE", "LAYER_PATH_FLAG", "LAYER_PATH_SYNTAX",
]

ENV_PREFIX = "EDGE0_"
CONFIG_ENV = "EDGE0_CONFIG"          # the TOML file, when neither toml_path nor --config names one
TOML_TABLE = "engine"                # keys may sit at top level or under [engine]
LAYER_PATH_FLAG = "--layer-path"     # repeatable CLI flag for layer_paths
LAYER_PATH_SYNTAX = "LAYER:PHASE=PATH"

# Fields whose CLI flag gets argparse ``choices``: field -> name of the tuple in edge0.config.
_CHOICES = {
    "compute_dtype": "COMPUTE_DTYPES",
    "decode_path": "PATHS",
    "prefill_path": "PREFILL_PATHS",
    "log_format": "LOG_FORMATS",
    "log_level": "LOG_LEVELS",
    "staged_source": "STAGED_SOURCES",
    "prerouter": "PREROUTER_MODES",
}

# Field kinds this module knows how to read from text.
_INT, _OPT_INT, _STR, _OPT_STR, _LAYER_PATHS, _STRS = "int", "int?", "str", "str?", "layer_paths", "strs"
_NONE_WORDS = ("none", "")
_INT_RE = re.compile(r"[+-]?\d+")
_LAYER_PATH_RE = re.compile(r"\s*(\d+)\s*:\s*([A-Za-z_]+)\s*=\s*([A-Za-z_]+)\s*")
_GIVEN_ATTR = "_edge0_config_given"   # set of dests given on the command line (see _GivenAction)


# --------------------------------------------------------------------------- field metadata

def _fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(EngineConfig)


def _field_names() -> tuple[str, ...]:
    return tuple(f.name for f in _fields())


def _kinds() -> dict[str, str]:
    hints = typing.get_type_hints(EngineConfig)
    return {f.name: _kind(f.name, hints[f.name]) for f in _fields()}


def _kind(name: str, hint) -> str:
    if hint is int:
        return _INT
    if hint is str:
        return _STR
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if rest == [int]:
            return _OPT_INT
        if rest == [str]:
            return _OPT_STR
    if name == "layer_paths":
        return _LAYER_PATHS
    if origin is tuple and args == (str, Ellipsis):
        return _STRS
    raise TypeError(f"edge0.config_sources cannot read EngineConfig.{name} of type {hint!r} from "
                    "TOML/environment/CLI; teach edge0/config_sources.py this type")


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _show(value) -> str:
    """A default as the docs show it: ``"float32"``, ``32``, ``None``, ``none`` (empty list)."""
    if isinstance(value, str):
        return json.dumps(value)
    if value == ():
        return "none"
    return repr(value)


def _valid_names() -> str:
    return ", ".join(_field_names())


def field_docs() -> dict[str, str]:
    """Field name -> the ``#`` comment above it in ``edge0/config.py`` (lines joined).

    A field with no comment of its own directly after another field shares that field's
    comment (``decode_path``/``prefill_path``, ``log_format``/``log_level``).
    """
    names = set(_field_names())
    docs: dict[str, str] = {}
    pending: list[str] = []
    last_text = ""
    previous_was_field = False
    field_re = re.compile(r"\s*([A-Za-z_]\w*)\s*:")
    try:
        source = inspect.getsource(EngineConfig)
    except (OSError, TypeError):  # no source (frozen/zipped install): no comments
        source = ""
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith(("def ", "async def ")):
            break  # the fields are over
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            previous_was_field = False
            continue
        m = field_re.match(line)
        if m and m.group(1) in names and m.group(1) not in docs:
            if pending:
                text = " ".join(p for p in pending if p)
            else:
                text = last_text if previous_was_field else ""
            docs[m.group(1)] = text
            last_text, pending, previous_was_field = text, [], True
            continue
        pending, previous_was_field = [], False
    return {name: docs.get(name, "") for name in _field_names()}


def env_var(name: str) -> str:
    """The environment variable of a field: ``EDGE0_`` + NAME."""
    return ENV_PREFIX + name.upper()


def flag(name: str) -> str:
    """The CLI flag of a field: ``--`` + name with dashes (``layer_paths`` also has ``--layer-path``)."""
    return "--" + name.replace("_", "-")


# --------------------------------------------------------------------------- typed values

def _expects(kind: str) -> str:
    return {_INT: "an integer", _OPT_INT: "an integer or none", _STR: "a string",
            _OPT_STR: "a string or none", _STRS: "a list of strings",
            _LAYER_PATHS: f"a list of [layer, phase, path] entries or {LAYER_PATH_SYNTAX} strings"}[kind]


def _check_native(name: str, kind: str, value, source: str):
    """A value that already has a Python type (TOML, keyword override): check it, return it."""
    def bad():
        return ConfigError(f"{source}: field {name} expects {_expects(kind)}, got {value!r}")

    if value is None and kind in (_OPT_INT, _OPT_STR):
        return None
    if kind in (_INT, _OPT_INT):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if kind in (_STR, _OPT_STR):
        if not isinstance(value, str):
            raise bad()
        return value
    if kind == _STRS:
        if isinstance(value, str):
            return (value,)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise bad()
        return tuple(value)
    # layer_paths
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise bad()
    entries = []
    for entry in value:
        if isinstance(entry, str):
            entries.extend(_parse_layer_paths(entry, f"{source}: field {name}"))
            continue
        if (not isinstance(entry, (list, tuple)) or len(entry) != 3
                or isinstance(entry[0], bool) or not isinstance(entry[0], int)
                or not isinstance(entry[1], str) or not isinstance(entry[2], str)):
            raise ConfigError(f"{source}: field {name} entries are [layer, phase, path] "
                              f"(integer, string, string) or {LAYER_PATH_SYNTAX} strings, got {entry!r}")
        entries.append((entry[0], entry[1], entry[2]))
    return tuple(entries)


def _parse_layer_paths(text: str, where: str) -> tuple[tuple[int, str, str], ...]:
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


def _parse_text(name: str, kind: str, text: str, source: str):
    """A value given as text (environment): parse it strictly for the field's type."""
    if kind in (_OPT_INT, _OPT_STR) and text.strip().lower() in _NONE_WORDS:
        return None
    if kind in (_INT, _OPT_INT):
        if not _INT_RE.fullmatch(text.strip()):
            raise ConfigError(f"{source}: field {name} expects {_expects(kind)}, got {text!r}")
        return int(text.strip())
    if kind in (_STR, _OPT_STR):
        return text
    if kind == _STRS:
        return tuple(part for part in (p.strip() for p in text.split(",")) if part)
    return _parse_layer_paths(text, f"{source}: field {name}")


# --------------------------------------------------------------------------- TOML

def config_from_toml(path) -> dict:
    """The values a TOML file sets (top level or under ``[engine]``), typed and checked."""
    path = Path(path)
    source = f"TOML file {path}"
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{source}: file not found") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{source}: invalid TOML: {err}") from None
    except OSError as err:
        raise ConfigError(f"{source}: cannot read: {err.strerror or err}") from None

    raw: dict = {}
    section = data.pop(TOML_TABLE, None)
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f"{source}: {TOML_TABLE!r} must be a table ([{TOML_TABLE}]), got {section!r}")
    kinds = _kinds()
    for where, table in (("top level", data), (f"[{TOML_TABLE}]", section or {})):
        unknown = [k for k in table if k not in kinds]
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))} at {where}; "
                              f"valid fields: {_valid_names()}")
    for key in section or {}:
        if key in data:
            raise ConfigError(f"{source}: field {key} is set both at top level and under [{TOML_TABLE}]; "
                              "set it once")
    raw.update(data)
    raw.update(section or {})
    return {name: _check_native(name, kinds[name], value, source) for name, value in raw.items()}


# --------------------------------------------------------------------------- environment

def config_from_env(environ: Mapping[str, str] | None = None) -> dict:
    """The values EDGE0_<FIELD> variables set. Other EDGE0_* variables are ignored."""
    environ = os.environ if environ is None else environ
    out = {}
    for name, kind in _kinds().items():
        var = env_var(name)
        if var in environ:
            out[name] = _parse_text(name, kind, environ[var], f"environment variable {var}")
    return out


# --------------------------------------------------------------------------- CLI

class _GivenAction(argparse.Action):
    """Store (or append) the value and remember that the flag was given, so that
    ``--memory-budget-mb none`` (None) can still override lower sources."""

    def __init__(self, *args, append: bool = False, **kwargs):
        self._append = append
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if self._append:
            current = getattr(namespace, self.dest, None)
            values = [*(current or []), values]
        setattr(namespace, self.dest, values)
        given = getattr(namespace, _GIVEN_ATTR, None)
        if given is None:
            given = set()
            setattr(namespace, _GIVEN_ATTR, given)
        given.add(self.dest)


class _AdapterAction(_GivenAction):
    """``--adapter DIR [DIR ...]`` (and repeated): the first directory is the default
    adapter, every other one is kept resident too (appended to ``extra_adapters``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        values = list(values)
        given = getattr(namespace, _GIVEN_ATTR, None) or set()
        if "adapter" not in given:
            super().__call__(parser, namespace, values[0], option_string)
            values = values[1:]
        if values:
            extra = list(getattr(namespace, "extra_adapters", None) or [])
            setattr(namespace, "extra_adapters", extra + values)
            getattr(namespace, _GIVEN_ATTR).add("extra_adapters")


def _int_or_none(text: str):
    if text.strip().lower() == "none":
        return None
    return int(text)


_int_or_none.__name__ = "integer-or-none"  # argparse: "invalid integer-or-none value: 'x'"


def _str_or_none(text: str):
    return None if text.strip().lower() == "none" else text


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (default None: absent flags override nothing), plus
    ``--config FILE``."""
    docs = field_docs()
    kinds = _kinds()
    group = parser.add_argument_group("engine configuration",
                                      "precedence: defaults < --config/EDGE0_CONFIG TOML < EDGE0_* "
                                      "environment < these flags")
    group.add_argument("--config", metavar="FILE", default=None,
                       help=f"TOML file of engine settings (env {CONFIG_ENV})")
    for f in _fields():
        name, kind = f.name, kinds[f.name]
        meaning = docs[name] + (" Repeatable." if kind in (_LAYER_PATHS, _STRS) else "")
        help_text = f"{meaning} (default: {_show(_default(f))}; env {env_var(name)})".strip()
        help_text = help_text.replace("%", "%%")
        kwargs: dict = {"dest": name, "default": None, "action": _GivenAction, "help": help_text}
        if kind == _LAYER_PATHS:
            group.add_argument(LAYER_PATH_FLAG, flag(name), metavar=LAYER_PATH_SYNTAX, append=True,
                               **kwargs)
            continue
        if kind == _STRS:
            group.add_argument(flag(name), metavar="TEXT", append=True, **kwargs)
            continue
        if name == "adapter":
            kwargs.update(action=_AdapterAction, nargs="+", metavar="DIR",
                          help=help_text.replace(" (default:", " Several directories (or the flag repeated): the "
                                                 "first is the default, the others stay resident too (as "
                                                 "--extra-adapters). (default:", 1))
            group.add_argument(flag(name), **kwargs)
            continue
        if kind == _INT:
            kwargs.update(type=int, metavar="N")
        elif kind == _OPT_INT:
            kwargs.update(type=_int_or_none, metavar="N|none")
        elif kind == _OPT_STR:
            kwargs.update(type=_str_or_none, metavar="TEXT|none")
        if name in _CHOICES and hasattr(_config_module, _CHOICES[name]):
            kwargs["choices"] = tuple(getattr(_config_module, _CHOICES[name]))
        elif kind == _STR:
            kwargs["metavar"] = "TEXT"
        group.add_argument(flag(name), **kwargs)


def config_from_args(args: argparse.Namespace) -> dict:
    """The values of the config flags the user actually gave (``--config`` excluded)."""
    kinds = _kinds()
    given = getattr(args, _GIVEN_ATTR, None)
    out = {}
    for name, kind in kinds.items():
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        if given is not None:
            if name not in given:
                continue
        elif value is None:  # a Namespace not built by add_config_flags' parser
            continue
        if kind == _LAYER_PATHS:
            if isinstance(value, str):
                value = [value]
            entries = []
            for item in value or ():
                if isinstance(item, str):
                    entries.extend(_parse_layer_paths(item, f"flag {LAYER_PATH_FLAG}"))
                else:
                    entries.extend(_check_native(name, kind, [item], f"flag {LAYER_PATH_FLAG}"))
            value = tuple(entries)
        elif kind == _STRS:
            value = tuple([value] if isinstance(value, str) else value or ())
        out[name] = value
    return out


# --------------------------------------------------------------------------- merge

def parse_settings(text: str, source: str) -> dict:
    """``KEY=VALUE,KEY=VALUE`` (EngineConfig fields, values as on the command line) -> typed
    values; ``source`` names where the text came from in errors."""
    kinds = _kinds()
    values = {}
    for pair in re.split(r",(?=\s*[a-z_]+=)", text):  # a comma inside a value (layer_paths) stays
        key, eq, value = pair.partition("=")
        key = key.strip()
        if not eq or key not in kinds:
            raise ConfigError(f"{source}: {key!r} is not an engine setting (KEY=VALUE with KEY one of "
                              f"{_valid_names()})")
        values[key] = _parse_text(key, kinds[key], value.strip(), source)
    return values


def resolve_config(args: argparse.Namespace | None = None, *, environ: Mapping[str, str] | None = None,
                   toml_path=None, defaults: dict | None = None, **overrides) -> EngineConfig:
    """Merge defaults < TOML < environment < CLI flags < ``overrides`` into one EngineConfig
    (``defaults``: a command's own defaults, in place of the dataclass's).

    The TOML file is ``toml_path``, else ``args.config`` (``--config``), else ``$EDGE0_CONFIG``;
    none of them: no file. ``environ`` defaults to ``os.environ``. A list value (layer_paths)
    from a higher source replaces the lower one whole.
    """
    environ = os.environ if environ is None else environ
    kinds = _kinds()
    unknown = [k for k in overrides if k not in kinds]
    if unknown:
        raise ConfigError(f"resolve_config: unknown keyword(s) {', '.join(map(repr, unknown))}; "
                          f"valid fields: {_valid_names()}")

    if toml_path is None and args is not None:
        toml_path = getattr(args, "config", None)
    if toml_path is None and environ.get(CONFIG_ENV):
        toml_path = environ[CONFIG_ENV]

    merged: dict = {}
    origin: dict[str, str] = {}

    def layer(values: dict, describe) -> None:
        for name, value in values.items():
            merged[name] = value
            origin[name] = describe(name)

    layer({n: _check_native(n, kinds[n], v, "default") for n, v in (defaults or {}).items()},
          lambda n: "the command's default")
    if toml_path is not None:
        layer(config_from_toml(toml_path), lambda n: f"TOML file {toml_path}")
    layer(config_from_env(environ), lambda n: f"environment variable {env_var(n)}")
    if args is not None:
        layer(config_from_args(args),
              lambda n: f"flag {LAYER_PATH_FLAG if kinds[n] == _LAYER_PATHS else flag(n)}")
    layer({n: _check_native(n, kinds[n], v, "keyword override") for n, v in overrides.items()},
          lambda n: "keyword override")

    try:
        return EngineConfig(**merged)
    except ConfigError as err:
        name = _field_in(str(err))
        if name is None or name not in origin:
            raise
        raise type(err)(f"{err} (field {name} set by {origin[name]})") from err


def _field_in(message: str) -> str | None:
    """The field a validation message is about: the first field name it mentions."""
    best = None
    for name in _field_names():
        m = re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", message)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), name)
    return best[1] if best else None


# --------------------------------------------------------------------------- docs

def _flag_cell(name: str, kind: str) -> str:
    if kind == _LAYER_PATHS:
        return f"`{LAYER_PATH_FLAG} {LAYER_PATH_SYNTAX}` (repeatable)"
    if kind == _STRS:
        return f"`{flag(name)} TEXT` (repeatable)"
    return f"`{flag(name)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_table_markdown() -> str:
    """The table of every EngineConfig field: default, CLI flag, environment variable, meaning."""
    docs, kinds = field_docs(), _kinds()
    rows = ["| field | default | CLI flag | environment variable | meaning |",
            "|---|---|---|---|---|"]
    for f in _fields():
        rows.append(f"| `{f.name}` | `{_cell(_show(_default(f)))}` | {_flag_cell(f.name, kinds[f.name])} "
                    f"| `{env_var(f.name)}` | {_cell(docs[f.name])} |")
    return "\n".join(rows) + "\n"
