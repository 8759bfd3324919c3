"""A checked request's generations turned into its answer.

Each choice (every prompt times ``n``: ``edge0.server.scoring``) is one generation of the
engine, all submitted at once so that the engine's batch decodes them together. ``complete``
waits for them all and answers the whole body (a client that leaves cancels them);
``stream`` answers a request of one choice as server-sent events. An echoed prompt's text
and scores come with a choice's first token (``TokenEvent.prompt_logprobs``). The bodies
are a shape's: OpenAI's (``OPENAI``) or Anthropic's (``edge0.server.anthropic.SHAPE``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import anyio
from starlette.requests import Request

from edge0.errors import ConfigError, Edge0Error, FormatTooCostlyError, StalledConsumerError
from edge0.server import protocol as P
from edge0.server import scoring
from edge0.server.state import ServerState
from edge0.server.tools import ToolCalls, stream_deltas


def request_fault(error: BaseException) -> str | None:
    """The request field to blame when a generation failed on what the request asked for (a
    400), else None (the server's fault, a 500): a format too costly to enforce, or a value
    the engine refused once the generation began (a format compiled again there after the
    cache let it go, whose walk then took too long)."""
    if isinstance(error, FormatTooCostlyError):
        return "response_format"
    if isinstance(error, ConfigError):  # a forced tool call's grammar is the request's tool_choice
        return next((param for prefix, param in (("response_format", "response_format"), ("grammar", "tool_choice"))
                     if str(error).startswith(prefix)), "messages")
    return None


class _Collector:
    """A choice's token events: count, logprob entries, tool calls, finish reason, final
    stats, and with ``echo`` its prompt's text and scores before the first token."""

    def __init__(self, state: ServerState, req: P.GenerationRequest):
        self.state, self.req = state, req
        self.logprobs: list[dict] | None = [] if req.logprobs else None
        self.tools = ToolCalls(state.engine.tokenizer, req.tools) if req.tools else None
        self.stats = None
        self.finish: str | None = None
        self.stop: str | None = None  # the stop string that ended the answer
        self.count = 0
        self.started = False  # the first event came
        self.echo_text = ""  # with echo: the prompt's text, before the first event's
        self.echoed = None  # with echo and logprobs: the prompt's part of the legacy logprobs

    def add(self, event) -> tuple[str, list[dict], list[dict], object]:
        """The text to emit for ``event``, its logprob entries, the tool calls it completes
        and (on the first event, with echo and logprobs) the echoed prompt's logprobs."""
        first, self.started = not self.started, True
        if self.req.score_only:  # the one token the engine ran for an echoed prompt: not part of the answer
            self.finish, self.stats = "length", event.stats
            return self.echo_text if first else "", [], [], self.echoed if first else None
        self.count += 1
        entries = []
        if self.logprobs is not None and event.logprob is not None:
            entries = [P.token_logprob(self.state.engine.tokenizer, event.token, event.logprob, event.top_logprobs)]
            self.logprobs.extend(entries)
        text, calls = event.text, []
        if self.tools is not None:
            text, calls = self.tools.feed(text, final=event.finish_reason is not None)
        if event.finish_reason is not None:
            self.finish, self.stats, self.stop = event.finish_reason, event.stats, event.stop_sequence
            if self.finish == "stop" and self.tools is not None and self.tools.calls:
                self.finish = "tool_calls"
        return (self.echo_text + text if first else text), entries, calls, self.echoed if first else None

    @property
    def calls(self) -> list[dict]:
        return self.tools.calls if self.tools is not None else []

    @property
    def cached(self) -> int:
        return self.stats.cached_tokens if self.stats is not None else 0


@dataclass
class Choice:
    """One generation of a request: its place among the answer's choices, the request as it
    runs (its own seed), its prompt (as given and as token ids) and what it produced."""

    index: int
    req: P.GenerationRequest
    ids: list[int]
    prompt: str | list[int] | None
    collector: _Collector
    parts: list[str] = field(default_factory=list)

    def answer(self) -> P.Answer:
        c = self.collector
        return P.Answer(self.index, "".join(self.parts), c.finish or "length", c.logprobs, c.calls, c.echoed)


def choices(state: ServerState, req: P.GenerationRequest, prompt_ids: list[list[int]]) -> list[Choice]:
    """Every choice of ``req``: each prompt ``n`` times, choice ``j`` of a prompt seeded
    ``seed + j`` (``scoring.choice_seed``)."""
    out = []
    for i, ids in enumerate(prompt_ids):
        for j in range(req.n):
            sampling = {**req.sampling, "seed": scoring.choice_seed(req.sampling.get("seed"), j)}
            r = dataclasses.replace(req, sampling=sampling)
            out.append(Choice(i * req.n + j, r, ids, req.prompts[i] if req.prompts else None, _Collector(state, r)))
    return out


def usage(req: P.GenerationRequest, picked: list[Choice]) -> P.S.Usage:
    """Each prompt's tokens once, every choice's completion tokens."""
    firsts = [c for c in picked if c.index % req.n == 0]
    return P.usage(sum(len(c.ids) for c in firsts), sum(c.collector.count for c in picked),
                   sum(c.collector.cached for c in firsts))


async def _echo(state: ServerState, choice: Choice, event) -> None:
    """An echoed choice's prompt text and (with logprobs) scores, made in a worker thread
    (a prompt's tokens decoded one by one)."""
    tokenizer = state.engine.tokenizer

    def made():
        text = choice.prompt if isinstance(choice.prompt, str) else tokenizer.decode(choice.ids)
        scored = scoring.echoed(tokenizer, choice.ids, event.prompt_logprobs) if choice.req.logprobs else None
        return text, scored

    choice.collector.echo_text, choice.collector.echoed = await anyio.to_thread.run_sync(made)


async def _generate(state: ServerState, choice: Choice, admission, heartbeat: float | None = None):
    """The engine's events for a choice as ``_Collector.add`` returns them; ``None`` items
    are heartbeats."""
    req, collector = choice.req, choice.collector
    gen = state.engine.generate(choice.ids, adapter=req.adapter, heartbeat=heartbeat, admission=admission,
                                cache_scope=req.tenant,
                                consumer_timeout=state.settings.send_timeout_s, **req.sampling)
    try:
        async for event in gen:
            if event is not None and req.echo and not collector.started:
                await _echo(state, choice, event)
            yield None if event is None else collector.add(event)
    finally:
        with anyio.CancelScope(shield=True):
            await gen.aclose()
        if collector.stats is not None:
            state.metrics.finished(collector.stats)


def _logged(record: dict, req: P.GenerationRequest, picked: list[Choice]) -> None:
    """The request's token counts into its access-log entry (``edge0.server.access_log``)."""
    counted = usage(req, picked)
    record.update(prompt_tokens=counted.prompt_tokens, completion_tokens=counted.completion_tokens)


async def complete(state: ServerState, request: Request, req: P.GenerationRequest, prompt_ids: list[list[int]],
                   admissions: list, shape, record: dict) -> dict | None:
    """A whole (non-streamed) answer; None when the client went away first. Each choice's
    generation takes its own place in the engine's line (``admissions``, one a choice);
    ``record``: the access log's entry."""
    picked = choices(state, req, prompt_ids)
    gone = False
    errors: list[Exception] = []

    async def watch_disconnect(scope: anyio.CancelScope):
        nonlocal gone
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone = True
                scope.cancel()
                return

    async def run(choice: Choice, admitted, scope: anyio.CancelScope):
        try:
            async for item in _generate(state, choice, admitted):
                if item is not None:
                    choice.parts.append(item[0])
        except Exception as e:  # noqa: BLE001 - raised below, outside the task group; the other choices stop
            errors.append(e)
            scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_disconnect, tg.cancel_scope)
        async with anyio.create_task_group() as generations:
            for k, choice in enumerate(picked):
                generations.start_soon(run, choice, admissions[k], tg.cancel_scope)
        tg.cancel_scope.cancel()
    _logged(record, req, picked)
    error = errors[0] if errors else None
    if request_fault(error):
        raise P.APIError(400, str(error), param=request_fault(error))
    if isinstance(error, Edge0Error):
        raise P.APIError(500, f"generation failed: {type(error).__name__}: {error}", kind="server_error")
    if error is not None:
        raise error
    if gone:
        state.metrics.disconnects += 1
        return None
    return shape.whole(req, picked)


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class OpenAIShape:
    """OpenAI's bodies of an answer: its errors, the whole answer, its events."""

    @staticmethod
    def error(e: P.APIError) -> dict:
        return e.body()

    @staticmethod
    def whole(req: P.GenerationRequest, picked: list[Choice]) -> dict:
        return P.response(req, P.new_id(req.kind), P.now(), [c.answer() for c in picked], usage(req, picked))

    @staticmethod
    async def events(req: P.GenerationRequest, choice: Choice, items):
        """A chunk per token (text held back while it may begin a stop string), keep-alive
        comments while no token comes, the usage chunk, ``[DONE]``."""
        rid, created = P.new_id(req.kind), P.now()
        collector = choice.collector
        if req.kind == "chat":
            yield _sse(P.chunk(req, rid, created, "", None, role=True))
        async for item in items:
            if item is None:
                yield ": keep-alive\n\n"
                continue
            text, entries, calls, echoed = item
            if text or entries or calls or echoed:
                first = len(collector.calls) - len(calls)
                yield _sse(P.chunk(req, rid, created, text if text or not calls else None, None, entries,
                                   tool_calls=stream_deltas(calls, first), echoed=echoed))
        yield _sse(P.chunk(req, rid, created, None if req.kind == "chat" else "", collector.finish or "length"))
        if req.include_usage:
            yield _sse(P.usage_chunk(req, rid, created, usage(req, [choice])))
        yield _sse("[DONE]")

    @staticmethod
    def stream_error(message: str, fault: str | None) -> str:
        return _sse({"error": {"message": message, "type": "invalid_request_error" if fault else "server_error",
                               "param": fault, "code": None}})


OPENAI = OpenAIShape()


async def stream(state: ServerState, req: P.GenerationRequest, prompt_ids: list[list[int]], admission, shape,
                 record: dict):
    """Server-sent events of a one-choice request in ``shape``'s bodies; an error event
    when the generation fails; ``record``: the access log's entry."""
    choice = choices(state, req, prompt_ids)[0]
    ended = False  # answered to the end, or with an error event: not a disconnect
    try:
        items = _generate(state, choice, admission, heartbeat=state.settings.keepalive_s)
        async for event in shape.events(req, choice, items):
            yield event
        ended = True
    except StalledConsumerError as e:  # the client stopped reading: its stream ends, nobody to tell
        state.log.warning("server.stream_stopped", reason=str(e))
    except Edge0Error as e:
        state.log.error("server.generation_failed", error=f"{type(e).__name__}: {e}")
        ended = True
        fault = request_fault(e)
        yield shape.stream_error(str(e) if fault else f"generation failed: {type(e).__name__}: {e}", fault)
    finally:
        _logged(record, req, [choice])
        if not ended:
            state.metrics.disconnects += 1
        admission.release()
