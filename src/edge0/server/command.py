"""``edge0 serve``: the OpenAI-compatible server on uvicorn (docs/SERVER.md)."""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_PROMPT_CACHE_MB = 512
# Prompt tokens prefilled between two decode steps of the batch when serving (the engine's
# 2048, mlx-lm's, froze running streams for the whole chunk: docs/SERVER.md, "Fairness")
DEFAULT_SERVE_PREFILL_STEP = 256
DEFAULT_SERVE_PREFILL_SHARE = 50  # percent of the compute thread's time while streams decode
API_KEY_ENV = "EDGE0_API_KEY"


def add_parser(sub) -> None:
    from edge0.config_sources.cli_flags import add_config_flags
    from edge0.server.api_error import DEFAULT_MAX_BODY

    s = sub.add_parser(
        "serve", help="an HTTP server with OpenAI's and Anthropic's APIs (chat, completions, messages, ...)",
        description="Serves /v1/chat/completions, /v1/completions, /v1/messages (Anthropic's), "
                    "/v1/messages/count_tokens, /v1/models, /health and /metrics on the "
                    "async engine. Every adapter given stays resident and each request picks its own through "
                    "'model' (the base's id: with its default adapter, as edge0 generate runs it; ID:base: the bare base; "
                    "or an adapter's name) or 'adapters'. docs/SERVER.md.")
    s.add_argument("--model", required=True,
                   help="an mlx-lm int4 MoE checkpoint: a directory, or a repo id (ORG/NAME) in the local Hugging "
                        "Face cache")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    s.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait for their turn; more get 429 with Retry-After (default 16)")
    s.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1, /metrics (env {API_KEY_ENV})")
    s.add_argument("--max-tokens", type=int, default=512,
                   help="tokens generated when a request does not say (default 512)")
    s.add_argument("--temp", type=float, default=0.0, help="temperature when a request does not say (default 0)")
    s.add_argument("--top-p", type=float, default=1.0, help="top_p when a request does not say (default 1)")
    s.add_argument("--top-k", type=int, default=0, help="top_k when a request does not say (default 0: off)")
    s.add_argument("--min-p", type=float, default=0.0, help="min_p when a request does not say (default 0: off)")
    s.add_argument("--keepalive", type=float, default=10.0,
                   help="seconds without a token after which a stream gets an SSE comment (default 10)")
    s.add_argument("--allowed-hosts", default="",
                   help="comma-separated Host names served besides IP addresses and localhost, '*' for any "
                        "(a page on another site reaching this server through DNS rebinding sends its own name)")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send its request's headers before it is closed (default 10)")
    s.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request's body may take to arrive; then 408 (default 30)")
    s.add_argument("--max-connections", type=int, default=256,
                   help="connections served at once; more get 503 (default 256). When all are taken, a new "
                        "connection closes an idle one of the client holding the most")
    s.add_argument("--max-connections-per-client", type=int, default=32,
                   help="connections from one client address; past it the client's oldest idle one is closed, "
                        "or the new one refused (default 32; behind a reverse proxy every client has the "
                        "proxy's address: raise it to --max-connections there, with --flood-ban 0)")
    s.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                   help="comma-separated origins (https://app.example) whose browsers may call the server: CORS "
                        "headers and preflight answers for them; * for any (default: none, as without the flag)")
    s.add_argument("--flood-ban", type=float, default=2.0, metavar="SECONDS",
                   help="an address that arrives at its full --max-connections-per-client more than that many "
                        "times in a second has its new connections dropped by the kernel this long, doubled on each "
                        "repeat within a minute of the last ban's end, up to 64 s (Linux; default 2; 0: never, as "
                        "behind a reverse proxy, where every client has the proxy's address)")
    s.add_argument("--send-timeout", type=float, default=30.0,
                   help="seconds a client may take no token of its stream (not reading it) before its "
                        "generation is stopped and its connection closed, so that it holds neither the engine "
                        "nor a connection slot (default 30)")
    s.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY,
                   help=f"largest request body accepted; more is 413 (default {DEFAULT_MAX_BODY})")
    s.add_argument("--render-timeout", type=float, default=2.0, metavar="SECONDS",
                   help="longest a request's chat template may take to render, in a worker process that is "
                        "killed then (a 400); large bodies are checked there too (default 2)")
    s.add_argument("--request-workers", type=int, default=2, metavar="N",
                   help="worker processes that render chat templates and check bodies over 64 KiB, about 90 MiB "
                        "each (default 2)")
    s.add_argument("--hide-paths", action="store_true",
                   help="the model's paths (the directory as given and absolute) still name it in requests, "
                        "but are not shown to clients: not in /v1/models, not in a 404's list of models")
    s.add_argument("--no-access-log", action="store_true",
                   help="no http.request line per request (method, path, status, ms, tokens) on standard error")
    s.add_argument("--grace", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds running requests may take to finish before they are "
                        "cancelled (default 30)")
    add_config_flags(s)
    for action in s._actions:  # serve's own defaults; say so where the flags are
        if action.dest == "prompt_cache_mb":
            action.help = action.help.replace("(default: 0;", f"(default for serve: {DEFAULT_PROMPT_CACHE_MB};")
        if action.dest == "prefill_step_size":
            action.help = action.help.replace("(default: 2048", f"(default for serve: {DEFAULT_SERVE_PREFILL_STEP}")
        if action.dest == "prefill_share":
            action.help = action.help.replace("(default: 100", f"(default for serve: {DEFAULT_SERVE_PREFILL_SHARE}")
    s.set_defaults(func=cmd_serve)


def build_settings(args: argparse.Namespace):
    from edge0.config_sources.resolve import resolve_config
    from edge0.errors import ConfigError
    from edge0.hub import repo_id_of, resolve_model
    from edge0.server.app import ServerSettings
    from edge0.server.protocol import Defaults
    from edge0.server.sandbox import SandboxLimits
    from edge0.sampling import SamplingParams

    for name, lo in (("max_queue", 0), ("max_body_bytes", 1), ("port", 0)):
        if getattr(args, name) < lo:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {lo}, got {getattr(args, name)}")
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ConfigError(f"--api-key (or {API_KEY_ENV}) is empty: give a key, or leave it out to serve without one")
    if not (args.keepalive > 0 and args.send_timeout > 0 and args.header_timeout > 0 and args.body_timeout > 0
            and args.grace >= 0 and args.flood_ban >= 0 and args.max_connections >= 1
            and args.max_connections_per_client >= 1 and args.render_timeout > 0 and args.request_workers >= 1):
        raise ConfigError("--keepalive, --send-timeout, --header-timeout, --body-timeout and --render-timeout must be "
                          "> 0, --grace and --flood-ban >= 0 and --max-connections, --max-connections-per-client "
                          "and --request-workers >= 1")
    SamplingParams(max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    model_dir = resolve_model(args.model)
    config = resolve_config(args, defaults={"prompt_cache_mb": DEFAULT_PROMPT_CACHE_MB,
                                            "prefill_step_size": DEFAULT_SERVE_PREFILL_STEP,
                                            "prefill_share": DEFAULT_SERVE_PREFILL_SHARE})
    model_id = args.model if not os.path.isdir(args.model) else os.path.basename(os.path.normpath(args.model))
    paths = {args.model, str(model_dir), os.path.abspath(model_dir)} - {model_id}
    aliases = ({repo_id_of(model_dir)} | (set() if args.hide_paths else paths)) - {None, model_id}
    return ServerSettings(
        model_dir=model_dir, config=config, model_id=model_id,
        defaults=Defaults(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p),
        max_queue=args.max_queue, api_key=key, header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
        max_connections=args.max_connections, max_connections_per_client=args.max_connections_per_client,
        flood_ban_s=args.flood_ban, model_aliases=tuple(sorted(aliases)),
        hidden_aliases=tuple(sorted(paths - aliases)) if args.hide_paths else (),
        sandbox=SandboxLimits(timeout_s=args.render_timeout, workers=args.request_workers),
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        allowed_hosts=tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip()),
        max_body_bytes=args.max_body_bytes, keepalive_s=args.keepalive, send_timeout_s=args.send_timeout,
        access_log=not args.no_access_log)


def cmd_serve(args: argparse.Namespace) -> int:
    from edge0.server.app import create_app
    from edge0.server.connections import make_server

    from edge0.backend import dist

    settings = build_settings(args)
    group = dist.group() if settings.config.pipeline == "auto" else None
    if group is not None and group.rank() > 0:
        return _follow(settings, group)
    app = create_app(settings)
    # uvicorn's access log is off: edge0.server.access_log writes one in Edge0's log format
    server = make_server(app, settings, host=args.host, port=args.port, log_level="warning",
                         timeout_graceful_shutdown=args.grace, access_log=False)
    state = app.state.edge0
    failed = []

    def stop_on_failure():
        failed.append(True)
        server.should_exit = True

    state.on_load_failure = stop_on_failure
    if args.host not in ("127.0.0.1", "localhost", "::1") and settings.api_key is None:
        print(f"[edge0] warning: serving on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    lines = _Lines(settings)
    state.on_ready = lines.ready
    _announce(server, lines)
    server.run()
    if failed:
        print(f"edge0: error: the model failed to load: {state.load_error}", file=sys.stderr)
        return 1
    return 0


def _follow(settings, group) -> int:
    """A rank after the first of a served pipeline: no HTTP; it runs every generation rank
    0 hands over until rank 0's engine closes."""
    from edge0.engine import Engine

    print(f"[edge0] rank {group.rank()} of {group.size()}: following rank 0's generations", file=sys.stderr)
    with Engine(settings.model_dir, settings.config) as engine:
        engine.follow()
    return 0


SERVED = ("POST /v1/chat/completions, /v1/completions, /v1/messages, /v1/messages/count_tokens; "
          "GET /v1/models, /health, /metrics (each OpenAI /v1 route also without it)")


class _Lines:
    """What ``edge0 serve`` says on standard error: the address once the port is open (the
    port a 0 picked), and once the model has loaded, that it is ready (after the address,
    whichever comes first)."""

    def __init__(self, settings):
        self.settings = settings
        self.url: str | None = None
        self.loaded_s: float | None = None
        self.adapters: list[str] = []

    def listening(self, url: str) -> None:
        self.url = url
        print(f"[edge0] serving {self.settings.model_id} on {url} (loading; GET /health says when ready)",
              file=sys.stderr, flush=True)
        self._ready_line()

    def ready(self, seconds: float, adapters: list[str]) -> None:
        self.loaded_s, self.adapters = seconds, adapters
        self._ready_line()

    def _ready_line(self) -> None:
        if self.url is None or self.loaded_s is None:
            return
        adapters = f", adapters {', '.join(self.adapters)}" if self.adapters else ""
        print(f"[edge0] ready on {self.url}: model {self.settings.model_id} ({self.settings.model_dir}{adapters}; "
              f"loaded in {self.loaded_s:g} s), serving {SERVED}", file=sys.stderr, flush=True)


def _announce(server, lines: _Lines) -> None:
    startup = server.startup

    async def announced(sockets=None):
        await startup(sockets=sockets)
        for s in server.servers:
            for sock in s.sockets:
                host, port = sock.getsockname()[:2]
                lines.listening(f"http://{host}:{port}")
                return

    server.startup = announced
