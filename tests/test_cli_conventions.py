"""``edge0 generate`` as a user of mlx_lm.generate expects it: same text for the same
settings, chat templates, standard input, repo ids from the local hub cache, checks before
output, quiet Ctrl-C, and logs on every path."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def run(*args, env=None, input=None, tool=("edge0",)):
    cmd = [sys.executable, "-m", *(["edge0"] if tool == ("edge0",) else list(tool)), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, input=input,
                          env={**os.environ, **ENV, **(env or {})})


@pytest.fixture(scope="module")
def qwen(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


@pytest.mark.parametrize("extra", [[], ["--system-prompt", "You write Python."], ["--ignore-chat-template"]])
def test_verbose_false_prints_what_mlx_lm_generate_prints(qwen, extra):
    """Same dtype (the checkpoint's: bfloat16), same chat template, same text on stdout."""
    args = ["--model", str(qwen), "--prompt", "Write a function.", "--max-tokens", "16", *extra]
    theirs = run("generate", *args, "--verbose", "False", tool=("mlx_lm",))
    assert theirs.returncode == 0, theirs.stderr[-2000:]
    ours = run("generate", *args, "--verbose", "false", "--compute-dtype", "bfloat16")
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert ours.stdout == theirs.stdout and len(ours.stdout.strip()) > 0


def test_the_chat_template_is_applied_by_default(qwen):
    from edge0 import Engine

    with Engine(qwen) as e:
        templated = e.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                    add_generation_prompt=True)
        expected = e.generate_text(e.tokenizer.encode(templated, add_special_tokens=False), max_tokens=8)[0]
        raw = e.generate_text("hi", max_tokens=8)[0]
    out = run("generate", "--model", str(qwen), "--prompt", "hi", "--max-tokens", "8", "--verbose", "false")
    assert out.stdout == expected + "\n" and expected != raw


def test_prompt_dash_reads_standard_input(qwen):
    direct = run("generate", "--model", str(qwen), "--prompt", "def f(x):\n", "--max-tokens", "8", "--verbose", "f")
    piped = run("generate", "--model", str(qwen), "--prompt", "-", "--max-tokens", "8", "--verbose", "f",
                input="def f(x):\n")
    assert piped.returncode == 0 and piped.stdout == direct.stdout and direct.stdout.strip()


def test_values_are_checked_before_anything_is_printed(qwen):
    for bad, match in ((["--top-p", "2"], "top_p must be a number in (0, 1]"),
                       (["--top-k", "-2"], "top_k must be an integer in >= 0"),
                       (["--max-kv-size", "0"], "max_kv_size must be an integer in >= 1"),
                       (["--extra-eos-token", "not-a-single-token-at-all"], "is not a single token")):
        r = run("generate", "--model", str(qwen), "--prompt", "x", *bad)
        assert r.returncode == 2 and r.stdout == "" and match in r.stderr, (bad, r.stderr)


def test_prompt_longer_than_the_context_is_a_clear_error(qwen):
    r = run("generate", "--model", str(qwen), "--prompt", "x " * 5000, "--ignore-chat-template")
    assert r.returncode == 2 and "the model's context is 4096 tokens" in r.stderr and r.stdout == ""


def _fake_hub(root, repo: str, model_dir) -> None:
    """A Hugging Face hub cache as huggingface_hub lays it out: blobs, a snapshot of
    symbolic links into them, and refs/main."""
    org, name = repo.split("/")
    base = root / f"models--{org}--{name}"
    rev = "0123456789abcdef0123456789abcdef01234567"
    (base / "blobs").mkdir(parents=True)
    (base / "snapshots" / rev).mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(rev)
    for f in model_dir.iterdir():
        if f.is_file():
            data = f.read_bytes()
            blob = base / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            os.symlink(os.path.relpath(blob, base / "snapshots" / rev), base / "snapshots" / rev / f.name)


def test_repo_ids_resolve_from_the_local_hub_cache(qwen, tmp_path):
    hub = tmp_path / "hub"
    _fake_hub(hub, "tiny-org/tiny-moe", qwen)
    env = {"HF_HUB_CACHE": str(hub), "HF_HOME": str(tmp_path / "hf")}
    local = run("generate", "--model", str(qwen), "--prompt", "x", "--max-tokens", "6", "--verbose", "f")
    cached = run("generate", "--model", "tiny-org/tiny-moe", "--prompt", "x", "--max-tokens", "6", "--verbose", "f",
                 env=env)
    assert cached.returncode == 0, cached.stderr[-2000:]
    assert cached.stdout == local.stdout
    missing = run("generate", "--model", "tiny-org/absent", "--prompt", "x", env=env)
    assert missing.returncode == 2 and "is not in the local Hugging Face cache" in missing.stderr
    assert "`hf download tiny-org/absent`" in missing.stderr and "mlx_lm.convert" in missing.stderr
    quantized = run("generate", "--model", "mlx-community/Absent-MoE-4bit", "--prompt", "x", env=env)
    assert "`hf download mlx-community/Absent-MoE-4bit`" in quantized.stderr  # already int4: nothing to convert
    assert quantized.returncode == 2 and "mlx_lm.convert" not in quantized.stderr
    # the Python API resolves the same way
    code = ("from edge0 import Engine; from edge0.hub import resolve_model; "
            "e = Engine(resolve_model('tiny-org/tiny-moe')); print(e.spec.model_type); e.close()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **ENV, **env})
    assert r.stdout.strip() == "qwen3_moe", r.stderr[-2000:]


def test_ctrl_c_while_starting_exits_quietly(qwen):
    """SIGINT while the program is still importing: status 130, no traceback."""
    for delay in (0.3, 1.0):
        p = subprocess.Popen([sys.executable, "-m", "edge0", "generate", "--model", str(qwen), "--prompt", "x"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **ENV})
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
        if p.returncode == 0:  # finished before the signal: nothing to check at this delay
            continue
        assert p.returncode == 130, (delay, p.returncode, err[-2000:])
        assert "Traceback" not in err, err[-2000:]


def test_ctrl_c_inside_a_string_eval_still_exits_130(tmp_path):
    """A Ctrl-C that lands inside an eval() of a string (the namedtuple factory runs one, so
    an import can) is marked unhandled by CPython even when main() catches it; main() clears
    the mark, so the status is 130 and not death by SIGINT. Deterministic: the interrupt is
    raised from inside such an eval."""
    code = ("import sys, edge0.cli as c\n"
            "c._main = lambda argv: eval('(_ for _ in ()).throw(KeyboardInterrupt())')\n"
            "sys.exit(c.main([]))\n")
    (tmp_path / "interrupt_probe.py").write_text(code)  # run with -m, as `python -m edge0` runs
    r = subprocess.run([sys.executable, "-m", "interrupt_probe"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_debug_logs_cover_the_exact_path(qwen):
    r = run("generate", "--model", str(qwen), "--prompt", "x", "--max-tokens", "3", "--verbose", "f",
            "--log-format", "json", "--log-level", "debug", "--expert-source", "slots")
    events = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    reads = [e for e in events if e["event"] == "exact.read"]
    assert reads and all({"layer", "experts", "bytes", "ms"} <= set(e) for e in reads)


def test_help_texts(qwen):
    top = run("--help").stdout
    for command in ("generate", "demo", "record-routing", "eval", "train", "adapter", "make-tiny", "bench"):
        assert command in top
    g = run("generate", "--help").stdout
    assert "--layer-path LAYER:PHASE=PATH" in g and "((" not in g
    for flag in ("--prefill-path", "--log-level", "--top-k", "--min-p", "--extra-eos-token", "--max-kv-size",
                 "--system-prompt", "--ignore-chat-template", "--verbose"):
        assert flag in g, flag
    helps = {}
    for flag in ("--decode-path", "--prefill-path", "--log-format", "--log-level"):
        block = g.split(flag + " ")[-1].split("\n  --")[0]
        helps[flag] = block
    assert len(set(helps.values())) == 4  # each flag its own help
    for command in ("demo", "make-tiny"):
        h = run(command, "--help").stdout
        assert h.count("(default") >= 3, command
