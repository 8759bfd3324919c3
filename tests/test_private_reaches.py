"""Modules talk through public names: no module reaches another object's private attribute
(``other._name``), but for third-party objects that have no public way, each listed here
with its reason; no class sets more than 15 attributes in ``__init__`` (dataclasses of plain
fields aside)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "edge0"

THIRD_PARTY = {  # (module, expression): why there is no public way
    ("benchmark/llama_cpp.py", "llm._ctx"): "llama-cpp-python exposes no public handle to its context's timings",
    ("server/command.py", "s._actions"): "argparse has no public list of a parser's actions (to restate defaults)",
    ("cli.py", "os._exit"): "the standard library's documented exit without the interpreter's finalization",
    ("backend/mlx/kernels/ops.py", "a._alpha"): "mlx-lm's SwigluOAI keeps its alpha and limit only as private members",
    ("backend/mlx/kernels/ops.py", "a._limit"): "mlx-lm's SwigluOAI keeps its alpha and limit only as private members",
    ("backend/mlx/kernels/ops.py", "a._approx"): "MLX's nn.GELU keeps which GELU it computes only as a private member",
}


def _reaches() -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            out[(rel, ast.unparse(node))] = node.lineno
    return out


def test_no_module_reaches_another_objects_private_attribute():
    reaches = {k: line for k, line in _reaches().items() if k not in THIRD_PARTY}
    assert reaches == {}, "\n".join(f"edge0/{m}:{line}: {expr}" for (m, expr), line in sorted(reaches.items()))
    assert set(THIRD_PARTY) <= set(_reaches()), "a listed reach is gone: take it off the list"


def _is_dataclass(cls: ast.ClassDef) -> bool:
    return any((isinstance(d, ast.Name) and d.id == "dataclass")
               or (isinstance(d, ast.Call) and getattr(d.func, "id", "") == "dataclass") for d in cls.decorator_list)


def _init_attributes(cls: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
            for n in ast.walk(fn):
                targets = n.targets if isinstance(n, ast.Assign) else \
                    [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else []
                for t in targets:
                    for e in [t, *(t.elts if isinstance(t, ast.Tuple) else [])]:
                        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                            names.add(e.attr)
    return names


def test_no_class_sets_more_than_15_attributes_in_init():
    over = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            n = len(_init_attributes(cls))
            if not _is_dataclass(cls) and n > 15:
                over[(rel, cls.name)] = n
    assert over == {}


PIPELINE_WIRING = {  # where a pipeline is wired when the model opens: the coordinator is chosen from it
    "loader.py": "opens the model: a rank's layers, heads and adapters, and the relayed embedding",
    "exec/budget.py": "the memory a rank's own tensors take, when the model opens",
    "coordinator.py": "the one place that knows",
}


def test_no_pipeline_checks_outside_the_coordinator():
    """The batch loop, the prefill, the rows, the engine and the commands ask the coordinator
    (``edge0.coordinator``) instead of checking whether there is a pipeline."""
    import re

    pattern = re.compile(r"\b(pipe|pipeline)\s+is\s+(not\s+)?None\b")
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in PIPELINE_WIRING:
            continue
        lines = [n for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
        if lines:
            found[rel] = lines
    assert found == {}, found
