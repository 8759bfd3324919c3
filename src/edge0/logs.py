"""Structured logs (structlog): every read, wait and stall is an event with its numbers.

    configure("json", "info")       # one JSON object per line on stderr
    log = get_logger("edge0.io")
    log.info("stage.wait", step=3, layer=7, ms=12.5)

Events: ``io.plan`` (step, layers, experts), ``io.read`` (step, layer, expert, slot, bytes,
ms), ``io.retry`` / ``io.read_error`` (layer, expert, error), ``io.cancel`` (step),
``stage.wait`` (step, layer, ms: compute waited for this layer's reads), ``step`` (a
per-step summary: step, stall_ms, reads, bytes, hits, misses), ``hot.step`` (layer, hits,
misses), ``whole_layer.load`` (layer, bytes, ms, waited_ms), ``exact.read`` (layer, experts,
bytes, ms, settle_ms: the exact path's on-demand reads), ``io.read_failed`` and
``checkpoint.changed`` (cached experts invalidated), ``adapter.without_heads``;
``http.request`` (the server's access log, ``always_logger``: method, path, status, ms,
prompt_tokens, completion_tokens).
"""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _processors(fmt: str) -> list:
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    return [structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True), renderer]


def configure(fmt: str = "console", level: str = "warning", stream=None) -> None:
    structlog.configure(
        processors=_processors(fmt),
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str):
    return structlog.get_logger(name)


class _Stderr:
    """Lines to whatever ``sys.stderr`` is when each is written."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    info = msg


def always_logger(fmt: str = "console"):
    """A logger whose info events are written whatever level ``configure`` set, in its format
    (``fmt``): the server's access log, one line per request, which the default level
    (warning) would hide."""
    return structlog.wrap_logger(_Stderr(), processors=_processors(fmt),
                                 wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
