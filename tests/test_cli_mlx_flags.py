"""``edge0 generate`` knows every flag of the installed ``mlx_lm.generate`` (honoured, or
refused with the reason), and a misspelt flag to any subcommand is answered by that
subcommand with the nearest spelling."""

from __future__ import annotations

import argparse

import pytest

from edge0.cli import PACKAGED_DEMO, build_parser, main
from edge0.cli_args import MLX_HONOURED, MLX_REFUSED


def _mlx_generate_actions():
    from mlx_lm.generate import setup_arg_parser

    return [a for a in setup_arg_parser()._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _generate_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["generate"]


def _sample_argv(action) -> list[str]:
    """The flag as an mlx_lm.generate command line would give it."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        return [flag]
    value = {int: "4", float: "0.5"}.get(action.type, "x")
    return [flag, value]


def test_every_mlx_lm_generate_flag_is_known_to_edge0_generate():
    """A flag mlx-lm adds turns this red until edge0 generate honours or refuses it."""
    ours = {s: a for a in _generate_parser()._actions for s in a.option_strings}
    for action in _mlx_generate_actions():
        for flag in action.option_strings:
            assert flag in ours, f"mlx_lm.generate's {flag} is unknown to edge0 generate"
            assert (ours[flag].nargs == 0) == (action.nargs == 0), f"{flag} takes a value in one and not the other"
    # the lists name only flags mlx_lm.generate has
    theirs = {s for a in _mlx_generate_actions() for s in a.option_strings}
    assert set(MLX_HONOURED) | set(MLX_REFUSED) <= theirs and not set(MLX_HONOURED) & set(MLX_REFUSED)


@pytest.mark.parametrize("action", _mlx_generate_actions(), ids=lambda a: a.option_strings[0])
def test_each_mlx_lm_generate_flag_parses_and_a_refused_one_says_why(action, capsys, monkeypatch):
    """Each flag, given as mlx_lm.generate takes it, parses; one Edge0 refuses stops before
    anything loads, exit status 2, naming the flag and the reason."""
    argv = _sample_argv(action)
    _generate_parser().parse_args(argv)  # no SystemExit: known, with mlx_lm.generate's arity
    flag = next(s for s in action.option_strings if s.startswith("--"))
    if flag not in MLX_REFUSED:
        return
    import edge0.engine

    monkeypatch.setattr(edge0.engine, "Engine", None)  # refused before an engine is made
    assert main(["generate", "--model", str(PACKAGED_DEMO), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"edge0: error: {flag}: {MLX_REFUSED[flag]}" in captured.err


def test_the_draft_flags_are_mlx_lm_s_and_a_missing_draft_model_is_named(capsys):
    for argv, named in ((["--draft-model", "no-such-dir"], "draft_model"), (["--num-draft-tokens", "0"], "num_draft")):
        assert main(["generate", "--model", str(PACKAGED_DEMO), "--prompt", "x", *argv]) == 2
        assert named in capsys.readouterr().err


@pytest.mark.parametrize("argv, usage, hint", [
    (["generate", "--max_tokens", "5"], "usage: edge0 generate", "--max_tokens: did you mean --max-tokens?"),
    (["generate", "--temperature", "0.5"], "usage: edge0 generate", "--temperature: did you mean --temp?"),
    (["demo", "--max-tokns", "5"], "usage: edge0 demo", "did you mean --max-tokens?"),
    (["serve", "--model", "m", "--prot", "8"], "usage: edge0 serve", "--prot: did you mean --port?"),
    (["train", "heads", "--model", "m", "--stepz", "3"], "usage: edge0 train heads", "did you mean --steps?"),
    (["bench", "--roundz", "2"], "usage: edge0 bench", "--roundz: did you mean --rounds?"),
    (["eval", "--model", "m", "--data", "d", "--max_tokens", "3"], "usage: edge0 eval", "did you mean --max-tokens?"),
])
def test_a_misspelt_flag_gets_its_subcommands_usage_and_the_nearest_spelling(argv, usage, hint, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(usage) and hint in err and "unrecognized arguments" in err
    assert "usage: edge0 [-h]" not in err


def test_under_mlx_launch_a_stray_argument_says_to_put_double_dash(capsys, monkeypatch):
    """`mlx.launch -n 2 edge0 generate ... --verbose false`: the launcher takes --verbose and
    hands edge0 a stray 'false'; edge0 says where it went."""
    monkeypatch.setenv("MLX_RANK", "0")
    with pytest.raises(SystemExit):
        main(["generate", "--model", "m", "false"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: false" in err and "put -- before the program" in err
    monkeypatch.delenv("MLX_RANK")
    with pytest.raises(SystemExit):
        main(["generate", "--model", "m", "false"])
    assert "mlx.launch" not in capsys.readouterr().err


def _generate(capsys, *argv) -> str:
    assert main(["generate", *argv]) == 0
    return capsys.readouterr().out


def test_xtc_flags_are_honoured(capsys):
    """--xtc-probability/--xtc-threshold sample as the engine's XTC does (the demo: a trained
    model, whose likeliest tokens are often above the threshold)."""
    from edge0 import Engine

    common = ["--model", str(PACKAGED_DEMO), "--prompt", "def f(x):", "--max-tokens", "16", "--temp", "1", "--seed",
              "3", "--verbose", "false"]
    xtc = _generate(capsys, *common, "--xtc-probability", "1", "--xtc-threshold", "0.1")
    plain = _generate(capsys, *common)
    with Engine(PACKAGED_DEMO) as e:
        want, _ = e.generate_text(e.prompt_ids("def f(x):"), max_tokens=16, temp=1.0, seed=3, xtc_probability=1.0,
                                  xtc_threshold=0.1)
    assert xtc == want + "\n" and xtc != plain


@pytest.fixture(scope="module")
def thinking_model(tiny_model_factory, tmp_path_factory):
    from tests.test_server_mlxlm import THINKING_TEMPLATE, _with_template

    return _with_template(tiny_model_factory("qwen3_moe"), tmp_path_factory.mktemp("thinking") / "m",
                          THINKING_TEMPLATE)


def test_chat_template_config_reaches_the_template(thinking_model, capsys):
    from edge0 import Engine, EngineConfig

    common = ["--model", str(thinking_model), "--prompt", "hi", "--max-tokens", "2", "--adapter", "off"]
    with Engine(thinking_model, EngineConfig(adapter="off")) as e:
        messages = [{"role": "user", "content": "hi"}]
        on = len(e.prompt_ids(messages=messages, template_kwargs={"enable_thinking": True}))
        off = len(e.prompt_ids(messages=messages, template_kwargs={"enable_thinking": False}))
    assert on != off
    for value, tokens in (("true", on), ("false", off)):
        out = _generate(capsys, *common, "--chat-template-config", f'{{"enable_thinking": {value}}}')
        assert f"Prompt: {tokens} tokens," in out, out


@pytest.mark.parametrize("config, why", [
    ("{nope", "--chat-template-config is not JSON"),
    ("[1]", "--chat-template-config must be a JSON object"),
    ('{"tools": []}', "'tools' is a parameter of the template renderer"),
    ('{"colour": "red"}', "'colour' is not a variable of this model's chat template"),
])
def test_a_bad_chat_template_config_is_refused_naming_it(thinking_model, config, why, capsys):
    assert main(["generate", "--model", str(thinking_model), "--prompt", "hi", "--chat-template-config", config]) == 2
    captured = capsys.readouterr()
    assert why in captured.err and captured.out == ""
