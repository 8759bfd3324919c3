"""docs/ARCHITECTURE.md names every Edge0 module one batched staged decode step enters: a
real step (the demo, two rows, staged with its heads and adapter) is traced on every thread
and its modules compared with the list."""

from __future__ import annotations

import asyncio
import re
import sys
import threading
from pathlib import Path

from edge0 import Engine, EngineConfig
from edge0.batch import Batcher
from edge0.cli import PACKAGED_DEMO

DOC = Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md"


def _documented() -> set[str]:
    text = DOC.read_text()
    part = text[text.index("<!-- decode-step-modules:begin -->"):text.index("<!-- decode-step-modules:end -->")]
    return set(re.findall(r"`(edge0(?:\.\w+)*)`", part))


def test_the_documented_modules_are_the_ones_a_staged_decode_step_enters(monkeypatch):
    entered: set[str] = set()
    tracing = threading.Event()

    def profile(frame, event, *_):
        if event == "call" and tracing.is_set():
            name = frame.f_globals.get("__name__", "")
            if name.startswith("edge0"):
                entered.add(name)

    step = Batcher._decode_step
    seen = []

    def traced_step(self):  # the third step of two rows decoding together is traced
        if len(self.rows) == 2:
            seen.append(1)
        if len(seen) == 3 and len(self.rows) == 2:
            tracing.set()
        try:
            return step(self)
        finally:
            tracing.clear()

    monkeypatch.setattr(Batcher, "_decode_step", traced_step)
    threading.setprofile(profile)  # the threads the engine starts: compute, scheduler loop, readers
    sys.setprofile(profile)
    try:
        with Engine(PACKAGED_DEMO, EngineConfig(max_batch=2)) as engine:
            async def both():
                async def one(prompt):
                    return [e async for e in engine.generate(prompt, max_tokens=8) if e is not None]
                return await asyncio.gather(one("import os\n"), one("def f(x):"))
            out = asyncio.run(both())
    finally:
        threading.setprofile(None)
        sys.setprofile(None)
    assert all(len(o) == 8 for o in out) and len(seen) >= 3
    assert "edge0.exec.staged" in entered and "edge0.prerouter.runtime" in entered  # staged, with heads
    documented = _documented()
    assert entered == documented, (f"entered, not in the doc: {sorted(entered - documented)}; "
                                   f"in the doc, not entered: {sorted(documented - entered)}")
