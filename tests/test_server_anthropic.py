"""Anthropic's Messages API on ``edge0 serve``, driven by the official ``anthropic`` client
(and raw HTTP where the client cannot say what is tested): the same answers as the OpenAI
chat endpoint for the same request, Anthropic's events, stop reasons, usage, token counts,
tool use and error shapes."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from edge0 import EngineConfig
from edge0.engine import TokenEvent
from edge0.errors import Edge0Error
from tests.test_server import PROMPT, chat, client, model, server, serving  # noqa: F401  (model, server: fixtures)
from tests.test_server_tools import CALL, PIECES, WEATHER, scripted, tool_model, tool_server  # noqa: F401

TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}


def messages_client(url: str, api_key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0)


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event, as the server framed them."""
    out = []
    for frame in response.text.split("\n\n"):
        if not frame.strip():
            continue
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_a_message_is_the_chat_endpoints_answer_with_its_usage(server):
    url, _ = server
    oai = chat(client(url), [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
               max_tokens=16)
    c = messages_client(url)
    m = c.messages.create(model="tiny", max_tokens=16, system="Be brief.",  # the server's default: greedy
                          messages=[{"role": "user", "content": PROMPT}], metadata={"user_id": "u1"})
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == oai.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.input_tokens == oai.usage.prompt_tokens and m.usage.output_tokens == 16
    # a system prompt of text blocks is their texts, a blank line apart; string content is one text block
    blocks = c.messages.create(model="tiny", max_tokens=16,
                               system=[{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
                               messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}])
    oai_blocks = chat(client(url), [{"role": "system", "content": "Be\n\nbrief."}, {"role": "user", "content": PROMPT}],
                      max_tokens=16)
    assert blocks.content[0].text == oai_blocks.choices[0].message.content
    assert blocks.usage.input_tokens == oai_blocks.usage.prompt_tokens
    plain = c.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": PROMPT}])
    assert plain.usage.input_tokens < m.usage.input_tokens  # the system prompt reached the template
    count = c.messages.count_tokens(model="tiny", system="Be brief.", messages=[{"role": "user", "content": PROMPT}])
    assert count.input_tokens == m.usage.input_tokens


def test_a_streamed_message_is_anthropics_event_sequence_with_the_same_text(server):
    url, _ = server
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": PROMPT}]}
    whole = httpx.post(url + "/v1/messages", json=body, timeout=60).json()
    r = httpx.post(url + "/v1/messages", json={**body, "stream": True}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert all(data["type"] == name for name, data in events)
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["usage"] == {"input_tokens": whole["usage"]["input_tokens"], "output_tokens": 0}
    assert start["content"] == [] and start["stop_reason"] is None and start["model"] == "tiny"
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == whole["content"][0]["text"]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == {"output_tokens": 12}
    with messages_client(url).messages.stream(**{k: v for k, v in body.items() if k != "temperature"}) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens == 12 and final.stop_reason == "max_tokens"


def test_stop_sequences_end_the_answer_and_are_named(server):
    url, _ = server
    c = messages_client(url)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}]}
    full = c.messages.create(max_tokens=24, **ask).content[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    cut = c.messages.create(max_tokens=24, stop_sequences=["\x00never", stop], **ask)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == full[: full.index(stop)]
    with c.messages.stream(max_tokens=24, stop_sequences=[stop], **ask) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence, streamed.content[0].text) == \
        ("stop_sequence", stop, cut.content[0].text)


def test_a_last_assistant_message_is_continued(server):
    url, state = server
    tok = state.engine.tokenizer
    turns = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "    return"}]
    m = messages_client(url).messages.create(model="tiny", max_tokens=4, messages=turns)
    prompt = tok.apply_chat_template(turns, tokenize=False, continue_final_message=True)
    assert m.usage.input_tokens == len(tok.encode(prompt, add_special_tokens=False))


def test_api_key_as_x_api_key_or_bearer(model):
    d, _, _ = model
    with serving(d, EngineConfig(adapter="off"), api_key="sekret") as (url, _):
        body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
        assert messages_client(url, "sekret").messages.create(**body).usage.output_tokens == 1
        for headers in ({"x-api-key": "sekret"}, {"Authorization": "Bearer sekret"}):
            assert httpx.post(url + "/v1/messages", json=body, headers=headers, timeout=60).status_code == 200
        wrong = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": "sekre"}, timeout=60)
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError) as e:
            messages_client(url, "wrong").messages.create(**body)
        assert e.value.status_code == 401 and e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "authentication_error"
        assert "x-api-key" in e.value.body["error"]["message"]
        assert client(url, api_key="sekret").models.list().data  # the OpenAI routes take it too


@pytest.mark.parametrize("fields,status,kind,match", [
    ({"max_tokens": None}, 400, "invalid_request_error", "'max_tokens' is required"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error",
     r"'messages\[0\]\.role' must be user or assistant"),
    ({"model": "nope"}, 404, "not_found_error", "the model 'nope' does not exist"),
    ({"temperature": 1.5}, 400, "invalid_request_error", r"'temperature' must be in \[0, 1\], got 1.5"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     r"'messages\[0\]\.content\[0\]' must be a text block .*got 'image'; this model reads text only"),
    ({"thinking": {"type": "enabled"}}, 400, "invalid_request_error", "'thinking' is not a field this server"),
    ({"stop_sequences": [""]}, 400, "invalid_request_error", "'stop_sequences' must not hold an empty string"),
    ({"tool_choice": {"type": "tool"}}, 400, "invalid_request_error", "needs the 'name' of the tool"),
    ({"tools": [{**TOOL, "type": "bash_20250124"}]}, 400, "invalid_request_error", "server tools are not served"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]}, 400, "invalid_request_error",
     "the user's tool_result must follow"),
])
def test_errors_are_anthropics_shape(server, fields, status, kind, match):
    import re

    url, _ = server
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], **fields}
    r = httpx.post(url + "/v1/messages", json={k: v for k, v in body.items() if v is not None}, timeout=60)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"type", "error"} and r.json()["type"] == "error"
    err = r.json()["error"]
    assert err["type"] == kind and re.search(match, err["message"]), err
    # the OpenAI routes keep theirs
    assert "message" in httpx.post(url + "/v1/chat/completions", json={"model": "nope", "messages": []}).json()["error"]


def test_refusals_before_the_route_are_anthropics_shape_on_its_routes(server):
    url, _ = server
    cases = [(httpx.post(url + "/v1/messages", content="{}", headers={"Content-Type": "text/plain"}), 415,
              "invalid_request_error", "Content-Type must be application/json"),
             (httpx.post(url + "/v1/messages", json={}, headers={"Host": "evil.example"}), 403, "permission_error",
              "is not served"),
             (httpx.get(url + "/v1/messages"), 405, "invalid_request_error", "GET is not allowed"),
             (httpx.post(url + "/v1/messages/batches", json={}), 404, "not_found_error", "no route")]
    for r, status, kind, words in cases:
        assert r.status_code == status and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == kind and words in r.json()["error"]["message"]
    assert "param" in httpx.get(url + "/v1/nothing").json()["error"]  # elsewhere OpenAI's


def test_the_sdk_raises_its_own_errors(server):
    url, _ = server
    c = messages_client(url)
    with pytest.raises(anthropic.NotFoundError):
        c.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny", max_tokens=4, messages=[{"role": "bot", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_a_tool_call_is_a_tool_use_block(scripted):
    url, state, script = scripted
    m = messages_client(url).messages.create(model="tiny", max_tokens=64, tools=[TOOL],
                                             messages=[{"role": "user", "content": "weather in Paris?"}])
    assert m.stop_reason == "tool_use"
    text, use = m.content
    assert text.type == "text" and text.text == "Let me check. "
    assert use.type == "tool_use" and use.id.startswith("toolu_") and use.name == "get_weather"
    assert use.input == {"city": "Paris"}
    prompt = state.engine.tokenizer.decode(script["ids"])
    assert json.dumps(TOOL["input_schema"]) in prompt and "# Tools" in prompt
    count = messages_client(url).messages.count_tokens(model="tiny", tools=[TOOL],
                                                       messages=[{"role": "user", "content": "weather in Paris?"}])
    assert count.input_tokens == len(script["ids"]) == m.usage.input_tokens


def test_streamed_tool_calls_are_tool_use_blocks_with_their_input_as_json_deltas(scripted):
    url, _, script = scripted
    script["pieces"] = PIECES[:-1] + [" Then ", CALL.replace("Paris", "Oslo"), ""]
    body = {"model": "tiny", "max_tokens": 64, "tools": [TOOL], "stream": True,
            "messages": [{"role": "user", "content": "two cities"}]}
    events = sse_events(httpx.post(url + "/v1/messages", json=body, timeout=60))
    starts = [(d["index"], d["content_block"]["type"]) for n, d in events if n == "content_block_start"]
    assert starts == [(0, "text"), (1, "tool_use"), (2, "text"), (3, "tool_use")]
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert stops == [0, 1, 2, 3]
    json_deltas = [json.loads(d["delta"]["partial_json"]) for n, d in events
                   if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert json_deltas == [{"city": "Paris"}, {"city": "Oslo"}]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with messages_client(url).messages.stream(**{k: v for k, v in body.items() if k != "stream"}) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use", "text", "tool_use"]
    assert [b.input["city"] for b in final.content if b.type == "tool_use"] == ["Paris", "Oslo"]
    assert final.content[2].text == " Then "


def test_tool_results_go_back_through_the_template(scripted):
    url, state, script = scripted
    script["pieces"] = ["It is sunny.", ""]
    turns = [{"role": "user", "content": "weather in Paris?"},
             {"role": "assistant", "content": [{"type": "text", "text": ""},
                                               {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Paris"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                           "content": [{"type": "text", "text": "sunny, 21 C"}]},
                                          {"type": "text", "text": "And so?"}]}]
    m = messages_client(url).messages.create(model="tiny", max_tokens=8, tools=[TOOL], messages=turns)
    assert m.content[0].text == "It is sunny." and m.stop_reason == "end_turn"
    prompt = state.engine.tokenizer.decode(script["ids"])
    assert CALL in prompt and "<|im_start|>tool\nsunny, 21 C<|im_end|>\n<|im_start|>user\nAnd so?" in prompt


def test_tool_choice_none_gives_no_tools_and_forced_choices_follow_the_chat_route(scripted):
    url, state, script = scripted
    script["pieces"] = [CALL, ""]
    m = messages_client(url).messages.create(model="tiny", max_tokens=8, tools=[TOOL], tool_choice={"type": "none"},
                                             messages=[{"role": "user", "content": "x"}])
    assert "# Tools" not in state.engine.tokenizer.decode(script["ids"])
    assert m.content[0].text == CALL and m.stop_reason == "end_turn"
    # a forced choice is OpenAI's "required" / a named function: refused, or honoured, as the chat route does
    for theirs, ours in (({"type": "any"}, "required"),
                         ({"type": "tool", "name": "get_weather"},
                          {"type": "function", "function": {"name": "get_weather"}})):
        r = httpx.post(url + "/v1/messages", timeout=60, json={
            "model": "tiny", "max_tokens": 8, "tools": [TOOL], "tool_choice": theirs,
            "messages": [{"role": "user", "content": "x"}]})
        o = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "max_tokens": 8, "tools": [WEATHER], "tool_choice": ours,
            "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == o.status_code
        if o.status_code == 400:
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error"
            assert err["message"] == f"tool_choice {theirs} cannot be honoured: {o.json()['error']['message']}"


def test_a_wait_is_a_ping_and_an_error_mid_stream_is_an_error_event(scripted, monkeypatch):
    url, state, _ = scripted

    async def failing(ids, **kw):
        yield None  # the engine's heartbeat: no token within --keepalive
        yield TokenEvent(5, "Hello", None)
        raise Edge0Error("the disk went away")

    monkeypatch.setattr(state.engine, "generate", failing)
    r = httpx.post(url + "/v1/messages", timeout=60, json={
        "model": "tiny", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "x"}]})
    events = sse_events(r)
    assert [n for n, _ in events] == ["message_start", "ping", "content_block_start", "content_block_delta", "error"]
    assert events[-1][1] == {"type": "error", "error": {
        "type": "api_error", "message": "generation failed: Edge0Error: the disk went away"}}


def test_a_large_body_is_checked_in_a_request_worker_the_same(tool_server):
    """Over 64 KiB a body is parsed in a worker process: the same translation there."""
    url, _ = tool_server
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    small = httpx.post(url + "/v1/messages/count_tokens", json=ask, timeout=60)
    big_tool = {**TOOL, "description": "d" * 70_000}
    big = httpx.post(url + "/v1/messages/count_tokens", json={**ask, "tools": [big_tool],
                                                              "tool_choice": {"type": "none"}}, timeout=60)
    assert small.status_code == big.status_code == 200 and big.json() == small.json()
    bad = httpx.post(url + "/v1/messages", json={**ask, "tools": [big_tool]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("'max_tokens' is required")


def test_count_tokens_counts_a_prompt_longer_than_the_context(server):
    """An agent asks whether its conversation still fits: a prompt over the model's context
    is counted, not refused (a message of it is refused, naming the context)."""
    url, state = server
    context = state.engine.context_length
    assert context, "the test model states its context"
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "x " * (2 * context)}]}
    counted = httpx.post(url + "/v1/messages/count_tokens", json=ask, timeout=60)
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] > context
    refused = httpx.post(url + "/v1/messages", json={**ask, "max_tokens": 4}, timeout=60)
    assert refused.status_code == 400 and refused.json()["type"] == "error"
