"""The command-line source: one argparse flag per EngineConfig field (plus ``--config FILE``
and the repeatable ``--layer-path``), the actions that remember which flags were actually
given, and reading the given flags back into typed values.
"""

from __future__ import annotations

import argparse
import dataclasses

from edge0.config_sources.fields import (
    CONFIG_ENV,
    INT,
    LAYER_PATH_FLAG,
    LAYER_PATH_SYNTAX,
    LAYER_PATHS,
    OPT_INT,
    OPT_STR,
    STR,
    STRS,
    choices,
    default,
    env_var,
    none_word,
    field_docs,
    fields,
    flag,
    kinds,
    show,
)
from edge0.config_sources.values import check_native, parse_layer_paths

# Fields that also answer to mlx-lm's name for the same setting.
_ALIASES = {"max_batch": "--decode-concurrency", "adapter": "--adapter-path"}

_GIVEN_ATTR = "_edge0_config_given"   # set of dests given on the command line (see _GivenAction)


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


def _int_or_word(word: str):
    """An integer, or ``none`` / ``word`` (what None means for the field: ``auto``, ``off``)."""
    def parse(text: str):
        return None if text.strip().lower() == word else _int_or_none(text)
    parse.__name__ = f"integer-or-{word}"
    return parse


def _str_or_none(text: str):
    return None if text.strip().lower() == "none" else text


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (default None: absent flags override nothing), plus
    ``--config FILE``."""
    docs = field_docs()
    field_kinds = kinds()
    group = parser.add_argument_group("engine configuration",
                                      "precedence: defaults < --config/EDGE0_CONFIG TOML < EDGE0_* "
                                      "environment < these flags")
    group.add_argument("--config", metavar="FILE", default=None,
                       help=f"TOML file of engine settings (env {CONFIG_ENV})")
    for f in fields():
        _add_field_flag(group, f, field_kinds[f.name], docs[f.name])


def _add_field_flag(group, f: dataclasses.Field, kind: str, doc: str) -> None:
    """The flag of one field: its metavar, type, choices and help by the field's kind."""
    name = f.name
    meaning = doc + (" Repeatable." if kind in (LAYER_PATHS, STRS) else "")
    help_text = f"{meaning} (default: {show(default(f))}; env {env_var(name)})".strip()
    help_text = help_text.replace("%", "%%")
    kwargs: dict = {"dest": name, "default": None, "action": _GivenAction, "help": help_text}
    if kind == LAYER_PATHS:
        group.add_argument(LAYER_PATH_FLAG, flag(name), metavar=LAYER_PATH_SYNTAX, append=True, **kwargs)
        return
    if kind == STRS:
        group.add_argument(flag(name), metavar="TEXT", append=True, **kwargs)
        return
    if name == "adapter":
        kwargs.update(action=_AdapterAction, nargs="+", metavar="DIR",
                      help=help_text.replace(" (default:", " Several directories (or the flag repeated): the "
                                             "first is the default, the others stay resident too (as "
                                             "--extra-adapters). (default:", 1))
        group.add_argument(flag(name), _ALIASES[name], **kwargs)
        return
    if kind == INT:
        kwargs.update(type=int, metavar="N")
    elif kind == OPT_INT:
        word = none_word(name)
        kwargs.update(type=_int_or_word(word) if word else _int_or_none, metavar=f"N|{word or 'none'}")
    elif kind == OPT_STR:
        kwargs.update(type=_str_or_none, metavar="TEXT|none")
    if kind == STR and choices(name):
        kwargs["choices"] = tuple(choices(name))
        if name == "log_level":  # mlx-lm's spelling, --log-level INFO, too
            kwargs["type"] = str.lower
    elif kind == STR:
        kwargs["metavar"] = "TEXT"
    group.add_argument(flag(name), *((_ALIASES[name],) if name in _ALIASES else ()), **kwargs)


def config_from_args(args: argparse.Namespace) -> dict:
    """The values of the config flags the user actually gave (``--config`` excluded)."""
    given = getattr(args, _GIVEN_ATTR, None)
    out = {}
    for name, kind in kinds().items():
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        if given is not None:
            if name not in given:
                continue
        elif value is None:  # a Namespace not built by add_config_flags' parser
            continue
        if kind == LAYER_PATHS:
            value = _flag_layer_paths(name, kind, value)
        elif kind == STRS:
            value = tuple([value] if isinstance(value, str) else value or ())
        out[name] = value
    return out


def _flag_layer_paths(name: str, kind: str, value) -> tuple[tuple[int, str, str], ...]:
    """``--layer-path`` values (``LAYER:PHASE=PATH`` strings or ready entries) as entries."""
    if isinstance(value, str):
        value = [value]
    entries = []
    for item in value or ():
        if isinstance(item, str):
            entries.extend(parse_layer_paths(item, f"flag {LAYER_PATH_FLAG}"))
        else:
            entries.extend(check_native(name, kind, [item], f"flag {LAYER_PATH_FLAG}"))
    return tuple(entries)
