"""``edge0 serve``: a real uvicorn on 127.0.0.1 at a free port, driven by the official
``openai`` client (and raw HTTP where the client cannot say what is tested)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from edge0 import Engine, EngineConfig
from edge0.server.connections import make_server
from edge0.server.app import ServerSettings, create_app
from edge0.server.protocol import Defaults
from tests.test_adapters import random_adapter

PROMPT = "def fibonacci(n):"


@contextmanager
def serving(model_dir, config: EngineConfig | None = None, sndbuf: int | None = None, **settings):
    """A uvicorn server in a thread; yields (base URL, the app's state). ``sndbuf``: the
    send buffer of its connections (a small one stands for a full network path)."""
    import socket

    s = ServerSettings(model_dir=Path(model_dir), config=config or EngineConfig(prompt_cache_mb=64),
                       model_id="tiny", **settings)
    app = create_app(s)
    server = make_server(app, s, host="127.0.0.1", port=0, log_level="error", timeout_graceful_shutdown=5)
    sock = socket.socket()
    if sndbuf is not None:  # accepted connections inherit it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    state = app.state.edge0
    deadline = time.monotonic() + 60
    while not (server.started and state.engine is not None):
        assert time.monotonic() < deadline and state.load_error is None, state.load_error
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(30)


_CLIENTS: list = []


def client(url, **kw) -> openai.OpenAI:
    c = openai.OpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)
    _CLIENTS.append(c)
    return c


@pytest.fixture(autouse=True)
def close_clients():
    """Each test's clients close their connections (no sockets left for later tests' fd counts)."""
    yield
    while _CLIENTS:
        _CLIENTS.pop().close()


@pytest.fixture(scope="module")
def model(tiny_model_factory, tmp_path_factory):
    """A tiny qwen3_moe (it has a chat template) with two adapters beside it."""
    from tests.ckpt_tools import copy_model

    d = copy_model(tiny_model_factory("qwen3_moe"), tmp_path_factory.mktemp("serve") / "m")
    a = random_adapter(d, d.parent / "alpha", seed=1)
    b = random_adapter(d, d.parent / "beta", seed=2)
    return d, a, b


@pytest.fixture(scope="module")
def server(model):
    d, a, b = model
    with serving(d, EngineConfig(adapter=str(a), extra_adapters=(str(b),), prompt_cache_mb=64)) as (url, state):
        yield url, state


def chat(c, messages, model="tiny", **kw):
    return c.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=kw.pop("max_tokens", 12),
                                     **kw)


def test_chat_matches_edge0_generate_and_counts_usage(server, model):
    url, state = server
    d, a, _ = model
    c = client(url)
    r = chat(c, [{"role": "user", "content": PROMPT}], model="tiny", max_tokens=16)
    # the base's id serves what edge0 generate runs: the base with the server's default adapter
    cli = subprocess.run([sys.executable, "-m", "edge0", "generate", "--model", str(d), "--prompt", PROMPT,
                          "--max-tokens", "16", "--verbose", "false", "--adapter", str(a)],
                         capture_output=True, text=True, check=True)
    assert r.choices[0].message.content == cli.stdout[:-1]  # print() adds the newline
    tok = state.engine.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 16
    assert r.usage.total_tokens == len(ids) + 16 and r.choices[0].finish_reason == "length"
    # streamed: the same text, chunk by chunk, and the usage chunk when asked for
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                            temperature=0, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens == len(ids)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_completions_streamed_and_not(server):
    url, state = server
    c = client(url)
    r = c.completions.create(model="tiny:base", prompt="import os\n", max_tokens=10, temperature=0)
    streamed = list(c.completions.create(model="tiny:base", prompt="import os\n", max_tokens=10, temperature=0,
                                         stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == r.choices[0].text
    assert r.usage.prompt_tokens == len(state.engine.tokenizer.encode("import os\n"))
    assert r.usage.completion_tokens == 10
    with Engine(state.settings.model_dir, EngineConfig(adapter="off")) as e:
        assert e.generate_text("import os\n", max_tokens=10)[0] == r.choices[0].text


def test_models_lists_the_base_and_every_adapter(server):
    url, _ = server
    ids = {m.id: m for m in client(url).models.list().data}
    assert set(ids) == {"tiny", "tiny:base", "alpha", "beta", "default_model"}
    assert ids["alpha"].parent == "tiny" and ids["tiny"].parent is None  # type: ignore[attr-defined]
    assert ids["default_model"].parent == "tiny"  # type: ignore[attr-defined]  (the default adapter, alpha)
    serves = {name: (m.edge0["base"], m.edge0["adapter"]) for name, m in ids.items()}  # type: ignore[attr-defined]
    assert serves == {"tiny": ("tiny", "alpha"), "tiny:base": ("tiny", None), "alpha": ("tiny", "alpha"),
                      "beta": ("tiny", "beta"), "default_model": ("tiny", "alpha")}
    assert ids["tiny:base"].edge0["description"] == "tiny without an adapter"  # type: ignore[attr-defined]
    assert "its default" in ids["tiny"].edge0["description"]  # type: ignore[attr-defined]


def test_adapters_alternate_without_reloading_and_match_dedicated_servers(server, model):
    url, state = server
    d, a, b = model
    c = client(url)
    engine_before = state.engine
    messages = [{"role": "user", "content": PROMPT}]
    answers = {}
    for name in ("alpha", "tiny:base", "beta", "alpha", "tiny:base", "beta"):  # interleaved on one server
        text = chat(c, messages, model=name).choices[0].message.content
        assert answers.setdefault(name, text) == text
    assert state.engine is engine_before  # nothing reloaded
    assert len(set(answers.values())) == 3  # each adapter changes the answer
    assert chat(c, messages, model="tiny").choices[0].message.content == answers["alpha"]  # the default adapter
    bare = c.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12,
                                     extra_body={"adapters": "none"})
    assert bare.choices[0].message.content == answers["tiny:base"] and bare.model == "tiny:base"
    via_field = c.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12,
                                          extra_body={"adapters": "beta"})
    assert via_field.choices[0].message.content == answers["beta"]
    for name, cfg in (("alpha", EngineConfig(adapter=str(a))), ("beta", EngineConfig(adapter=str(b))),
                      ("tiny:base", EngineConfig(adapter="off"))):
        with serving(d, cfg) as (alone, _):
            assert chat(client(alone), messages, model=name).choices[0].message.content == answers[name]


def test_second_turn_prefills_only_its_new_tokens(model):
    d, _, _ = model
    turn1 = [{"role": "user", "content": PROMPT}]
    with serving(d, EngineConfig(adapter="off", prompt_cache_mb=64)) as (url, state):
        c = client(url)
        r1 = chat(c, turn1, max_tokens=8)
        turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                         {"role": "user", "content": "and now in one line"}]
        r2 = chat(c, turn2, max_tokens=8)
        cached = r2.usage.prompt_tokens_details.cached_tokens
        metrics = httpx.get(url + "/metrics").text
    # everything the first turn's cache holds that the second prompt repeats was not prefilled
    assert cached >= r1.usage.prompt_tokens and cached < r2.usage.prompt_tokens
    assert f"edge0_cached_prompt_tokens_total {cached}" in metrics
    with serving(d, EngineConfig(adapter="off", prompt_cache_mb=0)) as (url, _):
        plain = chat(client(url), turn2, max_tokens=8)
    assert plain.usage.prompt_tokens_details.cached_tokens == 0
    assert plain.choices[0].message.content == r2.choices[0].message.content


def test_stop_strings_logprobs_and_seeds(server):
    url, _ = server
    c = client(url)
    full = chat(c, [{"role": "user", "content": PROMPT}], model="tiny", max_tokens=24).choices[0].message.content
    stop = full[len(full) // 2: len(full) // 2 + 2]
    cut = chat(c, [{"role": "user", "content": PROMPT}], model="tiny", max_tokens=24, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == full[: full.index(stop)]
    lp = chat(c, [{"role": "user", "content": PROMPT}], model="tiny", max_tokens=5, logprobs=True, top_logprobs=3)
    entries = lp.choices[0].logprobs.content
    assert len(entries) == 5 and all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)
    assert all(abs(e.logprob - e.top_logprobs[0].logprob) < 1e-5 for e in entries)  # greedy: the top token
    sampled = [c.completions.create(model="tiny", prompt="x = ", max_tokens=8, temperature=1.0, seed=7).choices[0].text
               for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_sampling_fields_over_http_take_effect(server):
    """The fields the openai client sends only as extra body (top_k, min_p,
    repetition_penalty) and max_completion_tokens reach the sampler: top_k=1 and a min_p
    near 1 at temperature 1 give the greedy text; a repetition penalty gives what the
    engine gives with it, which is not the greedy text."""
    url, state = server
    messages = [{"role": "user", "content": PROMPT}]

    def post(**fields):
        r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny:base", "messages": messages, **fields},
                       timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    greedy = post(temperature=0, max_tokens=16)["choices"][0]["message"]["content"]
    limited = post(temperature=0, max_completion_tokens=5)
    assert limited["usage"]["completion_tokens"] == 5 and greedy.startswith(limited["choices"][0]["message"]["content"])
    for seed in (1, 2):
        assert post(temperature=1.0, top_k=1, seed=seed, max_tokens=16)["choices"][0]["message"]["content"] == greedy
        assert post(temperature=1.0, min_p=0.999, seed=seed, max_tokens=16)["choices"][0]["message"]["content"] == greedy
    penalised = post(temperature=0, max_tokens=16, repetition_penalty=5.0)["choices"][0]["message"]["content"]
    tok = state.engine.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    with Engine(state.settings.model_dir, EngineConfig(adapter="off")) as e:
        assert e.generate_text(ids, max_tokens=16, repetition_penalty=5.0)[0] == penalised
    assert penalised != greedy


def test_penalties_and_logit_bias_over_http(server):
    """presence_penalty, frequency_penalty and logit_bias (JSON keys are strings) reach the
    sampler as the engine applies them."""
    url, state = server
    messages = [{"role": "user", "content": PROMPT}]
    tok = state.engine.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    fields = dict(presence_penalty=2.0, frequency_penalty=-1.0, logit_bias={"11": 3.5, "40": -100})
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny:base", "messages": messages, "max_tokens": 12,
                                                       "temperature": 0, **fields}, timeout=60)
    assert r.status_code == 200, r.text
    with Engine(state.settings.model_dir, EngineConfig(adapter="off")) as e:
        expected = e.generate_text(ids, max_tokens=12, **fields)[0]
        assert e.generate_text(ids, max_tokens=12)[0] != expected  # the fields change the text
    assert r.json()["choices"][0]["message"]["content"] == expected


@pytest.mark.parametrize("body,status,match", [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"messages": "hi"}).encode(), 400, "'messages' must be a non-empty list"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(), 400,
     "'temperature' must be a number"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "top_p": 2}).encode(), 400,
     r"'top_p' must be in \(0, 1\]"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(), 400,
     r"'max_tokens' must be in \[1,"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 17}).encode(), 400, r"'n' must be in \[1, 16\]"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}).encode(), 400,
     r"and max_tokens \(5000\) exceed the model's context of 4096 tokens: ask for at most 40"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1_000_001}).encode(), 400,
     r"'max_tokens' must be in \[1, 1000000\]"),
    (b'{"prompt": "a\\ud800b"}', 400, r"prompt holds a lone surrogate \(\\ud800 at character 1\)"),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, r"messages\[0\]\.content holds a lone"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 1e-300}).encode(), 400,
     r"'repetition_penalty' must be in \[0\.01, 100\]"),
    (json.dumps({"messages": [{"role": "user", "content": "x " * 5000}]}).encode(), 400, "context"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}).encode(), 404,
     "the model 'gpt-4' does not exist"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "adapters": "gamma"}).encode(), 404,
     "no adapter 'gamma'"),
    (b"{" + b" " * (5 * 2**20) + b"}", 413, "over the limit"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}).encode(), 400,
     r"'presence_penalty' must be in \[-2, 2\]"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": "hi"}).encode(), 400,
     r"'frequency_penalty' must be a number"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"7": 200}}).encode(), 400,
     r"logit_bias\[7\] must be a number in \[-100, 100\]"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999": 1}}).encode(), 400,
     r"logit_bias token ids \[99999\] are outside the vocabulary"),
])
def test_client_mistakes_get_their_status_in_openai_shape(server, body, status, match):
    import re

    url, _ = server
    r = httpx.post(url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert re.search(match, err["message"]) and set(err) == {"message", "type", "param", "code"}


def test_the_openai_client_sees_typed_errors(server):
    url, _ = server
    c = client(url)
    with pytest.raises(openai.NotFoundError):
        chat(c, [{"role": "user", "content": "x"}], model="nope")
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_p=5)


def test_routes_and_methods(server):
    url, _ = server
    assert httpx.get(url + "/v1/nothing").status_code == 404
    assert httpx.get(url + "/v1/chat/completions").status_code == 405
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_api_key(model):
    d, _, _ = model
    with serving(d, EngineConfig(adapter="off"), api_key="s3cret") as (url, _):
        with pytest.raises(openai.AuthenticationError):
            chat(client(url, api_key="wrong"), [{"role": "user", "content": "x"}])
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/health").status_code == 200  # health needs no key
        assert chat(client(url, api_key="s3cret"), [{"role": "user", "content": "x"}], max_tokens=2).usage


def test_the_bearer_scheme_is_case_insensitive_and_an_empty_key_is_refused(model):
    d, _, _ = model
    with serving(d, EngineConfig(adapter="off"), api_key="s3cret") as (url, _):
        for header in ("bearer s3cret", "BEARER  s3cret", "Bearer s3cret"):
            assert httpx.get(url + "/metrics", headers={"Authorization": header}).status_code == 200, header
        for header in ("Basic s3cret", "bearer", "s3cret", "Bearer s3cret2"):
            assert httpx.get(url + "/metrics", headers={"Authorization": header}).status_code == 401, header
    r = subprocess.run([sys.executable, "-m", "edge0", "serve", "--model", str(d), "--api-key", ""],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--api-key (or EDGE0_API_KEY) is empty" in r.stderr, r.stderr[-500:]


def test_foreign_hosts_and_non_json_bodies_are_refused(server):
    """DNS rebinding (a page on another site reaching this port under its own name) and
    cross-site form posts: refused before any route runs."""
    url, _ = server
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    r = httpx.post(url + "/v1/chat/completions", content=body, headers={"Host": "evil.example",
                                                                         "Content-Type": "application/json"})
    assert r.status_code == 403 and r.json()["error"]["param"] == "host", r.text
    assert httpx.get(url + "/metrics", headers={"Host": "evil.example:8080"}).status_code == 403
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": kind} if kind else {}
        r = httpx.post(url + "/v1/chat/completions", content=body, headers=headers)
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"], (kind, r.text)
    for host in ("localhost:1234", "127.0.0.1", "[::1]:80"):
        r = httpx.post(url + "/v1/chat/completions", content=body,
                       headers={"Host": host, "Content-Type": "application/json; charset=utf-8"})
        assert r.status_code == 200, (host, r.text)


def test_allowed_hosts_option():
    from edge0.server.guard import host_allowed

    assert host_allowed("api.example:443", ("api.example",)) and not host_allowed("evil.example", ("api.example",))
    assert host_allowed("anything", ("*",)) and host_allowed("10.0.0.2:8080", ())


def test_models_retrieve(server):
    url, _ = server
    c = client(url)
    assert c.models.retrieve("tiny").id == "tiny"
    assert c.models.retrieve("alpha").parent == "tiny"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")


def test_health_is_503_while_loading(model, monkeypatch):
    import anyio

    from edge0.server.app import ServerState

    d, _, _ = model
    release = threading.Event()
    original = ServerState.load

    async def slow_load(self):
        await anyio.to_thread.run_sync(release.wait)
        await original(self)

    monkeypatch.setattr(ServerState, "load", slow_load)
    import uvicorn

    app = create_app(ServerSettings(model_dir=d, config=EngineConfig(adapter="off"), model_id="tiny"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        release.set()
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)


def test_internal_failure_is_500_and_the_next_request_is_served(server, monkeypatch):
    url, state = server
    original = state.engine.generate
    calls = []

    def broken(*a, **kw):
        if not calls:
            calls.append(1)
            raise RuntimeError("boom")
        return original(*a, **kw)

    monkeypatch.setattr(state.engine, "generate", broken)
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
    assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_disconnect_mid_stream_frees_everything(model):
    d, _, _ = model
    with serving(d, EngineConfig(adapter="off", decode_path="hot")) as (url, state):
        with httpx.stream("POST", url + "/v1/completions",
                          json={"prompt": PROMPT, "max_tokens": 4000, "stream": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
        deadline = time.monotonic() + 30
        while state.engine.resources()["generations"] or state.in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        res = state.engine.resources()
        assert res["pinned_slots"] == 0 and res["pending_reads"] == 0
        assert "edge0_client_disconnects_total 1" in httpx.get(url + "/metrics").text
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_queue_bound_429_and_keepalive_while_waiting(model):
    d, _, _ = model
    # one generation at a time (max_batch 1), so that the second one waits in the queue
    with serving(d, EngineConfig(adapter="off", max_batch=1), max_queue=1, keepalive_s=0.05) as (url, state):
        results = {}

        def long_request():
            results["long"] = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 400},
                                         timeout=120).status_code

        t = threading.Thread(target=long_request)
        t.start()
        while state.in_flight < 1:
            time.sleep(0.01)
        # one waits (with keep-alive comments while it does), the next is refused
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "y", "max_tokens": 2, "stream": True},
                          timeout=120) as waiting:
            while state.in_flight < 2:
                time.sleep(0.01)
            refused = httpx.post(url + "/v1/completions", json={"prompt": "z", "max_tokens": 2})
            lines = [line for line in waiting.iter_lines() if line]
        t.join()
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert ": keep-alive" in lines and lines[-1] == "data: [DONE]"
    assert results["long"] == 200


def serve_process(*flags: str) -> tuple[subprocess.Popen, str]:
    """``edge0 serve --port 0 FLAGS`` in a process of its own (its standard error a text
    pipe), and its URL once ``/health`` says it is ready."""
    proc = subprocess.Popen([sys.executable, "-m", "edge0", "serve", "--port", "0", *flags], stderr=subprocess.PIPE,
                            text=True)
    line = proc.stderr.readline()
    url = line.split(" on ")[1].split(" ")[0]
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_sigterm_lets_running_requests_finish_then_exits(model, tmp_path):
    d, _, _ = model
    proc, url = serve_process("--model", str(d), "--adapter", "off")
    try:
        with httpx.stream("POST", url + "/v1/completions",
                          json={"prompt": PROMPT, "max_tokens": 200, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert first.startswith("data: ") and rest[-1] == "data: [DONE]"  # finished, not cut
        # uvicorn re-raises the signal once it has shut down: the exit status says SIGTERM
        assert proc.wait(30) == -signal.SIGTERM
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_metrics_during_a_generation_leave_no_thread_behind(model):
    d, _, _ = model
    with serving(d, EngineConfig(adapter="off")) as (url, state):
        with httpx.stream("POST", url + "/v1/completions",
                          json={"prompt": PROMPT, "max_tokens": 3000, "stream": True}, timeout=120) as r:
            lines = r.iter_lines()
            next(lines)
            before = threading.active_count()
            for _ in range(30):
                m = httpx.get(url + "/metrics", timeout=10)
                assert m.status_code == 200 and "edge0_engine_generations 1" in m.text
            during = threading.active_count()
    assert during - before <= 2, (before, during)


def test_a_client_that_never_reads_its_stream_does_not_hold_the_engine(model):
    """A stream whose client stops reading is stopped after --send-timeout; the next
    request is served, not kept waiting until the silent client leaves."""
    import socket

    d, _, _ = model
    with serving(d, EngineConfig(adapter="off"), sndbuf=4096, send_timeout_s=1.0) as (url, state):
        host, port = url.rsplit("//", 1)[1].split(":")
        silent = socket.socket()
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # fills at once: the server must wait
        silent.connect((host, int(port)))
        body = json.dumps({"prompt": PROMPT, "max_tokens": 4000, "stream": True}).encode()
        silent.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body) + body)
        try:
            deadline = time.monotonic() + 30
            while state.in_flight < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            t0 = time.monotonic()
            r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=120)
            waited = time.monotonic() - t0
        finally:
            silent.close()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert waited < 40, waited  # (the silent client's 4000 tokens take about 80 s)


def test_a_chat_template_that_refuses_the_messages_is_a_400_and_a_dropped_upload_no_500(model, tmp_path):
    """A Mistral-style template raising on roles that do not alternate; a client that sends
    half its body and leaves. Neither is the server's failure."""
    import socket

    from tests.ckpt_tools import copy_model

    d = copy_model(model[0], tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                            "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
                            "{% endif %}{{ m['content'] }}{% endfor %}")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with serving(d, EngineConfig(adapter="off")) as (url, state):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"},
                                                                         {"role": "user", "content": "b"}]})
        assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"], r.text
        host, port = url.rsplit("//", 1)[1].split(":")
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"messages\": ")
        s.close()
        deadline = time.monotonic() + 10
        while 'endpoint="chat",status="499"' not in (text := httpx.get(url + "/metrics").text):
            assert time.monotonic() < deadline, text
            time.sleep(0.05)
        assert 'status="500"' not in text


def test_slow_and_silent_connections_are_closed_and_bodies_time_out(model):
    """Slowloris (a request head sent a byte at a time), a silent socket and a body that
    never finishes: closed or answered 408 within their timeouts, not held open."""
    import socket

    d, _, _ = model
    with serving(d, EngineConfig(adapter="off"), header_timeout_s=1.0, body_timeout_s=1.0) as (url, _):
        host, port = url.rsplit("//", 1)[1].split(":")
        silent = socket.create_connection((host, int(port)))
        slow = socket.create_connection((host, int(port)))
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        body = socket.create_connection((host, int(port)))
        body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        for s in (silent, slow, body):
            s.settimeout(10)
        t0 = time.monotonic()
        assert silent.recv(100) == b"" and slow.recv(100) == b""  # closed by the server
        answer = b""
        while chunk := body.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer, answer
        assert time.monotonic() - t0 < 8
        for s in (silent, slow, body):
            s.close()
        assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_an_idle_keep_alive_connection_is_closed_after_5_s(server):
    """A connection serves several requests, then closes once idle for 5 s (not held)."""
    import socket

    url, _ = server
    host, port = url.rsplit("//", 1)[1].split(":")
    conn = socket.create_connection((host, int(port)))
    conn.settimeout(15)
    for _ in range(2):  # the same connection answers twice: it is kept alive
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = b""
        while b'"status":"ok"' not in answer:
            answer += conn.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200")
    t0 = time.monotonic()
    assert conn.recv(100) == b""  # closed by the server
    assert 4.0 < time.monotonic() - t0 < 8.0
    conn.close()


def test_connections_beyond_max_connections_get_503(model):
    """With every slot taken by busy connections (a request in progress on each; uvicorn
    counts the newcomer's own), a new request gets 503; idle ones (silent sockets) are
    closed to make room instead."""
    import socket

    d, _, _ = model
    with serving(d, EngineConfig(adapter="off"), max_connections=3) as (url, _):
        host, port = url.rsplit("//", 1)[1].split(":")
        body = {"prompt": "x", "max_tokens": 4000, "stream": True, "logit_bias": {"0": -100}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as a, \
                httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as b:
            lines = [r.iter_lines() for r in (a, b)]  # kept: a closed iterator closes its response
            for it in lines:
                while not next(it).startswith("data: "):  # both busy
                    pass
            assert httpx.get(url + "/health", timeout=10).status_code == 503
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        held = [socket.create_connection((host, int(port))) for _ in range(2)]  # silent: idle
        try:
            time.sleep(0.3)
            assert httpx.get(url + "/health", timeout=10).status_code == 200
        finally:
            for s in held:
                s.close()


def test_clients_that_stop_reading_lose_their_connections_not_others_theirs(model):
    """Three streams whose clients never read, with room for four connections: each is
    stopped after --send-timeout and its connection closed by the server, so a fourth
    client is served (not 503) while the silent ones still hold their sockets open, and
    the server's descriptors and tasks come back. No server error is logged."""
    import socket

    d, _, _ = model
    with serving(d, EngineConfig(adapter="off"), send_timeout_s=1.0, max_connections=4) as (url, state):
        host, port = url.rsplit("//", 1)[1].split(":")
        before = _process_counts(url)
        body = json.dumps({"prompt": PROMPT, "max_tokens": 4000, "stream": True,
                           "logprobs": 20}).encode()  # about 1.5 KB a token: the buffers fill fast
        silent = []
        for _ in range(3):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            s.connect((host, int(port)))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            silent.append(s)
        try:
            deadline = time.monotonic() + 120
            while state.in_flight or state.metrics.disconnects < 3:  # all three stopped and closed
                assert time.monotonic() < deadline, (state.in_flight, state.metrics.disconnects)
                time.sleep(0.1)
            r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=60)
            assert r.status_code == 200, r.text
            after = _process_counts(url)
            # the three client sockets are this process's too; the server's three ends are gone
            assert after["open_fds"] <= before["open_fds"] + 3 + 1 and after["tasks"] <= before["tasks"] + 1, \
                (before, after)
            text = httpx.get(url + "/metrics").text
            assert 'status="500"' not in text
        finally:
            for s in silent:
                s.close()


def _process_counts(url) -> dict:
    text = httpx.get(url + "/metrics").text
    out = {}
    for line in text.splitlines():
        for name in ("open_fds", "tasks"):
            if line.startswith(f"edge0_process_{name} "):
                out[name] = float(line.split()[1])
    assert set(out) == {"open_fds", "tasks"}, text[-800:]
    return out


def test_metrics_show_the_staged_slots_and_mlx_memory():
    """/metrics carries the engine's slot bytes and over-slot count, and MLX's memory."""
    demo = Path(__file__).resolve().parent.parent / "src" / "edge0" / "data" / "demo_model"
    with serving(demo, EngineConfig(expert_source="slots")) as (url, state):
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=120)
        assert r.status_code == 200, r.text
        values = {line.split()[0]: float(line.split()[1]) for line in httpx.get(url + "/metrics").text.splitlines()
                  if line.startswith("edge0_")}
        m = state.engine.metrics()
    assert m.slot_bytes > 0 and values["edge0_slot_bytes"] == m.slot_bytes
    assert values["edge0_over_slot_layers_total"] == m.over_slot_layers
    assert values["edge0_process_mlx_active_bytes"] > 0 and values["edge0_process_mlx_cache_bytes"] >= 0


def test_requests_that_leave_while_waiting_leave_the_queue_at_once(model):
    """Clients that leave while their request waits for a place (the batch full) once stayed
    queued, holding their prompts, drained one per decode step and none while the batch was
    full: now they are out of the engine's line while the batch is still busy."""
    d, _, _ = model
    with serving(d, EngineConfig(adapter="off", max_batch=1), max_queue=64, keepalive_s=0.05) as (url, state):
        engine = state.engine
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "x", "max_tokens": 4000, "stream": True,
                                                                "logit_bias": {"0": -100}},  # no EOS
                          timeout=120) as long:
            lines = long.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # the batch is full from now
            for _ in range(12):
                with httpx.stream("POST", url + "/v1/completions",
                                  json={"prompt": "y " * 500, "max_tokens": 2, "stream": True}, timeout=120) as w:
                    assert next(line for line in w.iter_lines() if line) == ": keep-alive"  # waiting
            deadline = time.monotonic() + 20
            while engine.resources(wait=False)["generations"] > 1:  # the long one only
                assert time.monotonic() < deadline, engine.resources(wait=False)
                next(lines)  # the long generation goes on meanwhile
                time.sleep(0.01)
            assert engine._batcher.counts() == (1, 0)
        r = httpx.post(url + "/v1/completions", json={"prompt": "z", "max_tokens": 3}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_prompt_cache_is_shared_within_one_tenant_only(model):
    """Client B once learnt client A's secret from cached_tokens (one more cached token: the
    next digit guessed right). Cached prompts are shared only by requests with the same API
    key, `user` and `cache_salt`: B's probe with another user recovers nothing."""
    d, _, _ = model
    secret = "The code is 4 8 1 5 1 6. Remember it."
    with serving(d, EngineConfig(adapter="off", prompt_cache_mb=64)) as (url, state):
        def cached(prompt, **extra):
            r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, **extra}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        cached(secret, user="alice")  # A's request leaves its prompt in the cache
        probes = {g: cached(secret[:12] + g + " 8 1 5 1 6. Remember it.", user=f"mallory-{g}") for g in "0123456789"}
        assert set(probes.values()) == {0}, probes  # other users: nothing shared, the right guess included
        assert cached(secret[:12] + "4 8 1 5 1 6. Remember it.", user="alice") > 0  # the same tenant: shared
        assert cached(secret + " More.", user="alice", cache_salt="s1") == 0  # another salt: another scope
        headers = {"Authorization": "Bearer other-key"}
        r = httpx.post(url + "/v1/completions", json={"prompt": secret, "max_tokens": 1, "user": "alice"},
                       headers=headers, timeout=120)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # another key: another tenant
        bad = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "user": "u" * 257})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "user"


def test_engine_prompt_cache_scopes(model):
    """The same through the engine's own API, sync and async: cache_scope separates."""
    import anyio

    from edge0 import ConfigError, Engine

    d, _, _ = model
    prompt = "def f(x):\n    return x * 2\n\ndef g(y):"
    with Engine(d, EngineConfig(adapter="off", prompt_cache_mb=64)) as e:
        last = lambda events: [ev for ev in events if ev.stats is not None][-1].stats  # noqa: E731
        assert last(e.stream(prompt, max_tokens=2, cache_scope="a")).cached_tokens == 0
        assert last(e.stream(prompt, max_tokens=2, cache_scope="b")).cached_tokens == 0
        assert last(e.stream(prompt, max_tokens=2)).cached_tokens == 0  # None is a scope of its own

        async def again():
            return last([ev async for ev in e.generate(prompt, max_tokens=2, cache_scope="a") if ev is not None])

        assert anyio.run(again).cached_tokens > 0
        with pytest.raises(ConfigError, match="cache_scope must be None or a string"):
            list(e.stream(prompt, max_tokens=2, cache_scope=5))


def _silent_sockets(port: int, source: str, n: int) -> list:
    """``n`` connections from address ``source`` that never send a byte."""
    import socket

    out = []
    for _ in range(n):
        s = socket.socket()
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        out.append(s)
    return out


def test_one_client_cannot_take_every_connection(model):
    """260 silent sockets from one address, reopened as they closed, once made every other
    request a 503: one address holds at most its share, and a full server closes an idle
    connection of the client holding the most to serve a new one."""
    d, _, _ = model
    with serving(d, EngineConfig(adapter="off"), max_connections=24, max_connections_per_client=8,
                 header_timeout_s=60, flood_ban_s=0) as (url, state):
        port = int(url.rsplit(":", 1)[1])
        stop, flood = threading.Event(), []

        def flooder():  # reopens its silent sockets as the server closes them
            while not stop.is_set():
                flood.extend(_silent_sockets(port, "127.0.0.2", 4))
                time.sleep(0.02)

        t = threading.Thread(target=flooder, daemon=True)
        t.start()
        try:
            time.sleep(1.0)
            for _ in range(5):
                r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
                assert r.status_code == 200, r.text
        finally:
            stop.set()
            t.join(10)
        time.sleep(0.2)
        assert len(flood) > 50 and sum(map(_open, flood)) <= 8  # the rest were closed by the server
        for s in flood:
            s.close()
        # every slot taken by idle sockets of three other clients: a newcomer is still served
        others = [s for src, n in (("127.0.0.3", 8), ("127.0.0.4", 8), ("127.0.0.5", 8))
                  for s in _silent_sockets(port, src, n)]
        try:
            time.sleep(0.5)
            r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text
        finally:
            for s in others:
                s.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel filter is Linux's")
def test_an_address_flooding_connections_is_dropped_by_the_kernel(model):
    """A flood of connections from one address kept the event loop accepting and closing
    them (3.2x the others' latency): an address that arrives at its full share more than
    share times in a second has its connections dropped before the accept queue for
    --flood-ban seconds, and counted; other addresses are served throughout, and the
    banned one connects again once its ban ends."""
    import socket

    d, _, _ = model

    def connect(source, port, timeout=0.3):
        s = socket.socket()
        s.bind((source, 0))
        s.settimeout(timeout)
        try:
            s.connect(("127.0.0.1", port))
            return s
        except OSError:
            s.close()
            return None

    with serving(d, EngineConfig(adapter="off"), max_connections=64, max_connections_per_client=4,
                 header_timeout_s=60, flood_ban_s=3) as (url, state):
        port = int(url.rsplit(":", 1)[1])
        held, t0 = [], time.monotonic()
        while state.metrics.address_bans == 0 and time.monotonic() - t0 < 20 and len(held) <= 100:
            s = connect("127.0.0.2", port)  # silent sockets, reopened as fast as they connect
            if s is not None:
                held.append(s)
            time.sleep(0.01)  # the server's event loop shares this process's interpreter
        banned_at = time.monotonic()
        try:
            assert state.metrics.address_bans == 1
            assert 9 <= len(held) <= 60, len(held)  # share + share + 1 arrivals, then none
            assert connect("127.0.0.2", port) is None  # still banned
            r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text  # another address, served
            assert "edge0_address_bans_total 1" in httpx.get(url + "/metrics", timeout=30).text
        finally:
            for s in held:
                s.close()
        time.sleep(max(0.0, banned_at + 3.5 - time.monotonic()))
        back = connect("127.0.0.2", port, timeout=5)
        assert back is not None  # the ban ended
        back.close()


def _open(s) -> bool:
    """Whether the server still holds the other end of client socket ``s``."""
    import socket

    try:
        return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True  # nothing to read, not closed
    except OSError:  # reset
        return False


def test_a_short_prompt_is_not_held_behind_long_ones(model):
    """Long prompts sent and abandoned held every later client's first token until each was
    cancelled (FIFO prefill): the prompt with the fewest tokens left prefills first, so a
    short request that arrives while a long prompt prefills gets its first token before
    the long one, and the long one's text is still its own."""
    d, _, _ = model
    long_prompt = "def long_function(a, b, c):\n" + "    a = a + b * c - 1\n" * 90
    body = lambda prompt: {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}  # noqa: E731
    with serving(d, EngineConfig(adapter="off", prefill_step_size=8, prompt_cache_mb=0)) as (url, state):
        first, texts = {}, {}

        def send(name, prompt):
            text = []
            with httpx.stream("POST", url + "/v1/completions", json=body(prompt), timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        first.setdefault(name, time.monotonic())
                        text.append(json.loads(line[6:])["choices"][0]["text"])
            texts[name] = "".join(text)

        engine = state.engine
        before = engine.metrics().prefill_passes
        long_ = threading.Thread(target=send, args=("long", long_prompt))
        long_.start()
        deadline = time.monotonic() + 60
        while engine.metrics().prefill_passes < before + 2 and time.monotonic() < deadline:
            time.sleep(0.002)  # the long prompt is prefilling
        send("short", "x = 1")
        long_.join(120)
        assert first["short"] < first["long"], first
        solo = httpx.post(url + "/v1/completions", json={**body(long_prompt), "stream": False}, timeout=120)
        assert texts["long"] == solo.json()["choices"][0]["text"]


@pytest.mark.parametrize("whitespace", ["compact", "flexible"])
def test_a_json_schema_answer_is_compact_and_closes(whitespace):
    """A json_schema of a name and an age once ended at max_tokens 80 as invalid JSON (runs
    of 39 spaces, keys added past the schema's): the demo's answer now closes within 40
    tokens, holds the two fields, and is compact unless the server is told otherwise."""
    from edge0.cli import PACKAGED_DEMO

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"]}}}
    with serving(PACKAGED_DEMO, EngineConfig(prompt_cache_mb=0, json_whitespace=whitespace)) as (url, _):
        r = client(url).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Give a person as JSON."}], max_tokens=40,
            temperature=0, response_format=fmt)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 40, (r.usage, text)
    doc = json.loads(text)
    assert set(doc) == {"name", "age"} and isinstance(doc["name"], str) and isinstance(doc["age"], int)
    if whitespace == "compact":
        assert text == json.dumps(doc, separators=(",", ":")), text


def test_serve_prefills_in_small_chunks_by_default(monkeypatch):
    """A running stream once froze for a whole 2048-token chunk of another request's prompt:
    serve interleaves DEFAULT_SERVE_PREFILL_STEP prompt tokens with each decode step, unless
    told otherwise (flag, environment)."""
    from edge0.cli import PACKAGED_DEMO, build_parser
    from edge0.server.command import DEFAULT_SERVE_PREFILL_STEP, build_settings

    parse = lambda *extra: build_settings(build_parser().parse_args(  # noqa: E731
        ["serve", "--model", str(PACKAGED_DEMO), *extra]))
    assert DEFAULT_SERVE_PREFILL_STEP == 256
    assert parse().config.prefill_step_size == 256
    assert parse("--prefill-step-size", "1024").config.prefill_step_size == 1024
    monkeypatch.setenv("EDGE0_PREFILL_STEP_SIZE", "512")
    assert parse().config.prefill_step_size == 512
    assert EngineConfig().prefill_step_size == 2048  # the engine's own default stays mlx-lm's


def test_serve_gives_prefill_half_the_time_by_default(monkeypatch):
    """serve keeps at least half of the compute thread's time for the streams decoding while
    prompts prefill (prefill_share 50), unless told otherwise; the engine's default is 100."""
    from edge0.cli import PACKAGED_DEMO, build_parser
    from edge0.server.command import build_settings

    parse = lambda *extra: build_settings(build_parser().parse_args(  # noqa: E731
        ["serve", "--model", str(PACKAGED_DEMO), *extra]))
    assert parse().config.prefill_share == 50
    assert parse("--prefill-share", "80").config.prefill_share == 80
    monkeypatch.setenv("EDGE0_PREFILL_SHARE", "30")
    assert parse().config.prefill_share == 30
    assert EngineConfig().prefill_share == 100


def test_the_uvicorn_protocol_contract_the_connection_bounds_rely_on(model):
    """edge0/server/connections.py extends uvicorn's h11 protocol (a class uvicorn does not
    promise to keep), within the versions pyproject.toml pins: what it reads and overrides
    is there, on a live connection as on the class."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    for name in ("connection_made", "data_received", "connection_lost", "pause_writing", "resume_writing",
                 "timeout_keep_alive_handler"):
        assert callable(getattr(H11Protocol, name, None)), name
    seen = {}
    real = H11Protocol.data_received

    def spy(self, data):
        seen.update(conn=self.conn, cycle=getattr(self, "cycle", "missing"), client=self.client,
                    connections=self.connections, loop=self.loop, transport=self.transport)
        return real(self, data)

    d, _, _ = model
    H11Protocol.data_received = spy
    try:
        with serving(d, EngineConfig(adapter="off")) as (url, _):
            assert httpx.get(url + "/health", timeout=30).status_code == 200
    finally:
        H11Protocol.data_received = real
    assert isinstance(seen["conn"], h11.Connection) and hasattr(seen["conn"], "their_state")
    assert seen["cycle"] is None or hasattr(seen["cycle"], "response_complete")
    assert seen["client"][0] == "127.0.0.1" and isinstance(seen["connections"], set)
    assert hasattr(seen["loop"], "call_later") and hasattr(seen["transport"], "abort")


def test_metrics_are_prometheus_text_with_the_process_collector(model):
    """/metrics is written by prometheus_client: its own parser reads every family, the
    counters and gauges Edge0 keeps are there, and so is the process collector's (CPU
    seconds, resident memory, open file descriptors)."""
    from prometheus_client.parser import text_string_to_metric_families

    d, _, _ = model
    with serving(d, EngineConfig(adapter="off")) as (url, _):
        httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        text = httpx.get(url + "/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("process_open_fds", "process_resident_memory_bytes", "process_cpu_seconds"):
        assert name in families, sorted(families)
    requests = families["edge0_requests"]
    assert requests.type == "counter"
    assert any(s.labels == {"endpoint": "completions", "status": "200"} and s.value == 1 for s in requests.samples)
    assert families["edge0_batch_size"].type == "gauge" and families["edge0_model_loaded"].samples[0].value == 1
