"""What each model name serves, and ``/v1/models`` saying so: the base's name serves what
``edge0 demo`` shows (the base with the adapter shipped beside it), ``NAME:base`` (or
``"adapters": "none"``) the bare base, an adapter's name that adapter."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from edge0 import Engine, EngineConfig
from edge0.cli import PACKAGED_DEMO
from tests.test_server import client, serving

PROMPT = "def parse_args(argv):"  # a prompt whose text the shipped adapter changes

pytestmark = pytest.mark.skipif(not (PACKAGED_DEMO / "adapter").is_dir(), reason="the packaged demo ships its adapter")


@pytest.fixture(scope="module")
def demo_server():
    with serving(PACKAGED_DEMO, EngineConfig()) as (url, state):
        yield url, state


def _complete(url, **fields) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r


def test_the_base_name_serves_what_edge0_demo_shows(demo_server):
    url, _ = demo_server
    demo = subprocess.run([sys.executable, "-m", "edge0", "demo", "--prompt", PROMPT, "--max-tokens", "8",
                           "--verbose", "false"], capture_output=True, text=True, check=True)
    named = _complete(url, model="tiny").json()
    assert named["choices"][0]["text"] == demo.stdout[:-1] and named["model"] == "tiny"
    assert _complete(url).json()["choices"][0]["text"] == demo.stdout[:-1]  # naming no model: the same


def test_the_bare_base_has_a_name_of_its_own(demo_server):
    url, _ = demo_server
    with Engine(PACKAGED_DEMO, EngineConfig(adapter="off")) as e:
        bare, _ = e.generate_text(PROMPT, max_tokens=8)
    base = _complete(url, model="tiny:base").json()
    assert base["choices"][0]["text"] == bare and base["model"] == "tiny:base"
    none = _complete(url, model="tiny", adapters="none").json()
    assert none["choices"][0]["text"] == bare and none["model"] == "tiny:base"
    assert _complete(url, model="tiny").json()["choices"][0]["text"] != bare  # the adapter changes the text


def test_models_say_what_each_name_serves(demo_server):
    url, _ = demo_server
    cards = {m.id: m for m in client(url).models.list().data}
    assert set(cards) == {"tiny", "tiny:base", "adapter", "default_model"}
    serves = {name: m.edge0 for name, m in cards.items()}  # type: ignore[attr-defined]
    assert serves["tiny"]["adapter"] == "adapter" and serves["tiny:base"]["adapter"] is None
    assert all(s["base"] == "tiny" for s in serves.values())
    assert serves["tiny"]["description"] == ("tiny with the adapter 'adapter' (its default: what edge0 generate and "
                                             "edge0 demo apply)")
    assert serves["tiny:base"]["description"] == "tiny without an adapter"
    assert cards["adapter"].parent == "tiny" and cards["tiny"].parent is None  # type: ignore[attr-defined]
    assert client(url).models.retrieve("tiny:base").edge0["adapter"] is None  # type: ignore[attr-defined]


def test_an_unknown_adapter_is_still_a_404(demo_server):
    url, _ = demo_server
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "adapters": "nope"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "adapters"
    assert "'tiny:base'" in r.json()["error"]["message"]  # the names it lists include the bare base's
