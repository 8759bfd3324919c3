"""What evaluation harnesses ask of the server: ``echo`` with the prompt's log-probabilities
(the engine's own scoring), ``max_tokens: 0``, a list of prompts answered as one choice
each and decoded together, ``n`` choices seeded ``seed + j``, and a typed 400 for each
misuse."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from edge0 import EngineConfig
from tests.test_server import client, model, serving  # noqa: F401  (model: the fixture)

PROMPT = "def fibonacci(n):\n    return"


@pytest.fixture(scope="module")
def server(model):  # noqa: F811
    with serving(model[0], EngineConfig(adapter="off", prompt_cache_mb=64)) as (url, state):
        yield url, state


def _post(url, path="/v1/completions", **body) -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _engine_scores(state, ids, k=0) -> list:
    """The engine's own scoring of ``ids`` (``prompt_logprobs``): what the server must echo."""
    return next(iter(state.engine.stream(ids, max_tokens=1, adapter=None, prompt_logprobs=k))).prompt_logprobs


def test_echo_gives_the_prompts_scores_as_the_engine_computes_them(server):
    url, state = server
    tok = state.engine.tokenizer
    ids = state.engine.encode(PROMPT)
    body = _post(url, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    plain = _post(url, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)["choices"][0]
    assert choice["text"] == PROMPT + plain["text"]
    assert lp["tokens"] == [tok.decode([i]) for i in ids] + plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = _engine_scores(state, ids, k=2)
    assert lp["token_logprobs"][1:len(ids)] == [s[0] for s in expected[1:]]
    assert lp["top_logprobs"][1:len(ids)] == [{tok.decode([t]): v for t, v in s[1]} for s in expected[1:]]
    assert lp["token_logprobs"][len(ids):] == plain["logprobs"]["token_logprobs"]
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]))
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 3


def test_max_tokens_0_scores_the_prompt_only(server):
    url, state = server
    ids = state.engine.encode(PROMPT)
    body = _post(url, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    choice = body["choices"][0]
    assert choice["text"] == state.engine.tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None] + [s[0] for s in _engine_scores(state, ids)[1:]]
    assert choice["logprobs"]["top_logprobs"] == [None] + [{}] * (len(ids) - 1)
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    echo_only = _post(url, prompt=PROMPT, echo=True, max_tokens=0)["choices"][0]  # no logprobs asked
    assert echo_only["text"] == PROMPT and echo_only["logprobs"] is None


def test_a_streamed_echo_starts_with_the_prompt_and_its_scores(server):
    url, state = server
    whole = _post(url, prompt=PROMPT, echo=True, logprobs=1, max_tokens=4, temperature=0)["choices"][0]
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 4, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    assert events[0]["choices"][0]["text"].startswith(PROMPT)
    first = events[0]["choices"][0]["logprobs"]
    n = len(state.engine.encode(PROMPT))
    assert first["token_logprobs"][:n] == whole["logprobs"]["token_logprobs"][:n] and first["token_logprobs"][0] is None


@pytest.mark.parametrize("as_ids", [False, True])
def test_a_list_of_prompts_is_one_choice_each_decoded_together(server, as_ids):
    url, state = server
    prompts = ["def f(x):", "import os\n", "class Stack:", "for i in range(3):"]
    if as_ids:
        prompts = [state.engine.encode(p) for p in prompts]
    alone = [_post(url, prompt=p, max_tokens=8, temperature=0, echo=True, logprobs=1)["choices"][0] for p in prompts]
    before = state.engine.metrics()
    body = _post(url, prompt=prompts, max_tokens=8, temperature=0, echo=True, logprobs=1)
    after = state.engine.metrics()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for got, one in zip(body["choices"], alone):  # each as it is alone (a batch's sums may round apart)
        assert (got["text"], got["logprobs"]["tokens"]) == (one["text"], one["logprobs"]["tokens"])
        np.testing.assert_allclose(got["logprobs"]["token_logprobs"][1:], one["logprobs"]["token_logprobs"][1:],
                                   atol=1e-5)
    assert body["usage"]["completion_tokens"] == 32
    assert body["usage"]["prompt_tokens"] == sum(len(state.engine.encode(p)) for p in prompts)
    # decoded together: far fewer forward passes than the 32 tokens they made
    steps, tokens = after.decode_steps - before.decode_steps, after.decode_tokens - before.decode_tokens
    assert tokens == 32 and steps <= 16, (steps, tokens)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_choices_are_seeded_distinct_and_reproducible(server, path):
    url, _ = server
    body = ({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]})
    body.update(max_tokens=8, temperature=1.0, seed=11)

    def texts(answer):
        return [c["text"] if "text" in c else c["message"]["content"] for c in answer["choices"]]

    first = _post(url, path, n=4, **body)
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    assert len(set(texts(first))) == 4  # each choice its own seed
    assert texts(_post(url, path, n=4, **body)) == texts(first)  # the same request, the same choices
    # choice j is what seed + j alone samples
    assert [texts(_post(url, path, **{**body, "seed": 11 + j}))[0] for j in range(4)] == texts(first)
    assert first["usage"]["completion_tokens"] == 32  # every choice's tokens, the prompt's once
    assert first["usage"]["prompt_tokens"] == _post(url, path, **body)["usage"]["prompt_tokens"]


def test_n_times_a_list_of_prompts_indexes_prompt_by_prompt(server):
    url, _ = server
    body = _post(url, prompt=["a = 1", "b = 2"], n=2, max_tokens=4, temperature=1.0, seed=3)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for i, p in enumerate(["a = 1", "b = 2"]):
        one = _post(url, prompt=p, n=2, max_tokens=4, temperature=1.0, seed=3)
        assert [c["text"] for c in body["choices"][2 * i:2 * i + 2]] == [c["text"] for c in one["choices"]]


@pytest.mark.parametrize("path,body,param,match", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo",
     "'echo' is not a field this server implements for chat completions"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n", r"'n' must be in \[1, 16\], got 17"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n",
     r"'n' must be in \[1, 16\], got 0"),
    ("/v1/completions", {"prompt": []}, "prompt", "'prompt' must not be an empty list"),
    ("/v1/completions", {"prompt": ["a", [1, 2]]}, "prompt", "'prompt' mixes lists and strs: a list of prompts"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt", r"'prompt\[1\]' must not be empty"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt", r"'prompt\[1\]' must not be empty"),
    ("/v1/completions", {"prompt": [[1, 2], [3, "x"]]}, "prompt", r"'prompt\[1\]' must be a list of token ids"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 10 ** 6]]}, "prompt", r"'prompt\[1\]' token ids must be in \[0, "),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt", "'prompt' mixes strs and token ids"),
    ("/v1/completions", {"prompt": [1, None]}, "prompt", "'prompt' must be a non-empty string, a list of token"),
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt", "'prompt' must be a non-empty string, a list of token ids"),
    ("/v1/completions", {"prompt": [[1]] * 129}, "prompt", "'prompt' holds 129 prompts; at most 128"),
    ("/v1/completions", {"prompt": ["a"] * 9, "n": 16}, "n", "9 prompts with 'n' 16 ask for 144 choices"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "'max_tokens' 0 generates nothing"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens",
     r"'max_tokens' must be in \[1, "),
    ("/v1/completions", {"prompt": "x", "n": 2, "stream": True}, "stream", "a streamed answer has one choice"),
    ("/v1/completions", {"prompt": ["x", "y"], "stream": True}, "stream", "a streamed answer has one choice"),
    ("/v1/completions", {"prompt": ["x", "y" * 20000], "max_tokens": 4}, "prompt",
     r"prompt\[1\]: the prompt is \d+ tokens; the model's context is 4096"),
    ("/v1/completions", {"prompt": [[1, 2], [5] * 4090], "max_tokens": 10}, "max_tokens",
     r"prompt\[1\]: the prompt \(4090 tokens\) and max_tokens \(10\) exceed the model's context of 4096"),
    ("/v1/completions", {"prompt": [[1, 2], [5] * 4097]}, "prompt",
     r"'prompt\[1\]' holds 4097 token ids, more than the model's context of 4096"),
])
def test_scoring_misuse_is_a_400_naming_the_field(server, path, body, param, match):
    import re

    url, _ = server
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(match, err["message"]), err


def test_the_openai_client_reads_echoed_lists_and_choices(server):
    url, state = server
    c = client(url)
    r = c.completions.create(model="tiny", prompt=[PROMPT, "import os"], echo=True, logprobs=1, max_tokens=2,
                             temperature=0, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text.startswith(PROMPT) and r.choices[2].text.startswith("import os")
    assert r.choices[0].logprobs.token_logprobs[0] is None and r.usage.completion_tokens == 8
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=2)
    assert [ch.index for ch in chat.choices] == [0, 1, 2]


def test_every_choice_takes_its_place_in_the_line(model):  # noqa: F811
    """A request's generations (prompts times ``n``) each take a place in the engine's line:
    more than the batch and ``max_queue`` hold together is a 400, more than would fit beside
    what already waits is a 429 that keeps no place, and what fits is answered."""
    import threading
    import time

    with serving(model[0], EngineConfig(adapter="off", max_batch=1), max_queue=1) as (url, state):
        for body, param in (({"n": 3}, "n"), ({"prompt": ["a", "b", "c"]}, "prompt")):
            r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "at most 2" in r.json()["error"]["message"]
        assert len(_post(url, prompt="x", max_tokens=2, n=2)["choices"]) == 2  # one runs, one waits
        done = {}
        long = threading.Thread(target=lambda: done.update(r=httpx.post(
            url + "/v1/completions", json={"prompt": "x", "max_tokens": 300}, timeout=120).status_code))
        long.start()
        while state.in_flight < 1:
            time.sleep(0.01)
        refused = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2})
        assert refused.status_code == 429 and "this request asks for 2" in refused.json()["error"]["message"]
        assert state.engine.metrics().queued == 0  # the refused request kept no place
        assert len(_post(url, prompt="y", max_tokens=2)["choices"]) == 1  # waits its turn, then answered
        long.join()
        assert done["r"] == 200
