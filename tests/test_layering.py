"""The shape of the package: core logic reaches the array library only through the backend
facade, serving never imports training, the import graph (imports inside functions
included) has no circle, and no module or function outgrows a reader."""

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


MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the edge0 modules it imports, at module level or inside functions, relative
    imports resolved; ``from package import name`` counts the submodule when ``name`` is one.
    Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``: those implicit edges are
    not counted (a package's ``__init__`` that imports its own submodules would otherwise be a
    circle by definition); an explicit ``import edge0`` or ``from edge0 import x`` is."""
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                submodules = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in paths}
                targets.update(submodules)
                if len(submodules) < len(node.names):  # a name of the package itself, not only its modules
                    targets.add(base)
        edges = set()
        for t in targets:
            while t and t not in paths:
                t = t.rpartition(".")[0]
            if t and t != name:
                edges.add(t)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_circle():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_the_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    edges = import_graph()
    assert "edge0.model.open" in edges["edge0.loader"]
    assert "edge0.tiny" in edges["edge0.cli"]  # imported inside cmd_make_tiny: counted too


def test_no_module_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_function_over_80_lines():
    long = {}
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = n
    assert long == {}


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
    for name in ("model/spec.py", "model/safetensors_header.py", "model/checkpoint.py", "errors.py", "config.py"):
        mods = imported_modules(ROOT / name)
        assert not {m for m in mods if m.split(".")[0] in ("mlx", "mlx_lm", "numpy", "edge0.backend")}, name
        assert "edge0.backend" not in mods, name


def test_public_surface():
    assert set(edge0.__all__) == {
        "CheckpointError", "ConfigError", "Edge0Error", "Engine", "EngineConfig", "ExpertReadError",
        "ForeignArtifactError", "GenerationStats", "HeaderError", "LayoutError", "MoESpec", "SUPPORTED_MODEL_TYPES",
        "SamplingParams", "TokenEvent", "TokenizerError", "UnsafeModelError", "UnsupportedModelError", "generate",
        "load_prompt_cache", "load_spec",
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
