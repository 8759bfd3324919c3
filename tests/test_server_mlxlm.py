"""What an mlx-lm user brings to ``edge0 serve``: its flag spellings, its model names, its
routes without ``/v1``, and browsers calling the server (CORS)."""

from __future__ import annotations

import os

import httpx
import pytest

from edge0 import EngineConfig
from tests.test_server import client, model, serving  # noqa: F401  (model: the fixture)


def _settings(*argv):
    from edge0.cli import build_parser
    from edge0.server.command import build_settings

    return build_settings(build_parser().parse_args(["serve", *argv]))


def test_the_base_answers_to_the_names_an_mlx_lm_user_gives_it(model):
    """mlx-lm's ``default_model``, the path the server was started with (as given and
    absolute) got 404: they name the base now (``default_model``: what naming no model
    gets), /v1/models lists them, and the answer echoes the name asked for."""
    d, _, _ = model
    s = _settings("--model", str(d))
    assert s.model_id == d.name and {str(d), os.path.abspath(d)} <= set(s.model_aliases)
    with serving(d, EngineConfig(adapter="off"), model_aliases=s.model_aliases) as (url, _):
        c = client(url)
        listed = {m.id for m in c.models.list().data}
        assert {"tiny", "default_model", str(d), os.path.abspath(d)} <= listed
        texts = set()
        for name in ("tiny", "default_model", str(d), os.path.abspath(d)):
            r = c.completions.create(model=name, prompt="def f(x):", max_tokens=4, temperature=0)
            assert r.model == name
            texts.add(r.choices[0].text)
        assert len(texts) == 1  # the same base under every name
        with pytest.raises(Exception, match="404|does not exist"):
            c.completions.create(model="other", prompt="x", max_tokens=1)


def test_a_hub_snapshot_answers_to_its_repo_id(tmp_path):
    from edge0.hub import repo_id_of

    snap = tmp_path / "hub" / "models--mlx-community--Some-MoE-4bit" / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    assert repo_id_of(snap) == "mlx-community/Some-MoE-4bit"
    assert repo_id_of(tmp_path) is None


def test_routes_without_v1_answer_as_mlx_lm_s_do(model):
    d, _, _ = model
    with serving(d, EngineConfig(adapter="off")) as (url, _):
        chat = httpx.post(url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 2}, timeout=60)
        comp = httpx.post(url + "/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        models = httpx.get(url + "/models", timeout=30)
    assert chat.status_code == comp.status_code == models.status_code == 200, (chat.text, comp.text)
    assert chat.json()["object"] == "chat.completion" and models.json()["object"] == "list"


def test_browsers_on_allowed_origins_may_call_the_server(model):
    """No CORS by default (a preflight is a 405, as before); with --allowed-origins a
    browser's preflight from an allowed origin is answered and its requests carry the
    header, another origin's preflight is refused."""
    d, _, _ = model
    pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type, authorization"}
    with serving(d, EngineConfig(adapter="off")) as (url, _):
        assert httpx.options(url + "/v1/chat/completions", headers=pre, timeout=30).status_code == 405
    assert _settings("--model", str(d), "--allowed-origins", "https://app.example, https://b.example"
                     ).allowed_origins == ("https://app.example", "https://b.example")
    with serving(d, EngineConfig(adapter="off"), allowed_origins=("https://app.example",)) as (url, _):
        r = httpx.options(url + "/v1/chat/completions", headers=pre, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        other = httpx.options(url + "/v1/chat/completions", headers={**pre, "Origin": "https://evil.example"},
                              timeout=30)
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        post = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                          headers={"Origin": "https://app.example"}, timeout=60)
        assert post.status_code == 200 and post.headers["access-control-allow-origin"] == "https://app.example"


def test_mlx_lm_flag_spellings_are_accepted(model):
    d, a, _ = model
    s = _settings("--model", str(d), "--adapter-path", str(a), "--log-level", "INFO")
    assert s.config.adapter == str(a) and s.config.log_level == "info"
