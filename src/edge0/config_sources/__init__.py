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

The modules of this package, by responsibility:

- ``fields``: the fields' names, kinds, defaults, docs and choices (their metadata), environment variables and flags.
- ``values``: checking typed values, parsing text, the ``LAYER:PHASE=PATH`` spec.
- ``toml_env``: the TOML file and ``EDGE0_*`` environment sources.
- ``cli_flags``: the argparse flags and reading the given ones back.
- ``settings_list``: ``KEY=VALUE,...`` settings lists (``parse_settings``).
- ``resolve``: the merge into one EngineConfig (``resolve_config``).
- ``docs_table``: the Markdown table of every field (``config_table_markdown``).

The public names are re-exported here.
"""

from __future__ import annotations

from edge0.config_sources.cli_flags import add_config_flags, config_from_args
from edge0.config_sources.docs_table import config_table_markdown
from edge0.config_sources.fields import (
    CONFIG_ENV,
    ENV_PREFIX,
    LAYER_PATH_FLAG,
    LAYER_PATH_SYNTAX,
    TOML_TABLE,
    env_var,
    field_docs,
    flag,
)
from edge0.config_sources.resolve import resolve_config
from edge0.config_sources.settings_list import parse_settings
from edge0.config_sources.toml_env import config_from_env, config_from_toml

__all__ = [
    "field_docs", "env_var", "flag", "config_from_toml", "config_from_env", "add_config_flags",
    "config_from_args", "resolve_config", "config_table_markdown", "parse_settings",
    "ENV_PREFIX", "CONFIG_ENV", "TOML_TABLE", "LAYER_PATH_FLAG", "LAYER_PATH_SYNTAX",
]
