"""The Markdown table of every EngineConfig field (default, CLI flag, environment variable,
meaning) that ``docs/CONFIG.md`` carries and the tests compare against.
"""

from __future__ import annotations

from edge0.config_sources.fields import (
    LAYER_PATH_FLAG,
    LAYER_PATH_SYNTAX,
    LAYER_PATHS,
    STRS,
    default,
    env_var,
    field_docs,
    fields,
    flag,
    kinds,
    show,
)


def _flag_cell(name: str, kind: str) -> str:
    if kind == LAYER_PATHS:
        return f"`{LAYER_PATH_FLAG} {LAYER_PATH_SYNTAX}` (repeatable)"
    if kind == STRS:
        return f"`{flag(name)} TEXT` (repeatable)"
    return f"`{flag(name)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_table_markdown() -> str:
    """The table of every EngineConfig field: default, CLI flag, environment variable, meaning."""
    docs, field_kinds = field_docs(), kinds()
    rows = ["| field | default | CLI flag | environment variable | meaning |",
            "|---|---|---|---|---|"]
    for f in fields():
        rows.append(f"| `{f.name}` | `{_cell(show(default(f)))}` | {_flag_cell(f.name, field_kinds[f.name])} "
                    f"| `{env_var(f.name)}` | {_cell(docs[f.name])} |")
    return "\n".join(rows) + "\n"
