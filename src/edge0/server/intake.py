"""A request from its bytes to its token ids: the body read within its bounds, parsed and
checked (a large one in a request worker process, ``edge0.server.sandbox``), the prompt
rendered (every chat template in a worker process) and tokenized; what a client's leaving
does meanwhile (its worker's job killed, its place in line given back)."""

from __future__ import annotations

import functools
import threading

import anyio
from starlette.requests import ClientDisconnect, Request

from edge0.errors import ConfigError
from edge0.heap import trim_heap
from edge0.server import anthropic
from edge0.server import protocol as P
from edge0.server.api_error import load_json
from edge0.server.sandbox import JobAbandoned, JobRefused, JobTimeout, SandboxError
from edge0.server.state import ServerState

INLINE_JSON_BYTES = 64 * 1024  # larger request bodies are parsed and checked in a request worker process


async def _read_body(state: ServerState, request: Request) -> bytes:
    limit = state.settings.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise P.APIError(413, f"the request body is {length} bytes, over the limit of {limit}")
    chunks, size = [], 0
    timeout = state.settings.body_timeout_s
    try:
        with anyio.fail_after(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise P.APIError(413, f"the request body is over the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise P.APIError(408, f"the request body did not arrive within {timeout:g} s",
                         kind="invalid_request_error", headers={"Connection": "close"}) from None
    return b"".join(chunks)


async def parse(state: ServerState, request: Request, kind: str) -> P.GenerationRequest:
    """The checked request of the body. A small body is parsed here; a large one in a
    request worker process (parsing 4 MB of JSON holds the interpreter lock for about
    0.1 s, walking it for seconds: other clients' streams must not wait for it)."""
    body = await _read_body(state, request)
    if len(body) > INLINE_JSON_BYTES:
        job, body = ("parse", body, kind), None
        try:
            req = await until_gone(request, state.sandbox.run, job)
        finally:
            # the body's megabytes (and their copies on the way to the worker) freed: glibc
            # keeps such blocks in its arenas once big frees have raised its mmap threshold
            del job
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(trim_heap)
        req.adapter = state.checks.models[req.model]  # the worker held the models by name
        return req
    return anthropic.parse_any(load_json(body), kind, state.checks)


async def until_gone(request: Request, fn, *args):
    """``fn(*args, abandoned=event)`` on a worker thread; the event is set, and
    ``ClientDisconnect`` raised, when the client leaves meanwhile (``fn`` ends soon after: a
    request worker process running its job is killed)."""
    gone = threading.Event()

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone.set()

    result = error = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        try:
            result = await anyio.to_thread.run_sync(functools.partial(fn, *args, abandoned=gone),
                                                    abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():  # the server is stopping: the job is killed, not waited for
            gone.set()
            raise
        except Exception as e:  # noqa: BLE001 - raised below, outside the task group (no exception group)
            error = e
        tg.cancel_scope.cancel()
    if isinstance(error, JobAbandoned):
        raise ClientDisconnect() from None
    if isinstance(error, JobRefused):
        raise P.APIError(error.status, str(error), param=error.param,
                         kind="server_error" if error.status >= 500 else None) from None
    if isinstance(error, SandboxError):  # no worker free in time, a check past its deadline, shutting down
        raise P.APIError(503, f"the request could not be checked: {error}", headers={"Retry-After": "1"}) from None
    if error is not None:
        raise error
    return result


def prompt_ids(state: ServerState, req: P.GenerationRequest, abandoned: threading.Event) -> list[list[int]]:
    """Token ids of each of the request's prompts (chat: the one the chat template renders,
    in a request worker process under a time and memory bound; completions: each of
    ``prompts``), checked by the engine (context length, sampling values). Runs in a
    worker thread."""
    engine = state.engine

    def render(messages, **keywords) -> str:
        try:
            return state.sandbox.run(("render", messages, keywords, engine.max_prompt_chars), abandoned=abandoned)
        except JobRefused as e:
            raise P.bad(f"the chat template failed on this request: {e}", _template_field(req)) from None
        except JobTimeout:
            raise P.bad(f"the chat template took longer than {state.settings.sandbox.timeout_s:g} s to render this "
                        "request", _template_field(req)) from None

    where = ""
    try:
        if req.tools and not getattr(engine.tokenizer, "has_tool_calling", False):
            raise P.bad("this model's chat template has no tool-call format: it cannot be given tools", "tools")
        sources = ([engine.prompt_ids(messages=req.messages, tools=req.tools, template_kwargs=req.template_kwargs,
                                      role_mapping=req.role_mapping, prefill_response=req.prefill,
                                      render=render)] if req.kind == "chat"
                   else req.prompts)
        out = []
        for i, prompt in enumerate(sources):
            where = f"prompt[{i}]: " if len(sources) > 1 else ""
            out.append(prompt if req.count_only else engine.validate(prompt, **req.sampling)[0])
    except ConfigError as e:  # a sampling value the model refuses, or the prompt
        named = next((f for f in req.sampling if str(e).startswith(f)), None)
        named = "tool_choice" if named == "grammar" else named  # the grammar of a forced tool call
        raise P.bad(str(e) if named else where + str(e), named or ("messages" if req.kind == "chat" else "prompt")
                    ) from None
    ctx, limit = engine.context_length, req.sampling["max_tokens"]
    for i, ids in enumerate([] if req.count_only else out):
        if req.max_tokens_given and ctx is not None and len(ids) + limit > ctx:  # a default limit is clipped instead
            where = f"prompt[{i}]: " if len(out) > 1 else ""
            raise P.bad(f"{where}the prompt ({len(ids)} tokens) and max_tokens ({limit}) exceed the model's context "
                        f"of {ctx} tokens: ask for at most {ctx - len(ids)}", "max_tokens")
    return out


def _template_field(req: P.GenerationRequest) -> str:
    """The field to blame for a template that fails: its variables when the request set
    some, else the messages it renders."""
    return "chat_template_kwargs" if req.template_kwargs else "messages"
