"""The OpenAI request and response bodies as pydantic models.

Requests: ``ChatRequest`` and ``CompletionRequest`` take exactly the fields the server
implements (any other is refused), each with its JSON type (strictly: ``"0.5"`` is not a
number, ``true`` is not an integer) and its bounds. ``refusal`` turns pydantic's
``ValidationError`` into the one 400 a client reads: the field at fault as OpenAI's
``param``, and what it must be (``'top_p' must be in (0, 1], got 2``). What a model cannot
say on its own (a response format's schema, logit bias against the vocabulary, tools,
the prompt's token ids) is checked after it, in ``protocol``.

Responses: ``ChatCompletion``, ``ChatCompletionChunk``, ``Completion`` and their parts,
the shapes the ``openai`` client's own (pydantic) types read. A field OpenAI leaves out
when it has nothing to say (a message's ``tool_calls``, a delta's ``role``) is left out
when None; every other field is sent, null included.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edge0.drafts import MAX_DRAFT
from edge0.sampling import MAX_TOKENS
from edge0.server.api_error import APIError, bad

MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_N = 16  # choices per prompt
MAX_MAP_ENTRIES = 64  # chat_template_kwargs, role_mapping
MAX_ID_CHARS = 256  # user, cache_salt
SEED_BOUND = 1 << 63


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class TextPart(BaseModel):
    """A message's content part: only text is understood (other keys a client's own part
    objects carry are passed over)."""

    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One chat message. Keys beyond these (``refusal``, ``annotations``... that the
    ``openai`` client's own message objects carry when a history is sent back) are passed
    over: they say nothing the prompt holds."""

    model_config = ConfigDict(strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls in the history: tools.history_calls
    tool_call_id: str | None = None
    name: str | None = None


def _number(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False):
    return Field(None, **{"gt" if lo_open else "ge": lo, "lt" if hi_open else "le": hi}, allow_inf_nan=False)


def _integer(lo: int, hi: int):
    return Field(None, ge=lo, le=hi)


class _Request(_Strict):
    """The fields both endpoints take: the model or adapter, the token limit and sampling,
    stop strings, JSON output, logprobs, streaming, and the prompt cache's scope."""

    model: str | None = None
    adapters: str | None = None  # mlx-lm's spelling: the adapter's name
    n: int | None = _integer(1, MAX_N)  # choices per prompt (edge0.server.scoring)
    max_tokens: int | None = _integer(1, MAX_TOKENS)
    max_completion_tokens: int | None = _integer(1, MAX_TOKENS)
    temperature: float | None = _number(0, 100)
    top_p: float | None = _number(0, 1, lo_open=True)
    top_k: int | None = _integer(0, 1 << 20)
    min_p: float | None = _number(0, 1, hi_open=True)
    seed: int | None = _integer(-SEED_BOUND, SEED_BOUND - 1)
    repetition_penalty: float | None = _number(0.01, 100)  # smaller: logits past float range
    repetition_context_size: int | None = _integer(1, 1 << 20)
    presence_penalty: float | None = _number(-2, 2)  # OpenAI's range; 0 (its default) is no penalty
    presence_context_size: int | None = _integer(1, 1 << 20)
    frequency_penalty: float | None = _number(-2, 2)
    frequency_context_size: int | None = _integer(1, 1 << 20)
    xtc_probability: float | None = _number(0, 1)
    xtc_threshold: float | None = _number(0, 0.5)
    prompt_lookup: int | None = _integer(0, MAX_DRAFT)  # speculative decoding's drafts a step (edge0.drafts); 0: off
    num_draft_tokens: int | None = _integer(0, MAX_DRAFT)  # the draft model's drafts a step (mlx-lm's); 0: off
    logit_bias: dict[str, Any] | None = None  # checked against the vocabulary: sampling.check_logit_bias
    response_format: dict[str, Any] | None = None  # compiled with the tokenizer: edge0.constrain
    stop: str | list[str] | None = Field(None, max_length=MAX_STOP)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_ID_CHARS)  # with the API key, the prompt cache's tenant
    cache_salt: str | None = Field(None, max_length=MAX_ID_CHARS)  # only equal salts share cached prompts


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = _integer(0, MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None  # function definitions: tools.parse_tools
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=MAX_MAP_ENTRIES)
    role_mapping: dict[str, str] | None = Field(None, max_length=MAX_MAP_ENTRIES)


class CompletionRequest(_Request):
    prompt: Any = None  # strings or token ids, checked against the vocabulary: scoring.prompts
    logprobs: int | None = _integer(0, MAX_TOP_LOGPROBS)  # the legacy form: how many alternatives
    echo: bool | None = None  # the prompt's text and scores first (scoring)
    max_tokens: int | None = _integer(0, MAX_TOKENS)  # 0: with echo, only the prompt scored


REQUESTS: dict[str, type[_Request]] = {"chat": ChatRequest, "completion": CompletionRequest}
ENDPOINT = {"chat": "chat completions", "completion": "completions"}

# What a field must be, where saying its JSON type alone would not help (keys: the path
# with list indices as [*]).
EXPECT = {
    "messages": "a non-empty list of {role, content} objects",
    "messages[*]": "an object with a role and content",
    "messages[*].role": "system, developer, user, assistant or tool",
    "messages[*].content": "a string or a list of text parts ({'type': 'text', 'text': ...}); "
                           "this model reads text only",
    "stop": f"a string or a list of at most {MAX_STOP} strings",
    "stream_options": "an object ({'include_usage': true|false})",
    "chat_template_kwargs": f"an object of at most {MAX_MAP_ENTRIES} entries",
    "role_mapping": f"an object of at most {MAX_MAP_ENTRIES} entries, each a string",
    "user": f"a string of at most {MAX_ID_CHARS} characters",
    "cache_salt": f"a string of at most {MAX_ID_CHARS} characters",
    "logit_bias": "an object of token id -> bias",
    "response_format": "an object ({'type': 'text' | 'json_object' | 'json_schema', ...})",
    "adapters": "the name of one adapter this server holds, or 'none' (the bare base)",
    "tools": "a list of function definitions",
}
_TYPES = {"int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
          "dict": "an object", "list": "a list", "model": "an object", "finite": "a finite number"}
_RANGE = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def parse_body(body: dict, kind: str) -> _Request:
    """The request model of ``body`` for ``kind`` ("chat" or "completion"), or the 400 a
    client reads."""
    try:
        return REQUESTS[kind].model_validate(body)
    except ValidationError as e:
        raise refusal(e, REQUESTS[kind], kind) from None


def refusal(error: ValidationError, model: type[BaseModel], kind: str,
            expect: dict[str, str] | None = None) -> APIError:
    """The 400 of a body's first fault: a field the server does not implement, or the first
    field that is not what it must be (``expect``: what a field must be, by path; default
    ``EXPECT``, the OpenAI bodies')."""
    expect = EXPECT if expect is None else expect
    errors = error.errors(include_url=False)
    extra = sorted(".".join(filter(None, (_path(e["loc"][:-1]), str(e["loc"][-1]))))
                   for e in errors if e["type"] == "extra_forbidden")
    if extra:
        return bad(f"'{extra[0]:.80}' is not a field this server implements for {ENDPOINT.get(kind, kind)}"
                   + (f" (nor {len(extra) - 1} more)" if len(extra) > 1 else ""), _param(extra[0])[:80])
    first = errors[0]
    path = _path(first["loc"])
    pattern = re.sub(r"\[\d+\]", "[*]", path)
    if first["type"] in _RANGE and len(first["loc"]) == 1:
        return bad(f"'{path}' must be in {_interval(model, path)}, got {first['input']!r:.40}", path)
    if first["type"] == "too_long" and pattern not in expect:  # a list of a bounded length
        return bad(f"'{path}' must have at most {first['ctx']['max_length']} entries", _param(path))
    if first["type"] == "missing" and len(first["loc"]) == 1:
        return bad(f"'{path}' is required: {expect.get(pattern, 'see the API reference')}", path)
    what = expect.get(pattern) or _TYPES.get(first["type"].split("_")[0]) or _enclosing(pattern, expect) \
        or first["msg"].lower()
    shown = "" if isinstance(first["input"], (dict, list)) else f", got {first['input']!r:.40}"
    return bad(f"'{path}' must be {what}{shown}", _param(path))


def _enclosing(pattern: str, expect: dict[str, str]) -> str | None:
    """What the nearest enclosing value with a stated form must be (a content part's
    fault is told as the content's)."""
    while pattern:
        pattern = re.sub(r"(\.\w+|\[\*\])$", "", pattern)
        if pattern in expect:
            return expect[pattern]
    return None


def _param(path: str) -> str:
    """OpenAI's ``param`` for a fault at ``path``: the top-level field, or for a message
    ``messages[i]`` and the message's own field."""
    m = re.match(r"messages\[\d+\](\.\w+)?", path)
    return m.group(0) if m else re.split(r"[.\[]", path)[0]


def _path(loc: tuple) -> str:
    """``('messages', 0, 'content', 'str')`` -> ``messages[0].content``: the fields and
    indices of the path, without pydantic's union member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part) and part not in _TAGS:
            out += f".{part}" if out else part
    return out


_TAGS = frozenset(("str", "int", "float", "bool", "list", "dict", "none"))


def _interval(model: type[BaseModel], name: str) -> str:
    """A field's bounds in interval notation, from its constraints: ``(0, 1]``."""
    lo = hi = None
    lo_open = hi_open = False
    for c in model.model_fields[name].metadata:
        for attr, is_lo, is_open in (("ge", True, False), ("gt", True, True), ("le", False, False),
                                     ("lt", False, True)):
            value = getattr(c, attr, None)
            if value is None:
                continue
            if is_lo:
                lo, lo_open = value, is_open
            else:
                hi, hi_open = value, is_open
    def show(v) -> str:
        return str(v) if isinstance(v, int) or not float(v).is_integer() else str(int(v))
    return f"{'(' if lo_open else '['}{show(lo)}, {show(hi)}{')' if hi_open else ']'}"


# ---- responses ----

class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _omitted():
    """A field left out of the body when None."""
    return Field(None, exclude_if=lambda v: v is None)


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Out):
    content: list[TokenLogprob] | None = None


class CompletionLogprobs(_Out):
    """The legacy completions' per-token logprobs (an echoed prompt's first token: null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class FunctionCall(_Out):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Out):
    index: int | None = _omitted()  # a streamed delta's position among the answer's calls
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class PromptTokensDetails(_Out):
    cached_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = _omitted()


class ChatChoice(_Out):
    index: int
    message: ChatMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None


class _Answer(_Out):
    """What every answer body carries beside its object type, choices and usage."""

    id: str
    created: int
    model: str  # the name the request asked for (an alias, an adapter)
    system_fingerprint: str | None = None


class ChatCompletion(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChunkDelta(_Out):
    role: Literal["assistant"] | None = _omitted()
    content: str | None = _omitted()
    tool_calls: list[ToolCall] | None = _omitted()


class ChunkChoice(_Out):
    index: int
    delta: ChunkDelta
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    logprobs: ChoiceLogprobs | None


class ChatCompletionChunk(_Answer):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    usage: Usage | None = _omitted()  # the last event's, when stream_options.include_usage


class CompletionChoice(_Out):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None


class Completion(_Answer):
    """A whole legacy completion, or one of its streamed events (no usage but the last's)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = _omitted()


class ModelServes(_Out):
    """What a model id serves: the base, the adapter applied to it (None: none), in words."""

    base: str
    adapter: str | None
    description: str


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    parent: str | None  # the base model an adapter applies to; None for the base's own names
    edge0: ModelServes  # what the id serves (OpenAI's clients keep fields they do not know)


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]
