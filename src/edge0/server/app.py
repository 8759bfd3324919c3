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
``tool_calls``) are ``edge0.server.tools``'s; a request's generations (each prompt times
``n``) become its answer in ``edge0.server.answers``, echoed prompts and choices are
``edge0.server.scoring``'s.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (each
also without ``/v1``, as mlx-lm's server answers), Anthropic's ``POST /v1/messages`` and
``/v1/messages/count_tokens`` (``edge0.server.anthropic``: the chat path, its answers in
Anthropic's shapes), ``GET /health`` (503 while the model
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

from edge0.errors import EngineBusyError
from edge0.admission import EngineMetrics
from edge0.server import anthropic, answers, intake
from edge0.server import protocol as P
from edge0.server import schema as S
from edge0.logs import always_logger
from edge0.server.access_log import AccessLog, entry
from edge0.server.guard import RequestGuard
from edge0.server.state import ServerSettings, ServerState  # noqa: F401  (ServerSettings: the public name)


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
    routes += [Route("/v1/messages", _endpoint(state, "messages", anthropic.SHAPE), methods=["POST"]),
               Route("/v1/messages/count_tokens", _endpoint(state, "count_tokens", anthropic.SHAPE), methods=["POST"])]
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


def _error(e: P.APIError, shape=answers.OPENAI) -> JSONResponse:
    return JSONResponse(shape.error(e), status_code=e.status, headers=e.headers)


async def _not_found(request: Request, exc) -> JSONResponse:
    return _error(P.APIError(404, f"no route {request.method} {request.url.path}"), _answers_at(request.url.path))


async def _not_allowed(request: Request, exc) -> JSONResponse:
    return _error(P.APIError(405, f"{request.method} is not allowed on {request.url.path}", kind="invalid_request_error"),
                  _answers_at(request.url.path))


def _answers_at(path: str):
    """The shapes of the API a path belongs to (Anthropic's under its route)."""
    return anthropic.SHAPE if anthropic.is_route(path) else answers.OPENAI


def _check_auth(state: ServerState, request: Request) -> None:
    key = state.settings.api_key
    if key is None:
        return
    if not hmac.compare_digest(_presented_key(request).encode(), key.encode()):
        raise P.APIError(401, "missing or wrong API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                         code="invalid_api_key")


def _presented_key(request: Request) -> str:
    """The API key a request presents: ``Authorization: Bearer KEY`` (OpenAI's clients) or
    ``x-api-key: KEY`` (Anthropic's); "" when none."""
    scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
    return given.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "").strip()


def _tenant(request: Request, req: P.GenerationRequest) -> str:
    """The prompt cache's scope of a request: the API key it presented (hashed: the key
    is never kept), its ``user`` and its ``cache_salt``. Requests share cached prompts only
    when all three are equal (docs/SERVER.md)."""
    parts = json.dumps([_presented_key(request), req.user, req.cache_salt]).encode()
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
            data = {name: state.card(name, created) for name in state.listed_models}
            wanted = request.path_params.get("model_id") if one else None
            if one and wanted in state.settings.hidden_aliases:
                data[wanted] = state.card(wanted, created)
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


def _endpoint(state: ServerState, kind: str, shape=answers.OPENAI):
    """The handler of ``kind``'s requests, answered in ``shape``'s bodies (OpenAI's by
    default). Anthropic's "count_tokens" stops at the prompt's token ids."""
    name = {"chat": "chat", "completion": "completions"}.get(kind, kind)

    async def handler(request: Request) -> Response:
        admissions: list = []
        try:
            _check_auth(state, request)
            _check_ready(state)
            req = await intake.parse(state, request, kind)
            req.tenant = _tenant(request, req)
            if kind == "count_tokens":  # counted as rendered: a prompt over the context too, to tell it so
                req.count_only = True
                ids = await intake.until_gone(request, intake.prompt_ids, state, req)
                state.metrics.count(name, 200)
                return JSONResponse({"input_tokens": len(ids[0])})
            admissions = _admit(state, req)  # before any work for the request
            ids = await intake.until_gone(request, intake.prompt_ids, state, req)
            if req.stream:
                stream = answers.stream(state, req, ids, admissions[0], shape, entry(request.scope))
                admissions = []  # the stream owns its one from here
                state.metrics.count(name, 200)
                return StreamingResponse(stream, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            result = await answers.complete(state, request, req, ids, admissions, shape, entry(request.scope))
            state.metrics.count(name, 200 if result is not None else 499)
            return JSONResponse(result) if result is not None else Response(status_code=499)
        except P.APIError as e:
            state.metrics.count(name, e.status)
            return _error(e, shape)
        except ClientDisconnect:  # the client left while sending its request: nobody to answer
            state.metrics.count(name, 499)
            state.metrics.disconnects += 1
            return Response(status_code=499)
        except anyio.get_cancelled_exc_class():
            # only the server's shutdown cancels a handler (its requests' --grace is over): an
            # answer that says so, not uvicorn's bare 500 and a logged traceback
            state.metrics.count(name, 503)
            return _error(P.APIError(503, "the server is shutting down", headers={"Connection": "close"}), shape)
        except Exception as e:  # noqa: BLE001 - an internal failure: 500, and the next request is served
            state.log.error("server.internal_error", error=f"{type(e).__name__}: {e}",
                            traceback=traceback.format_exc(limit=8))
            state.metrics.count(name, 500)
            return _error(P.APIError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"), shape)
        finally:
            for admission in admissions:
                admission.release()
    return handler


def _admit(state: ServerState, req: P.GenerationRequest) -> list:
    """A place in the engine's line for each of the request's generations (its prompts times
    ``n``), or 429 when ``max_queue`` generations would then wait beyond the batch; a request
    that asks for more than the batch and the line hold together is a 400."""
    count = req.n * len(req.prompts or [None])
    room, line = state.engine.config.max_batch, state.settings.max_queue
    if line is not None and count > room + line:
        raise P.APIError(400, f"this request asks for {count} generations (its prompts times 'n'); the server runs "
                              f"{room} together and lets {line} wait (--max-batch, --max-queue): at most {room + line}",
                         param="n" if req.n > 1 else "prompt")
    places: list = []
    try:
        for _ in range(count):
            places.append(state.engine.admit(line))
    except EngineBusyError as e:
        for place in places:
            place.release()
        asked = f"; this request asks for {count}" if count > 1 else ""
        raise P.APIError(429, f"{e.waiting} requests are waiting (max_queue {e.limit}){asked}; retry later",
                         headers={"Retry-After": str(state.settings.retry_after_s)}) from None
    return places
