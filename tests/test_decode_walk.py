"""docs/ARCHITECTURE.md names every Edge0 module one batched staged decode step enters: a
real step (the demo, two rows, staged with its heads and adapter) is traced on every thread
the engine runs it on (the compute thread, the scheduler's loop, the readers) and its
modules compared with the list. The application's own thread, here the main thread whose
event loop consumes the tokens, is not the step: what it does with a token handed out is
its own, and runs whenever it gets to it. The trace runs in a fresh process, so that every
thread the engine uses (its compute thread too, which a process reuses across engines)
starts under the profiler."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md"

TRACE = r'''
import asyncio, json, sys, threading
from edge0 import Engine, EngineConfig
from edge0.batch import Batcher
from edge0.cli import PACKAGED_DEMO

entered, tracing, seen = set(), threading.Event(), []

def profile(frame, event, *_):
    if event == "call" and tracing.is_set() and threading.current_thread() is not threading.main_thread():
        name = frame.f_globals.get("__name__", "")
        if name.startswith("edge0"):
            entered.add(name)

step = Batcher._decode_step

def traced_step(self):  # the third step of two rows decoding together is traced
    if len(self.rows) == 2:
        seen.append(1)
    if len(seen) == 3 and len(self.rows) == 2:
        tracing.set()
    try:
        return step(self)
    finally:
        tracing.clear()

Batcher._decode_step = traced_step
threading.setprofile(profile)
sys.setprofile(profile)
with Engine(PACKAGED_DEMO, EngineConfig(max_batch=2, expert_source=sys.argv[1])) as engine:
    async def both():
        async def one(prompt):
            return [e async for e in engine.generate(prompt, max_tokens=8) if e is not None]
        return await asyncio.gather(one("import os\n"), one("def f(x):"))
    out = asyncio.run(both())
sys.setprofile(None)
threading.setprofile(None)
print(json.dumps({"entered": sorted(entered), "tokens": [len(o) for o in out], "steps": len(seen)}))
'''


def _documented(block: str) -> set[str]:
    text = DOC.read_text()
    part = text[text.index(f"<!-- {block}:begin -->"):text.index(f"<!-- {block}:end -->")]
    return set(re.findall(r"`(edge0(?:\.\w+)*)`", part))


@pytest.mark.parametrize("source,block,most", [("slots", "decode-step-modules", 16),
                                               ("mapping", "decode-step-modules-mapped", 14)])
def test_the_documented_modules_are_the_ones_a_staged_decode_step_enters(tmp_path, source, block, most):
    """Over slots (the reads' modules) and over the checkpoint's mapping (none of them)."""
    r = subprocess.run([sys.executable, "-c", TRACE, source], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    entered = set(result["entered"])
    assert result["tokens"] == [8, 8] and result["steps"] >= 3
    assert "edge0.exec.staged" in entered and "edge0.prerouter.runtime" in entered  # staged, with heads
    documented = _documented(block)
    assert entered == documented, (f"entered, not in the doc: {sorted(entered - documented)}; "
                                   f"in the doc, not entered: {sorted(documented - entered)}")
    assert len(entered) <= most, sorted(entered)  # twelve, the slot tables' own module and the batch value's
