"""The OpenAI error shape every refused request gets: ``APIError`` (HTTP status,
message, the field at fault) and ``bad``, the 400 of a client's mistake."""

from __future__ import annotations


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
