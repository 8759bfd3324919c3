"""The jobs a request's worker process runs (``edge0.server.sandbox``): rendering a chat
template and parsing a large body. Each returns ``("ok", value)`` or ``("err", message,
param, status)``; nothing raised here leaves the child."""

from __future__ import annotations

from typing import Any


class Jobs:
    def __init__(self, setup: dict):
        self.setup = setup
        self.tokenizer = None
        if setup.get("tokenizer") is not None:
            from edge0.backend import nn as bnn

            self.tokenizer = bnn.rebuild_tokenizer(*setup["tokenizer"])
        from edge0.server import anthropic, protocol  # imported before the memory limit: they are the child's own
        from edge0.server.api_error import load_json

        self.protocol, self.parse, self.load_json = protocol, anthropic.parse_any, load_json

    def run(self, job: tuple) -> tuple:
        run = {"render": self._render, "parse": self._parse}[job[0]]
        try:
            return ("ok", run(*job[1:]))
        except self.protocol.APIError as e:
            return ("err", e.message, e.param, e.status)
        except MemoryError:
            return ("err", f"{job[0]}: the input needs more memory than a request may use "
                           f"({self.setup['memory_bytes'] >> 20} MiB)", None, 400)
        except Exception as e:  # noqa: BLE001 - a template may raise anything: the client's input at fault
            return ("err", f"{type(e).__name__}: {str(e)[:300]}", None, 400 if job[0] == "render" else 500)

    def _render(self, messages: list[dict], kwargs: dict, max_chars: int | None) -> str:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        if not isinstance(text, str):
            raise TypeError(f"the chat template rendered a {type(text).__name__}, not text")
        if max_chars is not None and len(text) > max_chars:
            raise ValueError(f"the rendered prompt is {len(text)} characters, more than the model's context holds "
                             f"(at most {max_chars})")
        return text

    def _parse(self, body: bytes, kind: str) -> Any:
        return self.parse(self.load_json(body), kind, self.setup["checks"])
