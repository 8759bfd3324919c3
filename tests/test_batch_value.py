"""The batch as a value (``edge0.decoding.Batch``): its rows, KV cache and what the prerouter
heads observed of each row's sequence belong to it, and only it changes them; the
prerouter keeps nothing of any sequence (a flush is a function of the batch's ``Observed``)."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import mlx.core as mx
import pytest

from edge0 import Engine
from edge0.decoding import Batch, Decoder
from edge0.exec.staged import Stager
from edge0.prerouter.runtime import Observed

ROOT = Path(__file__).resolve().parents[1] / "src"
PROMPTS = ["def add(a, b):\n    return", "x = [i * i for i in range(10)]\nprint(", "class Point:\n    def"]


def _assignments(attrs: set[str]) -> dict[str, set[str]]:
    """attribute -> the modules of edge0 that assign it (``x.attr = ...``, augmented too)."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "edge0").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and sub.attr in attrs:
                        found.setdefault(sub.attr, set()).add(str(path.relative_to(ROOT)))
    return found


def _calls(names: set[str]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / "edge0").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names:
                found.setdefault(node.func.attr, set()).add(str(path.relative_to(ROOT)))
    return found


def test_only_the_batch_assigns_its_state():
    """The batch's rows, cache and heads' state are assigned in its own module alone; the
    loop's ``batch`` and ``joining`` in the loop's alone; a batch cache is extended or
    filtered by the batch alone."""
    found = _assignments({"_rows", "_cache", "_heads", "batch", "joining"})
    assert {a: found.get(a) for a in ("_rows", "_cache", "_heads")} == {a: {"edge0/decoding.py"}
                                                                       for a in ("_rows", "_cache", "_heads")}
    assert found.get("batch") == {"edge0/batch.py"}
    assert found.get("joining") == {"edge0/batch.py"}
    calls = _calls({"extend_batch_cache", "filter_batch_cache"})
    assert calls == {"extend_batch_cache": {"edge0/decoding.py"}, "filter_batch_cache": {"edge0/decoding.py"}}
    batch = Batch()
    for name in ("rows", "cache", "heads"):
        with pytest.raises(AttributeError):
            setattr(batch, name, None)


@pytest.fixture(scope="module")
def heads_model(tiny_model_factory, tmp_path_factory):
    """A tiny qwen3_moe with warm-start heads beside it."""
    from edge0.train.heads import make_warm_heads
    from tests.ckpt_tools import copy_model

    d = copy_model(tiny_model_factory("qwen3_moe"), tmp_path_factory.mktemp("batch-value") / "m")
    make_warm_heads(d, d / "prerouter.safetensors", width=32)
    return d


def _state(obj) -> dict:
    return {k: id(v) for k, v in vars(obj).items()}


def test_the_prerouter_keeps_nothing_of_the_sequences_and_the_batch_keeps_a_row_each(heads_model, monkeypatch):
    """Rows join and leave a batch decoding with heads: the prerouter's attributes never
    change; at every step the batch's ``Observed`` has one row per row of the batch, in its
    order; a step planned ahead for a batch that changed since is planned again; each
    row's tokens are those it gets alone."""
    d = heads_model
    lengths = (64, 4, 8)  # the first row still decoding when the others arrive
    with Engine(d) as engine:
        alone = [[ev.token for ev in engine.stream(p, max_tokens=n, temp=0.0)] for p, n in zip(PROMPTS, lengths)]
    sizes, replans = [], []
    step = Decoder.step
    replan = Stager._replan
    monkeypatch.setattr(Stager, "_replan", lambda stager: (replans.append(stager.now.step), replan(stager))[1])

    def watched(decoder, batch):
        heads = batch.heads
        if heads is not None and heads.last:
            sizes.append((len(batch), {int(x.shape[0]) for x, _ in heads.last.values()}))
        return step(decoder, batch)

    monkeypatch.setattr(Decoder, "step", watched)
    with Engine(d) as engine:
        pre = engine.streaming.prerouter
        assert pre is not None
        before = _state(pre)

        async def one(prompt, delay, n):
            await asyncio.sleep(delay)
            return [ev.token async for ev in engine.generate(prompt, max_tokens=n, temp=0.0) if ev is not None]

        async def main():
            return await asyncio.gather(*(one(p, 0.02 * i, n) for i, (p, n) in enumerate(zip(PROMPTS, lengths))))

        together = asyncio.run(main())
        assert _state(pre) == before
    assert together == alone
    assert any(n >= 2 for n, _ in sizes)  # rows decoded together
    assert all(rows == {n} for n, rows in sizes), sizes
    assert replans  # a row joined (or left) after the step before had planned this one


def test_observed_joins_selects_and_splits_by_row():
    """Joining two values puts the second's rows after the first's; selecting keeps the
    rows named, in that order; a value without a previous step joins with -1 rows."""
    a = Observed({3: (mx.array([[1.0], [2.0]]), mx.array([[0, 1], [2, 3]]))}, {3: mx.array([[4, 5], [6, 7]])})
    b = Observed({3: (mx.array([[9.0]]), mx.array([[8, 9]]))}, {})
    both = Observed.join([a, b])
    assert both.last[3][0].reshape(-1).tolist() == [1.0, 2.0, 9.0]
    assert both.prev[3].tolist() == [[4, 5], [6, 7], [-1, -1]]
    picked = both.select([2, 0])
    assert picked.last[3][1].tolist() == [[8, 9], [0, 1]] and picked.prev[3].tolist() == [[-1, -1], [4, 5]]
    assert both.seen([3]) and not both.seen([3, 4])


def test_one_sequence_through_the_step_model_keeps_its_own_heads_state(heads_model):
    """A caller of ``StepModel`` that gives no heads' state (one sequence: tools, the
    benchmark) has the step model keep it from call to call; a new sequence's first chunk,
    on an empty cache, starts from nothing observed."""
    from edge0 import EngineConfig
    from edge0.backend import core as B
    from edge0.backend import nn as bnn
    from edge0.loader import load_streaming_model
    from edge0.streaming import StepModel

    s = load_streaming_model(heads_model, EngineConfig())
    try:
        model = StepModel(s)
        owners = s.prerouter.owners
        cache = bnn.make_cache(model)
        B.eval(model(B.array([[5, 6, 7]]), cache=cache))
        B.eval(model(B.array([[8]]), cache=cache))
        assert model.observed.seen(owners) and all(model.observed.prev.get(o) is not None for o in owners)
        cache = bnn.make_cache(model)
        B.eval(model(B.array([[9]]), cache=cache, decode=False))  # a one-token prompt
        assert model.observed.seen(owners) and not any(model.observed.prev.get(o) is not None for o in owners)
    finally:
        s.close()
