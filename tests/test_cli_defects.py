"""Small defects of the command line and the engine's prompt API, each fixed with the test
that found it: a system prompt on a model without a chat template, a weights file given as
``--model``, writing into the packaged demo model, the prompt-cache run's token counts."""

from __future__ import annotations

import pytest

from edge0 import Engine, EngineConfig
from edge0.cli import PACKAGED_DEMO, main
from tests.test_server import client, serving  # noqa: F401


@pytest.fixture(scope="module")
def plain_model(tiny_model_factory, tmp_path_factory):
    """A tiny qwen3_moe whose tokenizer has no chat template."""
    from tests.test_server_mlxlm import _with_template

    return _with_template(tiny_model_factory("qwen3_moe"), tmp_path_factory.mktemp("plain") / "m", None)


def test_a_system_prompt_without_a_chat_template_is_kept_as_the_server_keeps_it(plain_model, capsys):
    """engine.prompt_ids(text, system_prompt=...) dropped the system prompt on a model without
    a chat template, where the server writes a system and a user message as their contents
    joined by a newline: both give the same ids now, and `edge0 generate --system-prompt`."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]
    with Engine(plain_model, EngineConfig(adapter="off")) as e:
        assert not e.tokenizer.has_chat_template
        ours = e.prompt_ids("def f(x):", system_prompt="be brief")
        assert ours == e.prompt_ids(messages=messages) and ours != e.prompt_ids("def f(x):")
        assert e.prompt_ids("def f(x):", system_prompt="be brief", after_cache=True) == \
            e.prompt_ids("def f(x):", after_cache=True)  # the cache holds the start
    with serving(plain_model, EngineConfig(adapter="off")) as (url, _):
        r = client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert r.usage.prompt_tokens == len(ours)
    assert main(["generate", "--model", str(plain_model), "--prompt", "def f(x):", "--system-prompt", "be brief",
                 "--max-tokens", "2", "--adapter", "off"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("==========\nbe brief\ndef f(x):") and f"Prompt: {len(ours)} tokens," in out
