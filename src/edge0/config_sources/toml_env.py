"""The two config sources read from outside the command line: a TOML file (keys at top
level or under ``[engine]``) and ``EDGE0_<FIELD>`` environment variables. Each returns the
values it sets, typed and checked, keyed by field name.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path

from edge0.config_sources.fields import TOML_TABLE, env_var, kinds, valid_names
from edge0.config_sources.values import check_native, parse_text
from edge0.errors import ConfigError


def config_from_toml(path) -> dict:
    """The values a TOML file sets (top level or under ``[engine]``), typed and checked."""
    path = Path(path)
    source = f"TOML file {path}"
    data = _load_toml(path, source)
    raw: dict = {}
    section = data.pop(TOML_TABLE, None)
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f"{source}: {TOML_TABLE!r} must be a table ([{TOML_TABLE}]), got {section!r}")
    field_kinds = kinds()
    for where, table in (("top level", data), (f"[{TOML_TABLE}]", section or {})):
        unknown = [k for k in table if k not in field_kinds]
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))} at {where}; "
                              f"valid fields: {valid_names()}")
    for key in section or {}:
        if key in data:
            raise ConfigError(f"{source}: field {key} is set both at top level and under [{TOML_TABLE}]; "
                              "set it once")
    raw.update(data)
    raw.update(section or {})
    return {name: check_native(name, field_kinds[name], value, source) for name, value in raw.items()}


def _load_toml(path: Path, source: str) -> dict:
    """The parsed file; a missing, unreadable or invalid file is a ``ConfigError``."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{source}: file not found") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{source}: invalid TOML: {err}") from None
    except OSError as err:
        raise ConfigError(f"{source}: cannot read: {err.strerror or err}") from None


def config_from_env(environ: Mapping[str, str] | None = None) -> dict:
    """The values EDGE0_<FIELD> variables set. Other EDGE0_* variables are ignored."""
    environ = os.environ if environ is None else environ
    out = {}
    for name, kind in kinds().items():
        var = env_var(name)
        if var in environ:
            out[name] = parse_text(name, kind, environ[var], f"environment variable {var}")
    return out
