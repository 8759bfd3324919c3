"""Checks every request passes before any route sees it: a Host header a browser page on
another site cannot send (DNS rebinding), and JSON bodies only (a cross-site form post
cannot be ``application/json`` without a preflight the server never answers).

A Host is accepted when it is an IP literal, ``localhost``, or in ``--allowed-hosts``
(``*`` accepts any), or absent (HTTP/1.0; browsers always send one); the port is not
looked at. Refusals are OpenAI-shaped errors (Anthropic-shaped on its routes).
"""

from __future__ import annotations

import ipaddress
import json

from edge0.server.anthropic import error_body, is_route


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    if "*" in allowed:
        return True
    name = host.strip().lower()
    if not name:  # no Host at all (HTTP/1.0): not a browser, which always sends one
        return True
    if name.startswith("["):  # [v6]:port
        name = name[1:].split("]", 1)[0]
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    if name == "localhost" or name in allowed:
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class RequestGuard:
    """ASGI middleware: 403 for a Host outside the allowed ones, 415 for a POST whose body is
    not declared ``application/json``."""

    def __init__(self, app, allowed_hosts: tuple[str, ...] = ()):
        self.app, self.allowed = app, tuple(h.lower() for h in allowed_hosts)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        anthropic_shape = is_route(scope.get("path", ""))
        if not host_allowed(headers.get("host", ""), self.allowed):
            return await _refuse(send, 403, "permission_error", "host",
                                 f"Host {headers.get('host', '')!r:.80} is not served (an IP address, localhost or "
                                 "--allowed-hosts)", anthropic_shape)
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind != "application/json":
                return await _refuse(send, 415, "invalid_request_error", "content-type",
                                     f"Content-Type must be application/json, got {kind or 'none'!r:.80}",
                                     anthropic_shape)
        return await self.app(scope, receive, send)


async def _refuse(send, status: int, kind: str, param: str, message: str, anthropic_shape: bool) -> None:
    body = json.dumps(error_body(status, message) if anthropic_shape else
                      {"error": {"message": message, "type": kind, "param": param, "code": None}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
