"""Edge0's child processes import the same Edge0 as the process that starts them, even
when started from the folder a clone sits in (the working directory holds a folder named
``edge0``, which a child's ``python -m`` imported as a namespace package ``edge0``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge0.cli import main


@pytest.fixture
def beside_a_clone(tmp_path, monkeypatch):
    """The working directory is the folder a clone named ``edge0`` sits in, and nothing but
    the process's own import path says where Edge0 is (no PYTHONPATH for the children)."""
    clone = tmp_path / "edge0"
    (clone / "edge0").mkdir(parents=True)
    (clone / "edge0" / "__init__.py").write_text("")
    (clone / "README.md").write_text("a clone\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    return tmp_path


def test_bench_runs_from_the_folder_a_clone_sits_in(beside_a_clone, tmp_path_factory, capsys):
    from edge0.benchmark.checkpoint import make_bench_checkpoint
    from tests.test_bench import SMALL

    model = make_bench_checkpoint(tmp_path_factory.mktemp("bench") / "m", SMALL, seed=3)
    out = tmp_path_factory.mktemp("out")
    assert main(["bench", "--model", str(model), "--arms", "exact", "--rounds", "1", "--cache", "warm",
                 "--prompt-tokens", "6", "--decode-tokens", "2", "--out", str(out), "--no-progress",
                 "--no-chart"]) == 0
    results = json.loads(next(out.glob("*.json")).read_text())
    assert results, capsys.readouterr().err[-2000:]


def test_a_child_imports_this_processs_edge0(beside_a_clone):
    import subprocess

    import edge0
    from edge0.child_python import python_code, python_module

    code = "import edge0, sys; print(edge0.__file__); print(sys.argv[1:])"
    out = subprocess.run(python_code(code, "a", "b"), capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [edge0.__file__, "['a', 'b']"]
    # a module run as a program (`python -m site` prints its sys.path): this Edge0's folder on it, not the
    # working directory
    out = subprocess.run(python_module("site"), capture_output=True, text=True, check=True).stdout
    assert repr(str(Path(edge0.__file__).parent.parent)) in out and repr(str(beside_a_clone)) not in out


def test_a_script_beside_a_clone_imports_the_installed_edge0(tmp_path):
    """A script run from the folder a clone named ``edge0`` sits in (its folder first on the
    import path) imports the installed package, not the clone's folder: the package lives in
    the clone's ``src/``, so the clone's root is never a package named ``edge0``."""
    import subprocess
    import sys

    import edge0

    clone = Path(edge0.__file__).resolve().parents[2]
    assert (clone / "src" / "edge0" / "__init__.py").exists(), "the package is laid out under src/"
    beside = tmp_path / "projects"
    (beside / "edge0" / "src").mkdir(parents=True)  # a clone of the same layout, beside the script
    (beside / "script.py").write_text("import edge0\nfrom edge0 import Engine\nprint(edge0.__file__)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "script.py"], cwd=beside, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).resolve() != (beside / "edge0").resolve()
