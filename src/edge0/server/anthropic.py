"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) on the
same generation path as the OpenAI chat endpoint.

A Messages body is checked here (its own fields, in Anthropic's terms), then translated into
the chat body the OpenAI route takes (``system`` a system message, ``tool_use`` blocks an
assistant's ``tool_calls``, ``tool_result`` blocks ``tool`` messages, ``tools`` function
definitions, ``tool_choice`` OpenAI's) and parsed by ``protocol.parse`` into the same
``GenerationRequest``: one chat template rendering, one tool-call parser, one engine call.
Only the answers differ: ``SHAPE`` writes them as Anthropic's message, its server-sent
events and its error shape (``{"type": "error", "error": {"type", "message"}}``).

A last assistant message is a prefill: the model continues it, and the answer holds only
what it wrote after it (as Anthropic's API does).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edge0.sampling import MAX_TOKENS
from edge0.server import protocol as P
from edge0.server import schema as S
from edge0.server.api_error import APIError, bad, check_value
from edge0.server.tools import MAX_TOOLS

MAX_STOP_SEQUENCES = 16
ROUTE = "/v1/messages"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]  # content blocks: checked by _blocks, in Anthropic's terms


class Metadata(_Strict):
    user_id: str | None = Field(None, max_length=S.MAX_ID_CHARS)  # the prompt cache's tenant, as OpenAI's ``user``


class Tool(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # a client tool; Anthropic's server tools are not served
    cache_control: dict[str, Any] | None = None  # a hint for Anthropic's cache; this server caches prompts itself


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(_Strict):
    """``/v1/messages/count_tokens``: what the prompt is made of."""

    model: str = Field(max_length=S.MAX_ID_CHARS)
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0, le=1 << 20)
    metadata: Metadata | None = None


REQUESTS = {"messages": MessagesRequest, "count_tokens": CountTokensRequest}

EXPECT = {  # what a field must be, where its JSON type alone would not say (schema.refusal)
    "model": "the name of a model this server holds (GET /v1/models)",
    "max_tokens": "the most tokens to generate, an integer >= 1",
    "messages": "a non-empty list of {role, content} messages",
    "messages[*]": "an object with a role and content",
    "messages[*].role": "user or assistant (the system prompt is the top-level 'system')",
    "messages[*].content": "a string or a list of content blocks (text, tool_use, tool_result)",
    "system": "a string or a list of text blocks",
    "stop_sequences": f"a list of at most {MAX_STOP_SEQUENCES} strings",
    "tools": f"a list of at most {MAX_TOOLS} tools ({{name, description, input_schema}})",
    "tools[*].name": "1-64 letters, digits, '_' or '-'",
    "tools[*].type": "'custom' (a tool the client runs; Anthropic's server tools are not served)",
    "tool_choice": "{'type': 'auto' | 'any' | 'tool' | 'none', ...}",
    "tool_choice.type": "auto, any, tool or none",
    "metadata": "an object ({'user_id': ...})",
}

_TEXT_BLOCK_KEYS = {"type", "text", "cache_control", "citations"}


def parse_any(body: Any, kind: str, checks: P.Checks) -> P.GenerationRequest:
    """The checked request of a body for any endpoint: Anthropic's ("messages",
    "count_tokens") here, OpenAI's (``protocol.parse``)."""
    return parse(body, kind, checks) if kind in REQUESTS else P.parse(body, kind, checks)


def parse(body: Any, kind: str, checks: P.Checks) -> P.GenerationRequest:
    """The chat request of a Messages body (``kind`` "messages") or of a token count's
    ("count_tokens": nothing is generated; its token limit is 1)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_value(body)
    try:
        r = REQUESTS[kind].model_validate(body)
    except ValidationError as e:
        raise S.refusal(e, REQUESTS[kind], kind, EXPECT) from None
    messages, prefill = _chat_messages(r.messages)
    system = _system(r.system)
    chat: dict[str, Any] = {"model": r.model, "messages": ([{"role": "system", "content": system}]
                                                           if system is not None else []) + messages}
    if r.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {})}} for t in r.tools]
    if r.tool_choice is not None:
        chat.update(_tool_choice(r.tool_choice))
    if isinstance(r, MessagesRequest):
        chat.update({k: v for k, v in (("temperature", r.temperature), ("top_p", r.top_p), ("top_k", r.top_k),
                                       ("user", r.metadata and r.metadata.user_id)) if v is not None})
    chat["max_tokens"] = r.max_tokens if isinstance(r, MessagesRequest) else 1
    try:
        req = P.parse(chat, "chat", checks)
    except APIError as e:
        if e.param != "tool_choice":
            raise
        raise APIError(e.status, f"tool_choice {r.tool_choice.model_dump(exclude_none=True)} cannot be honoured: "
                       f"{e.message}", param=e.param) from None
    req.stream = bool(getattr(r, "stream", False))
    req.sampling["stop"] = _stop_sequences(getattr(r, "stop_sequences", None))
    req.prefill = prefill
    return req


def _stop_sequences(stops: list[str] | None) -> tuple[str, ...]:
    if any(s == "" for s in stops or ()):
        raise bad("'stop_sequences' must not hold an empty string", "stop_sequences")
    return tuple(stops or ())


def _tool_choice(choice: ToolChoice) -> dict:
    """OpenAI's ``tool_choice`` (and ``parallel_tool_calls``) for Anthropic's."""
    if choice.type == "tool" and not choice.name:
        raise bad("tool_choice {'type': 'tool'} needs the 'name' of the tool to call", "tool_choice")
    out: dict[str, Any] = {"tool_choice": {"auto": "auto", "none": "none", "any": "required"}.get(choice.type) or
                           {"type": "function", "function": {"name": choice.name}}}
    if choice.disable_parallel_tool_use is not None:
        out["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return out


def _system(system: str | list[dict] | None) -> str | None:
    """The system prompt: a string, or text blocks joined by blank lines."""
    if system is None or isinstance(system, str):
        return system
    return "\n\n".join(_text(block, f"system[{j}]") for j, block in enumerate(system))


def _text(block: Any, where: str) -> str:
    """A text block's text (its ``cache_control`` and ``citations`` are passed over)."""
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise bad(f"'{where}' must be a text block ({{'type': 'text', 'text': ...}}), got {kind!r:.40}; "
                  "this model reads text only", where)
    if not isinstance(block.get("text"), str):
        raise bad(f"'{where}.text' must be a string", f"{where}.text")
    extra = sorted(set(block) - _TEXT_BLOCK_KEYS)
    if extra:
        raise bad(f"'{where}.{extra[0]:.60}' is not a field of a text block", where)
    return block["text"]


def _chat_messages(messages: list[Message]) -> tuple[list[dict], str | None]:
    """The chat messages of an Anthropic conversation, and the prefill (a last assistant
    message of text, which the model continues; None when the user spoke last)."""
    out: list[dict] = []
    names: dict[str, str] = {}  # tool_use id -> the tool's name, for the results that answer it
    for i, m in enumerate(messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            out.append(_assistant(blocks, f"messages[{i}].content", names))
        else:
            out.extend(_user(blocks, f"messages[{i}].content", names))
    prefill = None
    if messages[-1].role == "assistant":
        last = out.pop()
        if last.get("tool_calls"):
            raise bad(f"the last message (messages[{len(messages) - 1}]) is the assistant's with tool_use blocks: "
                      "the user's tool_result must follow", f"messages[{len(messages) - 1}]")
        prefill = last["content"]
    return out, prefill


def _assistant(blocks: list, where: str, names: dict[str, str]) -> dict:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, dict) and block.get("type") == "tool_use":
            at = f"{where}[{j}]"
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input"), dict)):
                raise bad(f"'{at}' must be {{'type': 'tool_use', 'id': str, 'name': str, 'input': object}}", at)
            names[block["id"]] = block["name"]
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        else:
            texts.append(_text(block, f"{where}[{j}]"))
    return {"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})}


def _user(blocks: list, where: str, names: dict[str, str]) -> list[dict]:
    """A user turn: a tool message per ``tool_result`` (Anthropic's come first in the turn),
    then its text as a user message."""
    out: list[dict] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if not (isinstance(block, dict) and block.get("type") == "tool_result"):
            texts.append(_text(block, at))
            continue
        use_id, content = block.get("tool_use_id"), block.get("content", "")
        if not isinstance(use_id, str):
            raise bad(f"'{at}.tool_use_id' must be a string (the id of the tool_use it answers)", at)
        if not isinstance(content, str):
            if not isinstance(content, list):
                raise bad(f"'{at}.content' must be a string or a list of text blocks", at)
            content = "".join(_text(b, f"{at}.content[{k}]") for k, b in enumerate(content))
        if block.get("is_error") is True:
            content = f"Error: {content}"
        out.append({"role": "tool", "tool_call_id": use_id, "content": content,
                    **({"name": names[use_id]} if use_id in names else {})})
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


# ---- answers ----

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}


def is_route(path: str) -> bool:
    """Whether a request path is one of this API's (its errors then take this API's shape)."""
    return path == ROUTE or path.startswith(ROUTE + "/")


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _stop(collector) -> tuple[str, str | None]:
    """The answer's ``stop_reason`` and ``stop_sequence``."""
    finish = collector.finish or "length"
    if finish == "stop" and collector.stop is not None:
        return "stop_sequence", collector.stop
    return STOP_REASONS[finish], None


def _tool_use(call: dict) -> dict:
    """A tool_use block of a parsed call (its arguments' JSON text as the ``input`` object)."""
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        args = call["function"]["arguments"]
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": args if isinstance(args, dict) else {"arguments": args}}


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps({'type': event, **data})}\n\n"


class _Stream:
    """The content blocks of a streamed answer as they come: a text block opened by the
    first text after a call (or at the start), each call a tool_use block of its own."""

    def __init__(self):
        self.index = -1
        self.text_open = False

    def text(self, text: str) -> list[str]:
        out = [] if self.text_open else self._open({"type": "text", "text": ""})
        self.text_open = True
        return out + [_sse("content_block_delta", {"index": self.index,
                                                   "delta": {"type": "text_delta", "text": text}})]

    def call(self, call: dict) -> list[str]:
        block = _tool_use(call)
        return self._open({**block, "input": {}}) + [
            _sse("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}),
            _sse("content_block_stop", {"index": self.index})]

    def _open(self, block: dict) -> list[str]:
        out = self.close()
        self.index += 1
        return out + [_sse("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        """The open text block's end (nothing when none is open)."""
        if not self.text_open:
            return []
        self.text_open = False
        return [_sse("content_block_stop", {"index": self.index})]


class AnthropicShape:
    """Anthropic's bodies of an answer (``edge0.server.answers`` writes through them, as
    through its OpenAI shape): errors, the whole message, and its server-sent events."""

    @staticmethod
    def error(e: APIError) -> dict:
        return error_body(e.status, e.message)

    @staticmethod
    def whole(req: P.GenerationRequest, picked: list) -> dict:
        """The message of a request's one choice (``answers.Choice``)."""
        (choice,) = picked
        text, collector = "".join(choice.parts), choice.collector
        reason, sequence = _stop(collector)
        content = ([{"type": "text", "text": text}] if text else []) + [_tool_use(c) for c in collector.calls]
        return {"id": new_id(), "type": "message", "role": "assistant", "model": req.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": len(choice.ids), "output_tokens": collector.count}}

    @staticmethod
    async def events(req: P.GenerationRequest, choice, items):
        """message_start, the content blocks (start, deltas, stop), message_delta with the
        stop reason and output tokens, message_stop; a ping while no token comes."""
        yield _sse("message_start", {"message": {
            "id": new_id(), "type": "message", "role": "assistant", "model": req.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": len(choice.ids), "output_tokens": 0}}})
        blocks = _Stream()
        async for item in items:
            if item is None:
                yield _sse("ping", {})
                continue
            text, _, calls, _ = item
            for piece in (blocks.text(text) if text else []) + [e for c in calls for e in blocks.call(c)]:
                yield piece
        for piece in blocks.close():
            yield piece
        reason, sequence = _stop(choice.collector)
        yield _sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                     "usage": {"output_tokens": choice.collector.count}})
        yield _sse("message_stop", {})

    @staticmethod
    def stream_error(message: str, fault: str | None) -> str:
        return _sse("error", {"error": error_body(400 if fault else 500, message)["error"]})


SHAPE = AnthropicShape()


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]
