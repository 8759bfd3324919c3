"""Disk faults while serving, on every path: injected EIO, EINTR, short reads and latency.

Transient faults are retried (bounded) and the output is the fault-free output; a
persistent fault fails the request with a typed ``ExpertReadError`` and the engine serves
the next request correctly once the fault is gone; latency never deadlocks and every
wait is logged with its layer."""

from __future__ import annotations

import errno
import json
import os
import threading
import time

import pytest

from edge0 import Engine, EngineConfig, ExpertReadError
from tests.test_async_misuse import CONFIGS, N, PROMPT, setups  # noqa: F401


class Faults:
    """A pread that misbehaves on purpose: transient kinds fail the first attempt at every
    ``every``-th distinct offset (the retry then succeeds), ``persistent_eio`` fails always."""

    def __init__(self, kind: str, every: int = 3, delay: float = 0.0):
        self.kind, self.every, self.delay = kind, every, delay
        self.calls = 0
        self.injected = 0
        self._seen: set = set()
        self._lock = threading.Lock()

    def _first_attempt(self, fd, offset) -> bool:
        with self._lock:
            self.calls += 1
            if (fd, offset) in self._seen:
                return False
            self._seen.add((fd, offset))
            return len(self._seen) % self.every == 1

    def __call__(self, fd, buffers, offset):
        first = self._first_attempt(fd, offset)
        if self.delay:
            time.sleep(self.delay)
        if self.kind == "persistent_eio" or (self.kind in ("eio", "eintr") and first):
            self.injected += 1
            code = errno.EINTR if self.kind == "eintr" else errno.EIO
            raise OSError(code, f"injected {errno.errorcode[code]}")
        if self.kind == "short" and len(buffers[0]) > 1:
            half = len(buffers[0]) // 2
            if len(buffers[0]) % 4096 == 0:  # a direct read's: short by whole blocks, as a device's
                half -= half % 4096
            if half:
                self.injected += 1
                return os.preadv(fd, [buffers[0][:half]], offset)
        return os.preadv(fd, buffers, offset)


def over_slots(cfg: EngineConfig) -> EngineConfig:
    """``cfg`` with every path reading its experts into its buffers (what these tests fault)."""
    return EngineConfig(**{**cfg.__dict__, "expert_source": "slots"})


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind", ["eio", "eintr", "short"])
def test_transient_faults_are_retried_and_output_is_unchanged(setups, config, kind):
    d, cfg, oracle, expected = setups[config]
    cfg = over_slots(cfg)
    with Engine(d, cfg, oracle=oracle) as engine:
        faults = Faults(kind)
        engine.reader.pread = faults
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
        assert faults.injected > 0
        assert engine.resources()["pinned_slots"] == 0


@pytest.mark.parametrize("config", list(CONFIGS))
def test_persistent_fault_fails_the_request_not_the_engine(setups, config):
    d, cfg, oracle, expected = setups[config]
    cfg = over_slots(cfg)
    with Engine(d, cfg, oracle=oracle) as engine:
        engine.reader.pread = Faults("persistent_eio")
        with pytest.raises(ExpertReadError, match="injected EIO") as err:
            list(engine.stream(PROMPT, max_tokens=N))
        assert err.value.layer is not None and err.value.file
        engine.reader.pread = os.preadv
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
        assert engine.resources() == {"generations": 0, "pinned_slots": 0, "pending_reads": 0,
                                      "open_files": engine.reader.open_files}


def test_latency_is_logged_and_never_deadlocks(setups, capsys):
    d, _, _, expected = setups["staged+heads"]
    cfg = EngineConfig(log_format="json", log_level="debug", expert_source="slots")
    with Engine(d, cfg) as engine:
        engine.reader.pread = Faults("none", delay=0.02)
        t0 = time.perf_counter()
        tokens = [ev.token for ev in engine.stream(PROMPT, max_tokens=N)]
        assert tokens == expected and time.perf_counter() - t0 < 120
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    waits = [e for e in events if e.get("event") == "stage.wait"]
    reads = [e for e in events if e.get("event") == "io.read"]
    assert waits and all("layer" in e and "ms" in e for e in waits)
    assert reads and all(e["bytes"] > 0 and "layer" in e and "ms" in e for e in reads)
    assert max(e["ms"] for e in reads) >= 20  # the injected latency shows in the events


def test_requests_that_need_no_reads_do_not_wait_on_slow_disk(setups):
    """A hot set holding every expert serves a request without a single read, however slow
    the disk has become."""
    d, _, _, expected = setups["exact"]
    with Engine(d, EngineConfig(decode_path="hot", prefill_path="hot", hot_experts=64,
                                expert_source="slots")) as engine:
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
        faults = Faults("none", delay=0.5)
        engine.reader.pread = faults
        t0 = time.perf_counter()
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
        assert faults.calls == 0 and time.perf_counter() - t0 < 5


@pytest.mark.parametrize("kernels", ["edge0", "mlx"])
@pytest.mark.parametrize("config", ["staged+heads", "staged+oracle"])
def test_slow_reads_are_waited_for_inside_the_step(setups, config, kernels):
    """A staged layer's wait for its slots is an op of the step's graph (the thread that
    builds the step never waits): with every read 20 ms late, every op that reads the slots
    (MLX's cast of their scales included, on its own kernels) still runs after the reads, so
    each token's log-probability is the same number as with a fast disk."""
    d, cfg, oracle, _ = setups[config]
    cfg = EngineConfig(**{**cfg.__dict__, "kernels": kernels, "expert_source": "slots"})

    def run(delay):
        with Engine(d, cfg, oracle=oracle) as engine:
            assert engine.streaming.stager.pool.flags.in_graph
            if delay:
                engine.reader.pread = Faults("none", delay=delay)
            events = list(engine.stream(PROMPT, max_tokens=N, logprobs=True))
            return [(ev.token, ev.logprob) for ev in events], events[-1].stats.stall_ms_per_step

    fast, _ = run(0.0)
    slow, stall = run(0.02)
    assert slow == fast
    assert stall > 5  # the waits happened, and were counted
