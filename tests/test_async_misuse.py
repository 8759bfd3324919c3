"""The async API under misuse, on every path, under asyncio and trio.

Each test leaves a generation early by one route (``break``, ``aclosing``, ``fail_after``,
task cancellation, an exception in the loop body, two consumers at once) and then checks
that the engine is as good as new: the next greedy generation equals a fresh engine's,
and generations, pinned slots, reads in flight, the engine's threads and open file
descriptors are back to what they were before.
"""

from __future__ import annotations

import gc
import os
from contextlib import aclosing

import anyio
import pytest

from edge0 import Engine, EngineConfig

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
N = 10
LONG = 200  # the generations a misuse leaves early; the oracle covers them all

CONFIGS = {
    "exact": dict(),
    "hot": dict(decode_path="hot", hot_experts=6),
    "whole_layer": dict(decode_path="whole_layer", prefill_path="whole_layer"),
    "staged+heads": dict(),  # warm-start heads beside the checkpoint: consumers decode staged
    "staged+select": dict(routing="select", stage_extra=2),  # the same heads, select routing
    "staged+oracle": dict(decode_path="staged"),
}


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(scope="module")
def setups(tiny_model_factory, tmp_path_factory):
    """config name -> (model dir, EngineConfig, oracle or None, the fresh engine's tokens)."""
    from edge0.train.heads import make_warm_heads
    from tests.ckpt_tools import copy_model

    base = tiny_model_factory("qwen3_moe")
    with_heads = copy_model(base, tmp_path_factory.mktemp("heads") / "m")
    make_warm_heads(with_heads, with_heads / "prerouter.safetensors", width=32)
    with Engine(base) as e:
        oracle = e.record_routing(PROMPT, max_tokens=LONG)
    out = {}
    for name, kwargs in CONFIGS.items():
        d = with_heads if name in ("staged+heads", "staged+select") else base
        cfg = EngineConfig(**kwargs)
        orc = oracle if name == "staged+oracle" else None
        with Engine(d, cfg, oracle=orc) as e:
            if name in ("staged+heads", "staged+select"):
                assert e.streaming.stager is not None and e.streaming.prerouter is not None
                assert e.streaming.routing == (("select", 2) if name == "staged+select" else ("replace", 0))
            expected = [ev.token for ev in e.stream(PROMPT, max_tokens=N)]
        out[name] = (d, cfg, orc, expected)
    return out


def edge0_threads() -> int:
    """Threads working for open engines (compute threads back in the pool excluded)."""
    from edge0.worker import busy_threads

    return busy_threads()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fds_under(path) -> list[str]:
    """The files under `path` this process holds open."""
    root, held = str(os.path.realpath(path)), []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed while listing
            continue
        if target.startswith(root + os.sep):
            held.append(target)
    return held


def baseline(engine) -> dict:
    return {"resources": engine.resources(), "threads": edge0_threads(), "fds": open_fds()}


async def leave_by_break(engine):
    async for i, _ in aenumerate(engine.generate(PROMPT, max_tokens=N)):
        if i == 2:
            break


async def leave_by_aclosing(engine):
    async with aclosing(engine.generate(PROMPT, max_tokens=N)) as gen:
        async for i, _ in aenumerate(gen):
            if i == 2:
                break


async def leave_by_fail_after(engine):
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.05):
            async for _ in engine.generate(PROMPT, max_tokens=LONG):
                await anyio.sleep(0.01)  # a slow consumer: the deadline falls mid-generation on any machine


async def leave_by_task_cancellation(engine):
    started = anyio.Event()

    async def consume():
        async for i, _ in aenumerate(engine.generate(PROMPT, max_tokens=LONG)):
            if i == 1:
                started.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await started.wait()
        tg.cancel_scope.cancel()


async def leave_by_exception(engine):
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async for i, _ in aenumerate(engine.generate(PROMPT, max_tokens=N)):
            if i == 2:
                raise Boom


async def two_consumers(engine, expected):
    got = {}

    async def consume(key):
        got[key] = [ev.token async for ev in engine.generate(PROMPT, max_tokens=N)]

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume, "a")
        tg.start_soon(consume, "b")
    assert got["a"] == expected and got["b"] == expected


async def aenumerate(agen):
    i = 0
    async for item in agen:
        yield i, item
        i += 1


MISUSES = {
    "break": leave_by_break,
    "aclosing": leave_by_aclosing,
    "fail_after": leave_by_fail_after,
    "task_cancellation": leave_by_task_cancellation,
    "exception": leave_by_exception,
}


@pytest.mark.anyio
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("misuse", [*MISUSES, "two_consumers"])
async def test_engine_is_as_new_after_misuse(setups, config, misuse):
    d, cfg, oracle, expected = setups[config]
    with anyio.fail_after(120):
        engine = await anyio.to_thread.run_sync(lambda: Engine(d, cfg, oracle=oracle))
        try:
            first = [ev.token async for ev in engine.generate(PROMPT, max_tokens=N)]
            assert first == expected
            before = baseline(engine)
            if misuse == "two_consumers":
                await two_consumers(engine, expected)
            else:
                await MISUSES[misuse](engine)
                gc.collect()  # an abandoned generator is finalized (its job cancelled) here
            again = [ev.token async for ev in engine.generate(PROMPT, max_tokens=N)]
            assert again == expected
            await wait_for(lambda: baseline(engine) == before, what=lambda: (baseline(engine), before))
        finally:
            await anyio.to_thread.run_sync(engine.close)


async def wait_for(predicate, what, timeout: float = 10.0):
    """Poll a condition that settles asynchronously (a cancelled job ending on its thread)."""
    with anyio.fail_after(timeout):
        while not await anyio.to_thread.run_sync(predicate):
            await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_sync_and_async_generations_interleave(setups):
    d, cfg, _, expected = setups["staged+heads"]
    with anyio.fail_after(120):
        async with Engine.open(d, cfg) as engine:
            sync_tokens = await anyio.to_thread.run_sync(
                lambda: [ev.token for ev in engine.stream(PROMPT, max_tokens=N)])
            async_tokens = [ev.token async for ev in engine.generate(PROMPT, max_tokens=N)]
    assert sync_tokens == async_tokens == expected


def test_sync_break_leaves_engine_usable(setups):
    d, cfg, _, expected = setups["staged+heads"]
    with Engine(d, cfg) as engine:
        before = engine.resources()
        for i, _ in enumerate(engine.stream(PROMPT, max_tokens=N)):
            if i == 2:
                break
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
        assert engine.resources() == before


def test_readme_async_example_runs_staged_with_heads(setups):
    """The README's Engine.open + engine.generate example, with prerouter heads present
    (staged decode switches on by itself)."""
    d, _, _, expected = setups["staged+heads"]

    async def main():
        async with Engine.open(d, EngineConfig(bundle_capacity=16)) as engine:
            return [event.token async for event in engine.generate(PROMPT, max_tokens=N, temp=0.0)]

    assert anyio.run(main) == expected


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # both event loops: the matrix above
@pytest.mark.parametrize("config", ["exact", "staged+select"])
@pytest.mark.parametrize("misuse", list(MISUSES))
async def test_a_misuse_inside_a_batch_leaves_the_other_rows_as_they_were(setups, config, misuse):
    """Each misuse while two other generations decode in the same batch: theirs are the
    tokens of a generation alone, and the engine comes back to its state before."""
    d, cfg, oracle, expected = setups[config]
    with anyio.fail_after(120):
        engine = await anyio.to_thread.run_sync(lambda: Engine(d, cfg, oracle=oracle))
        try:
            assert [ev.token async for ev in engine.generate(PROMPT, max_tokens=N)] == expected
            before = baseline(engine)
            got = {}

            async def full(key):
                got[key] = [ev.token async for ev in engine.generate(PROMPT, max_tokens=N)]

            async with anyio.create_task_group() as tg:
                tg.start_soon(full, "a")
                tg.start_soon(MISUSES[misuse], engine)
                tg.start_soon(full, "b")
            gc.collect()
            assert got == {"a": expected, "b": expected}
            await wait_for(lambda: baseline(engine) == before, what=lambda: (baseline(engine), before))
        finally:
            await anyio.to_thread.run_sync(engine.close)
