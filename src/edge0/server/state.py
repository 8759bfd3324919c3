"""The server's settings and its state: the engine it loads, the models it answers to, the
counters of ``/metrics`` (``edge0.server.app`` serves them)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio

from edge0.backend import nn as bnn
from edge0.config import EngineConfig
from edge0.logs import get_logger
from edge0.prompts import template_variables
from edge0.server import protocol as P
from edge0.server import schema as S
from edge0.server.api_error import DEFAULT_MAX_BODY
from edge0.server.forced_tools import tool_format
from edge0.server.metrics import Metrics
from edge0.server.sandbox import Sandbox, SandboxLimits


BARE_SUFFIX = ":base"  # ID + this names the bare base (no adapter); ID alone serves its default adapter


@dataclass
class ServerSettings:
    model_dir: Path
    config: EngineConfig
    model_id: str  # the base's id in /v1/models (the directory name or the repo id)
    defaults: P.Defaults = field(default_factory=P.Defaults)
    max_queue: int = 16
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    keepalive_s: float = 10.0
    send_timeout_s: float = 30.0  # a stream whose client takes nothing this long is stopped
    allowed_hosts: tuple[str, ...] = ()  # Host names served besides IP literals and localhost ("*": any)
    header_timeout_s: float = 10.0  # a connection that sends no whole request head in this long is closed
    body_timeout_s: float = 30.0  # a request body not in after this long: 408
    max_connections: int = 256  # connections served at once (503 beyond)
    max_connections_per_client: int = 32  # of them from one client address (edge0.server.connections)
    flood_ban_s: float = 2.0  # an address cycling through its share: dropped this long (server.address_gate)
    retry_after_s: int = 1
    model_aliases: tuple[str, ...] = ()  # other names of the base: the path it was started with, its hub id
    hidden_aliases: tuple[str, ...] = ()  # names of the base never shown to clients (--hide-paths: its paths)
    allowed_origins: tuple[str, ...] = ()  # browser origins answered with CORS headers ("*": any)
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)  # large bodies' checks, template renders
    access_log: bool = True  # an http.request event per request (edge0.server.access_log)


def sandbox_setup(tokenizer, checks: P.Checks) -> dict:
    """What every request worker process holds: the tokenizer (mlx-lm's wrapper is rebuilt
    there around it) and the body checks (adapters by name: the engine's arguments for them
    are looked up again here)."""
    return {"tokenizer": bnn.tokenizer_parts(tokenizer),
            "checks": replace(checks, models={name: None for name in checks.models})}


class ServerState:
    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.engine = None
        self.load_error: str | None = None
        self.metrics = Metrics()
        self.log = get_logger("edge0.server")
        self.on_load_failure = None  # the command line stops the server when loading fails
        self.on_ready = None  # the command line's ready line: called with the load's seconds and the adapters
        self.sandbox: Sandbox | None = None  # set once the engine is loaded
        self.checks: P.Checks | None = None  # what a body is checked against, once the engine is loaded

    @property
    def in_flight(self) -> int:
        """Requests admitted and not finished (the engine counts them)."""
        return self.engine.metrics().in_flight if self.engine is not None else 0

    @property
    def models(self) -> dict[str, Any]:
        """Model id -> the adapter it serves (None: the bare base). The base's names (its id,
        ``model_aliases`` and mlx-lm's ``default_model``, what a request naming no model
        gets) serve what ``edge0 generate`` and ``edge0 demo`` run: the base with the
        engine's default adapter when it has one; ``ID:base`` the bare base; each adapter's
        name that adapter."""
        return self._models(self.engine)

    def _models(self, engine) -> dict[str, Any]:
        default = self._default_adapter(engine)
        out: dict[str, Any] = {self.settings.model_id: default, self.bare_id: None}
        for name in engine.adapters:
            out[name] = name
        for name in self.settings.model_aliases + self.settings.hidden_aliases:
            out.setdefault(name, default)
        out.setdefault("default_model", default)
        return out

    @property
    def bare_id(self) -> str:
        """The id that names the base without any adapter."""
        return self.settings.model_id + BARE_SUFFIX

    def card(self, name: str, created: int) -> S.ModelCard:
        """``/v1/models``'s entry for ``name``: OpenAI's fields, ``parent`` (the base, for a
        name that applies an adapter to it) and ``edge0``: what the name serves."""
        base, adapter = self.settings.model_id, self.models.get(name)
        own = name in (base, self.bare_id, *self.settings.model_aliases, *self.settings.hidden_aliases)
        if adapter is None:
            what = f"{base} without an adapter"
        else:
            default = adapter == self._default_adapter(self.engine)
            what = f"{base} with the adapter {adapter!r}" + (
                " (its default: what edge0 generate and edge0 demo apply)" if default else "")
        return S.ModelCard(id=name, created=created, owned_by="edge0", parent=None if own or adapter is None else base,
                           edge0=S.ModelServes(base=base, adapter=adapter, description=what))

    @property
    def listed_models(self) -> dict[str, Any]:
        """``models`` without the names never shown to clients (``hidden_aliases``)."""
        return {k: v for k, v in self.models.items() if k not in self.settings.hidden_aliases}

    def _default_model(self, engine) -> str:
        """The id a request naming no model is answered with: the engine's default adapter if
        it has one."""
        return self._default_adapter(engine) or self.settings.model_id

    def _default_adapter(self, engine) -> str | None:
        adapters = engine.adapters
        return adapters[0] if adapters and self.settings.config.adapter != "off" else None

    async def load(self) -> None:
        """The engine, then the request worker processes; ``engine`` is set (the server is
        ready) once both are."""
        from edge0.engine import Engine

        t0 = time.perf_counter()
        engine = None
        try:
            engine = await anyio.to_thread.run_sync(Engine, self.settings.model_dir, self.settings.config)
            if getattr(getattr(engine, "streaming", None), "pipeline", None) is not None:  # rank 0 of mlx.launch
                engine.lead()
            self.checks = P.Checks(self._models(engine), self._default_model(engine), self.settings.defaults,
                                   engine.vocab_size, engine.context_length,
                                   template_variables(*bnn.tokenizer_parts(engine.tokenizer)),
                                   hidden=frozenset(self.settings.hidden_aliases),
                                   bare=self.bare_id, tool_format=tool_format(engine.tokenizer))
            self.sandbox = await anyio.to_thread.run_sync(Sandbox, sandbox_setup(engine.tokenizer, self.checks),
                                                          self.settings.sandbox)
        except Exception as e:  # noqa: BLE001 - reported by /health and the log, then the server stops
            self.load_error = f"{type(e).__name__}: {e}"
            self.log.error("server.load_failed", error=self.load_error)
            if engine is not None:
                await anyio.to_thread.run_sync(engine.close)
            if self.on_load_failure is not None:
                self.on_load_failure()
            return
        self.engine = engine
        seconds = round(time.perf_counter() - t0, 2)
        self.log.info("server.ready", model=str(self.settings.model_dir), seconds=seconds, adapters=self.engine.adapters)
        if self.on_ready is not None:
            self.on_ready(seconds, list(self.engine.adapters))

    async def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
        if self.engine is not None:
            engine, self.engine = self.engine, None
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(engine.close)
