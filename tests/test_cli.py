"""The edge0 command line, run as a user would run it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from edge0.cli import main


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "edge0", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_generate_streams_text_and_stats(tiny_model_factory):
    d = tiny_model_factory("qwen3_moe")
    r = run_cli("generate", "--model", str(d), "--prompt", "def f(x):", "--max-tokens", "8", "--ignore-chat-template")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("==========\ndef f(x):")
    assert "prefill" in out and "decode" in out and "tok/s" in out
    assert "peak MLX active" in out and "peak RSS" in out and "MiB/token" in out
    assert "qwen3_moe, 4 MoE layers x 16 experts, k=4" in out
    import re  # mlx_lm.generate's lines, as scripts that parse them expect them, before Edge0's own

    lines = out.splitlines()
    at = lines.index("==========", 1)
    assert re.fullmatch(r"Prompt: \d+ tokens, \d+\.\d{3} tokens-per-sec", lines[at + 1]), lines[at + 1]
    assert re.fullmatch(r"Generation: 8 tokens, \d+\.\d{3} tokens-per-sec", lines[at + 2]), lines[at + 2]
    assert re.fullmatch(r"Peak memory: \d+\.\d{3} GB", lines[at + 3]), lines[at + 3]
    assert lines[at + 4].startswith("model: ") and lines[at + 5].startswith("prefill ")


def test_generate_missing_model_is_a_clear_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edge0: error: ") and "is not a model directory" in err


def test_bad_flag_value_is_a_clear_error(tiny_model_factory, capsys):
    d = tiny_model_factory("qwen3_moe")
    assert main(["generate", "--model", str(d), "--prompt", "x", "--top-p", "2"]) == 2
    assert "top_p must be a number in (0, 1], got 2.0" in capsys.readouterr().err


def test_make_tiny_then_generate(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["make-tiny", "mixtral", str(out), "--layers", "2", "--experts", "8", "--k", "2"]) == 0
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert main(["generate", "--model", str(out), "--prompt", "x = ", "--max-tokens", "4"]) == 0
    assert "mixtral, 2 MoE layers x 8 experts, k=2" in capsys.readouterr().out


def test_demo_streams_the_default_model(tmp_path):
    from edge0.cli import PACKAGED_DEMO, demo_model_dir

    env = {"EDGE0_CACHE": str(tmp_path / "cache")}
    first = run_cli("demo", "--max-tokens", "5", env=env)
    assert first.returncode == 0, first.stderr
    assert "tok/s" in first.stdout and "MiB/token" in first.stdout
    second = run_cli("demo", "--max-tokens", "5", env=env)
    assert second.returncode == 0 and "building" not in second.stderr
    assert second.stdout.split("==========")[1] == first.stdout.split("==========")[1]
    if (PACKAGED_DEMO / "config.json").exists():
        assert demo_model_dir() == PACKAGED_DEMO and "building" not in first.stderr
    else:
        assert "building a random demo model" in first.stderr


def test_demo_fallback_builds_a_random_model_once(tmp_path, monkeypatch):
    import edge0.cli as cli

    monkeypatch.setattr(cli, "PACKAGED_DEMO", tmp_path / "absent")
    monkeypatch.setenv("EDGE0_CACHE", str(tmp_path / "cache"))
    path = cli.demo_model_dir()
    assert path.parent == tmp_path / "cache" and (path / "config.json").exists()
    assert cli.demo_model_dir() == path


def test_eval_reports_perplexity(tiny_model_factory, tmp_path, capsys):
    d = tiny_model_factory("qwen3_moe")
    text = tmp_path / "heldout.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 20)
    assert main(["eval", "--model", str(d), "--teacher", str(d), "--data", str(text), "--max-tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "perplexity" in out and "top-1 agreement 1.0000" in out


def test_readme_oracle_example_on_the_demo_which_ships_heads(tmp_path):
    """record-routing then --oracle-file on the demo (which ships prerouter heads), without
    --adapter off (the adapter's warning aside, the replay still equals the exact path): the recording holds every MoE layer at every step, and the staged replay
    writes the text of the exact path without heads."""
    from edge0.cli import PACKAGED_DEMO

    d, out = str(PACKAGED_DEMO), str(tmp_path / "routing.json")
    r = run_cli("record-routing", "--model", d, "--prompt", "def f(x):", "--max-tokens", "12", "--out", out)
    assert r.returncode == 0, r.stderr
    import json

    steps = json.loads(open(out).read())["steps"]
    assert len(steps) == 12 and all(len(s) == 8 for s in steps)
    replay = run_cli("generate", "--model", d, "--prompt", "def f(x):", "--max-tokens", "12", "--decode-path",
                     "staged", "--oracle-file", out, "--prefill-path", "whole_layer")
    exact = run_cli("generate", "--model", d, "--prompt", "def f(x):", "--max-tokens", "12", "--prerouter", "off")
    assert replay.returncode == 0 and exact.returncode == 0, replay.stderr + exact.stderr
    text = lambda r: r.stdout.split("==========")[1]  # noqa: E731
    assert text(replay) == text(exact)


def test_recording_routing_where_heads_stage_the_layers_is_refused():
    import pytest

    from edge0 import ConfigError, Engine
    from edge0.cli import PACKAGED_DEMO

    with Engine(PACKAGED_DEMO) as e:
        with pytest.raises(ConfigError, match=r"layers decode elsewhere \(1: staged, 2: staged.*prerouter='off'"):
            e.record_routing("def f(x):", max_tokens=4)


HEAVY_MODULES = ("mlx", "mlx_lm", "transformers", "numpy", "starlette", "uvicorn", "structlog", "huggingface_hub")


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"], ["train", "sft", "--help"],
                                  ["bench", "--help"], ["eval", "--help"], ["demo", "--help"], ["plan", "--help"],
                                  ["generate", "--model"], ["generate", "--model", "m", "--temp", "hot"]])
def test_help_and_argument_errors_load_no_array_or_model_library(argv):
    """Every CLI call once cost about 3 s of CPU, --help included, because building the parser
    imported the training code and through it MLX, mlx-lm and transformers: help and
    argument errors now import none of them (about 0.1 s of CPU here)."""
    code = ("import sys\nfrom edge0.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            f"print(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip().splitlines()[-1] == "[]", (r.stdout[-500:], r.stderr[-500:])


def test_train_heads_shows_its_tracing_and_a_sane_first_rate(tiny_model_factory, tmp_path):
    """`edge0 train heads` said nothing while it traced (80 s on a real model) and its bar
    started at thousands of steps a second: it says it traces, with a bar per text, and the
    training bar's first line shows no rate yet (one comes from two reports)."""
    d = tiny_model_factory("qwen3_moe")
    r = run_cli("train", "heads", "--model", str(d), "--tokens", "1500", "--heldout-tokens", "300", "--steps", "6",
                "--out", str(tmp_path / "h.safetensors"))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stderr.replace("\r", "\n").splitlines() if line.strip()]
    said = next(i for i, line in enumerate(lines) if "tracing the model's routing on the train text" in line)
    traced = next(i for i, line in enumerate(lines) if line.startswith("tracing train:"))
    trained = next(i for i, line in enumerate(lines) if line.startswith("heads:"))
    assert said < traced < trained
    assert "?step/s" in lines[trained], lines[trained]


def test_a_progress_bar_rate_is_measured_between_reports(monkeypatch):
    """The bar counted its first step the moment it was made, and the loss it then showed
    redrew it with that step over a few microseconds: thousands of steps a second. Now the
    first report is the bar's start: no rate until the next report."""
    import io
    import re

    from edge0.train import console

    out = io.StringIO()
    monkeypatch.setattr(console.sys, "stderr", out)
    bar = console.Progress("x")
    bar(1, 10, 1.0)
    first = out.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    bar.close()
    assert "loss=1.0000" in first and "?step/s" in first, first
    assert not re.search(r"[0-9.]+step/s", first), first


def test_prefill_response_is_written_as_mlx_lm_writes_it(tiny_model_factory):
    """mlx_lm.generate's --prefill-response: the assistant's answer starts with it, in the
    chat template (continue_final_message), and the model continues it; without a chat
    template it is refused."""
    from mlx_lm.utils import load_tokenizer

    from edge0 import ConfigError, Engine

    d = tiny_model_factory("qwen3_moe")
    tok = load_tokenizer(d)
    messages = [{"role": "user", "content": "write f"}, {"role": "assistant", "content": "def f(x):"}]
    text = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True, add_generation_prompt=False)
    want = tok.encode(text, add_special_tokens=False)
    assert text.endswith("def f(x):")
    with Engine(d) as e:
        assert e.prompt_ids("write f", prefill_response="def f(x):") == want
        assert e.prompt_ids("write f") != want
        with pytest.raises(ConfigError, match=r"prefill_response \(the start of the answer; over HTTP, a last "
                                              r"assistant message\) needs the tokenizer's chat template"):
            e.prompt_ids("write f", chat_template=False, prefill_response="def f(x):")
    r = run_cli("generate", "--model", str(d), "--prompt", "write f", "--prefill-response", "def f(x):",
                "--max-tokens", "4")
    assert r.returncode == 0 and "Generation: 4 tokens" in r.stdout, r.stderr[-1000:]


def test_train_heads_says_when_the_adapter_beside_is_superseded(tmp_path):
    """New heads beside the demo's adapter (trained under the shipped heads): the engine
    refuses that adapter with them, and `train heads` says so, with what to do."""
    import shutil

    from edge0.cli import PACKAGED_DEMO

    d = tmp_path / "demo"
    shutil.copytree(PACKAGED_DEMO, d)
    r = run_cli("train", "heads", "--model", str(d), "--data", "model", "--tokens", "160", "--heldout-tokens", "40",
                "--steps", "2", "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"note: {d / 'adapter'} was trained under the heads these replace" in r.stderr + r.stdout
    refused = run_cli("generate", "--model", str(d), "--max-tokens", "2")
    assert refused.returncode != 0 and "trained under other prerouter heads" in refused.stderr
    assert run_cli("generate", "--model", str(d), "--max-tokens", "2", "--adapter", "off").returncode == 0
    aside = run_cli("train", "heads", "--model", str(d), "--data", "model", "--tokens", "160", "--heldout-tokens",
                    "40", "--steps", "2", "--no-progress", "--out", str(tmp_path / "h.safetensors"),
                    "--routing", "select", "--stage-extra", "2", "--over-memory", "select:0")
    assert aside.returncode == 0 and "note:" not in aside.stderr + aside.stdout  # nothing beside it changed
    from edge0.model.safetensors_header import read_header
    from edge0.prerouter.files import serving_of

    assert serving_of(read_header(tmp_path / "h.safetensors").metadata) == {
        "routing": "select", "stage_extra": 2, "over_memory": {"routing": "select", "stage_extra": 0}}
    bad = run_cli("train", "heads", "--model", str(d), "--data", "model", "--tokens", "600", "--steps", "4",
                  "--no-progress", "--out", str(tmp_path / "bad.safetensors"), "--over-memory", "select")
    assert bad.returncode == 2 and "'replace' or 'select:M'" in bad.stderr and not (tmp_path / "bad.safetensors").exists()
