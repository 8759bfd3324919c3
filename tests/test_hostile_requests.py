"""What one client's request may cost the others: the chat template it can reach, a large
body, numbers and keys that crash a naive server. Each through a real server, since the harm
is to another client (a stalled event loop, a place in line never given back, memory)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from edge0 import EngineConfig
from edge0.server.sandbox import SandboxLimits
from tests.test_server import model, serve_process, serving  # noqa: F401  (model: the fixture)
from tests.test_server_mlxlm import _with_template

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import fuzz_bodies  # noqa: E402

# A chat template whose variables let a client ask for unbounded work: nested loops,
# a huge string, a division by zero; a model's own template may do any of these.
HOSTILE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if loops is defined %}{% for i in range(loops) %}{% for j in range(loops) %}{% endfor %}{% endfor %}"
    "{% endif %}{% if pad is defined %}{{ 'x' * pad }}{% endif %}{% if divisor is defined %}{{ 1 // divisor }}"
    "{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def hostile_model(model, tmp_path_factory):
    return _with_template(model[0], tmp_path_factory.mktemp("hostile") / "m", HOSTILE_TEMPLATE)


def _chat(url, timeout=60, **body):
    return httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **body},
                      timeout=timeout)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _settled(state, deadline_s: float = 5.0) -> bool:
    deadline = time.monotonic() + deadline_s
    while state.in_flight:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("key", ["chat_template", "continue_final_message", "return_assistant_tokens_mask",
                                 "documents", "tokenize", "tools", "messages"])
def test_a_client_cannot_set_the_renderers_own_parameters(hostile_model, key):
    """``chat_template_kwargs`` reached ``apply_chat_template`` as its keyword arguments: a
    client's ``chat_template`` replaced the model's (200), ``continue_final_message`` was a
    500. They are the renderer's own now: a 400 naming the key."""
    with serving(hostile_model, EngineConfig(adapter="off")) as (url, _):
        value = "{{ 'INJECTED ' * 50 }}" if key == "chat_template" else True
        r = _chat(url, chat_template_kwargs={key: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template_kwargs"
    assert f"'chat_template_kwargs.{key}' is a parameter of the template renderer" in error["message"]


def test_only_the_templates_own_variables_pass(hostile_model):
    with serving(hostile_model, EngineConfig(adapter="off")) as (url, _):
        unknown = _chat(url, chat_template_kwargs={"colour": "red"})
        known = _chat(url, chat_template_kwargs={"pad": 3, "enable_thinking": False})
        plain = _chat(url)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "chat_template_kwargs"
    assert "'chat_template_kwargs.colour' is not a variable of this model's chat template" in unknown.text
    assert "(it reads: divisor, enable_thinking, loops, pad)" in unknown.text  # what it reads, to fix the request by
    assert known.status_code == plain.status_code == 200, (known.text, plain.text)
    assert known.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]  # 'xxx' reached it


def test_a_template_that_fails_or_eats_memory_is_a_400_and_the_server_keeps_nothing(hostile_model):
    """A template raising anything but jinja2's TemplateError was a 500; a huge string was
    built in the server's own memory (548 MiB kept). Rendering runs in a worker process
    under a memory bound now."""
    with serving(hostile_model, EngineConfig(adapter="off")) as (url, state):
        assert _chat(url).status_code == 200
        before = _rss_mib()
        zero = _chat(url, chat_template_kwargs={"divisor": 0})
        huge = _chat(url, chat_template_kwargs={"pad": 2_000_000_000})
        grown = _rss_mib() - before
        after = _chat(url)
    for r in (zero, huge):
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        assert "the chat template failed on this request" in r.json()["error"]["message"]
    assert "ZeroDivisionError" in zero.text and "more memory than a request may use" in huge.text
    assert grown < 50, f"the server's RSS grew {grown:.0f} MiB"
    assert after.status_code == 200


def test_a_template_past_its_deadline_is_a_400_and_gives_its_place_back(hostile_model):
    """Nested loops of 1e10 steps ran in a thread nobody could stop, holding the request's
    place in line until a restart. The render is killed at its deadline now."""
    limits = SandboxLimits(timeout_s=1.0)
    with serving(hostile_model, EngineConfig(adapter="off"), sandbox=limits) as (url, state):
        r = _chat(url, timeout=30, chat_template_kwargs={"loops": 100000})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        assert "took longer than 1 s to render" in r.json()["error"]["message"]
        assert _settled(state) and state.sandbox.killed == 1
        assert _chat(url).status_code == 200


def test_a_client_that_leaves_during_a_render_gives_its_place_back(hostile_model):
    """33 such requests whose clients left after 3 s held every place in line (429 for
    everyone) until a restart: leaving frees the place and kills the render now, long before
    its deadline."""
    limits = SandboxLimits(timeout_s=120.0)
    with serving(hostile_model, EngineConfig(adapter="off"), sandbox=limits) as (url, state):
        for _ in range(3):
            with pytest.raises(httpx.ReadTimeout):
                _chat(url, timeout=0.5, chat_template_kwargs={"loops": 100000})
        assert _settled(state), f"{state.in_flight} requests still hold a place after their clients left"
        deadline = time.monotonic() + 5
        while state.sandbox.killed < 2:  # the renders that had a worker (a third waited for one)
            assert time.monotonic() < deadline, state.sandbox.killed
            time.sleep(0.02)
        assert _chat(url).status_code == 200


def test_large_bodies_are_checked_off_the_event_loop(model):
    """Three 4 MB bodies of two million token ids were walked on the event loop: /health
    waited seconds for each. They are parsed and checked in a worker process now; the loop
    answers meanwhile."""
    body = ('{"prompt": [' + ",".join(["0"] * 2_000_000) + ", -1]}").encode()
    with serving(model[0], EngineConfig(adapter="off")) as (url, state):
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        answers: list = []

        def attack():
            answers.append(httpx.post(url + "/v1/completions", content=body, timeout=120,
                                      headers={"Content-Type": "application/json"}))

        attackers = [threading.Thread(target=attack) for _ in range(3)]
        for t in attackers:
            t.start()
        worst = 0.0
        while any(t.is_alive() for t in attackers):
            t0 = time.perf_counter()
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.01)
        for t in attackers:
            t.join()
        parsed_apart = state.sandbox.jobs["parse"]
    assert [a.status_code for a in answers] == [400] * 3, [a.text[:200] for a in answers]
    assert parsed_apart == 3  # (json.loads of each holds the interpreter lock 0.1 s: not on the loop)
    assert all(a.json()["error"]["param"] == "prompt" and "more than the model's context" in a.text for a in answers)
    assert worst < 1.0, f"/health took {worst:.2f} s while large bodies were checked"


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_an_integer_past_float_range_is_a_400_naming_the_field(model, route):
    with serving(model[0], EngineConfig(adapter="off")) as (url, _):
        body = {"max_tokens": 2, "logit_bias": {"1": int("9" * 400)}}
        r = (_chat(url, **body) if route == "chat" else
             httpx.post(url + "/v1/completions", json={"prompt": "x", **body}, timeout=60))
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_object_keys_are_checked_like_string_values(model):
    """A lone surrogate as a key of a tool call's arguments (an object, or JSON text) was a
    500 TypeError; as a top-level key, a 400 with an empty ``param``."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"\ud800": 1}}}
    as_text = {**call, "function": {"name": "f", "arguments": '{"\\ud800": 1}'}}
    with serving(model[0], EngineConfig(adapter="off")) as (url, _):
        answers = {}
        for name, calls in (("object", call), ("text", as_text)):
            messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [calls]},
                        {"role": "user", "content": "go on"}]
            answers[name] = httpx.post(url + "/v1/chat/completions",
                                       content=json.dumps({"messages": messages, "max_tokens": 2}),
                                       headers={"Content-Type": "application/json"}, timeout=60)
        answers["top"] = httpx.post(url + "/v1/completions", content='{"prompt": "x", "\\ud800": 1}',
                                    headers={"Content-Type": "application/json"}, timeout=60)
    for name, r in answers.items():
        assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"], (name, r.text)
    assert answers["object"].json()["error"]["param"] == "messages"
    assert answers["top"].json()["error"]["message"].startswith("a key of the request body holds a lone surrogate")


@pytest.mark.parametrize("templated", [False, True])
def test_fuzzed_bodies_get_no_5xx(model, tmp_path, templated):
    """tools/fuzz_bodies.py's bodies (hostile values and keys at any depth, broken bytes,
    the renderer's parameters): a 2xx or a 4xx in OpenAI's shape each, on a model without and
    with a chat template (one with tool calls); the tool sends 3,000 (docs/SERVER.md)."""
    d = fuzz_bodies.with_template(model[0], tmp_path / "m") if templated else model[0]
    with serving(d, EngineConfig(adapter="off")) as (url, state):
        report = fuzz_bodies.fuzz(url, seed=7 + templated, n=150)
        text = httpx.get(url + "/metrics", timeout=30).text
    assert report["failures"] == [], report["failures"][:3]
    assert 'status="500"' not in text and 'status="599"' not in text
    assert sum(v for k, v in report["statuses"].items() if 200 <= k < 300) > 0  # some got through to a generation


def test_a_large_valid_body_is_answered_as_its_small_twin(model):
    """A body over 64 KiB is parsed in a worker process and comes back as the same request:
    the same text as a small body asking the same, for the base and for an adapter."""
    d, a, b = model
    with serving(d, EngineConfig(adapter=str(a), extra_adapters=(str(b),))) as (url, state):
        texts = {}
        for name in ("tiny", b.name):
            for size in (1, 60_000):  # a schema's description is not part of its grammar
                schema = {"type": "object", "description": "d" * size, "properties": {"n": {"type": "integer"}}}
                r = httpx.post(url + "/v1/completions", timeout=120, json={
                    "model": name, "prompt": "def f(x):", "max_tokens": 6, "temperature": 0,
                    "stop": ["\u00a7" * (1 + size // 20)],  # a stop string the text never holds: the body past 64 KiB
                    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
                assert r.status_code == 200 and r.json()["model"] == name, r.text
                texts[name, size] = r.json()["choices"][0]["text"]
        assert state.sandbox.jobs["parse"] == 2
    assert texts["tiny", 1] == texts["tiny", 60_000] and texts[b.name, 1] == texts[b.name, 60_000]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table in /proc")
def test_sigterm_during_a_long_render_exits_promptly_and_quietly(hostile_model):
    """With a render that would run for minutes in flight, SIGTERM took 40 s and logged a
    traceback: the render is killed with the request now, and the worker processes go
    with the server."""
    proc, url = serve_process("--model", str(hostile_model), "--adapter", "off", "--render-timeout", "120",
                              "--grace", "2")
    try:
        workers = _children(proc.pid)
        assert len(workers) == 2
        answers = []

        def send_bomb():
            try:
                r = _chat(url, timeout=60, chat_template_kwargs={"loops": 100000})
                answers.append(r.status_code if r.status_code != 500 else r.text)
            except httpx.HTTPError as e:
                answers.append(type(e).__name__)

        bomb = threading.Thread(target=send_bomb)
        bomb.start()
        time.sleep(1.0)  # the render has begun (it never ends on its own)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM
        took = time.monotonic() - t0
        bomb.join(30)
        log = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    assert took < 10, f"SIGTERM took {took:.1f} s"
    assert answers in ([503], ["RemoteProtocolError"], ["ReadError"]), answers  # never a 400 blaming the client
    assert "Traceback" not in log, log[-2000:]
    assert not [pid for pid in workers if _alive(pid)]


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return out


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie waiting for its parent to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table in /proc")
def test_a_worker_killed_from_outside_is_replaced_and_blames_no_request(hostile_model):
    """A request worker that died while idle (the kernel's OOM killer, an operator's kill)
    was handed the next job: a 400 blaming that request's input. It is dropped and
    replaced now; every request is answered as usual."""
    with serving(hostile_model, EngineConfig(adapter="off")) as (url, state):
        children = _children(os.getpid())
        workers = [pid for pid in children if _alive(pid) and "edge0.server.sandbox" in _cmdline(pid)]
        assert len(workers) == 2
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in workers):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        answers = [_chat(url).status_code for _ in range(3)]
        assert answers == [200] * 3
        assert state.sandbox.killed == 0  # dropped as dead, not killed for a request
        deadline = time.monotonic() + 60
        while len([p for p in _children(os.getpid()) if _alive(p) and "edge0.server.sandbox" in _cmdline(p)]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


def test_a_pool_left_short_by_a_failed_start_starts_another(monkeypatch):
    """A request worker that failed to start left the pool one smaller for good (none
    left: every chat request a 503): a request that finds no worker free starts another."""
    from edge0.server import protocol as P
    from edge0.server import sandbox

    real, starts = sandbox._Child, []

    def first_fails(*args):
        starts.append(1)
        if len(starts) == 1:
            raise sandbox.SandboxError("did not start")
        return real(*args)

    monkeypatch.setattr(sandbox, "_Child", first_fails)
    checks = P.Checks(models={"m": None}, default_model="m", defaults=P.Defaults(), vocab_size=100, context=64)
    pool = sandbox.Sandbox({"tokenizer": None, "checks": checks}, SandboxLimits(workers=2))
    try:
        assert pool.size() == 1
        results: list = []
        jobs = [threading.Thread(target=lambda: results.append(
            pool.run(("parse", b'{"prompt": [1, 2], "max_tokens": 1}', "completion")).prompts)) for _ in range(2)]
        for t in jobs:
            t.start()
        for t in jobs:
            t.join(60)
        assert results == [[[1, 2]], [[1, 2]]]
        deadline = time.monotonic() + 60
        while pool.size() < 2:  # the one the waiting request started
            assert time.monotonic() < deadline, (pool.size(), len(starts))
            time.sleep(0.05)
        assert len(starts) == 3
    finally:
        pool.close()


def test_a_large_body_nested_past_the_parser_is_a_400(model):
    """A body over 64 KiB nested deeper than the JSON parser goes is parsed in a worker:
    its RecursionError is the same 400 as a small body's, not a 500."""
    deep = '{"prompt": ' + "[" * 40_000 + "]" * 40_000 + "}"
    with serving(model[0], EngineConfig(adapter="off")) as (url, _):
        r = httpx.post(url + "/v1/completions", content=deep, headers={"Content-Type": "application/json"},
                       timeout=60)
    assert r.status_code == 400 and "nested deeper than 64 levels" in r.json()["error"]["message"], r.text


def test_the_round_three_tools_run(tmp_path):
    """tools/schema_refusal_rss.py and tools/victim_stall.py (docs/SERVER.md's figures) run
    to their reports on the demo: small runs of each."""
    import schema_refusal_rss
    import victim_stall

    assert schema_refusal_rss.main(["--schemas", "2", "--out", str(tmp_path / "s.json")]) == 0
    schemas = json.loads((tmp_path / "s.json").read_text())
    assert [r["status"] for r in schemas["rows"]] == [400, 400] and schemas["after_mib"] is not None
    assert victim_stall.main(["--attack", "big_bodies", "--repeats", "1", "--victim-tokens", "8",
                              "--out", str(tmp_path / "v.json")]) == 0
    summary = json.loads((tmp_path / "v.json").read_text())["summary"]
    assert set(summary) == {"quiet", "big_bodies"} and summary["big_bodies"]["settle_s"] < 60
