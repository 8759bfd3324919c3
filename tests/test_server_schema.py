"""The server's bodies as pydantic models: every answer is what the ``openai`` client's own
types read, strictly, and every request field's type and bounds are checked by its model
with a 400 that names it."""

from __future__ import annotations

import json

import httpx
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

from edge0.server import schema as S
from tests.test_server import model, server  # noqa: F401  (fixtures)
from tests.test_server_tools import WEATHER, scripted, tool_model, tool_server  # noqa: F401  (fixtures)

USER = [{"role": "user", "content": "def add(a, b):"}]


def _events(r: httpx.Response) -> list[dict]:
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _strict(kind: type[BaseModel], body: dict) -> None:
    """``body`` read by the openai client's type with no coercion: a missing field, a
    wrong type or a value outside its literals fails."""
    kind.model_validate(body, strict=True)


def test_every_answer_is_the_openai_clients_own_type_strictly(server):
    url, _ = server
    post = lambda path, **kw: httpx.post(url + path, json=kw, timeout=60)  # noqa: E731
    chat = post("/v1/chat/completions", messages=USER, max_tokens=6, logprobs=True, top_logprobs=2)
    assert chat.status_code == 200, chat.text
    _strict(ChatCompletion, chat.json())
    assert len(chat.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    streamed = post("/v1/chat/completions", messages=USER, max_tokens=6, stream=True, logprobs=True,
                    stream_options={"include_usage": True})
    events = _events(streamed)
    for event in events:
        _strict(ChatCompletionChunk, event)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    assert "usage" not in events[0]  # only the usage chunk carries one
    done = post("/v1/completions", prompt="import os\n", max_tokens=5, logprobs=2)
    _strict(Completion, done.json())
    assert len(done.json()["choices"][0]["logprobs"]["tokens"]) == 5
    events = _events(post("/v1/completions", prompt="import os\n", max_tokens=5, stream=True))
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    for event in events:
        # the API sends null until the last event; the client's type (one class for both
        # shapes) names only the final values, so a null is read as the final one would be
        choice = event["choices"][0]
        _strict(Completion, {**event, "choices": [{**choice, "finish_reason": choice["finish_reason"] or "stop"}]})
    models = httpx.get(url + "/v1/models").json()
    assert models["object"] == "list"
    for card in models["data"]:
        _strict(Model, card)


def test_tool_calls_are_the_openai_clients_own_type_strictly(scripted):
    url, _, _ = scripted
    whole = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "tools": [WEATHER]}, timeout=60).json()
    _strict(ChatCompletion, whole)
    message = whole["choices"][0]["message"]
    assert whole["choices"][0]["finish_reason"] == "tool_calls" and message["tool_calls"][0]["type"] == "function"
    assert "index" not in message["tool_calls"][0]  # an index belongs to a streamed delta only
    streamed = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "tools": [WEATHER], "stream": True},
                          timeout=60)
    calls = []
    for event in _events(streamed):
        _strict(ChatCompletionChunk, event)
        calls += event["choices"][0]["delta"].get("tool_calls") or []
    assert [c["index"] for c in calls] == [0]


def _bounded_fields(kind: type[S._Request]) -> list[tuple[str, str]]:
    out = []
    for name, info in kind.model_fields.items():
        if any(hasattr(c, a) for c in info.metadata for a in ("ge", "gt")):
            out.append((name, S._interval(kind, name)))
    return out


@pytest.mark.parametrize("kind,path", [("chat", "/v1/chat/completions"), ("completion", "/v1/completions")])
def test_every_bounded_field_refuses_a_value_past_its_bounds_and_of_the_wrong_type(server, kind, path):
    """Each numeric field of the request model: past its upper bound, below its lower one,
    a string and a boolean are each a 400 naming it; the bounds the message states are the
    model's."""
    url, _ = server
    base = {"messages": USER} if kind == "chat" else {"prompt": "x"}
    fields = _bounded_fields(S.REQUESTS[kind])
    assert {"temperature", "top_p", "max_tokens", "seed", "xtc_threshold"} <= {f for f, _ in fields}
    with httpx.Client(base_url=url, timeout=60) as http:
        for name, interval in fields:
            info = S.REQUESTS[kind].model_fields[name]
            lo = next(getattr(c, a) for c in info.metadata for a in ("ge", "gt") if hasattr(c, a))
            hi = next(getattr(c, a) for c in info.metadata for a in ("le", "lt") if hasattr(c, a))
            for value in (hi + 1, lo - 1, "1", True):
                r = http.post(path, json={**base, name: value})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == name, (name, value, r.text)
                if isinstance(value, (str, bool)):
                    assert "must be a number" in err["message"] or "must be an integer" in err["message"], err
                else:
                    assert f"'{name}' must be in {interval}" in err["message"], err


@pytest.mark.parametrize("body,param,match", [
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "must be system, developer"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "must be system, developer"),
    ({"messages": ["hi"]}, "messages[0]", "an object with a role and content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content",
     "this model reads text only"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "a string or a list of text parts"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "a string or a list of text parts"),
    ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 strings"),
    ({"messages": USER, "stop": [1]}, "stop", "a string or a list"),
    ({"messages": USER, "stream_options": {"include_usage": "yes"}}, "stream_options", "true or false"),
    ({"messages": USER, "stream_options": {"usage": True}}, "stream_options", "'stream_options.usage' is not a field"),
    ({"messages": USER, "role_mapping": {"user": 3}}, "role_mapping", "must be a string"),
    ({"messages": USER, "user": "u" * 300}, "user", "at most 256 characters"),
    ({"messages": USER, "suffix": "x", "best_of": 2}, "best_of", "'best_of' is not a field .* \\(nor 1 more\\)"),
    ({"messages": USER, "top-k": 2}, "top-k", "'top-k' is not a field"),
    ({}, "messages", "'messages' is required"),
])
def test_a_malformed_chat_body_is_a_400_naming_the_field(server, body, param, match):
    import re

    url, _ = server
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and re.search(match, err["message"]), r.text


def test_history_sent_back_as_the_clients_own_message_objects_is_read(server):
    """A message dumped from the openai client's own type carries keys (``refusal``,
    ``annotations``, ``audio``...) that say nothing the prompt holds: they are passed over,
    and the answer equals the one to the plain history."""
    from openai.types.chat import ChatCompletionMessage

    url, _ = server
    own = ChatCompletionMessage(role="assistant", content="x = 1").model_dump()
    assert {"refusal", "annotations", "audio"} <= set(own)
    plain = [*USER, {"role": "assistant", "content": "x = 1"}, {"role": "user", "content": "more"}]
    sent = [*USER, own, {"role": "user", "content": "more"}]
    answers = [httpx.post(url + "/v1/chat/completions", json={"messages": m, "max_tokens": 6}, timeout=60)
               for m in (plain, sent)]
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    assert answers[0].json()["choices"][0]["message"] == answers[1].json()["choices"][0]["message"]
