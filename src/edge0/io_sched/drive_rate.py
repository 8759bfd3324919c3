"""The drive's read rate at a plan's request sizes, idle and beside a step's compute, and a
memory copy's rate: what ``edge0.speed`` forecasts a token's reads from."""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path

DRIVE_BYTES = 256 * 2**20  # what a drive measurement reads (each pass)
IDLE_PASSES = 3  # passes of DRIVE_BYTES read idle
IDLE_STEPS = 5  # steps of products timed idle before the reads beside them, and again after
BUSY_STEPS, BUSY_PASSES = 5, 4  # read passes beside the products until this many steps ran beside them (at most)


def drive_key(path: Path) -> dict:
    """The drive under ``path``: the kernel's name for its block device, and its model."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    name = None
    try:
        name = Path(os.path.realpath(f"/sys/dev/block/{major}:{minor}")).name
        parent = Path(os.path.realpath(f"/sys/dev/block/{major}:{minor}")).parent.name
        if (Path("/sys/block") / parent).exists():
            name = parent  # a partition: the whole disk
    except OSError:
        pass
    model = None
    if name:
        try:
            model = Path(f"/sys/block/{name}/device/model").read_text().strip()
        except OSError:
            pass
    return {"device": name or f"{major}:{minor}", "model": model}


def _expert_ranges(index, seed: int) -> list[tuple[str, int, int]]:
    """``DRIVE_BYTES`` of random experts' byte ranges: each expert tensor's rows, as a reader
    reads them."""
    rng = random.Random(seed)
    layers = sorted(index.layers)
    ranges, total = [], 0
    while total < DRIVE_BYTES:
        layer = index.layers[rng.choice(layers)]
        e = rng.randrange(index.spec.num_experts)
        for t in layer.tensors:
            ranges.append((str(t.file), t.offset + e * t.row_bytes, t.row_bytes))
            total += t.row_bytes
    return ranges


def _read_ranges(ranges, threads: int, direct: bool) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, bytes) of reading ``ranges`` with ``threads`` threads into
    page-aligned buffers faulted in before (as slots), the page cache bypassed (O_DIRECT, else
    the ranges dropped from it first). Each thread reads its share of the ranges in one task,
    as the engine's readers do (a task a read costs the process 2-3x the CPU here)."""
    import mmap
    import resource
    from concurrent.futures import ThreadPoolExecutor

    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    try:
        fds = {p: os.open(p, flags) for p in {r[0] for r in ranges}}
    except OSError:  # a filesystem that refuses O_DIRECT (tmpfs) is read buffered
        fds = {p: os.open(p, os.O_RDONLY) for p in {r[0] for r in ranges}}
    for p, off, n in ranges:
        os.posix_fadvise(fds[p], off, n, os.POSIX_FADV_DONTNEED)
    threads = max(1, threads)
    size = max((((off + n + 4095) & ~4095) - (off & ~4095) for _, off, n in ranges), default=4096)
    bufs = [mmap.mmap(-1, size) for _ in range(threads)]
    for buf in bufs:
        buf.write(b"\1" * size)

    def read(part: int) -> int:
        view, got = memoryview(bufs[part]), 0
        for p, off, n in ranges[part::threads]:
            start, end = off & ~4095, (off + n + 4095) & ~4095
            got += os.preadv(fds[p], [view[: end - start]], start)
        return got

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    try:
        with ThreadPoolExecutor(threads) as pool:
            c0, t0 = cpu(), time.perf_counter()
            got = max(1, sum(pool.map(read, range(threads))))
            return time.perf_counter() - t0, cpu() - c0, got
    finally:
        for fd in fds.values():
            os.close(fd)


def drive_seconds_per_byte(index, threads: int, direct: bool, busy=None) -> dict:
    """The drive at the plan's request sizes (``_read_ranges``), the median of ``IDLE_PASSES``
    passes over other experts each, each pass's experts read twice. ``fresh``: seconds a byte
    read the first time; ``wall``: the same bytes read again (a drive's own cache, or a
    virtual disk's host's, may hold them: a decode re-reads the experts it used before, a
    prompt reads its experts once); ``cpu``: this process's CPU seconds a byte read again
    (user and system, its threads' too); ``fresh_busy``: seconds a byte of other experts read
    the first time while a step's products run over and over on the cores, as staged reads
    run beside the compute (``busy()``: made and run in a thread of its own, as MLX's arrays
    belong to the thread that made them, returns what runs one step); ``compute_busy``: how much longer
    a step's products take while those reads run than idle (the median step beside the reads
    over the median of ``IDLE_STEPS`` steps just before and after them, so that a drift of
    the machine's speed falls on both)."""
    import threading

    first, again = [], []
    for seed in range(IDLE_PASSES):
        ranges = _expert_ranges(index, seed)
        first.append(_read_ranges(ranges, threads, direct))
        again.append(_read_ranges(ranges, threads, direct))
    wall = statistics.median(w / n for w, _, n in again)  # a drive shared with others varies: medians
    fresh = statistics.median(w / n for w, _, n in first)
    out = {"fresh": fresh, "wall": wall,
           "cpu": statistics.median(c / n for _, c, n in again), "fresh_busy": fresh, "compute_busy": 1.0}
    if busy is None:
        return out
    ready, reading, stop, failed = threading.Event(), threading.Event(), threading.Event(), []
    alone: list[float] = []
    beside: list[float] = []

    def load():
        try:
            step = busy()
            step()  # once before the reads start: the products' first run allocates and warms
            alone.extend(_timed(step) for _ in range(IDLE_STEPS))
            ready.set()
            while not stop.is_set():
                started = reading.is_set()
                took = _timed(step)
                if started and reading.is_set():  # the reads ran for the whole step
                    beside.append(took)
            alone.extend(_timed(step) for _ in range(IDLE_STEPS))
        except BaseException as e:  # said where the reads wait for it
            failed.append(e)
            ready.set()
    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        ready.wait()
        if failed:
            raise failed[0]
        wall = got = 0
        for seed in range(IDLE_PASSES, IDLE_PASSES + BUSY_PASSES):  # more passes while too few steps ran beside them
            reading.set()  # other experts than the idle passes', read the first time
            w, _, n = _read_ranges(_expert_ranges(index, seed), threads, direct)
            wall, got = wall + w, got + n
            if len(beside) >= BUSY_STEPS:
                break
    finally:
        reading.clear()
        stop.set()
        worker.join()
    if failed:
        raise failed[0]
    out["fresh_busy"] = wall / got
    if beside and alone:
        out["compute_busy"] = max(1.0, statistics.median(beside) / statistics.median(alone))
    return out


def _timed(step) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def copy_seconds_per_byte() -> float:
    """A memory copy's rate (an expert out of the expert cache or the page cache into a slot)."""
    import numpy as np

    src = np.ones(64 * 2**20, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / src.nbytes
