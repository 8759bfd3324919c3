"""The OpenAI-compatible HTTP server: a Starlette app on the async ``Engine``.

No thread per request and nothing blocking on the event loop: a large body is parsed and
every chat template rendered in a request worker process (``edge0.server.intake``),
tokenizing runs in a worker thread, generation on the engine's compute thread, and each
request awaits its tokens.
The engine decodes up to ``max_batch`` generations together (continuous batching, in
arrival order); requests beyond ``max_queue`` waiting ones are answered 429 with
``Retry-After``. A client that goes away cancels its
generation (within one decode step). Every adapter is resident: each request applies its
own, and switching never reloads the base.

Tool calls (``tools`` in the chat template, the model's calls parsed back into
``tool_calls``) are ``edge0.server.tools``'s.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (each
also without ``/v1``, as mlx-lm's server answers), ``GET /health`` (503 while the model
loads), ``GET /metrics`` (Prometheus text). With ``allowed_origins``, browsers on those
origins may call it (CORS, Starlette's middleware).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import traceback
from contextlib import asynccontextmanager

import anyio
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from edge0.errors import ConfigError, Edge0Error, EngineBusyError, FormatTooCostlyError, StalledConsumerError
from edge0.admission import EngineMetrics
from edge0.server import intake
from edge0.server import protocol as P
from edge0.server import schema as S
from edge0.logs import always_logger
from edge0.server.access_log import AccessLog, entry
from edge0.server.guard import RequestGuard
from edge0.server.state import ServerSettings, ServerState  # noqa: F401  (ServerSettings: the public name)
from edge0.server.tools import ToolCalls, stream_deltas


def create_app(settings: ServerSettings) -> Starlette:
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app):
        async with anyio.create_task_group() as tg:
            tg.start_soon(state.load)  # the port opens now; /health says 503 until this is done
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
        await state.close()

    routes = [Route("/health", _health(state), methods=["GET"]), Route("/metrics", _metrics(state), methods=["GET"])]
    for prefix in ("/v1", ""):  # mlx-lm's server answers both
        routes += [Route(f"{prefix}/chat/completions", _endpoint(state, "chat"), methods=["POST"]),
                   Route(f"{prefix}/completions", _endpoint(state, "completion"), methods=["POST"]),
                   Route(f"{prefix}/models", _models(state), methods=["GET"]),
                   Route(prefix + "/models/{model_id:path}", _models(state, one=True), methods=["GET"])]
    middleware = [Middleware(RequestGuard, allowed_hosts=settings.allowed_hosts)]
    if settings.allowed_origins:  # browsers' preflight and CORS headers, outside the Host and Content-Type checks
        middleware.insert(0, Middleware(_CORS, allow_origins=list(settings.allowed_origins),
                                        allow_methods=["GET", "POST"], allow_headers=["*"], max_age=600))
    if settings.access_log:  # outermost: it sees every answer, the guard's refusals too
        middleware.insert(0, Middleware(AccessLog, log=always_logger(settings.config.log_format)))
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: _not_found, 405: _not_allowed},
                    middleware=middleware)
    app.state.edge0 = state
    return app


class _CORS(CORSMiddleware):
    """Starlette's CORS, with a refused preflight in the API's error shape (not plain text)."""

    def preflight_response(self, request_headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        return JSONResponse(P.APIError(response.status_code, f"CORS preflight refused: {response.body.decode()}",
                                       kind="invalid_request_error").body(),
                            status_code=response.status_code, headers=headers)


# -- responses -------------------------------------------------------------------------------


def _error(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _not_found(request: Request, exc) -> JSONResponse:
    return _error(P.APIError(404, f"no route {request.method} {request.url.path}"))


async def _not_allowed(request: Request, exc) -> JSONResponse:
    return _error(P.APIError(405, f"{request.method} is not allowed on {request.url.path}", kind="invalid_request_error"))


def _check_auth(state: ServerState, request: Request) -> None:
    key = state.settings.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
    if not (scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())):
        raise P.APIError(401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")


def _tenant(request: Request, req: P.GenerationRequest) -> str:
    """The prompt cache's scope of a request: the API key it presented (hashed: the key
    is never kept), its ``user`` and its ``cache_salt``. Requests share cached prompts only
    when all three are equal (docs/SERVER.md)."""
    given = request.headers.get("authorization", "").strip()
    parts = json.dumps([given, req.user, req.cache_salt]).encode()
    return hashlib.sha256(parts).hexdigest()


def _check_ready(state: ServerState) -> None:
    if state.engine is None:
        why = f"the model failed to load: {state.load_error}" if state.load_error else "the model is loading"
        raise P.APIError(503, why, headers={"Retry-After": "1"})


def _models(state: ServerState, one: bool = False):
    """``GET /v1/models``, or with ``one`` ``GET /v1/models/{id}`` (404 for an unknown id)."""
    async def handler(request: Request) -> Response:
        try:
            _check_auth(state, request)
            _check_ready(state)
            created = P.now()
            data = {name: S.ModelCard(id=name, created=created, owned_by="edge0",
                                      parent=None if adapter is None else state.settings.model_id)
                    for name, adapter in state.listed_models.items()}
            wanted = request.path_params.get("model_id") if one else None
            if one and wanted in state.settings.hidden_aliases:
                data[wanted] = S.ModelCard(id=wanted, created=created, owned_by="edge0", parent=None)
            if one and wanted not in data:
                raise P.APIError(404, f"the model {wanted!r:.80} does not exist; this server has {sorted(data)}",
                                 param="model", code="model_not_found")
        except P.APIError as e:
            state.metrics.count("models", e.status)
            return _error(e)
        state.metrics.count("models", 200)
        return JSONResponse((data[wanted] if one else S.ModelList(data=list(data.values()))).model_dump())
    return handler


def _health(state: ServerState):
    async def handler(request: Request) -> Response:
        if state.engine is not None:
            return JSONResponse({"status": "ok", "model": state.settings.model_id, "adapters": state.engine.adapters})
        body = {"status": "error", "error": state.load_error} if state.load_error else {"status": "loading"}
        return JSONResponse(body, status_code=503)
    return handler


def _metrics(state: ServerState):
    async def handler(request: Request) -> Response:
        try:
            _check_auth(state, request)
        except P.APIError as e:
            return _error(e)
        engine = state.engine
        # never waits for (nor leaves a thread waiting on) a busy compute thread: the counts
        # as of the last generation's end, with the live number of generations
        resources = engine.resources(wait=False) if engine is not None else None
        m = engine.metrics() if engine is not None else None
        text = state.metrics.render(m or EngineMetrics(), loaded=engine is not None, resources=resources,
                                    process=_process())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
    return handler


def _request_fault(error: BaseException) -> str | None:
    """The request field to blame when a generation failed on what the request asked for (a
    400), else None (the server's fault, a 500): a format too costly to enforce, or a value
    the engine refused once the generation began (a format compiled again there after the
    cache let it go, whose walk then took too long)."""
    if isinstance(error, FormatTooCostlyError):
        return "response_format"
    if isinstance(error, ConfigError):
        return "response_format" if str(error).startswith("response_format") else "messages"
    return None


def _process() -> dict:
    """Threads, open file descriptors and event-loop tasks of this process (leak checks)."""
    import asyncio
    import os
    import threading

    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1
    try:
        tasks = len(asyncio.all_tasks())
    except RuntimeError:  # not an asyncio loop
        tasks = -1
    from edge0.backend import core as B

    return {"threads": threading.active_count(), "open_fds": fds, "tasks": tasks,
            "mlx_active_bytes": B.active_memory(), "mlx_cache_bytes": B.cache_memory()}


def _endpoint(state: ServerState, kind: str):
    name = "chat" if kind == "chat" else "completions"

    async def handler(request: Request) -> Response:
        admission = None
        try:
            _check_auth(state, request)
            _check_ready(state)
            req = await intake.parse(state, request, kind)
            req.tenant = _tenant(request, req)
            admission = _admit(state)  # before any work for the request
            ids = await intake.until_gone(request, intake.prompt_ids, state, req)
            if req.stream:
                stream = _stream(state, req, ids, admission, entry(request.scope))
                admission = None  # the stream owns it from here
                state.metrics.count(name, 200)
                return StreamingResponse(stream, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            result = await _complete(state, request, req, ids, admission)
            state.metrics.count(name, 200 if result is not None else 499)
            return JSONResponse(result) if result is not None else Response(status_code=499)
        except P.APIError as e:
            state.metrics.count(name, e.status)
            return _error(e)
        except ClientDisconnect:  # the client left while sending its request: nobody to answer
            state.metrics.count(name, 499)
            state.metrics.disconnects += 1
            return Response(status_code=499)
        except anyio.get_cancelled_exc_class():
            # only the server's shutdown cancels a handler (its requests' --grace is over): an
            # answer that says so, not uvicorn's bare 500 and a logged traceback
            state.metrics.count(name, 503)
            return _error(P.APIError(503, "the server is shutting down", headers={"Connection": "close"}))
        except Exception as e:  # noqa: BLE001 - an internal failure: 500, and the next request is served
            state.log.error("server.internal_error", error=f"{type(e).__name__}: {e}",
                            traceback=traceback.format_exc(limit=8))
            state.metrics.count(name, 500)
            return _error(P.APIError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))
        finally:
            if admission is not None:
                admission.release()
    return handler


def _admit(state: ServerState):
    """The request's place in the engine's line, or 429 when ``max_queue`` already wait."""
    try:
        return state.engine.admit(state.settings.max_queue)
    except EngineBusyError as e:
        raise P.APIError(429, f"{e.waiting} requests are waiting (max_queue {e.limit}); retry later",
                         headers={"Retry-After": str(state.settings.retry_after_s)}) from None


class _Collector:
    """A request's token events: count, logprob entries, tool calls, finish reason, final
    stats."""

    def __init__(self, state: ServerState, req: P.GenerationRequest, record: dict):
        self.state, self.req, self.record = state, req, record  # record: the access log's entry
        self.logprobs: list[dict] | None = [] if req.logprobs else None
        self.tools = ToolCalls(state.engine.tokenizer, req.tools) if req.tools else None
        self.stats = None
        self.finish: str | None = None
        self.count = 0

    def add(self, event) -> tuple[str, list[dict], list[dict]]:
        """The text to emit for ``event``, its logprob entries and the tool calls it completes."""
        self.count += 1
        entries = []
        if self.logprobs is not None and event.logprob is not None:
            entries = [P.token_logprob(self.state.engine.tokenizer, event.token, event.logprob, event.top_logprobs)]
            self.logprobs.extend(entries)
        text, calls = event.text, []
        if self.tools is not None:
            text, calls = self.tools.feed(text, final=event.finish_reason is not None)
        if event.finish_reason is not None:
            self.finish, self.stats = event.finish_reason, event.stats
            if self.finish == "stop" and self.tools is not None and self.tools.calls:
                self.finish = "tool_calls"
        return text, entries, calls

    @property
    def calls(self) -> list[dict]:
        return self.tools.calls if self.tools is not None else []

    def usage(self, prompt_tokens: int) -> dict:
        cached = self.stats.cached_tokens if self.stats is not None else 0
        return P.usage(prompt_tokens, self.count, cached)


async def _generate(state: ServerState, req: P.GenerationRequest, ids: list[int], collector: _Collector,
                    admission, heartbeat: float | None = None):
    """The engine's events for a request as (text, logprob entries); ``None`` items are
    heartbeats."""
    gen = state.engine.generate(ids, adapter=req.adapter, heartbeat=heartbeat, admission=admission,
                                cache_scope=req.tenant,
                                consumer_timeout=state.settings.send_timeout_s, **req.sampling)
    try:
        async for event in gen:
            yield None if event is None else collector.add(event)
    finally:
        with anyio.CancelScope(shield=True):
            await gen.aclose()
        if collector.stats is not None:
            state.metrics.finished(collector.stats)
        collector.record.update(prompt_tokens=len(ids), completion_tokens=collector.count)


async def _complete(state: ServerState, request: Request, req: P.GenerationRequest, ids: list[int],
                    admission) -> dict | None:
    """A whole (non-streamed) answer; None when the client went away first."""
    collector = _Collector(state, req, entry(request.scope))
    parts: list[str] = []
    gone = False

    async def watch_disconnect(scope: anyio.CancelScope):
        nonlocal gone
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone = True
                scope.cancel()
                return

    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_disconnect, tg.cancel_scope)
        try:
            async for item in _generate(state, req, ids, collector, admission):
                if item is not None:
                    parts.append(item[0])
        except Exception as e:  # noqa: BLE001 - re-raised below, outside the task group
            error = e
        tg.cancel_scope.cancel()
    if _request_fault(error):
        raise P.APIError(400, str(error), param=_request_fault(error))
    if isinstance(error, Edge0Error):
        raise P.APIError(500, f"generation failed: {type(error).__name__}: {error}", kind="server_error")
    if error is not None:
        raise error
    if gone:
        state.metrics.disconnects += 1
        return None
    return P.response(req, P.new_id(req.kind), P.now(), "".join(parts), collector.finish or "length",
                      collector.usage(len(ids)), collector.logprobs, collector.calls)


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _stream(state: ServerState, req: P.GenerationRequest, ids: list[int], admission, record: dict):
    """Server-sent events: a chunk per token (text held back while it may begin a stop
    string), keep-alive comments while no token comes, the usage chunk, ``[DONE]``;
    ``record``: the access log's entry."""
    rid, created = P.new_id(req.kind), P.now()
    collector = _Collector(state, req, record)
    ended = False  # answered to the end, or with an error event: not a disconnect
    try:
        if req.kind == "chat":
            yield _sse(P.chunk(req, rid, created, "", None, role=True))
        async for item in _generate(state, req, ids, collector, admission, heartbeat=state.settings.keepalive_s):
            if item is None:
                yield ": keep-alive\n\n"
                continue
            text, entries, calls = item
            if text or entries or calls:
                first = len(collector.calls) - len(calls)
                yield _sse(P.chunk(req, rid, created, text if text or not calls else None, None, entries,
                                   tool_calls=stream_deltas(calls, first)))
        yield _sse(P.chunk(req, rid, created, None if req.kind == "chat" else "", collector.finish or "length"))
        if req.include_usage:
            yield _sse(P.usage_chunk(req, rid, created, collector.usage(len(ids))))
        yield _sse("[DONE]")
        ended = True
    except StalledConsumerError as e:  # the client stopped reading: its stream ends, nobody to tell
        state.log.warning("server.stream_stopped", reason=str(e))
    except Edge0Error as e:
        state.log.error("server.generation_failed", error=f"{type(e).__name__}: {e}")
        ended = True
        fault = _request_fault(e)
        yield _sse({"error": {"message": str(e) if fault else f"generation failed: {type(e).__name__}: {e}",
                              "type": "invalid_request_error" if fault else "server_error",
                              "param": fault, "code": None}})
    finally:
        if not ended:
            state.metrics.disconnects += 1
        admission.release()
