"""``response_format`` through the public API and the server: the text is JSON (valid for
the schema with ``json_schema``) where the same request without it is not.

The tiny random model writes no JSON by itself. A ``logit_bias`` steers it: the quote most,
then the braces, colon and comma, a digit, EOS. Unconstrained that writes four quotes and more; under the constraint
the mask leaves the grammar's tokens only, so the biased choice among them writes the
shortest document the grammar allows (``{"": ""}``) and EOS ends it."""

from __future__ import annotations

import json
import re

import anyio
import httpx
import pytest

from edge0 import ConfigError, Engine, EngineConfig
from tests.test_server import client, serving

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def qwen(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


@pytest.fixture(scope="module")
def engine(qwen):
    with Engine(qwen, EngineConfig(adapter="off")) as e:
        yield e


def steer(engine) -> dict[int, float]:
    tok = engine.tokenizer

    def one(ch):
        (i,) = tok.encode(ch, add_special_tokens=False)
        return i

    bias = {one('"'): 60.0, one("{"): 55.0, one("}"): 50.0, one(":"): 45.0, one(","): 45.0, one("1"): 40.0}
    bias.update({e: 30.0 for e in tok.eos_token_ids})
    return bias


def test_json_object_makes_the_text_json(engine):
    bias = steer(engine)
    free, _ = engine.generate_text("x", max_tokens=16, logit_bias=bias)
    with pytest.raises(ValueError):
        json.loads(free)
    text, stats = engine.generate_text("x", max_tokens=16, logit_bias=bias, response_format={"type": "json_object"})
    assert isinstance(json.loads(text), dict) and stats.generated_tokens < 16  # ended by EOS once complete


def test_json_schema_makes_the_text_valid_for_the_schema(engine):
    text, _ = engine.generate_text("x", max_tokens=32, logit_bias=steer(engine), response_format=JSON_SCHEMA)
    value = json.loads(text)
    assert set(value) == {"name", "n"} and isinstance(value["name"], str) and isinstance(value["n"], int)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_json_within_the_limit_is_a_prefix_of_json(engine, seed):
    """Sampled at temperature 1 without steering: every token the mask let through keeps the
    text a prefix of some JSON object (a complete one if it stopped before the limit)."""
    events = list(engine.stream("x", max_tokens=24, temp=1.0, seed=seed, response_format={"type": "json_object"}))
    text = "".join(e.text for e in events)
    assert text.lstrip().startswith("{") or not text.strip()
    if events[-1].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.asyncio
async def test_async_generate_takes_response_format(qwen):
    with anyio.fail_after(120):
        async with Engine.open(qwen, EngineConfig(adapter="off")) as engine:
            bias = steer(engine)
            text = "".join([e.text async for e in engine.generate("x", max_tokens=16, logit_bias=bias,
                                                                  response_format={"type": "json_object"})])
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("fmt,match", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "not": {}}}},
     "response_format.json_schema.schema"),
    ("json", "response_format"),
])
def test_bad_response_formats_are_config_errors_naming_the_field(engine, fmt, match):
    with pytest.raises(ConfigError, match=match.replace(".", r"\.")):
        engine.generate_text("x", max_tokens=2, response_format=fmt)


@pytest.fixture(scope="module")
def json_server(qwen):
    with serving(qwen, EngineConfig(adapter="off")) as (url, state):
        yield url, state


def test_json_output_through_the_openai_client_streamed_and_not(json_server):
    url, state = json_server
    bias = {str(k): v for k, v in steer(state.engine).items()}
    c = client(url)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "a thing as JSON"}], max_tokens=32,
              temperature=0, extra_body={"logit_bias": bias})
    free = c.chat.completions.create(**kw).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(free)
    r = c.chat.completions.create(response_format=JSON_SCHEMA, **kw)
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"name", "n"} and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       c.chat.completions.create(response_format={"type": "json_object"}, stream=True, **kw)
                       if ch.choices)
    assert isinstance(json.loads(streamed), dict)


@pytest.mark.parametrize("fmt,match", [
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}},
     "response_format.json_schema.schema"),
])
def test_bad_response_formats_over_http_are_400s(json_server, fmt, match):
    url, _ = json_server
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "response_format": fmt, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and match in err["message"], err


def _strict_json(text: str):
    """JSON as OpenAI's clients parse it: Infinity / NaN are no JSON."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_with_a_constraint_are_valid_json(json_server, stream):
    """response_format with logprobs and top_logprobs 20 was a 500 ('Out of range float
    values') and, streamed, "logprob": -Infinity: masked tokens are no alternatives."""
    url, _ = json_server
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "logprobs": True,
            "top_logprobs": 20, "response_format": {"type": "json_object"}, "stream": stream}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [_strict_json(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        entries = [e for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
                   for e in c["choices"][0]["logprobs"]["content"]]
    else:
        entries = _strict_json(r.text)["choices"][0]["logprobs"]["content"]
    assert entries
    for e in entries:
        assert e["logprob"] > -9999.0 and all(t["logprob"] > float("-inf") for t in e["top_logprobs"])
        assert len(e["top_logprobs"]) <= 20


def test_engine_top_logprobs_leave_out_masked_tokens(engine):
    events = list(engine.stream("x", max_tokens=6, logprobs=True, top_logprobs=20,
                                response_format={"type": "json_object"}))
    for ev in events:
        assert all(lp > float("-inf") for _, lp in ev.top_logprobs)


@pytest.mark.parametrize("fmt", [None, {"type": "json_object"}])
def test_a_vanishing_temperature_is_greedy(json_server, fmt):
    """temperature 1e-300 was a 500 with json_object (a masked token sampled from NaNs) and
    garbage without: below 1e-5 the sampling is greedy, the text temperature 0's."""
    url, _ = json_server

    def text(temp):
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 12, "temperature": temp,
                "seed": 3, **({"response_format": fmt} if fmt else {})}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    assert text(1e-300) == text(0) == text(9e-6)


def _schema(s: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}


@pytest.mark.parametrize("schema,match", [
    # a 500 at token 1; which bound it meets first depends on the machine's speed
    ({"type": "string", "pattern": "^(a{1000000})$"}, "too large for the grammar engine|too expensive to enforce"),
    ({"anyOf": [{"const": i} for i in range(5000)]}, "more than the 65536 a response_format may take"),
    ({"const": "x" * 2_000_000}, "more than the 65536"),  # 1.8 s to its first mask, cached for ever
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "admits no JSON value at all"),  # was "NoExtensionBias"
])
def test_schemas_the_grammar_cannot_run_are_400s_before_generation(json_server, schema, match):
    url, state = json_server
    before = state.engine.metrics().decode_steps
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "response_format": _schema(schema), "max_tokens": 4},
                   timeout=120)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "response_format" and re.search(match, err["message"]), err
    assert state.engine.metrics().decode_steps == before  # refused before any generation


def test_the_compute_thread_never_compiles_a_format(engine, monkeypatch):
    """A schema evicted from the cache once recompiled on the compute thread, stalling
    every stream: a generation carries its compiled format from where it was submitted."""
    import threading

    from edge0 import constrain

    where = []
    original = constrain.compile_response_format

    def spy(*a, **kw):
        where.append(threading.current_thread().name)
        return original(*a, **kw)

    monkeypatch.setattr(constrain, "compile_response_format", spy)
    cache = constrain.ConstraintCache(engine.tokenizer)
    monkeypatch.setattr(engine, "_constraints", cache)
    submit = engine._batcher.submit

    def evicting_submit(row):  # the format leaves the cache between submission and the compute thread
        cache._entries.clear()
        submit(row)

    monkeypatch.setattr(engine._batcher, "submit", evicting_submit)
    for i in range(2):
        fmt = _schema({"type": "object", "properties": {f"k{i}": {"type": "integer"}}})
        events = list(engine.stream("x", max_tokens=3, response_format=fmt))
        assert events and events[-1].stats is not None
    assert len(where) == 2 and set(where) == {threading.current_thread().name}, where


def test_compiled_formats_are_kept_within_a_byte_bound(engine):
    """Distinct heavy schemas once grew the process by 200 MB each, never given back: the
    cache of compiled formats is bounded by the memory its entries hold."""
    from edge0.constrain import ConstraintCache

    cache = ConstraintCache(engine.tokenizer, max_bytes=24 * 2**20)
    sizes = []
    for n in (20, 24, 28, 32, 36):
        c = cache.get(_schema({"type": "string", "pattern": "^(a{1000}){%d}$" % n}))
        sizes.append(c.nbytes)
        assert cache.nbytes <= 24 * 2**20
    assert min(sizes) > 2**20  # each holds megabytes (lexer states), counted
    assert len(cache._entries) < 5  # the oldest went
    small = ConstraintCache(engine.tokenizer, max_bytes=2**20)
    assert small.get(_schema({"type": "string", "pattern": "^(a{1000}){30}$"})) is not None  # used...
    assert small.nbytes == 0  # ...and not kept


def _slow_masks_on_the_compute_thread(monkeypatch, seconds: float):
    """Masks computed on the compute thread (while generating) take ``seconds`` longer; the
    ones compiling walks (the request's thread) stay fast, so the format is admitted."""
    import threading
    import time

    import llguidance.numpy as lln

    fill = lln.fill_next_token_bitmask

    def slow(*a, **kw):
        if threading.current_thread().name.startswith("edge0-compute"):
            time.sleep(seconds)
        return fill(*a, **kw)

    monkeypatch.setattr(lln, "fill_next_token_bitmask", slow)


def test_a_format_whose_masks_stall_the_batch_ends_its_generation(qwen, monkeypatch):
    """One row's grammar work per token is bounded (constrain.MASK_STEP_S): a generation
    whose mask takes longer ends with FormatTooCostlyError, a 400 naming response_format
    over HTTP (an error event of that type when streamed); a row without a format beside
    it runs on."""
    from edge0 import constrain
    from edge0.errors import FormatTooCostlyError

    _slow_masks_on_the_compute_thread(monkeypatch, constrain.MASK_STEP_S + 0.1)
    with Engine(qwen, EngineConfig(adapter="off")) as e:
        with pytest.raises(FormatTooCostlyError, match="response_format: the schema is too expensive"):
            list(e.stream("x", max_tokens=4, response_format=JSON_SCHEMA))
        assert len(list(e.stream("x", max_tokens=4, temp=0.0))) == 4
    with serving(qwen, EngineConfig(adapter="off")) as (url, state):
        body = {"messages": [{"role": "user", "content": "x"}], "response_format": JSON_SCHEMA, "max_tokens": 4}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["param"] == "response_format" and "at most" in r.json()["error"]["message"]
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        err = events[-1]["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "response_format", err
        free = httpx.post(url + "/v1/chat/completions", json={**body, "response_format": None}, timeout=120)
        assert free.status_code == 200


def test_masks_within_the_bound_leave_the_generation_alone(qwen, monkeypatch):
    """The bound is per token: masks a little slower than usual, under it, change nothing."""
    _slow_masks_on_the_compute_thread(monkeypatch, 0.02)
    with Engine(qwen, EngineConfig(adapter="off")) as e:
        events = list(e.stream("x", max_tokens=4, response_format=JSON_SCHEMA))
    assert events and events[-1].finish_reason in ("stop", "length")


def test_a_format_refused_once_its_generation_began_is_a_400(qwen, monkeypatch):
    """A format compiled again when its generation is made (the cache let it go after the
    request was checked) and refused then, its walk over the bounds on a loaded machine,
    was a 500 "generation failed: ConfigError": it is the request's 400, streamed or not."""
    from edge0.errors import ConfigError as Refused

    with serving(qwen, EngineConfig(adapter="off")) as (url, state):
        cache = state.engine._constraints
        get, calls = cache.get, []

        def second_refused(fmt, grammar=None):
            calls.append(fmt)
            if len(calls) % 2 == 0:  # the generation's own compile, after the request's check
                raise Refused("response_format.json_schema.schema: the schema is too expensive to enforce: "
                              "computing the step 2 token mask took 0.06 s (at most 0.05 s)")
            return get(fmt, grammar)

        monkeypatch.setattr(cache, "get", second_refused)
        body = {"messages": [{"role": "user", "content": "x"}], "response_format": JSON_SCHEMA, "max_tokens": 4}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["param"] == "response_format"
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert s.status_code in (200, 400)
        if s.status_code == 200:
            err = json.loads(lines[-1][6:])["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == "response_format", err
        assert len(calls) == 4
