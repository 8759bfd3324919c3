"""The OpenAI HTTP API as Edge0's server speaks it: request checking and response bodies.

Requests are checked field by field before anything runs; every mistake is an
``APIError`` with the HTTP status and the OpenAI error shape
(``{"error": {"message", "type", "param", "code"}}``). The fields are the ones mlx-lm's
server takes: ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``seed``, ``stop``, ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty`` (with mlx-lm's ``repetition_context_size``, ``presence_context_size``
and ``frequency_context_size``), mlx-lm's ``xtc_probability`` / ``xtc_threshold``,
``logit_bias``, ``response_format`` (JSON output, ``edge0.constrain``), ``logprobs`` /
``top_logprobs``, ``stream`` / ``stream_options.include_usage``, chat's
``chat_template_kwargs`` and ``role_mapping``, and the adapter chosen by ``model`` (the
base or an adapter's name) or ``adapters``. Any other field is refused (400 naming it):
nothing a client sends is silently ignored.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from edge0.constrain import parse_response_format
from edge0.errors import ConfigError
from edge0.sampling import MAX_TOKENS, check_logit_bias
from edge0.server.api_error import APIError, bad, check_value
from edge0.server.tools import history_calls, parse_tools

MAX_STOP = 4
MAX_TOP_LOGPROBS = 20


@dataclass
class GenerationRequest:
    """One checked request, ready for the engine."""

    kind: str  # "chat" or "completion"
    model: str  # the id answered with
    adapter: Any  # the engine's adapter argument: a name, None (the bare base) or the default
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
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


def _number(body: dict, name: str, lo: float, hi: float, *, lo_open=False, hi_open=False, integer=False,
            default=None):
    if name not in body or body[name] is None:
        return default
    v = body[name]
    kind = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, (int,) if integer else (int, float)) \
            or (isinstance(v, float) and not math.isfinite(v)):
        raise bad(f"'{name}' must be {kind}, got {v!r:.40}", name)
    ok = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        lb, hb = "(" if lo_open else "[", ")" if hi_open else "]"
        raise bad(f"'{name}' must be in {lb}{lo}, {hi}{hb}, got {v!r}", name)
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false, got {v!r:.40}", name)
    return v


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"messages[{i}].role must be system, developer, user, assistant or tool, got {role!r:.40}",
                      f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is understood
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content[{j}] must be a text part ({{'type': 'text', 'text': ...}}); "
                              "this model reads text only", f"messages[{i}].content")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
        entry = {"role": "system" if role == "developer" else role, "content": content}
        calls = history_calls(m, i)
        if calls is not None:
            entry["tool_calls"] = calls
        for key in ("tool_call_id", "name") if role == "tool" else ():
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad(f"messages[{i}].{key} must be a string", f"messages[{i}].{key}")
                entry[key] = m[key]
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


def parse(body: Any, kind: str, models: dict[str, Any], default_model: str, defaults: Defaults,
          vocab_size: int | None) -> GenerationRequest:
    """A checked request. ``models``: id -> the engine's adapter argument for it."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_value(body)
    _known_fields(body, kind)
    model, adapter = _model_and_adapter(body, models, default_model)
    sampling = _sampling(body, defaults)
    stops = _stops(body)
    stream, include_usage = _stream_options(body)
    logprobs, top = _logprob_fields(body, kind)
    sampling["stop"] = tuple(stops)
    req = GenerationRequest(kind=kind, model=model, adapter=adapter, sampling=sampling, stream=stream,
                            include_usage=include_usage, logprobs=logprobs, top_logprobs=top,
                            max_tokens_given=body.get("max_tokens") is not None
                            or body.get("max_completion_tokens") is not None)
    req.user, req.cache_salt = _short_string(body, "user"), _short_string(body, "cache_salt")
    if logprobs:
        sampling["logprobs"] = True
        sampling["top_logprobs"] = top
    if kind == "chat":
        req.messages = _messages(body.get("messages"))
        req.tools = parse_tools(body).tools
        req.template_kwargs = _string_map(body, "chat_template_kwargs", any_value=True)
        req.role_mapping = _string_map(body, "role_mapping")
        if req.template_kwargs and TEMPLATE_OWN & set(req.template_kwargs):
            name = sorted(TEMPLATE_OWN & set(req.template_kwargs))[0]
            raise bad(f"'chat_template_kwargs.{name}' is set by the server, not the request", "chat_template_kwargs")
    else:
        req.prompt = _prompt(body.get("prompt"), vocab_size)
    return req


COMMON_FIELDS = frozenset((
    "model", "adapters", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "repetition_penalty", "repetition_context_size", "presence_penalty", "presence_context_size",
    "frequency_penalty", "frequency_context_size", "xtc_probability", "xtc_threshold", "logit_bias",
    "response_format", "logprobs", "top_logprobs", "stream", "stream_options", "user", "cache_salt"))
FIELDS = {"chat": COMMON_FIELDS | {"messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                                   "role_mapping"},
          "completion": COMMON_FIELDS | {"prompt", "echo"}}
TEMPLATE_OWN = frozenset(("messages", "conversation", "tools", "tokenize", "add_generation_prompt"))
MAX_MAP_ENTRIES = 64


def _known_fields(body: dict, kind: str) -> None:
    """A field this server does not implement is refused, never silently ignored."""
    unknown = sorted(str(k) for k in body if k not in FIELDS[kind])
    if unknown:
        raise bad(f"'{unknown[0]:.80}' is not a field this server implements for "
                  f"{'chat completions' if kind == 'chat' else 'completions'}"
                  + (f" (nor {len(unknown) - 1} more)" if len(unknown) > 1 else ""), unknown[0][:80])


def _string_map(body: dict, name: str, any_value: bool = False) -> dict | None:
    """An object of at most ``MAX_MAP_ENTRIES`` string keys (and string values unless
    ``any_value``), or None."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_MAP_ENTRIES:
        raise bad(f"'{name}' must be an object of at most {MAX_MAP_ENTRIES} entries", name)
    for k, v in value.items():
        if not any_value and not isinstance(v, str):
            raise bad(f"'{name}.{k:.40}' must be a string, got {v!r:.40}", name)
    return dict(value)


def _model_and_adapter(body: dict, models: dict[str, Any], default_model: str) -> tuple[str, Any]:
    """The model id answered with and the engine's adapter argument, from ``model`` or ``adapters``."""
    model = body.get("model", default_model)
    if model is None:
        model = default_model
    if not isinstance(model, str):
        raise bad(f"'model' must be a string, got {model!r:.40}", "model")
    adapters = body.get("adapters")
    if adapters is not None:
        if not isinstance(adapters, str):
            raise bad("'adapters' must be the name of one adapter this server holds", "adapters")
        if adapters not in models:
            raise APIError(404, f"no adapter {adapters!r}; this server serves {sorted(models)}", param="adapters",
                           code="model_not_found")
        return adapters, models[adapters]
    if model not in models:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {sorted(models)}",
                       param="model", code="model_not_found")
    return model, models[model]


def _sampling(body: dict, defaults: Defaults) -> dict:
    """``n`` (one choice only), the token limit and the sampling fields, with the server's defaults."""
    n = _number(body, "n", 1, 1, integer=True, default=1)
    del n  # one choice per request
    max_tokens = _number(body, "max_completion_tokens", 1, MAX_TOKENS, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", 1, MAX_TOKENS, integer=True, default=defaults.max_tokens)
    sampling = dict(
        max_tokens=max_tokens, temp=float(_number(body, "temperature", 0, 100, default=defaults.temperature)),
        top_p=float(_number(body, "top_p", 0, 1, lo_open=True, default=defaults.top_p)),
        top_k=_number(body, "top_k", 0, 1 << 20, integer=True, default=defaults.top_k),
        min_p=float(_number(body, "min_p", 0, 1, hi_open=True, default=defaults.min_p)),
        seed=_number(body, "seed", -(1 << 63), (1 << 63) - 1, integer=True),
        repetition_penalty=_number(body, "repetition_penalty", 0.01, 100),  # smaller: logits past float range
        repetition_context_size=_number(body, "repetition_context_size", 1, 1 << 20, integer=True),
        xtc_probability=_number(body, "xtc_probability", 0, 1),
        xtc_threshold=_number(body, "xtc_threshold", 0, 0.5),
    )
    if sampling["seed"] is not None:
        sampling["seed"] = sampling["seed"] % (1 << 63)
    for name in ("presence", "frequency"):  # OpenAI's range; 0 (its default) is no penalty
        penalty = _number(body, f"{name}_penalty", -2, 2)
        size = _number(body, f"{name}_context_size", 1, 1 << 20, integer=True)
        if penalty:
            sampling[f"{name}_penalty"] = float(penalty)
        if size is not None:
            sampling[f"{name}_context_size"] = size
    for name in [k for k, v in sampling.items() if v is None and k != "seed"]:
        del sampling[name]
    for name in ("xtc_probability", "xtc_threshold"):
        if name in sampling:
            sampling[name] = float(sampling[name])
    if body.get("response_format") is not None:  # the shape now; the schema compiles with the tokenizer
        try:
            parse_response_format(body["response_format"])
        except ConfigError as e:
            raise bad(str(e), "response_format") from None
        sampling["response_format"] = body["response_format"]
    if body.get("logit_bias") is not None:
        try:
            sampling["logit_bias"] = check_logit_bias(body["logit_bias"])
        except ConfigError as e:
            raise bad(str(e), "logit_bias") from None
    return sampling


MAX_ID_CHARS = 256  # user, cache_salt


def _short_string(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_ID_CHARS:
        raise bad(f"'{name}' must be a string of at most {MAX_ID_CHARS} characters", name)
    return value


def _stops(body: dict) -> list[str]:
    """``stop``: none, one string or a list of at most ``MAX_STOP`` non-empty strings."""
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP:
        stops = list(stop)
    else:
        raise bad(f"'stop' must be a string or a list of at most {MAX_STOP} strings", "stop")
    if any(s == "" for s in stops):
        raise bad("'stop' strings must not be empty", "stop")
    return stops


def _stream_options(body: dict) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage``."""
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    return stream, bool(options and _bool(options, "include_usage"))


def _logprob_fields(body: dict, kind: str) -> tuple[bool, int]:
    """Whether to return logprobs and how many alternatives: chat's ``logprobs`` /
    ``top_logprobs``, or the legacy completions' ``logprobs: N`` (and no ``echo``)."""
    if kind == "chat":
        logprobs = _bool(body, "logprobs")
        top = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True, default=0)
        if top and not logprobs:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return logprobs, top
    lp = _number(body, "logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
    if _bool(body, "echo"):
        raise bad("'echo' is not supported", "echo")
    return lp is not None, lp or 0


def _prompt(prompt: Any, vocab_size: int | None) -> str | list[int]:
    """A completion's prompt: a non-empty string or token ids (a one-element list is unwrapped)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' must not be empty", "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt):
            raise bad(f"'prompt' token ids must be in [0, {vocab_size})", "prompt")
    else:
        raise bad("'prompt' must be a non-empty string or a list of token ids (one prompt per request)",
                  "prompt")
    return prompt


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


IMPOSSIBLE_LOGPROB = -9999.0  # OpenAI's stand-in for log(0): JSON has no -Infinity


def token_logprob(tokenizer, token: int, logprob: float, top: list | None) -> dict:
    text = tokenizer.decode([token])
    logprob = logprob if math.isfinite(logprob) else IMPOSSIBLE_LOGPROB
    entry = {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    entry["top_logprobs"] = [
        {"token": (t := tokenizer.decode([i])), "logprob": lp, "bytes": list(t.encode("utf-8"))}
        for i, lp in (top or [])]
    return entry


def completion_logprobs(entries: list[dict]) -> dict:
    """The legacy completions shape of per-token logprobs."""
    offsets, pos = [], 0
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def response(req: GenerationRequest, rid: str, created: int, text: str, finish: str, use: dict,
             logprobs: list[dict] | None, tool_calls: list[dict] | None = None) -> dict:
    if req.kind == "chat":
        message = {"role": "assistant", "content": text if text or not tool_calls else None}
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice = {"index": 0, "message": message, "finish_reason": finish,
                  "logprobs": {"content": logprobs} if logprobs is not None else None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish,
                  "logprobs": completion_logprobs(logprobs) if logprobs is not None else None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice], "usage": use,
            "system_fingerprint": None}


def chunk(req: GenerationRequest, rid: str, created: int, text: str | None, finish: str | None,
          logprobs: list[dict] | None = None, *, role: bool = False, tool_calls: list[dict] | None = None) -> dict:
    if req.kind == "chat":
        delta: dict = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": 0, "delta": delta, "finish_reason": finish,
                  "logprobs": {"content": logprobs} if logprobs else None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish,
                  "logprobs": completion_logprobs(logprobs) if logprobs else None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice],
            "system_fingerprint": None}


def usage_chunk(req: GenerationRequest, rid: str, created: int, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
            "created": created, "model": req.model, "choices": [], "usage": use}


def now() -> int:
    return int(time.time())
