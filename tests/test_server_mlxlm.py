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


def test_hide_paths_keeps_the_models_path_from_clients(model):
    """/v1/models and a 404 showed the server's absolute model path to every client: with
    --hide-paths the paths still name the base but are shown nowhere."""
    d, _, _ = model
    s = _settings("--model", str(d), "--hide-paths")
    assert not {str(d), os.path.abspath(d)} & set(s.model_aliases)
    with serving(d, EngineConfig(adapter="off"), model_aliases=s.model_aliases,
                 hidden_aliases=s.hidden_aliases) as (url, _):
        listed = httpx.get(url + "/v1/models", timeout=30).text
        missing = httpx.post(url + "/v1/completions", json={"model": "other", "prompt": "x", "max_tokens": 1},
                             timeout=60)
        named = httpx.post(url + "/v1/completions", json={"model": os.path.abspath(d), "prompt": "x",
                                                          "max_tokens": 1}, timeout=60)
        one = httpx.get(url + "/v1/models/" + os.path.abspath(d).lstrip("/"), timeout=30)
    assert missing.status_code == 404 and "tiny" in missing.text
    for text in (listed, missing.text):
        assert str(d.parent) not in text, text
    assert named.status_code == 200, named.text
    assert one.status_code in (200, 404)  # a path with its leading slash is not a route segment either way


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
        assert other.json()["error"]["message"].startswith("CORS preflight refused: Disallowed CORS origin")
        post = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                          headers={"Origin": "https://app.example"}, timeout=60)
        assert post.status_code == 200 and post.headers["access-control-allow-origin"] == "https://app.example"


def test_mlx_lm_flag_spellings_are_accepted(model):
    d, a, _ = model
    s = _settings("--model", str(d), "--adapter-path", str(a), "--log-level", "INFO")
    assert s.config.adapter == str(a) and s.config.log_level == "info"


THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                     "{% endif %}")


def _with_template(src, dst, template):
    """A copy of model ``src`` whose tokenizer has chat template ``template`` (None: none)."""
    import json

    from tests.ckpt_tools import copy_model

    d = copy_model(src, dst)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    if template is None:
        cfg.pop("chat_template", None)
    else:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_chat_template_kwargs_reach_the_template(model, tmp_path):
    """chat_template_kwargs was accepted and dropped (Qwen3's thinking could not be switched
    off): its entries are the template's variables now, and what the server sets itself is
    refused."""
    from edge0 import Engine

    d = _with_template(model[0], tmp_path / "m", THINKING_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    with Engine(d, EngineConfig(adapter="off")) as e:  # (mlx-lm's tokenizer passes enable_thinking=False unless told)
        want = len(e.prompt_ids(messages=messages, template_kwargs={"enable_thinking": True}))
        plain = len(e.prompt_ids(messages=messages))
    assert want != plain
    with serving(d, EngineConfig(adapter="off")) as (url, _):
        c = client(url)
        given = c.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        default = c.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        assert (given.usage.prompt_tokens, default.usage.prompt_tokens) == (want, plain)
        for bad_value, why in (({"tools": []}, "a parameter of the template renderer"), ("yes", "must be an object")):
            r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2,
                                                               "chat_template_kwargs": bad_value}, timeout=60)
            assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
            assert r.json()["error"]["param"] == "chat_template_kwargs"


def test_role_mapping_writes_a_template_less_prompt_as_mlx_lm_does(model, tmp_path):
    from edge0 import Engine
    from edge0.prompts import mapped_roles

    d = _with_template(model[0], tmp_path / "m", None)
    mapping = {"system": "RULE: ", "user": "USER: ", "assistant": "ASSISTANT: ", "stop": "\n"}
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert mapped_roles(messages, mapping) == "RULE: be brief\nUSER: hi\nASSISTANT:"
    with Engine(d, EngineConfig(adapter="off")) as e:
        want = len(e.encode(mapped_roles(messages, mapping)))
        joined = len(e.encode("be brief\nhi"))
    with serving(d, EngineConfig(adapter="off")) as (url, _):
        c = client(url)
        mapped = c.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                           extra_body={"role_mapping": mapping})
        plain = c.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        assert (mapped.usage.prompt_tokens, plain.usage.prompt_tokens) == (want, joined)
        r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "role_mapping": {"user": 5}},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "role_mapping"


def test_mlx_lm_sampling_fields_are_applied_and_checked(model):
    """repetition_context_size and xtc_probability / xtc_threshold were accepted and ignored
    (even "abc" and 5): they change the sampling now, and a bad value is a 400 naming it;
    a field the server does not implement is refused by name."""
    d, _, _ = model

    def text(c, prompt="def f(x):", **extra):
        return c.completions.create(model="tiny", prompt=prompt, max_tokens=24, extra_body=extra,
                                    **({} if "temperature" in extra else {"temperature": 0})).choices[0].text

    with serving(d, EngineConfig(adapter="off")) as (url, _):
        c = client(url)
        repeating = "def f(x):" + text(c)[:20]  # the model's own tokens again: a penalty has something to act on
        short = text(c, repeating, repetition_penalty=3.0, repetition_context_size=1)
        assert short == text(c, repeating, repetition_penalty=3.0, repetition_context_size=1)
        assert short != text(c, repeating, repetition_penalty=3.0, repetition_context_size=64)
        sampled = dict(temperature=1.0, seed=3)
        assert text(c, **sampled) == text(c, **sampled, xtc_probability=0.0)
        assert text(c, **sampled) != text(c, **sampled, xtc_probability=1.0, xtc_threshold=0.0)
        for body, param in (({"repetition_context_size": "abc"}, "repetition_context_size"),
                            ({"xtc_probability": 5}, "xtc_probability"), ({"xtc_threshold": 0.9}, "xtc_threshold"),
                            ({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of")):
            r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, **body}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "functions": []}, timeout=60)
        assert r.status_code == 400 and "'functions' is not a field" in r.json()["error"]["message"]


def test_the_renderers_own_parameters_cover_transformers_signatures():
    """``chat_template_kwargs`` names that are parameters of the installed transformers'
    renderer are refused (edge0.prompts.RENDERER_OWN): a parameter a new version adds must
    be added there, or a client could set it."""
    import inspect

    from transformers import PreTrainedTokenizerBase
    from transformers.utils.chat_template_utils import render_jinja_template

    from edge0.prompts import RENDERER_OWN

    names = set()
    for fn in (PreTrainedTokenizerBase.apply_chat_template, render_jinja_template):
        names |= {p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind is not inspect.Parameter.VAR_KEYWORD and p.name != "self"}
    assert names <= RENDERER_OWN, sorted(names - RENDERER_OWN)


def test_the_request_worker_flags_reach_the_settings(model):
    from edge0.errors import ConfigError
    from edge0.server.sandbox import SandboxLimits

    d, _, _ = model
    s = _settings("--model", str(d), "--render-timeout", "5", "--request-workers", "3")
    assert s.sandbox == SandboxLimits(timeout_s=5.0, workers=3)
    assert _settings("--model", str(d)).sandbox == SandboxLimits()
    for flag in ("--render-timeout", "--request-workers"):
        with pytest.raises(ConfigError, match=flag):
            _settings("--model", str(d), flag, "0")
