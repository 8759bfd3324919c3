"""The expert cache: expert bytes kept beside the slots, filled by the reads they make anyway.

Through the engine on every path (exact, hot, whole-layer, staged with heads under replace
and select, staged on an oracle), sync and async: the tokens equal the cache-off tokens, and
a second generation is served from the cache. The cache never holds more than its budget;
its bytes are the file's; a failed read never enters it; a changed checkpoint empties it;
its policies evict what they say. Every engine here reads its experts into buffers
(``expert_source="slots"``): over the checkpoint's mapping nothing is read and no cache is
planned (tests/test_expert_source.py)."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from edge0 import Engine, EngineConfig, ExpertReadError
from edge0.io_sched.expert_cache import LRU, ExpertCache, LFUAging
from tests.test_async_misuse import CONFIGS, N, PROMPT, setups  # noqa: F401
from tests.test_read_faults import Faults


def _assert_entries_are_the_files(cache: ExpertCache, index, limit: int | None = None) -> None:
    """Each cached expert's bytes (its tensors' rows one after the other) are the file's."""
    for layer, expert in list(cache.entries)[:limit]:
        want = b""
        for loc in index.layers[layer].tensors:
            with open(loc.file, "rb") as f:
                f.seek(loc.offset + expert * loc.row_bytes)
                want += f.read(loc.row_bytes)
        assert cache.row(layer, expert).tobytes()[:len(want)] == want


@pytest.mark.parametrize("config", list(CONFIGS))
def test_tokens_equal_with_the_cache_on_and_off_and_the_second_generation_is_served_from_it(setups, config):
    d, cfg, oracle, expected = setups[config]
    with Engine(d, EngineConfig(**{**cfg.__dict__, "expert_source": "slots", "cache_mb": 0}), oracle=oracle) as off:
        assert off.streaming.reader.cache is None
        assert [e.token for e in off.stream(PROMPT, max_tokens=N)] == expected
    with Engine(d, EngineConfig(**{**cfg.__dict__, "expert_source": "slots", "cache_mb": 64}), oracle=oracle) as on:
        stats = on.streaming.reader.stats
        assert [e.token for e in on.stream(PROMPT, max_tokens=N)] == expected
        disk, hits = stats.bytes, stats.cache_hits
        assert disk > 0

        async def again():
            return [e.token async for e in on.generate(PROMPT, max_tokens=N) if e is not None]

        assert asyncio.run(again()) == expected
        if config != "whole_layer":  # whole-layer reads whole tensors: not through the cache
            assert stats.cache_hits > hits and stats.bytes - disk < disk
        m = on.metrics()
        assert m.expert_cache_hits == stats.cache_hits and m.expert_cache_bytes == on.streaming.reader.cache.nbytes


def test_a_small_cache_never_holds_more_than_its_budget_and_serves_the_files_bytes(setups):
    d, _, _, expected = setups["exact"]
    with Engine(d, EngineConfig(expert_source="slots", cache_mb=1, cache_policy="lru")) as engine:
        reader = engine.streaming.reader
        assert reader.cache.budget == 2**20
        per = max(layer.expert_bytes for layer in engine.streaming.index.layers.values())
        cache = reader.cache = ExpertCache(2**18, "lru", per)  # a quarter of the experts this tiny model reads
        seen = []
        keep = cache.keep

        def watched(*args):
            keep(*args)
            seen.append(cache.nbytes)

        cache.keep = watched
        assert [e.token for e in engine.stream(PROMPT, max_tokens=N)] == expected
        assert seen and max(seen) <= cache.budget and cache.evictions > 0
        _assert_entries_are_the_files(cache, engine.streaming.index, limit=8)
        assert reader.stats.cache_hits > 0


def test_a_failed_read_is_not_cached_and_a_changed_checkpoint_empties_the_cache(setups, tmp_path):
    from tests.ckpt_tools import copy_model

    d, _, _, expected = setups["exact"]
    model = copy_model(d, tmp_path / "m")
    with Engine(model, EngineConfig(expert_source="slots", cache_mb=64)) as engine:
        cache, reader = engine.streaming.reader.cache, engine.streaming.reader
        reader.pread = Faults("persistent_eio")
        with pytest.raises(ExpertReadError):
            list(engine.stream(PROMPT, max_tokens=N))
        assert cache.entries == {} and cache.nbytes == 0
        reader.pread = os.preadv
        assert [e.token for e in engine.stream(PROMPT, max_tokens=N)] == expected
        assert cache.entries
        shard = engine.streaming.index.files[0]
        st = os.stat(shard)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # changed in place, as far as Edge0 can tell
        disk = reader.stats.bytes
        assert [e.token for e in engine.stream(PROMPT, max_tokens=N)] == expected
        assert reader.stats.bytes > disk  # read again from the disk: nothing kept from before the change


def test_the_stats_line_and_metrics_name_the_cache(setups):
    d, _, _, _ = setups["exact"]
    with Engine(d, EngineConfig(expert_source="slots", cache_mb=64, cache_policy="lru")) as engine:
        list(engine.stream(PROMPT, max_tokens=N))
        _, stats = engine.generate_text(PROMPT, max_tokens=N)
        assert "| expert cache " in stats.line() and "(lru, 64 MiB)" in stats.line()
        assert stats.decode_cache_hits > 0 and stats.decode_cache_bytes > 0
        from edge0.server.metrics import Metrics

        text = Metrics().render(engine.metrics(), loaded=True)
        assert f"expert_cache_hits_total {float(engine.metrics().expert_cache_hits)}" in text
    with Engine(d, EngineConfig(expert_source="slots", cache_mb=0)) as engine:
        _, stats = engine.generate_text(PROMPT, max_tokens=N)
        assert "expert cache" not in stats.line() and stats.expert_cache is None


class _Rows:
    def __init__(self, n: int, width: int):
        self.host = np.zeros((n, width), dtype=np.uint8)


def _fill(cache: ExpertCache, layer: int, experts: list[int], width: int = 100) -> None:
    """A read of ``experts`` as the reader makes it: asked of the cache, then kept."""
    bufs = [_Rows(len(experts), width)]
    left, rows, _ = cache.serve(layer, experts, list(range(len(experts))), bufs)
    for i, e in enumerate(experts):
        bufs[0].host[i] = e
    cache.keep(layer, left, rows, bufs)


def test_the_budget_holds_and_each_policy_evicts_what_it_says():
    lru = ExpertCache(300, "lru", 100)  # three experts of 100 bytes
    _fill(lru, 0, [1, 2, 3])
    out = [_Rows(1, 100)]
    assert lru.serve(0, [1], [0], out)[2] == 1 and out[0].host[0, 0] == 1  # 1 is now the most recent
    _fill(lru, 0, [4])
    assert sorted(lru.entries) == [(0, 1), (0, 3), (0, 4)] and lru.nbytes == 300
    lfu = ExpertCache(300, "lfu", 100)
    _fill(lfu, 0, [1, 2, 3])
    for _ in range(3):
        lfu.serve(0, [1, 3], [0, 0], [_Rows(1, 100)])
    _fill(lfu, 0, [4])  # 2 was used least
    assert sorted(lfu.entries) == [(0, 1), (0, 3), (0, 4)] and lfu.nbytes <= 300
    lfu.serve(0, [4, 4, 4], [0, 0, 0], [_Rows(1, 100)])  # 4 asked for again: the victim is now 1 or 3
    _fill(lfu, 0, [5])  # asked for once, against four times for the victim: not copied
    assert (0, 5) not in lfu.entries and lfu.refused == 1
    small = ExpertCache(50, "lfu", 100)  # less than one expert: nothing is kept
    small.keep(0, [1], [0], [_Rows(1, 100)])
    assert small.entries == {} and small.nbytes == 0
    with pytest.raises(ValueError, match="cache policy 'fifo'"):
        ExpertCache(10, "fifo", 1)


def test_lfu_with_aging_lets_what_was_used_often_long_ago_go():
    p = LFUAging()
    for _ in range(5):
        p.touch("old")
    for step in range(20):  # a stream of new keys, each used twice, evicted in turn
        p.touch(f"k{step}")
        p.touch(f"k{step}")
        if step:
            victim = p.victim()
            p.remove(victim)
    assert "old" not in p._priority  # aged out: the age rose past its five uses
    q = LRU()
    for k in "abc":
        q.touch(k)
    q.touch("a")
    assert q.victim() == "b"


@pytest.mark.parametrize("direct_io", ["on", "off"])
def test_auto_keeps_a_cache_where_reads_bypass_the_page_cache(setups, direct_io):
    """cache_mb auto: a cache with direct reads (the page cache bypassed), within the memory the
    process may use; none with buffered reads (the page cache keeps what was read)."""
    from edge0.io_sched.direct import memory_limit

    d, _, _, _ = setups["exact"]
    with Engine(d, EngineConfig(expert_source="slots", direct_io=direct_io)) as engine:
        reader = engine.streaming.reader
        assert (reader.cache is not None) == reader.direct  # a filesystem refusing O_DIRECT reads buffered
        if reader.cache is not None:
            assert 0 < reader.cache.budget <= memory_limit() * 3 // 4


def test_an_automatic_cache_is_within_the_memory_left_and_none_when_too_small_to_pay(setups, monkeypatch):
    import edge0.exec.budget as budget
    import edge0.io_sched.direct as dio
    from edge0.plan import make

    d, _, _, _ = setups["exact"]
    auto = EngineConfig(expert_source="slots", direct_io="on")
    monkeypatch.setattr(budget, "process_rss", lambda: 100 * 2**20)  # the process itself, fixed
    plan = make(d, auto)["plan"]
    if not plan["direct"]:
        pytest.skip("this filesystem refuses O_DIRECT: an automatic cache is none with buffered reads")
    rest = plan["planned"] - plan["cache"]  # everything the plan holds but the cache
    held = plan["held"]
    for free, expected in ((held // 2, held // 2), (held * 3, held), (held // 20, 0)):  # half, all, a twentieth
        limit = rest + budget.MARGIN_MIN + free  # (an eighth of it is under the 1 GiB margin here)
        monkeypatch.setattr(budget, "memory_limit", lambda limit=limit: limit)
        monkeypatch.setattr(dio, "memory_limit", lambda limit=limit: limit)
        assert make(d, auto)["plan"]["cache"] == expected
        with Engine(d, auto) as engine:
            assert engine.streaming.plan.cache == expected
            assert (engine.streaming.reader.cache.budget if expected else engine.streaming.reader.cache) == (
                expected or None)
    assert make(d, EngineConfig(expert_source="slots", cache_mb=3))["plan"]["cache"] == 3 * 2**20


@pytest.mark.parametrize("config", ["staged+heads", "exact"])
def test_a_generation_cancelled_while_it_generates_leaves_the_cache_whole_and_the_resources_at_baseline(setups, config):
    d, cfg, oracle, expected = setups[config]
    with Engine(d, EngineConfig(**{**cfg.__dict__, "expert_source": "slots", "cache_mb": 64}), oracle=oracle) as engine:
        baseline = engine.resources()
        cache = engine.streaming.reader.cache

        async def cancelled():
            async def consume():
                async for e in engine.generate(PROMPT, max_tokens=N):
                    if e is not None:
                        await asyncio.sleep(0.2)  # the next steps run meanwhile
            task = asyncio.ensure_future(consume())
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(cancelled())
        assert engine.resources() == baseline and cache.nbytes <= cache.budget
        _assert_entries_are_the_files(cache, engine.streaming.index)  # every entry whole
        assert [e.token for e in engine.stream(PROMPT, max_tokens=N)] == expected


def test_the_cache_memory_is_mapped_when_the_cache_is_made():
    """Its pages are mapped at once (one madvise), not faulted in one by one during a step."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("MADV_POPULATE_WRITE is Linux's")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    probe = np.empty(3 * 4096, dtype=np.uint8)
    if libc.madvise(-(-probe.ctypes.data // 4096) * 4096, 4096, 23) != 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

    before = rss()
    cache = ExpertCache(64 * 2**20, "lfu", 2**20)
    assert cache.capacity == 64 and rss() - before >= 60 * 2**20
