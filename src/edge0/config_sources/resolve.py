"""Merging the config sources into one EngineConfig, lowest to highest precedence
(defaults < TOML < environment < CLI flags < keyword overrides), validated once by
``EngineConfig.__post_init__``; a validation error is re-raised naming the source that set
the offending field.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping

from edge0.config import EngineConfig
from edge0.config_sources.cli_flags import config_from_args
from edge0.config_sources.fields import (
    CONFIG_ENV,
    LAYER_PATH_FLAG,
    LAYER_PATHS,
    env_var,
    field_names,
    flag,
    kinds,
    valid_names,
)
from edge0.config_sources.toml_env import config_from_env, config_from_toml
from edge0.config_sources.values import check_native
from edge0.errors import ConfigError


def resolve_config(args: argparse.Namespace | None = None, *, environ: Mapping[str, str] | None = None,
                   toml_path=None, defaults: dict | None = None, **overrides) -> EngineConfig:
    """Merge defaults < TOML < environment < CLI flags < ``overrides`` into one EngineConfig
    (``defaults``: a command's own defaults, in place of the dataclass's).

    The TOML file is ``toml_path``, else ``args.config`` (``--config``), else ``$EDGE0_CONFIG``;
    none of them: no file. ``environ`` defaults to ``os.environ``. A list value (layer_paths)
    from a higher source replaces the lower one whole.
    """
    environ = os.environ if environ is None else environ
    field_kinds = kinds()
    unknown = [k for k in overrides if k not in field_kinds]
    if unknown:
        raise ConfigError(f"resolve_config: unknown keyword(s) {', '.join(map(repr, unknown))}; "
                          f"valid fields: {valid_names()}")

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

    layer({n: check_native(n, field_kinds[n], v, "default") for n, v in (defaults or {}).items()},
          lambda n: "the command's default")
    if toml_path is not None:
        layer(config_from_toml(toml_path), lambda n: f"TOML file {toml_path}")
    layer(config_from_env(environ), lambda n: f"environment variable {env_var(n)}")
    if args is not None:
        layer(config_from_args(args),
              lambda n: f"flag {LAYER_PATH_FLAG if field_kinds[n] == LAYER_PATHS else flag(n)}")
    layer({n: check_native(n, field_kinds[n], v, "keyword override") for n, v in overrides.items()},
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
    for name in field_names():
        m = re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", message)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), name)
    return best[1] if best else None
