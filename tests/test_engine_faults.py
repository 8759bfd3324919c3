"""Engines dropped unclosed, opens that fail half-way, a routing mismatch, files changed
under a running engine: each leaves nothing behind and never poisons the next request."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from edge0 import CheckpointError, ConfigError, Engine, EngineConfig
from edge0.errors import RoutingMismatchError
from tests.test_async_misuse import CONFIGS, PROMPT, N, edge0_threads, fds_under, open_fds, setups  # noqa: F401


def test_unclosed_engines_do_not_keep_python_from_exiting(setups):
    """Sync and async, every path: the process exits promptly without close()."""
    script = textwrap.dedent("""
        import sys, anyio
        from edge0 import Engine, EngineConfig
        from edge0.exec.oracle import OracleRouting
        d, kind = sys.argv[1], sys.argv[2]
        cfg = {"exact": EngineConfig(), "hot": EngineConfig(decode_path="hot"),
               "whole_layer": EngineConfig(decode_path="whole_layer", prefill_path="whole_layer"),
               "staged+heads": EngineConfig()}[kind]
        engine = Engine(d, cfg)
        for _ in engine.stream("def f(x):", max_tokens=3):
            pass
        async def main():
            cm = Engine.open(d, cfg)
            e = await cm.__aenter__()   # never exited
            async for _ in e.generate("def f(x):", max_tokens=3):
                break
        anyio.run(main)
        print("done", flush=True)
    """)
    for kind in ("exact", "hot", "whole_layer", "staged+heads"):
        d = setups[kind][0]
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", script, str(d), kind], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, (kind, out.stderr[-2000:])
        assert "done" in out.stdout
        assert time.perf_counter() - t0 < 60, kind


def test_garbage_collected_engine_releases_threads_and_files(setups):
    """Counted by what the engine itself holds: its threads and the checkpoint's files (a
    descriptor count alone also moves when earlier tests' garbage is collected)."""
    d, cfg, _, _ = setups["staged+heads"]
    gc.collect()
    threads, fds = edge0_threads(), open_fds()
    assert fds_under(d) == []
    engine = Engine(d, cfg)
    list(engine.stream(PROMPT, max_tokens=3))
    assert edge0_threads() > threads and fds_under(d)
    del engine
    gc.collect()
    deadline = time.time() + 10
    while (edge0_threads() != threads or fds_under(d) or open_fds() > fds) and time.time() < deadline:
        time.sleep(0.05)
    assert (edge0_threads(), fds_under(d)) == (threads, [])
    assert open_fds() <= fds  # nothing else it opened (event loop, pipes) is left either


def test_failed_opens_leak_no_file_descriptors(setups, tmp_path):
    from tests.ckpt_tools import copy_model

    d = copy_model(setups["exact"][0], tmp_path / "m")
    (d / "tokenizer.json").write_text("{ not json")
    gc.collect()  # earlier tests' garbage closed now, not during the count
    before, threads = open_fds(), edge0_threads()
    for _ in range(30):
        with pytest.raises(Exception):
            Engine(d)
    assert fds_under(d) == []
    assert open_fds() == before and edge0_threads() == threads


def test_routing_mismatch_does_not_poison_the_engine(setups):
    d, cfg, oracle, expected = setups["staged+oracle"]
    with Engine(d, EngineConfig(**{**cfg.__dict__, "expert_source": "slots"}), oracle=oracle) as engine:
        with pytest.raises(RoutingMismatchError):
            list(engine.stream("x = [1, 2, 3]\nprint(x)\n", max_tokens=N))
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
        assert engine.resources()["pinned_slots"] == 0


def _data_region(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    return 8 + n, os.path.getsize(path)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("overwrite", ["data", "whole file"])
def test_file_overwritten_under_a_running_engine(setups, tmp_path, config, overwrite):
    """Same-size overwrite with random bytes, then the original restored: nothing corrupt is
    served after the restore, on any path. An overwritten header is a typed error."""
    from tests.ckpt_tools import copy_model

    d0, cfg, oracle, expected = setups[config]
    d = copy_model(d0, tmp_path / "m")
    if (d0 / "prerouter.safetensors").exists():
        from edge0.train.heads import make_warm_heads

        make_warm_heads(d, d / "prerouter.safetensors", width=32)
    shard = d / "model.safetensors"
    original = shard.read_bytes()
    start, end = _data_region(shard) if overwrite == "data" else (0, len(original))
    noise = np.random.default_rng(0).integers(0, 256, end - start, dtype=np.uint8).tobytes()
    with Engine(d, cfg, oracle=oracle) as engine:
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
        with open(shard, "r+b") as f:
            f.seek(start)
            f.write(noise)
        os.utime(shard, ns=(time.time_ns(), time.time_ns() + 1))
        if overwrite == "data":
            try:  # garbage experts: any output, or a typed error; never a crash
                list(engine.stream(PROMPT, max_tokens=N))
            except (RoutingMismatchError, ConfigError):
                pass
        else:
            with pytest.raises(CheckpointError, match="header differs"):
                list(engine.stream(PROMPT, max_tokens=N))
        shard.write_bytes(original)
        os.utime(shard, ns=(time.time_ns(), time.time_ns() + 2))
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
        assert engine.resources()["pinned_slots"] == 0


@pytest.mark.parametrize("source", ["slots", "mapping"])
def test_read_error_invalidates_cached_experts(setups, tmp_path, source):
    """A read that fails mid-request (file truncated) fails the request with a typed error;
    once the file is whole again, every cached expert is read anew (over the mapping: the
    file is mapped anew)."""
    from edge0.errors import ExpertReadError
    from tests.ckpt_tools import copy_model

    d0, cfg, _, expected = setups["hot"]
    d = copy_model(d0, tmp_path / "m")
    shard = d / "model.safetensors"
    original = shard.read_bytes()
    with Engine(d, EngineConfig(**{**cfg.__dict__, "expert_source": source})) as engine:
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
        with open(shard, "r+b") as f:
            f.truncate(len(original) // 2)
        with pytest.raises(ExpertReadError):
            list(engine.stream(PROMPT, max_tokens=N))
        if source == "slots":
            assert all(s != "ready" for t in engine.streaming.hot.tables.values() for s in t.state)
        shard.write_bytes(original)
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected


def test_threads_of_closed_engines_are_gone(setups):
    """Every engine's threads end with it, but its compute thread, which goes back to a
    pool that never grows past the number of engines open at once (MLX keeps an OS thread
    for every thread that ever used it, so threads are reused rather than replaced)."""
    before = edge0_threads()
    idle_before = sum(1 for t in threading.enumerate() if t.name == "edge0-idle")  # earlier tests' pool
    tasks = len(os.listdir("/proc/self/task"))
    for _ in range(3):
        for name in CONFIGS:
            d, cfg, oracle, _ = setups[name]
            with Engine(d, cfg, oracle=oracle) as e:
                list(e.stream(PROMPT, max_tokens=3))
    assert edge0_threads() == before
    idle = [t for t in threading.enumerate() if t.name == "edge0-idle"]
    assert len(idle) == max(idle_before, 1)  # one engine open at a time: the pool is reused, not grown
    assert len(os.listdir("/proc/self/task")) <= tasks + 4  # OS threads do not grow with engines opened
