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


class _Ran(Exception):
    """A training function was reached (the command got past its checks)."""


def _never(*args, **kwargs):
    raise _Ran()


@pytest.mark.parametrize("argv, what", [
    (["train", "heads", "--model", str(PACKAGED_DEMO)], f"the heads file {PACKAGED_DEMO / 'prerouter.safetensors'}"),
    (["train", "heads", "--model", "m", "--out", str(PACKAGED_DEMO / "h.safetensors")], "the heads file"),
    (["train", "distill", "--model", str(PACKAGED_DEMO), "--teacher", "t", "--adapter", "a"],
     f"the adapter {PACKAGED_DEMO / 'adapter'}"),
    (["train", "sft", "--model", "m", "--teacher", "t", "--out", str(PACKAGED_DEMO / "adapter")], "the adapter"),
    (["train", "recipe", "--model", str(PACKAGED_DEMO), "--teacher", "t"], "the heads and adapter's folder"),
    (["adapter", "init", "--model", str(PACKAGED_DEMO), "--out", str(PACKAGED_DEMO / "adapter")], "the adapter"),
    (["record-routing", "--model", str(PACKAGED_DEMO), "--out", str(PACKAGED_DEMO / "routing-trace.json")],
     "the routing file"),
])
def test_writing_into_the_packaged_demo_is_refused(argv, what, capsys, monkeypatch):
    """The README says to train on a copy of the demo: a command whose output would land
    inside the packaged one (the installed package) is refused before it runs, naming the
    path and saying to copy the model first."""
    import edge0.engine
    import edge0.train.distill
    import edge0.train.heads
    import edge0.train.recipe
    import edge0.train.sft
    from edge0.train import adapter_init

    for module, name in ((edge0.train.heads, "train_heads"), (edge0.train.distill, "run_distill"),
                         (edge0.train.sft, "run_sft"), (edge0.train.recipe, "run_recipe"),
                         (adapter_init, "init_adapter"), (edge0.engine, "Engine")):
        monkeypatch.setattr(module, name, _never)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"edge0: error: {what}" in err and "is inside the demo model that ships in the package" in err
    assert f"copy the model first (cp -r {PACKAGED_DEMO} DIR)" in err


def test_training_from_the_demo_into_another_path_is_not_refused(tmp_path, monkeypatch):
    import edge0.train.heads

    monkeypatch.setattr(edge0.train.heads, "train_heads", _never)
    with pytest.raises(_Ran):
        main(["train", "heads", "--model", str(PACKAGED_DEMO), "--out", str(tmp_path / "h.safetensors")])


@pytest.mark.parametrize("command", [["generate"], ["record-routing", "--out", "r.json"], ["plan"]])
def test_a_weights_file_as_model_says_model_takes_a_folder(command, capsys):
    """`--model model.safetensors` said "cannot inspect: Not a directory"."""
    weights = PACKAGED_DEMO / "model.safetensors"
    assert main([*command, "--model", str(weights)]) == 2
    err = capsys.readouterr().err
    assert f"edge0: error: {weights} is a file, not a model folder: a model (--model) is a folder holding " \
           f"config.json and its .safetensors weights; give the folder that holds it ({PACKAGED_DEMO})" in err
    from edge0 import ConfigError

    with pytest.raises(ConfigError, match="is a file, not a model folder"):
        Engine(weights)


def test_the_prompt_cache_runs_two_stats_lines_count_the_same_prompt_tokens(tiny_model_factory, tmp_path, capsys):
    """mlx_lm.generate's `Prompt: N tokens` counts the tokens prefilled (the cache holds the
    rest); Edge0's own line said the whole prompt's (9 against 11): both count the prefilled
    ones now, and Edge0's says how many more the cache held."""
    import re

    from mlx_lm.utils import load_model

    from tests.test_prompt_cache_file import _cache_file

    tiny = tiny_model_factory("qwen3_moe")
    ref, _ = load_model(tiny)
    with Engine(tiny) as e:
        prefix = e.encode("import os\n\n\ndef read_lines(path):")
    path = _cache_file(ref, prefix, tmp_path / "c.safetensors", str(tiny))
    assert main(["generate", "--prompt-cache-file", path, "--prompt", "    with open(path) as f:", "--max-tokens", "3",
                 "--ignore-chat-template"]) == 0
    out = capsys.readouterr().out
    theirs = int(re.search(r"^Prompt: (\d+) tokens,", out, re.M).group(1))
    ours = re.search(r"prefill [\d.]+ tok/s \((\d+) tok, (\d+) more from the prompt cache\)", out)
    assert ours is not None, out
    assert int(ours.group(1)) == theirs and int(ours.group(2)) == len(prefix)


def test_the_oracle_recipe_with_adapter_off_records_and_replays_the_base_without_a_warning(tmp_path, capsys):
    """README's record-routing, then the staged replay, on the demo (heads and an adapter
    trained under them): as the README wrote them, both warned adapter.without_heads (the
    heads are off for the oracle, the adapter is not). With --adapter off on both (the
    corrected lines), nothing warns and the replay writes the base's exact text."""
    out = str(tmp_path / "routing.json")
    common = ["--model", str(PACKAGED_DEMO), "--prompt", "def f(x):", "--max-tokens", "12"]
    assert main(["record-routing", *common, "--out", out]) == 0
    assert "adapter.without_heads" in capsys.readouterr().err  # the lines as the README wrote them
    assert main(["record-routing", *common, "--adapter", "off", "--out", out]) == 0
    replay_flags = ["--decode-path", "staged", "--oracle-file", out, "--prefill-path", "whole_layer"]
    assert main(["generate", *common, "--adapter", "off", *replay_flags]) == 0
    replay = capsys.readouterr()
    assert "adapter.without_heads" not in replay.err and "warning" not in replay.err, replay.err
    assert main(["generate", *common, "--adapter", "off", "--prerouter", "off"]) == 0
    exact = capsys.readouterr().out
    text = lambda out: out.split("==========")[1]  # noqa: E731
    assert text(replay.out) == text(exact)
