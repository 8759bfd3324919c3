"""``tool_choice`` ``"required"`` or a named function: the answer is forced to be one call,
written in the model's own tool-call format, of one of the functions allowed, its
arguments valid against that function's ``parameters``.

The force is a grammar (llguidance's Lark syntax, compiled by ``edge0.constrain`` into the
same per-token logits mask as ``response_format``): the format's start marker, the call's
JSON (``{"name": NAME, "arguments": ARGS}`` for one of the allowed names, with ARGS that
function's schema, objects closed to the properties they name) and the end marker; then
only EOS. The answer parses back into ``tool_calls`` through the format's own parser, as an
unforced call does (``edge0.server.tools``), and ends with ``finish_reason: "tool_calls"``.
One call: a forced answer never runs on writing calls until ``max_tokens``.

Formats: those whose call is a JSON object between two markers, spelled as the chat
templates write it (``FORMATS``); a model whose template writes calls another way gets a
400 naming its format.
"""

from __future__ import annotations

import copy
import json

from edge0.constrain import closed_objects
from edge0.server.api_error import bad

# format (mlx-lm's tool parser module) -> (start marker, end marker, the JSON's separators),
# written as the template writes a call: "<tool_call>\n" + tojson + "\n</tool_call>"
FORMATS = {
    "json_tools": ("<tool_call>\n", "\n</tool_call>", (", ", ": ")),
}
# a function that declares no parameters takes none (OpenAI's reading of an omitted "parameters")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_format(tokenizer) -> str | None:
    """The name of the model's tool-call format (mlx-lm's parser module, chosen from the
    chat template), or None when its template has none."""
    parser = getattr(tokenizer, "tool_parser", None)
    return None if parser is None else parser.__module__.rsplit(".", 1)[-1]


def forced_call_grammar(fmt: str | None, tools: list[dict], names: tuple[str, ...]) -> str:
    """The Lark grammar of one call, in format ``fmt``, of one of ``names`` (of ``tools``)."""
    if fmt is None:
        raise bad("this model's chat template has no tool-call format: it cannot be given tools", "tools")
    if fmt not in FORMATS:
        raise bad(f"'tool_choice' cannot force a call in this model's tool-call format ({fmt!r}): a forced call "
                  f"is enforced for the formats {', '.join(sorted(FORMATS))}; use 'auto'", "tool_choice")
    start, end, (item, key) = FORMATS[fmt]
    params = {t["function"]["name"]: t["function"].get("parameters", NO_PARAMETERS) for t in tools}
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": name}, "arguments": closed_objects(copy.deepcopy(params[name]))}}
             for name in names]
    schema = {"x-guidance": {"whitespace_flexible": False, "item_separator": item, "key_separator": key},
              "anyOf": calls}
    return f"start: {json.dumps(start)} call {json.dumps(end)}\ncall: %json {json.dumps(schema)}\n"
