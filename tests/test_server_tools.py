"""Tool calling through the server, with the official openai client: the tools reach the
model's chat template, the model's call text becomes ``tool_calls`` (streamed and not),
and every malformed tool field is a 400 naming it.

The tiny model's template carries tools in the ``<tool_call>`` JSON format (mlx-lm picks
its parser from the template). What the model writes is driven: the engine's generation is
replaced by one that yields chosen text, split where the markers are hardest to find."""

from __future__ import annotations

import json

import httpx
import pytest

from edge0 import EngineConfig
from edge0.engine import TokenEvent
from tests.test_server import client, serving

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for tc in m.tool_calls %}{% set tool_call = tc.function %}<tool_call>\n"
    "{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# the answer as the model writes it, cut inside both markers and inside the call
PIECES = ["Let me check. <tool", "_call>\n{\"name\": \"get_", "weather\", \"arguments\": {\"city\": \"Par",
          "is\"}}\n</tool", "_call>", ""]


@pytest.fixture(scope="module")
def tool_model(tiny_model_factory, tmp_path_factory):
    from tests.ckpt_tools import copy_model

    d = copy_model(tiny_model_factory("qwen3_moe"), tmp_path_factory.mktemp("tools") / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def tool_server(tool_model):
    with serving(tool_model, EngineConfig(adapter="off")) as (url, state):
        yield url, state


@pytest.fixture
def scripted(tool_server, monkeypatch):
    """The engine writes ``script["pieces"]`` (finish ``script["finish"]``); the prompt ids
    it was given land in ``script["ids"]``."""
    url, state = tool_server
    script = {"pieces": PIECES, "finish": "stop", "ids": None}

    async def generate(ids, **kw):
        script["ids"] = list(ids)
        pieces = script["pieces"]
        for n, text in enumerate(pieces):
            yield TokenEvent(5, text, script["finish"] if n == len(pieces) - 1 else None)

    monkeypatch.setattr(state.engine, "generate", generate)
    return url, state, script


def test_a_tool_call_is_returned_as_tool_calls(scripted):
    url, state, script = scripted
    c = client(url)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather in Paris?"}],
                                  tools=[WEATHER], max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # the tool's definition reached the template, as the tokenizer renders it
    prompt = state.engine.tokenizer.decode(script["ids"])
    assert json.dumps(WEATHER["function"]["parameters"]) in prompt and "# Tools" in prompt


def test_a_streamed_tool_call_arrives_as_one_delta_with_its_index(scripted):
    url, _, script = scripted
    script["pieces"] = PIECES[:-1] + [" Then ", CALL.replace("Paris", "Oslo"), ""]
    c = client(url)
    content, calls, finish = [], [], None
    for chunk in c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "two cities"}],
                                           tools=[WEATHER], max_tokens=64, stream=True):
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        calls.extend(delta.tool_calls or [])
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(content) == "Let me check.  Then " and finish == "tool_calls"
    assert [c.index for c in calls] == [0, 1]
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Oslo"]
    assert all(c.function.name == "get_weather" and c.id.startswith("call_") for c in calls)


def test_a_call_cut_off_by_max_tokens_stays_text(scripted):
    url, _, script = scripted
    script["pieces"], script["finish"] = PIECES[:3], "length"
    r = client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                            tools=[WEATHER], max_tokens=3)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == "".join(PIECES[:3])


def test_history_with_tool_calls_and_results_renders_through_the_template(scripted):
    url, state, script = scripted
    script["pieces"] = ["It is sunny.", ""]
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client(url).chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=8)
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    prompt = state.engine.tokenizer.decode(script["ids"])
    assert CALL in prompt  # the arguments as an object, not a JSON string inside a string
    assert "<|im_start|>tool\nsunny, 21 C" in prompt


def test_tool_choice_none_gives_the_model_no_tools(scripted):
    url, state, script = scripted
    script["pieces"] = [CALL, ""]
    r = client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                            tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert "# Tools" not in state.engine.tokenizer.decode(script["ids"])
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls


def test_tools_on_the_real_engine(tool_server):
    """Unscripted: the tiny model with tools in its prompt answers (whatever it writes)."""
    url, state = tool_server
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER], "max_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["finish_reason"] in ("stop", "length",
                                                                                                "tool_calls")


@pytest.mark.parametrize("fields,param,match", [
    ({"tools": {"a": 1}}, "tools", "'tools' must be a list"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", r"tools\[0\] must be \{'type': 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name",
     "must be 1-64 letters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters", "JSON Schema object"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be 'auto', 'none', 'required' or "),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f",
                                                                                        "arguments": "{x"}}]}]},
     "messages[0].tool_calls", "arguments is not valid JSON"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls",
     "on an assistant message"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]}, "messages[0].tool_call_id",
     "must be a string"),
])
def test_malformed_tool_fields_are_400s_naming_the_field(tool_server, fields, param, match):
    import re

    url, _ = tool_server
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **fields}
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(match, err["message"]), err


def test_tools_for_a_model_without_a_tool_format_are_a_400(tiny_model_factory):
    with serving(tiny_model_factory("qwen3_moe"), EngineConfig(adapter="off")) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "no tool-call format" in r.json()["error"]["message"]


def _nested(depth: int, inner: str = "1") -> str:
    return '{"a": ' * depth + inner + "}" * depth


@pytest.mark.parametrize("name", ["arguments string 5,000 deep", "a field 980 deep in a body over 64 KB",
                                  "history arguments 900 deep", "tool parameters 320 deep"])
def test_deeply_nested_json_is_a_400_not_a_500(tool_server, name):
    """Each once raised RecursionError -> 500 (the template, the unicode check, the
    arguments' parse)."""
    url, _ = tool_server
    user = '{"role": "user", "content": "x"}'
    call = '{"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", ' \
           '"function": {"name": "get_weather", "arguments": %s}}]}'
    body = {
        "arguments string 5,000 deep": '{"messages": [%s, %s], "max_tokens": 2}'
                                       % (user, call % json.dumps(_nested(5000))),
        "a field 980 deep in a body over 64 KB": '{"messages": [%s], "max_tokens": 2, "pad": "%s", "x": %s}'
                                                 % (user, "p" * 70_000, _nested(980)),
        "history arguments 900 deep": '{"messages": [%s, %s], "max_tokens": 2}' % (user, call % _nested(900)),
        "tool parameters 320 deep": '{"messages": [%s], "max_tokens": 2, "tools": [{"type": "function", '
                                    '"function": {"name": "f", "parameters": {"type": "object", "properties": %s}}}]}'
                                    % (user, _nested(320, "{}")),
    }[name]
    r = httpx.post(url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text[:500]
    assert "nested deeper than 64 levels" in r.json()["error"]["message"]
    ok = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                        "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
