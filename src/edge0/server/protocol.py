"""The OpenAI HTTP API as Edge0's server speaks it: a body's model (``schema``) turned
into a request for the engine, and the engine's tokens into response bodies.

A body is first its pydantic model (``schema.ChatRequest`` / ``CompletionRequest``:
exactly the fields the server implements, each with its type and bounds; any other field
is refused, nothing a client sends is silently ignored), then what only the server can
check: the model or adapter it names (404), the response format's schema, logit bias and
token ids against the vocabulary, tools, the chat template's own variables. Every mistake
is an ``APIError`` with the HTTP status and OpenAI's error shape (``{"error": {"message",
"type", "param", "code"}}``). The fields are the ones mlx-lm's server takes, with OpenAI's
``max_completion_tokens``, ``user`` and ``stream_options`` and vLLM's ``cache_salt``.
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from edge0.constrain import parse_response_format
from edge0.errors import ConfigError
from edge0.prompts import RENDERER_OWN
from edge0.sampling import check_logit_bias
from edge0.server import schema as S
from edge0.server import scoring
from edge0.server.api_error import MAX_NODES, APIError, bad, check_value
from edge0.server.forced_tools import forced_call_grammar
from edge0.server.scoring import IMPOSSIBLE_LOGPROB
from edge0.server.tools import history_calls, parse_tools


NO_ADAPTER = "none"  # 'adapters': 'none' asks for the bare base


@dataclass
class GenerationRequest:
    """One checked request, ready for the engine."""

    kind: str  # "chat" or "completion"
    model: str  # the id answered with
    adapter: Any  # the engine's adapter argument: a name, None (the bare base) or the default
    messages: list[dict] | None = None
    prompts: list[str | list[int]] | None = None  # a completion's prompts: one choice per prompt (times n)
    n: int = 1  # choices per prompt
    echo: bool = False  # a completion's text (and logprobs) start with its prompt's
    score_only: bool = False  # max_tokens 0 with echo: the prompt scored, nothing generated
    count_only: bool = False  # Anthropic's count_tokens: the prompt's tokens counted, whatever its length
    sampling: dict = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    max_tokens_given: bool = False  # the request named its token limit (else the server's default)
    tools: list[dict] | None = None  # function definitions for the chat template (tool_choice "auto")
    template_kwargs: dict | None = None  # chat_template_kwargs: the chat template's variables
    role_mapping: dict | None = None  # mlx-lm's prompt format for a model without a chat template
    user: str | None = None  # OpenAI's end-user id: with the API key, the prompt cache's tenant
    cache_salt: str | None = None  # vLLM's finer scope: only requests with the same salt share cached prompts
    tenant: str | None = None  # the prompt cache's scope, set by the server (API key, user, cache_salt)
    prefill: str | None = None  # the start of the answer, which the model continues (Anthropic's last assistant message)


def _messages(messages: list[S.Message]) -> list[dict]:
    """The checked messages in the form chat templates read: content parts joined, the
    developer role a system message, an assistant's history calls and a tool result's id."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        if content is None and m.role == "assistant":
            content = ""
        if content is None:
            raise bad(f"'messages[{i}].content' must be {S.EXPECT['messages[*].content']}", f"messages[{i}].content")
        entry = {"role": "system" if m.role == "developer" else m.role, "content": content}
        calls = history_calls({"role": m.role, "tool_calls": m.tool_calls}, i)
        if calls is not None:
            entry["tool_calls"] = calls
        if m.role == "tool":
            entry.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name)) if v is not None})
        out.append(entry)
    return out


@dataclass(frozen=True)
class Defaults:
    """Sampling a request gets for the fields it leaves out (``edge0 serve``'s flags, as
    mlx-lm's server has them: greedy unless asked)."""

    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0


@dataclass(frozen=True)
class Checks:
    """What a body is checked against besides its own shape."""

    models: dict[str, Any]  # id -> the engine's adapter argument
    default_model: str  # what a request naming no model gets
    defaults: Defaults
    vocab_size: int | None
    context: int | None  # the model's context in tokens (None: not known)
    template_vars: frozenset[str] | None = None  # the variables the chat template reads (None: not known)
    hidden: frozenset[str] = frozenset()  # model ids never shown to clients (a 404 lists the others)
    bare: str | None = None  # the id of the bare base, what 'adapters': 'none' gets (None: no such id)
    tool_format: str | None = None  # the chat template's tool-call format (forced_tools.tool_format; None: none)


def parse(body: Any, kind: str, checks: Checks) -> GenerationRequest:
    """A checked request."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    room = scoring.prompt_room(body.get("prompt"), checks.context) if kind == "completion" else 0
    check_value(body, max_nodes=MAX_NODES + max(room, checks.context or 0))
    r = S.parse_body(body, kind)
    model, adapter = _model_and_adapter(r, checks)
    sampling = _sampling(r, checks.defaults)
    logprobs, top = _logprob_fields(r, kind)
    sampling["stop"] = _stops(r)
    req = GenerationRequest(kind=kind, model=model, adapter=adapter, sampling=sampling, stream=bool(r.stream),
                            include_usage=bool(r.stream_options and r.stream_options.include_usage),
                            logprobs=logprobs, top_logprobs=top,
                            max_tokens_given=r.max_tokens is not None or r.max_completion_tokens is not None,
                            user=r.user, cache_salt=r.cache_salt, n=r.n or 1)
    if logprobs:
        sampling["logprobs"] = True
        sampling["top_logprobs"] = top
    if kind == "chat":
        req.messages = _messages(r.messages)
        tools = parse_tools(body)
        req.tools = tools.tools
        if tools.forced:
            if "response_format" in sampling:
                raise bad("'response_format' cannot be given with a 'tool_choice' that forces a call (the call is "
                          "the answer's format)", "response_format")
            sampling["grammar"] = forced_call_grammar(checks.tool_format, tools.tools, tools.forced)
        req.template_kwargs, req.role_mapping = r.chat_template_kwargs, r.role_mapping
        _check_template_kwargs(req.template_kwargs or {}, checks.template_vars)
    else:
        req.prompts = scoring.prompts(r.prompt, checks.vocab_size)
        _echo(req, r)
    scoring.check_choices(req.n, len(req.prompts or [None]))
    if req.stream and req.n * len(req.prompts or [None]) > 1:
        raise bad("a streamed answer has one choice: 'n' above 1 or a list of prompts needs 'stream': false",
                  "stream")
    return req


def _echo(req: GenerationRequest, r: S.CompletionRequest) -> None:
    """``echo`` (the prompt's text and scores first) and ``max_tokens: 0`` (only the
    prompt scored: the engine runs one step, whose token is dropped)."""
    req.echo = bool(r.echo)
    if req.echo and req.logprobs:
        req.sampling["prompt_logprobs"] = req.top_logprobs
    if r.max_tokens == 0:
        if not req.echo:
            raise bad("'max_tokens' 0 generates nothing: it needs 'echo': true (the prompt scored)", "max_tokens")
        req.sampling["max_tokens"], req.score_only = 1, True


def _check_template_kwargs(kwargs: dict, variables: frozenset[str] | None) -> None:
    """``chat_template_kwargs`` are the chat template's variables: the renderer's own
    parameters (a whole template, the messages, tokenizing) are the server's to set, and a
    name the template does not read would be silently ignored."""
    for name in sorted(kwargs):
        if name in RENDERER_OWN:
            raise bad(f"'chat_template_kwargs.{name:.80}' is a parameter of the template renderer, set by the server; "
                      "chat_template_kwargs are the chat template's variables", "chat_template_kwargs")
        if variables is not None and name not in variables:
            known = ", ".join(sorted(variables - RENDERER_OWN)) or "none"
            raise bad(f"'chat_template_kwargs.{name:.80}' is not a variable of this model's chat template (it reads: "
                      f"{known:.400})", "chat_template_kwargs")


def _model_and_adapter(r: S.ChatRequest | S.CompletionRequest, checks: Checks) -> tuple[str, Any]:
    """The model id answered with and the engine's adapter argument, from ``model`` or ``adapters``."""
    models = checks.models
    shown = sorted(m for m in models if m not in checks.hidden)
    if r.adapters == NO_ADAPTER and checks.bare is not None:
        return checks.bare, models[checks.bare]
    if r.adapters is not None:
        if r.adapters not in models:
            raise APIError(404, f"no adapter {r.adapters!r:.80}; this server serves {shown}", param="adapters",
                           code="model_not_found")
        return r.adapters, models[r.adapters]
    model = checks.default_model if r.model is None else r.model
    if model not in models:
        raise APIError(404, f"the model {model!r:.80} does not exist; this server serves {shown}",
                       param="model", code="model_not_found")
    return model, models[model]


def _sampling(r: S.ChatRequest | S.CompletionRequest, defaults: Defaults) -> dict:
    """The token limit and the sampling fields, with the server's defaults for those left out."""
    def given(value, default):
        return default if value is None else value

    sampling = dict(
        max_tokens=given(r.max_completion_tokens, given(r.max_tokens, defaults.max_tokens)),
        temp=float(given(r.temperature, defaults.temperature)), top_p=float(given(r.top_p, defaults.top_p)),
        top_k=given(r.top_k, defaults.top_k), min_p=float(given(r.min_p, defaults.min_p)),
        seed=None if r.seed is None else r.seed % (1 << 63),
        repetition_penalty=r.repetition_penalty, repetition_context_size=r.repetition_context_size,
        xtc_probability=r.xtc_probability, xtc_threshold=r.xtc_threshold,
        presence_context_size=r.presence_context_size, frequency_context_size=r.frequency_context_size,
        presence_penalty=r.presence_penalty or None, frequency_penalty=r.frequency_penalty or None,
        prompt_lookup=r.prompt_lookup, num_draft_tokens=r.num_draft_tokens)
    for name in [k for k, v in sampling.items() if v is None and k != "seed"]:
        del sampling[name]
    if r.response_format is not None:  # the shape now; the schema compiles with the tokenizer
        try:
            parse_response_format(r.response_format)
        except ConfigError as e:
            raise bad(str(e), "response_format") from None
        sampling["response_format"] = r.response_format
    if r.logit_bias is not None:
        try:
            sampling["logit_bias"] = check_logit_bias(r.logit_bias)
        except ConfigError as e:
            raise bad(str(e), "logit_bias") from None
    return sampling


def _stops(r: S.ChatRequest | S.CompletionRequest) -> tuple[str, ...]:
    """``stop``: none, one string or a list of non-empty strings."""
    stops = [] if r.stop is None else [r.stop] if isinstance(r.stop, str) else r.stop
    if any(s == "" for s in stops):
        raise bad("'stop' strings must not be empty", "stop")
    return tuple(stops)


def _logprob_fields(r: S.ChatRequest | S.CompletionRequest, kind: str) -> tuple[bool, int]:
    """Whether to return logprobs and how many alternatives: chat's ``logprobs`` /
    ``top_logprobs``, or the legacy completions' ``logprobs: N`` (and no ``echo``)."""
    if kind == "chat":
        top = r.top_logprobs or 0
        if top and not r.logprobs:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return bool(r.logprobs), top
    return r.logprobs is not None, r.logprobs or 0


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> S.Usage:
    return S.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=S.PromptTokensDetails(cached_tokens=cached))


def token_logprob(tokenizer, token: int, logprob: float, top: list | None) -> S.TokenLogprob:
    def entry(i: int, lp: float) -> dict:
        text = tokenizer.decode([i])
        return {"token": text, "logprob": lp if math.isfinite(lp) else IMPOSSIBLE_LOGPROB,
                "bytes": list(text.encode("utf-8"))}
    return S.TokenLogprob(**entry(token, logprob), top_logprobs=[S.TopLogprob(**entry(i, lp)) for i, lp in top or []])


def completion_logprobs(entries: list[S.TokenLogprob], echoed: S.CompletionLogprobs | None = None
                        ) -> S.CompletionLogprobs:
    """The legacy completions shape of per-token logprobs, after an echoed prompt's
    (``echoed``: ``scoring.echoed``); ``text_offset`` counts from the choice's text."""
    tokens = (echoed.tokens if echoed else []) + [e.token for e in entries]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return S.CompletionLogprobs(tokens=tokens,
                                token_logprobs=(echoed.token_logprobs if echoed else []) + [e.logprob for e in entries],
                                top_logprobs=(echoed.top_logprobs if echoed else [])
                                + [{t.token: t.logprob for t in e.top_logprobs} for e in entries],
                                text_offset=offsets)


@dataclass
class Answer:
    """One choice of a whole answer."""

    index: int
    text: str
    finish: str
    logprobs: list[S.TokenLogprob] | None  # the generated tokens' (None: not asked for)
    tool_calls: list[dict] | None = None
    echoed: S.CompletionLogprobs | None = None  # the echoed prompt's part of the legacy logprobs


def response(req: GenerationRequest, rid: str, created: int, answers: list[Answer], use: S.Usage) -> dict:
    """A whole answer's body."""
    if req.kind == "chat":
        choices = [S.ChatChoice(index=a.index, message=S.ChatMessage(
            content=a.text if a.text or not a.tool_calls else None,
            tool_calls=[S.ToolCall(**c) for c in a.tool_calls] if a.tool_calls else None), finish_reason=a.finish,
            logprobs=S.ChoiceLogprobs(content=a.logprobs) if a.logprobs is not None else None) for a in answers]
        return S.ChatCompletion(id=rid, created=created, model=req.model, choices=choices, usage=use).model_dump()
    choices = [S.CompletionChoice(index=a.index, text=a.text, finish_reason=a.finish,
                                  logprobs=completion_logprobs(a.logprobs, a.echoed) if a.logprobs is not None
                                  else None) for a in answers]
    return S.Completion(id=rid, created=created, model=req.model, choices=choices, usage=use).model_dump()


def chunk(req: GenerationRequest, rid: str, created: int, text: str | None, finish: str | None,
          logprobs: list[S.TokenLogprob] | None = None, *, role: bool = False,
          tool_calls: list[dict] | None = None, echoed: S.CompletionLogprobs | None = None) -> dict:
    """A streamed event's body: the text, logprobs and tool calls one event settles
    (``echoed``: the echoed prompt's logprobs, on a completion's first event)."""
    if req.kind == "chat":
        delta = S.ChunkDelta(role="assistant" if role else None, content=text,
                             tool_calls=[S.ToolCall(**c) for c in tool_calls] if tool_calls else None)
        choice = S.ChunkChoice(index=0, delta=delta, finish_reason=finish,
                               logprobs=S.ChoiceLogprobs(content=logprobs) if logprobs else None)
        return S.ChatCompletionChunk(id=rid, created=created, model=req.model, choices=[choice]).model_dump()
    choice = S.CompletionChoice(index=0, text=text or "", finish_reason=finish,
                                logprobs=completion_logprobs(logprobs or [], echoed) if logprobs or echoed else None)
    return S.Completion(id=rid, created=created, model=req.model, choices=[choice]).model_dump()


def usage_chunk(req: GenerationRequest, rid: str, created: int, use: S.Usage) -> dict:
    """The last streamed event's body when ``stream_options.include_usage``: no choice, the usage."""
    kind = S.ChatCompletionChunk if req.kind == "chat" else S.Completion
    return kind(id=rid, created=created, model=req.model, choices=[], usage=use).model_dump()


def now() -> int:
    return int(time.time())
