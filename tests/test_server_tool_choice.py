"""``tool_choice`` ``"required"`` and a named function, through the server with the official
openai client: the answer is one call, in the model's tool-call format, of an allowed
function, with arguments valid for its ``parameters``, where the same request with
``"auto"`` gets no call at all (the tiny random model never writes one by itself); and
every choice the server cannot honour is a 400 naming ``tool_choice``."""

from __future__ import annotations

import json

import httpx
import pytest

from edge0.server import protocol as P
from tests.test_server import client
from tests.test_server_tools import tool_model, tool_server  # noqa: F401  (fixtures)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
TOOLS = [WEATHER, CLOCK]
HELLO = [{"role": "user", "content": "Say hello."}]


def _valid_weather(args: dict) -> bool:
    """``args`` valid for WEATHER's parameters (closed to the properties they name)."""
    return (set(args) <= {"city", "unit", "days"} and {"city", "unit"} <= set(args)
            and isinstance(args["city"], str) and len(args["city"]) <= 12 and args["unit"] in ("C", "F")
            and (type(args.get("days", 1)) is int and 1 <= args.get("days", 1) <= 7))


def _ask(url, choice, **kw):
    return client(url).chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS, tool_choice=choice,
                                               max_tokens=kw.pop("max_tokens", 200), temperature=0, **kw)


def test_auto_writes_no_call_for_this_prompt(tool_server):
    url, _ = tool_server
    r = _ask(url, "auto")
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls"


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_a_named_function_is_called_with_valid_arguments(tool_server, name):
    url, state = tool_server
    r = _ask(url, {"type": "function", "function": {"name": name}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == name and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert _valid_weather(args) if name == "get_weather" else args == {}, args  # get_time takes none
    assert not choice.message.content  # the answer is the call
    assert r.usage.completion_tokens < 200  # the call ended the answer (EOS), not the token limit


def test_required_calls_one_of_the_tools_with_valid_arguments(tool_server):
    url, _ = tool_server
    r = _ask(url, "required", seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name in ("get_weather", "get_time")
    assert call.function.name != "get_weather" or _valid_weather(args), args


def test_a_forced_call_streams_as_one_delta(tool_server):
    url, _ = tool_server
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls, finish, content = [], None, []
    for chunk in _ask(url, named, stream=True):
        delta = chunk.choices[0].delta
        calls.extend(delta.tool_calls or [])
        content.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and "".join(content).strip() == ""
    (call,) = calls
    assert call.index == 0 and call.function.name == "get_weather"
    assert _valid_weather(json.loads(call.function.arguments))
    whole = _ask(url, named).choices[0].message.tool_calls[0]
    assert json.loads(whole.function.arguments) == json.loads(call.function.arguments)  # greedy: the same call


@pytest.mark.parametrize("fields,match", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_wether"}}},
     "names the function 'get_wether', which is not among 'tools' \\(get_weather, get_time\\)"),
    ({"tools": None, "tool_choice": "required"}, "forces a tool call, but the request gives no 'tools'"),
    ({"tools": None, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "forces a tool call, but the request gives no 'tools'"),
    ({"tool_choice": {"type": "function", "name": "get_time"}}, "must be 'auto', 'none', 'required' or"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time", "x": 1}}}, "must be 'auto', 'none'"),
    ({"tool_choice": "always"}, "must be 'auto', 'none', 'required' or"),
])
def test_a_choice_that_cannot_be_honoured_is_a_400_naming_tool_choice(tool_server, fields, match):
    import re

    url, _ = tool_server
    body = {"messages": HELLO, "tools": TOOLS, "max_tokens": 2, **fields}
    r = httpx.post(url + "/v1/chat/completions", json={k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tool_choice" and re.search(match, err["message"]), err


def test_a_forced_call_with_a_response_format_is_a_400(tool_server):
    url, _ = tool_server
    r = httpx.post(url + "/v1/chat/completions", json={"messages": HELLO, "tools": TOOLS, "tool_choice": "required",
                                                       "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_parameters_the_grammar_engine_refuses_are_a_400_naming_tool_choice(tool_server):
    url, _ = tool_server
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(?<=a)b"}}, "required": ["x"]}}}  # a lookbehind: not enforceable
    r = httpx.post(url + "/v1/chat/completions", json={"messages": HELLO, "tools": [bad], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert r.json()["error"]["message"].startswith("grammar: ")


def test_a_format_without_a_grammar_is_a_400_naming_it():
    """A template whose calls are not JSON between two markers (Qwen3-Coder's XML, say)."""
    checks = P.Checks(models={"m": None}, default_model="m", defaults=P.Defaults(), vocab_size=100, context=64,
                      tool_format="qwen3_coder")
    body = {"messages": HELLO, "tools": TOOLS, "tool_choice": "required"}
    with pytest.raises(P.APIError, match="cannot force a call in this model's tool-call format \\('qwen3_coder'\\)"):
        P.parse(body, "chat", checks)
    assert "grammar" not in P.parse({**body, "tool_choice": "auto"}, "chat", checks).sampling


def test_the_engine_takes_a_lark_grammar_but_not_with_a_response_format(tool_server):
    from edge0 import ConfigError

    _, state = tool_server
    text, _ = state.engine.generate_text("x", max_tokens=8, grammar='start: "ok" "!"')
    assert text == "ok!"
    with pytest.raises(ConfigError, match="cannot be given with a response_format"):
        state.engine.validate("x", grammar='start: "ok"', response_format={"type": "json_object"})
    with pytest.raises(ConfigError, match="^grammar: "):
        state.engine.validate("x", grammar="start: undefined_rule")


def test_a_grammar_refused_once_its_generation_began_is_a_400_naming_tool_choice(tool_server, monkeypatch):
    """As a response_format's (tests/test_response_format.py): the compile the generation
    makes, after the request's check, refused (the cache let the grammar go meanwhile)."""
    from edge0 import ConfigError

    url, state = tool_server
    cache = state.engine._constraints
    get, calls = cache.get, []

    def second_refused(fmt, grammar=None):
        calls.append(grammar)
        if len(calls) % 2 == 0:
            raise ConfigError("grammar: the schema is too expensive to enforce: computing the step 2 token mask "
                              "took 0.06 s (at most 0.05 s)")
        return get(fmt, grammar)

    monkeypatch.setattr(cache, "get", second_refused)
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": HELLO, "tools": TOOLS, "tool_choice": "required", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text[:300]
    assert calls[0] is not None and calls[0].startswith("start: ")
