"""The OpenAI error shape every refused request gets: ``APIError`` (HTTP status,
message, the field at fault), ``bad``, the 400 of a client's mistake, ``load_json``, a
body's JSON or its 400, and ``check_value``, the 400 of a value too deep or too large to walk."""

from __future__ import annotations

import json
import re
from typing import Any

DEFAULT_MAX_BODY = 4 * 2**20  # bytes of a request body (--max-body-bytes)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             413: "invalid_request_error", 429: "rate_limit_error",
                             503: "service_unavailable"}.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


MAX_DEPTH = 64  # nesting of the request body, and of tool-call arguments given as JSON text
MAX_NODES = 65536  # values (objects, lists, strings, numbers) in a body beside a prompt's token ids


def load_json(body: bytes) -> Any:
    """A request body's JSON, or the 400 of one that is not JSON or nests past what the
    parser takes (wherever it is parsed: the event loop or a request worker process)."""
    try:
        return json.loads(body)
    except RecursionError:
        raise bad(f"the request body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise bad(f"the request body is not valid JSON: {e}") from None


def check_value(value: Any, what: str = "the request body", param: str | None = None,
                max_nodes: int = MAX_NODES) -> None:
    """A 400 for a value nested deeper than ``MAX_DEPTH`` levels, holding more than
    ``max_nodes`` values, or holding a string (an object's key included) that is no Unicode
    text (JSON's ``\\ud800`` escapes make lone surrogates, which no tokenizer or template
    takes), naming the path. Walked without recursion: a body 5,000 levels deep must not
    exhaust the stack checking it. The bound on values bounds every later walk of the body
    (the request's model, a template's arguments, copies between processes)."""
    stack = [(value, None, 0)]  # (value, (parent entry, key), depth): a path is built only for an error
    nodes = 0
    while stack:
        entry = stack.pop()
        v, _, depth = entry
        nodes += 1
        if nodes > max_nodes:
            raise bad(f"{what} holds more than {max_nodes} values (objects, lists, strings and numbers)", param)
        if isinstance(v, str):
            _check_text(v, entry, what, param, "")
        elif isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                raise bad(f"{what} is nested deeper than {MAX_DEPTH} levels (at {_path(entry) or 'the top'})", param)
            for k, child in (v.items() if isinstance(v, dict) else enumerate(v)):
                if isinstance(k, str):
                    _check_text(k, entry, what, param, " key")
                stack.append((child, (entry, k), depth + 1))


def _check_text(text: str, entry, what: str, param: str | None, kind: str) -> None:
    """``text``: a string value at ``entry`` (``kind`` "") or a key of the object there
    (``kind`` " key"), which may not hold a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = _path(entry)
        at = f"(\\u{ord(text[e.start]):04x} at character {e.start}): not Unicode text"
        if kind:
            field = re.split(r"[.\[]", where)[0] if where else None
            raise bad(f"a key of {where or what} holds a lone surrogate {at}", field or param) from None
        raise bad(f"{where or what} holds a lone surrogate {at}", where or param) from None


def _path(entry) -> str:
    keys = []
    while entry[1] is not None:
        entry, key = entry[1]
        keys.append(f".{key}" if isinstance(entry[0], dict) else f"[{key}]")
    return "".join(reversed(keys)).lstrip(".")
