"""Tool calling as the OpenAI API has it, through the model's own chat template.

The request side: ``tools`` (function definitions) and ``tool_choice`` are checked here,
and the history's assistant ``tool_calls`` and ``tool`` results are put in the shape chat
templates read (a call's ``arguments`` as an object). The tools go into the template
(``apply_chat_template(..., tools=...)``), which writes them the way the model was trained
to read them.

The answer side: the model writes a call between its format's start and end markers
(``<tool_call>`` ... ``</tool_call>`` and the others mlx-lm knows, chosen from the chat
template when the tokenizer loads); ``ToolCallSplitter`` cuts the streamed text into
plain text and call texts, and the format's parser (mlx-lm's ``tool_parsers``) turns each
call text into a name and arguments. A call text that does not parse (cut off by
``max_tokens``, say) stays in the answer as text: nothing the model wrote is dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from edge0.text import open_tail
from edge0.server.api_error import MAX_DEPTH, bad, check_value

MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolRequest:
    """The checked ``tools`` (None: none), ``tool_choice`` ("auto", "none", "required" or
    "function") and, for a forced choice, the functions one of which must be called."""

    tools: list[dict] | None
    choice: str
    forced: tuple[str, ...] | None = None  # "required": every tool's name; a named function: its name


def parse_tools(body: dict) -> ToolRequest:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
            raise bad(f"'tools' must be a list of at most {MAX_TOOLS} function definitions", "tools")
        tools = [_tool(t, i) for i, t in enumerate(tools)] or None
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if choice in ("auto", "none"):
        return ToolRequest(tools if choice == "auto" else None, choice)
    names = tuple(t["function"]["name"] for t in tools or ())
    forced = names if choice == "required" else (_named_choice(choice),)
    if not names:
        raise bad("'tool_choice' forces a tool call, but the request gives no 'tools' to call", "tool_choice")
    unknown = [n for n in forced if n not in names]
    if unknown:
        raise bad(f"'tool_choice' names the function {unknown[0]!r:.80}, which is not among 'tools' "
                  f"({', '.join(names):.400})", "tool_choice")
    return ToolRequest(tools, "required" if choice == "required" else "function", forced)


def _named_choice(choice: Any) -> str:
    """The function a named ``tool_choice`` (``{"type": "function", "function": {"name": ..}}``) names."""
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or set(choice) != {"type", "function"} \
            or set(fn) != {"name"}:
        raise bad("'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'function': "
                  f"{{'name': NAME}}}}, got {choice!r:.80}", "tool_choice")
    return fn["name"]


def _tool(tool: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
            or not isinstance(tool.get("function"), dict):
        raise bad(f"{where} must be {{'type': 'function', 'function': {{'name', 'parameters', ...}}}}", where)
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 \
            or not all(c.isascii() and (c.isalnum() or c in "_-") for c in name):
        raise bad(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r:.70}",
                   f"{where}.function.name")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad(f"{where}.function.description must be a string", f"{where}.function.description")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise bad(f"{where}.function.parameters must be a JSON Schema object", f"{where}.function.parameters")
    out = {"name": name, **{k: fn[k] for k in ("description", "parameters", "strict") if fn.get(k) is not None}}
    return {"type": "function", "function": out}


def history_calls(message: dict, i: int) -> list[dict] | None:
    """An assistant message's ``tool_calls`` with each call's ``arguments`` an object (what
    templates write out); None when it has none."""
    calls = message.get("tool_calls")
    if calls is None:
        return None
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or message.get("role") != "assistant":
        raise bad(f"{where} must be a list, on an assistant message", where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{where}[{j}] must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                       where)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except RecursionError:
                raise bad(f"{where}[{j}].function.arguments is nested deeper than {MAX_DEPTH} levels", where) from None
            except ValueError:
                raise bad(f"{where}[{j}].function.arguments is not valid JSON", where) from None
            check_value(args, f"{where}[{j}].function.arguments", where)
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


class ToolCallSplitter:
    """Streamed text -> plain text and complete call texts. ``feed`` returns the segments
    that are settled (``("text", s)`` or ``("call", s)``); a tail that may still grow into
    the start marker is held back, as is a call whose end marker has not come."""

    def __init__(self, start: str, end: str):
        self.start, self.end = start, end
        self.pending = ""
        self.in_call = False

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.pending += text
        out: list[tuple[str, str]] = []
        while True:
            if self.in_call:
                i = self.pending.find(self.end)
                if i < 0:
                    return out
                out.append(("call", self.pending[:i]))
                self.pending, self.in_call = self.pending[i + len(self.end):], False
                continue
            i = self.pending.find(self.start)
            if i >= 0:
                if i:
                    out.append(("text", self.pending[:i]))
                self.pending, self.in_call = self.pending[i + len(self.start):], True
                continue
            cut = len(self.pending) - open_tail(self.pending, (self.start,))
            if cut:
                out.append(("text", self.pending[:cut]))
            self.pending = self.pending[cut:]
            return out

    def flush(self) -> list[tuple[str, str]]:
        """The end of the answer: a call left open is tried as a call, the rest is text."""
        rest, self.pending = self.pending, ""
        if self.in_call:
            self.in_call = False
            return [("open_call", rest)]
        return [("text", rest)] if rest else []


class ToolCalls:
    """A request's tool-call handling: its splitter, the format's parser and the calls made."""

    def __init__(self, tokenizer, tools: list[dict]):
        self.parser: Callable = tokenizer.tool_parser
        self.splitter = ToolCallSplitter(tokenizer.tool_call_start, tokenizer.tool_call_end)
        self.tools = tools
        self.calls: list[dict] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """The plain text settled by ``text`` and the calls completed by it."""
        segments = self.splitter.feed(text) + (self.splitter.flush() if final else [])
        plain, calls = [], []
        for kind, s in segments:
            if kind == "text":
                plain.append(s)
                continue
            parsed = self._parse(s)
            if parsed is None:  # not a call after all: the text stays in the answer
                marks = self.splitter
                plain.append(marks.start + s + (marks.end if kind == "call" else ""))
                continue
            calls.extend(parsed)
        self.calls.extend(calls)
        return "".join(plain), calls

    def _parse(self, text: str) -> list[dict] | None:
        try:
            parsed = self.parser(text, self.tools)
        except Exception:  # noqa: BLE001 - any parser failure means: not a well-formed call
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        out = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            args = item.get("arguments", {})
            out.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": item["name"],
                                     "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}})
        return out


def stream_deltas(calls: list[dict], first_index: int) -> list[dict]:
    """Calls as a streamed delta's ``tool_calls`` entries (each with its ``index``)."""
    return [{"index": first_index + n, **c} for n, c in enumerate(calls)]
