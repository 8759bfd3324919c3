"""The README is a manual that runs as pasted: every command of its `bash` blocks and every
`python` block, from the root of a clone (a folder holding the clone's `src/` and
`teachers/`), with the set-up commands' environment on PATH; and the statements the code
can check (the architecture table in docs/MODELS.md and its count)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from edge0.model.families import SUPPORTED_MODEL_TYPES
from edge0.tiny.table import architecture_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MODELS = ROOT / "docs" / "MODELS.md"
sys.path.insert(0, str(ROOT / "tools"))
SETUP = "python3 -m venv .venv"
# commands that start something meant to run for hours: started here, checked to be running
LONG = ("edge0 train heads",)
WORKING = b"chunk/s]"  # its progress bar's rate: chunks are done
MAX_LINES = 300
SERVED = "localhost:8080"  # Python blocks that are clients of the README's server


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"^```{kind}\n(.*?)^```", README.read_text(), flags=re.M | re.S)


def _commands(block: str) -> list[str]:
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def _bash_blocks() -> list[str]:
    return [b for b in _blocks("bash") if SETUP not in b]


def _clone(tmp_path: Path) -> Path:
    """A folder laid out as the clone's root after the first set-up command: its package,
    teachers and the environment (`.venv`: the one running these tests), nothing else."""
    for name in ("src", "teachers"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    return tmp_path


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.pop("PYTHONPATH", None)
    return env


def _run(script: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_readme_is_a_short_manual():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    assert "edge0 demo" in text.split("## Set up", 1)[1].split("##", 1)[0]
    for placeholder in ("DIR", "ADAPTER_NAME", "path/to/", "SOME-MoE", "KEY_HERE"):
        for block in _blocks("bash") + _blocks("python"):
            assert placeholder not in block, (placeholder, block)


def test_setup_commands_are_the_ones_ci_runs():
    setup = [b.strip() for b in _blocks("bash") if SETUP in b]
    assert setup[0].endswith(".venv/bin/edge0 demo")
    ci = (ROOT / ".ci" / "run").read_text()
    assert setup[1] in ci


def _command_ids():
    return [f"{i}:{c[:40]}" for i, b in enumerate(_bash_blocks()) for c in _commands(b)[:1]]


@pytest.mark.parametrize("index", range(len(_bash_blocks())), ids=_command_ids())
def test_bash_block_runs_as_pasted(tmp_path, index):
    block = _bash_blocks()[index]
    cwd = _clone(tmp_path)
    if "edge0 serve" in block:
        return _server_block(block, cwd)
    for command in _commands(block):
        if command.startswith(LONG):
            _started(command, cwd)
            continue
        done = _run(command, cwd, timeout=300)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-4000:])
        assert "Traceback" not in done.stderr, (command, done.stderr[-4000:])


def _started(command: str, cwd: Path) -> None:
    """A training of hours: within 45 s it must get past loading and checking and show its
    work going (a rate on its progress bar: chunks done); then it is stopped."""
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", command], cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: proc.stdout.read1(4096), b"")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 45
    try:
        while proc.poll() is None and time.monotonic() < deadline and WORKING not in b"".join(out):
            time.sleep(0.2)
    finally:
        ended = proc.poll()
        if ended is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(5)
    text = b"".join(out).decode(errors="replace")
    assert ended is None, f"{command!r} ended ({ended}): {text[-3000:]}"
    assert "Traceback" not in text, text[-3000:]
    assert WORKING.decode() in text, f"{command!r} showed no progress in 45 s: {text[-3000:]}"


def _server_block(block: str, cwd: Path) -> None:
    """The server's block as one script (its `&` and `kill %1` are a shell's job control),
    with the README's Python clients run while the server is up; each answer is JSON without
    an error, and each client prints its reply."""
    clients = [b for b in _blocks("python") if SERVED in b]
    for i, client in enumerate(clients):
        (cwd / f"client{i}.py").write_text(client)
    lines = _commands(block)
    kill = lines.index("kill %1")
    script = "\n".join([*(f"{c}; echo" if c.startswith("curl") else c for c in lines[:kill]),
                        *(f"{sys.executable} client{i}.py" for i in range(len(clients))), *lines[kill:]])
    with socket.socket() as probe:  # the README's port: another server there would answer instead
        assert probe.connect_ex(("127.0.0.1", 8080)) != 0, "something already listens on port 8080"
    done = _run(script, cwd, timeout=300)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-4000:])
    assert "ready on http://127.0.0.1:8080" in done.stderr, done.stderr[-3000:]  # the README's server answered
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    curls = [c for c in lines if c.startswith("curl") and "/health" not in c]
    assert len(answers) == len(curls), done.stdout
    for answer in answers:
        assert "error" not in answer and answer.get("type") != "error", answer
    printed = [line for line in done.stdout.splitlines() if line.strip() and not line.startswith("{")]
    assert len(printed) >= len(clients), done.stdout


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_block_runs_as_pasted(tmp_path, index):
    block = _blocks("python")[index]
    if SERVED in block:
        pytest.skip("a client of the server: run while the server block's server is up")
    cwd = _clone(tmp_path)
    (cwd / "example.py").write_text(block)
    done = subprocess.run([sys.executable, "example.py"], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    assert done.stdout.strip()


def test_architecture_table_is_generated_from_the_code():
    from arch_table import rendered

    text = MODELS.read_text()
    assert rendered(text, architecture_table()) == text, "docs/MODELS.md's table out of date: python tools/arch_table.py"


def test_stated_count_is_the_tested_list():
    for path in (README, MODELS):
        counts = {int(n) for n in re.findall(r"(\d+) model types", path.read_text())}
        assert counts == {len(SUPPORTED_MODEL_TYPES)}, (path.name, counts)
    rows = re.findall(r"^\| `([^`]+)` \| `", MODELS.read_text(), flags=re.M)
    assert tuple(rows) == SUPPORTED_MODEL_TYPES
