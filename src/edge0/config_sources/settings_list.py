"""``KEY=VALUE,KEY=VALUE`` settings lists (EngineConfig fields, values written as on the
command line), as commands that take several engine configurations in one flag accept them.
"""

from __future__ import annotations

import re

from edge0.config_sources.fields import kinds, valid_names
from edge0.config_sources.values import parse_text
from edge0.errors import ConfigError


def parse_settings(text: str, source: str) -> dict:
    """``KEY=VALUE,KEY=VALUE`` (EngineConfig fields, values as on the command line) -> typed
    values; ``source`` names where the text came from in errors."""
    field_kinds = kinds()
    values = {}
    for pair in re.split(r",(?=\s*[a-z_][a-z0-9_]*=)", text):  # a comma inside a value (layer_paths) stays
        key, eq, value = pair.partition("=")
        key = key.strip()
        if not eq or key not in field_kinds:
            raise ConfigError(f"{source}: {key!r} is not an engine setting (KEY=VALUE with KEY one of "
                              f"{valid_names()})")
        values[key] = parse_text(key, field_kinds[key], value.strip(), source)
    return values
