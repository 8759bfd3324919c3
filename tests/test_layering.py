"""Core logic reaches the array library only through the backend facade."""

from __future__ import annotations

import ast
from pathlib import Path

import edge0

ROOT = Path(edge0.__file__).parent
# Checkpoint builders make checkpoints *with* mlx-lm's classes by design (tools, not the engine).
# Training (edge0/train/) runs mlx-lm's resident classes and MLX's autodiff by design.
EXEMPT = {"tiny/build.py", "benchmark/checkpoint.py"}
EXEMPT_DIRS = ("backend", "train")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_only_the_backend_imports_mlx():
    offenders = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in EXEMPT_DIRS or rel.as_posix() in EXEMPT:
            continue
        bad = {m for m in imported_modules(path) if m.split(".")[0] in ("mlx", "mlx_lm")}
        if bad:
            offenders[str(rel)] = sorted(bad)
    assert offenders == {}


def test_serving_path_imports_no_training_code():
    """Training imports the serving code (it trains on the served path), never the reverse:
    only the command line, the benchmark harness and edge0.train itself import edge0.train."""
    allowed = {"cli.py"}
    offenders = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("train", "benchmark") or rel.as_posix() in allowed:
            continue
        bad = {m for m in imported_modules(path) if m == "edge0.train" or m.startswith("edge0.train.")}
        if bad:
            offenders[str(rel)] = sorted(bad)
    assert offenders == {}


def test_spec_and_header_reader_need_no_array_library():
    for name in ("spec.py", "safetensors_header.py", "checkpoint.py", "errors.py", "config.py"):
        mods = imported_modules(ROOT / name)
        assert not {m for m in mods if m.split(".")[0] in ("mlx", "mlx_lm", "numpy", "edge0.backend")}, name
        assert "edge0.backend" not in mods, name


def test_public_surface():
    assert set(edge0.__all__) == {
        "CheckpointError", "ConfigError", "Edge0Error", "Engine", "EngineConfig", "ExpertReadError",
        "ForeignArtifactError", "GenerationStats", "HeaderError", "LayoutError", "MoESpec", "SUPPORTED_MODEL_TYPES",
        "SamplingParams", "TokenEvent", "TokenizerError", "UnsafeModelError", "UnsupportedModelError", "generate",
        "load_spec",
    }
    for name in edge0.__all__:
        assert hasattr(edge0, name), name


def test_importing_the_package_and_the_cli_loads_no_array_library():
    """So that the command line starts (and answers Ctrl-C) before MLX loads."""
    import subprocess
    import sys

    code = "import edge0, edge0.cli, sys; print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
