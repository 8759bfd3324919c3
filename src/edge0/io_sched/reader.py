"""ExpertReader: positional reads of expert byte ranges straight into buffer rows.

One file descriptor per shard, opened once; ``os.preadv`` fills a NumPy view of device
memory, so bytes go from the page cache (or disk) into the tensor the kernel reads with
no intermediate copy. pread rather than mmap: a file truncated under an mmap is SIGBUS,
which cannot be caught; a short pread is an ordinary, typed error. With ``direct=True``
the reads bypass the page cache (O_DIRECT, ``edge0.io_sched.direct``) through a page-aligned
bounce buffer per thread; a file whose filesystem refuses O_DIRECT is read buffered (one
``io.direct_unavailable`` log line).

``SlotStore`` is the ``Store`` the scheduler reads through: an expert's rows into a slot.

``ExpertCache``: expert bytes kept in the process's memory beside the slots, keyed by
(layer, expert) and filled by the reads the buffers make anyway; the reader serves a cached
expert as a memory copy, not a read. It never holds more than its budget, only an expert
whose read completed enters it, and its policy (``POLICIES``: LFU with dynamic aging, or
LRU) chooses what leaves.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import heapq
import itertools
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from edge0.io_sched import direct as dio
from edge0.model.checkpoint import CheckpointIndex, TensorLocation
from edge0.errors import CheckpointError, ExpertReadError


@dataclass
class ReadStats:
    bytes: int = 0
    reads: int = 0
    seconds: float = 0.0  # wall time the caller spent waiting on reads
    in_place_reads: int = 0  # direct reads that landed in the rows' memory (no bounce copy)
    layer_bytes: dict = field(default_factory=dict)  # MoE layer -> bytes read of its experts
    cache_hits: int = 0  # experts served from the expert cache (memory copies, not reads)
    cache_bytes: int = 0  # their bytes (``bytes`` counts what came from the disk)

    def snapshot(self) -> "ReadStats":
        return ReadStats(self.bytes, self.reads, self.seconds, self.in_place_reads, dict(self.layer_bytes),
                         self.cache_hits, self.cache_bytes)

    def count(self, layer: int, nbytes: int, reads: int, seconds: float) -> None:
        self.bytes += nbytes
        self.reads += reads
        self.seconds += seconds
        self.layer_bytes[layer] = self.layer_bytes.get(layer, 0) + nbytes


class ExpertReader:
    """Reads rows of stacked expert tensors; safe to call from one thread at a time."""

    # errnos worth another try: interrupted, would block, or a transient device error
    RETRY_ERRNOS = (errno.EINTR, errno.EAGAIN, errno.EIO)

    def __init__(self, index: CheckpointIndex, threads: int = 2, *, retries: int = 2, log=None,
                 direct: bool = False):
        self.index = index
        self.retries = retries
        self.log = log
        self.pread = os.preadv  # replaced by fault-injection tests
        self._fds: dict[str, int] = {}
        self._identity: dict[str, tuple] = {}
        self._direct: dict[str, int] = {}  # file -> its O_DIRECT descriptor (direct reads)
        self._retired: list[int] = []  # O_DIRECT descriptors given up: closed by close(), never before
        self._bounce_only: set[str] = set()  # files whose in-place direct reads were refused
        self._bounce = dio.Bounce()
        self._pool = None
        self._lock = threading.Lock()
        ensure_descriptors(len(index.files) * (2 if direct else 1), what=f"the checkpoint's {len(index.files)} "
                           "weight files" + (" (two descriptors each with direct reads)" if direct else ""))
        try:
            for path in index.files:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                self._fds[path] = fd
                self._identity[path] = _identity(os.fstat(fd))
                if direct:
                    self._open_direct(path)
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="edge0-read") if threads > 1 else None
        self._threads = threads
        self.stats = ReadStats()
        self.cache: ExpertCache | None = None  # set when the engine keeps an expert cache

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for fd in [*self._fds.values(), *self._direct.values(), *self._retired]:
            os.close(fd)
        self._fds.clear()
        self._direct.clear()
        self._retired.clear()

    def _open_direct(self, path: str) -> None:
        fd = dio.open_direct(path)
        if fd is not None:
            self._direct[path] = fd
        elif self.log is not None:
            self.log.warning("io.direct_unavailable", file=path, action="buffered reads")

    def _buffered_from_now(self, path: str, error: OSError) -> None:
        """The filesystem took the O_DIRECT open but refuses its reads: buffered from now. The
        descriptor stays open until ``close``: another reader thread may be reading with it."""
        with self._lock:
            fd = self._direct.pop(path, None)
            if fd is not None:
                self._retired.append(fd)
        if fd is not None:
            if self.log is not None:
                self.log.warning("io.direct_unavailable", file=path, error=str(error), action="buffered reads")

    @property
    def direct(self) -> bool:
        """Whether reads bypass the page cache (every file opened with O_DIRECT)."""
        return bool(self._fds) and len(self._direct) == len(self._fds)

    @property
    def open_files(self) -> int:
        return len(self._fds)

    def changed_files(self) -> list[str]:
        """Shards whose bytes may have changed since they were opened or last checked
        (size or modification time of the open file differ). Each is checked again: a
        changed header is a ``CheckpointError`` (the expert byte ranges are stale); an
        unchanged one is accepted, and the caller forgets what it cached from the file.
        A file replaced by rename is not listed: the open descriptor still reads the file
        that was opened, consistently."""
        changed = []
        for path, fd in self._fds.items():
            now = _identity(os.fstat(fd))
            if now == self._identity[path]:
                continue
            header = self.index.header_of(path)
            try:
                raw = os.pread(fd, header.data_start, 0)
                same = len(raw) == header.data_start and hashlib.sha256(raw[8:]).hexdigest() == header.digest
            except OSError:
                same = False
            if not same:
                raise CheckpointError("the file changed under the running engine and its header differs from "
                                      "the one it was opened with; open the engine again", file=path)
            self._identity[path] = now
            changed.append(path)
        return changed

    def __enter__(self) -> "ExpertReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read_one(self, loc: TensorLocation, expert: int, view, layer: int, count: int = 1) -> int:
        """Experts ``expert`` .. ``expert + count - 1`` of one stacked tensor (adjacent in the
        file) into ``view`` (as many adjacent rows)."""
        start = loc.offset + expert * loc.row_bytes
        done, want = 0, loc.row_bytes * count
        mv = memoryview(view).cast("B")
        failures = in_place_reads = 0
        while done < want:
            direct = self._direct.get(loc.file)
            in_place = direct is not None and loc.file not in self._bounce_only
            try:
                if direct is not None:
                    bounce = self._bounce.get()
                    n = dio.read_in_place(self.pread, direct, bounce, mv[done:], start + done) if in_place else None
                    if n is not None:
                        in_place_reads += 1
                    else:
                        in_place = False
                        n = dio.read_direct(self.pread, direct, bounce, mv[done:], start + done)
                else:
                    n = self.pread(self._fds[loc.file], [mv[done:]], start + done)
            except OSError as e:
                if direct is not None and e.errno == errno.EINVAL:
                    if in_place:  # the device refuses this layout: the bounce buffer, then buffered
                        self._bounce_only.add(loc.file)
                    else:
                        self._buffered_from_now(loc.file, e)
                    continue
                failures += 1
                if e.errno in self.RETRY_ERRNOS and failures <= self.retries:
                    if self.log is not None:
                        self.log.warning("io.retry", file=loc.file, layer=layer, expert=expert + done // loc.row_bytes,
                                         attempt=failures, error=str(e))
                    continue
                raise ExpertReadError(f"read of {want} bytes at offset {start} failed: {e}", file=loc.file,
                                      tensor=loc.key, layer=layer, expert=expert + done // loc.row_bytes) from e
            if n == 0:
                raise ExpertReadError(
                    f"short read: got {done} of {want} bytes at offset {start} (file truncated?)",
                    file=loc.file, tensor=loc.key, layer=layer, expert=expert + done // loc.row_bytes)
            done += n
        if in_place_reads:
            with self._lock:
                self.stats.in_place_reads += in_place_reads
        return want

    def read_layer(self, layer: int, buffers) -> int:
        """Read every expert of ``layer``: its whole stacked tensors, one range each, into
        ``buffers`` (rows = experts). Returns bytes read."""
        locs = self.index.layers[layer].tensors
        jobs = [(loc, buf) for loc, buf in zip(locs, buffers)]
        t0 = time.perf_counter()

        def one(job):
            loc, buf = job
            whole = TensorLocation(loc.key, loc.file, loc.dtype, loc.offset, loc.row_bytes * buf.rows, loc.row_shape)
            return self._read_one(whole, 0, buf.host.reshape(-1), layer)

        total = sum(self._pool.map(one, jobs)) if self._pool is not None else sum(map(one, jobs))
        with self._lock:
            self.stats.count(layer, total, len(jobs), time.perf_counter() - t0)
        return total

    def read_experts(self, layer: int, experts, rows, buffers, parallel: bool = True) -> int:
        """Read each expert ``experts[i]`` of ``layer`` into row ``rows[i]`` of ``buffers``
        (one buffer per stacked tensor, in the index's order). Returns the bytes put into the
        rows: read, or copied from the expert cache (``stats.cache_bytes``).
        ``parallel=False`` reads in the calling thread (callers that are reader threads)."""
        locs = self.index.layers[layer].tensors
        experts = [int(e) for e in experts]
        bad = [e for e in experts if not 0 <= e < self.index.spec.num_experts]
        if bad:  # never read bytes that belong to another tensor
            raise ExpertReadError(f"expert ids {bad[:4]} are outside [0, {self.index.spec.num_experts})",
                                  layer=layer, expert=bad[0])
        rows = [int(r) for r in rows]
        cached = 0
        if self.cache is not None:  # what the cache holds is copied, the rest read
            experts, rows, cached = self.cache.serve(layer, experts, rows, buffers)
        jobs = [(loc, e, buf.host[r:r + n], layer, n)  # adjacent experts into adjacent rows: one read
                for e, r, n in _runs(experts, rows) for loc, buf in zip(locs, buffers)]
        t0 = time.perf_counter()
        if self._pool is None or not parallel or len(jobs) < 4:
            total = sum(self._read_one(*job) for job in jobs)
        else:  # one task per reader thread (a task per read costs more CPU than many reads), biggest first
            jobs.sort(key=lambda job: -job[0].row_bytes * job[4])
            parts = [jobs[i::self._threads] for i in range(self._threads)]
            total = sum(self._pool.map(lambda part: sum(self._read_one(*job) for job in part), parts))
        if self.cache is not None:
            self.cache.keep(layer, experts, rows, buffers)  # read whole: each may enter the cache
        with self._lock:
            self.stats.count(layer, total, len(jobs), time.perf_counter() - t0)
            copied = cached * sum(loc.row_bytes for loc in locs)
            self.stats.cache_hits += cached
            self.stats.cache_bytes += copied
        return total + copied


class LRU:
    """Least recently used first out."""

    def __init__(self):
        self._order: dict = {}  # key -> None, least recent first (a dict keeps insertion order)

    def touch(self, key) -> None:
        self._order.pop(key, None)
        self._order[key] = None

    def remove(self, key) -> None:
        self._order.pop(key, None)

    def victim(self):
        """The key to evict next (None when empty)."""
        return next(iter(self._order), None)


class LFUAging:
    """LFU with dynamic aging (LFU-DA): a key's priority is the cache's age when it was last
    used plus how often it was used since it entered; the least is evicted and the age rises
    to its priority, so what was used often long ago ages out. Ties: the least recently used."""

    def __init__(self):
        self.age = 0
        self._count: dict = {}
        self._priority: dict = {}
        self._heap: list = []  # (priority, tick, key); an entry whose priority changed since is stale
        self._tick = itertools.count()

    def touch(self, key) -> None:
        self._count[key] = self._count.get(key, 0) + 1
        self._priority[key] = self.age + self._count[key]
        heapq.heappush(self._heap, (self._priority[key], next(self._tick), key))

    def remove(self, key) -> None:
        if self._count.pop(key, None) is not None:
            self.age = max(self.age, self._priority.pop(key))

    def victim(self):
        while self._heap and self._priority.get(self._heap[0][2]) != self._heap[0][0]:
            heapq.heappop(self._heap)  # stale
        return self._heap[0][2] if self._heap else None


POLICIES = {"lfu": LFUAging, "lru": LRU}


class ExpertCache:
    """Expert bytes (every stacked tensor's row of an expert, one after the other) kept in
    memory, keyed by (layer, expert): ``budget // expert_bytes`` entries of ``expert_bytes``
    (the largest expert) in one array allocated at once, so that what is evicted is reused in
    place (no allocation per expert: a freed copy in a reader thread's heap is not memory given
    back) and the budget holds by construction. Safe from several reader threads (copies under
    its lock: a copy holds the interpreter's lock anyway)."""

    def __init__(self, budget: int, policy: str, expert_bytes: int):
        if policy not in POLICIES:
            raise ValueError(f"cache policy {policy!r} is not one of {sorted(POLICIES)}")
        self.budget, self.name = int(budget), policy
        self.policy = POLICIES[policy]()
        self.capacity = max(0, self.budget // max(1, expert_bytes))  # entries
        self._store = np.empty((self.capacity, expert_bytes), dtype=np.uint8)
        self._free = list(range(self.capacity - 1, -1, -1))  # handed out from entry 0 up
        if self.capacity:
            _populate(self._store)
        self.entries: dict = {}  # (layer, expert) -> its row of the store
        self.uses: dict = {}  # (layer, expert) -> how often a read asked for it, held or not
        self.nbytes = 0  # the bytes of the entries held
        self.evictions = self.refused = 0
        self._lock = threading.Lock()

    def serve(self, layer: int, experts: list[int], rows: list[int], buffers) -> tuple[list, list, int]:
        """Copy each cached expert of ``experts`` into its row of ``buffers``; returns the
        experts and rows left to read, and how many were served."""
        left_e, left_r, hits = [], [], 0
        with self._lock:
            for e, r in zip(experts, rows):
                self.uses[layer, e] = self.uses.get((layer, e), 0) + 1
                slot = self.entries.get((layer, e))
                if slot is None:
                    left_e.append(e)
                    left_r.append(r)
                    continue
                self.policy.touch((layer, e))
                at = 0
                for buf in buffers:
                    n = buf.host.shape[1]
                    buf.host[r] = self._store[slot, at:at + n]
                    at += n
                hits += 1
        return left_e, left_r, hits

    def keep(self, layer: int, experts: list[int], rows: list[int], buffers) -> None:
        """Copies of the experts just read into ``rows`` of ``buffers``; when the cache is
        full, each in the entry the policy's victim leaves, unless reads asked for it less
        often than for the victim (a copy costs the step its time: what is needed less than what
        the cache holds is not copied)."""
        size = sum(buf.host.shape[1] for buf in buffers)
        if size > self._store.shape[1] or not self.capacity:
            return
        with self._lock:
            for e, r in zip(experts, rows):
                key = (layer, e)
                if key in self.entries:
                    continue
                if not self._free:
                    victim = self.policy.victim()
                    if self.uses.get(key, 0) < self.uses.get(victim, 0):
                        self.refused += 1  # asked for less often than what it would push out: not copied
                        continue
                    self._free.append(self.entries.pop(victim))
                    self.policy.remove(victim)
                    self.nbytes -= size
                    self.evictions += 1
                slot = self._free.pop()
                at = 0
                for buf in buffers:
                    n = buf.host.shape[1]
                    self._store[slot, at:at + n] = buf.host[r]
                    at += n
                self.entries[key] = slot
                self.nbytes += size
                self.policy.touch(key)

    def row(self, layer: int, expert: int):
        """The cached bytes of an expert (its tensors' rows one after the other), or None."""
        with self._lock:
            slot = self.entries.get((layer, expert))
            return None if slot is None else self._store[slot].copy()

    def clear(self) -> None:
        """Forget everything (the checkpoint's files changed)."""
        with self._lock:
            for key, slot in self.entries.items():
                self.policy.remove(key)
                self._free.append(slot)
            self.entries.clear()
            self.nbytes = 0


MADV_POPULATE_WRITE = 23  # Linux 5.14+


def _populate(store) -> None:
    """Have the kernel map every page of ``store`` now, in one call, its bytes untouched: the
    first write to each page is otherwise a page fault during a step (one per 4 KiB, about
    2.7 s per GiB on a virtual machine measured here, against 0.05 s per GiB this way). Where
    the call is unknown (another kernel or system) the pages are mapped as they are filled."""
    if not sys.platform.startswith("linux") or not store.size:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        start = -(-store.ctypes.data // 4096) * 4096
        end = (store.ctypes.data + store.nbytes) // 4096 * 4096
        if end > start:
            libc.madvise(start, end - start, MADV_POPULATE_WRITE)  # a failure leaves the pages as they were
    except (OSError, AttributeError):
        pass


DESCRIPTOR_MARGIN = 64  # left for sockets, logs, the tokenizer, other engines' files


def ensure_descriptors(needed: int, *, what: str) -> None:
    """Room for ``needed`` more open files, raising the soft RLIMIT_NOFILE toward the hard
    one where that is short; a CheckpointError saying how many there is room for where even
    the hard limit is (before one file is opened, not an OSError half-way)."""
    try:
        import resource
    except ImportError:  # not POSIX: nothing to ask
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    try:
        open_now = len(os.listdir(fd_dir))
    except OSError:
        return
    want = open_now + needed + DESCRIPTOR_MARGIN
    if soft != resource.RLIM_INFINITY and want > soft:
        raised = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and want > soft:
        raise CheckpointError(f"{what} need {needed} open files; this process may open {soft} (RLIMIT_NOFILE "
                              f"{soft}, hard limit {hard}) and has {open_now} open: raise `ulimit -n`, or write "
                              "the checkpoint in fewer, larger shards")


def _runs(experts: list[int], rows: list[int]) -> list[tuple[int, int, int]]:
    """(first expert, first row, count) of each run of experts that are adjacent in the file
    and go to adjacent rows (a layer's distinct experts read into rows 0..n-1 in order)."""
    out: list[list[int]] = []
    for e, r in zip(experts, rows):
        if out and e == out[-1][0] + out[-1][2] and r == out[-1][1] + out[-1][2]:
            out[-1][2] += 1
        else:
            out.append([e, r, 1])
    return [tuple(x) for x in out]


def _identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class Store(Protocol):
    """What the scheduler reads through (``edge0.io_sched.scheduler``); tests substitute a
    fake one (latency, faults) and drive the scheduler without MLX or a model."""

    def read(self, layer: int, expert: int, slot: int) -> int:
        """Fill ``slot`` of ``layer`` with ``expert``'s rows (blocking, in a reader thread);
        return the bytes read."""


class SlotStore:
    """Reads expert rows from the checkpoint into per-layer slot buffers."""

    def __init__(self, reader: ExpertReader, buffers: dict[int, Sequence]):
        self.reader = reader
        self.buffers = buffers  # layer -> the RowBuffers of its slots (one per stacked tensor)

    def read(self, layer: int, expert: int, slot: int) -> int:
        return self.reader.read_experts(layer, [expert], [slot], self.buffers[layer], parallel=False)
