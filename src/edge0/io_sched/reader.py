"""ExpertReader: positional reads of expert byte ranges straight into buffer rows.

One file descriptor per shard, opened once; ``os.preadv`` fills a NumPy view of device
memory, so bytes go from the page cache (or disk) into the tensor the kernel reads with
no intermediate copy. pread rather than mmap: a file truncated under an mmap is SIGBUS,
which cannot be caught; a short pread is an ordinary, typed error. With ``direct=True``
the reads bypass the page cache (O_DIRECT, ``edge0.io_sched.direct``) through a page-aligned
bounce buffer per thread; a file whose filesystem refuses O_DIRECT is read buffered (one
``io.direct_unavailable`` log line).

``SlotStore`` is the ``Store`` the scheduler reads through: an expert's rows into a slot.
Where the engine keeps an ``ExpertCache`` (``edge0.io_sched.expert_cache``), the reader serves
a cached expert as a memory copy, not a read.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, Sequence


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
                 direct: bool = False, native: bool = True):
        """``native``: read experts through the extension's ``read_rows`` where it is built (one
        call for a ``read_experts`` call's experts, the interpreter's lock released). With
        ``pread`` ``os.preadv`` they are; ``native=False`` or another ``pread`` (fault
        injection) reads them here in Python, one ``pread`` a range."""
        self.index = index
        self.retries = retries
        self.log = log
        self.pread = os.preadv if native else _preadv  # replaced by fault-injection tests
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
        self.cache = None  # the engine's ExpertCache (edge0.io_sched.expert_cache), when it keeps one

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
        room = min((buf.host.shape[0] for buf in buffers), default=0)
        if any(not 0 <= r < room for r in rows):  # never write past a buffer
            raise ExpertReadError(f"rows {[r for r in rows if not 0 <= r < room][:4]} are outside the buffers' "
                                  f"[0, {room})", layer=layer)
        narrow = next((loc for loc, buf in zip(locs, buffers) if buf.host.shape[1:] < (loc.row_bytes,)), None)
        if narrow is not None:
            raise ExpertReadError(f"its buffer's rows hold fewer than the {narrow.row_bytes} bytes of an expert's row",
                                  tensor=narrow.key, layer=layer)
        cached = 0
        if self.cache is not None:  # what the cache holds is copied, the rest read
            experts, rows, cached = self.cache.serve(layer, experts, rows, buffers)
        t0 = time.perf_counter()
        total, reads, done_e, done_r = 0, 0, experts, rows
        if self.pread is os.preadv and experts and _native_read_rows() is not None:
            total, reads, experts, rows = self._read_native(locs, experts, rows, buffers, parallel)
        jobs = [(loc, e, buf.host[r:r + n], layer, n)  # adjacent experts into adjacent rows: one read
                for e, r, n in _runs(experts, rows) for loc, buf in zip(locs, buffers)]
        if self._pool is None or not parallel or len(jobs) < 4:
            total += sum(self._read_one(*job) for job in jobs)
        else:  # one task per reader thread (a task per read costs more CPU than many reads), biggest first
            jobs.sort(key=lambda job: -job[0].row_bytes * job[4])
            parts = [jobs[i::self._threads] for i in range(self._threads)]
            total += sum(self._pool.map(lambda part: sum(self._read_one(*job) for job in part), parts))
        reads += len(jobs)
        if self.cache is not None:
            self.cache.keep(layer, done_e, done_r, buffers)  # read whole: each may enter the cache
        with self._lock:
            self.stats.count(layer, total, reads, time.perf_counter() - t0)
            copied = cached * sum(loc.row_bytes for loc in locs)
            self.stats.cache_hits += cached
            self.stats.cache_bytes += copied
        return total + copied

    def _read_native(self, locs, experts: list[int], rows: list[int], buffers, parallel: bool):
        """The experts read by the extension (in the pool's threads, a contiguous share each,
        where ``parallel``); returns (bytes, reads, and the experts and rows it did not read
        whole, which the Python path reads again with its retries and typed errors)."""
        spec = []
        for loc, buf in zip(locs, buffers):
            direct = self._direct.get(loc.file)
            mode = 0 if direct is None else 1 if loc.file in self._bounce_only else 2  # buffered, bounced, in place
            address = getattr(buf, "address", None) or buf.host.ctypes.data
            spec.append((self._fds[loc.file] if direct is None else direct, mode, loc.offset, loc.row_bytes, address,
                         buf.host.strides[0], buf.host.shape[0]))
        parts = 1 if self._pool is None or not parallel else min(self._threads, len(experts))
        size = -(-len(experts) // parts)
        shares = [(experts[i:i + size], rows[i:i + size]) for i in range(0, len(experts), size)]
        read_rows = _native_read_rows()
        results = list(self._pool.map(lambda sh: read_rows(spec, *sh), shares)) if len(shares) > 1 else \
            [read_rows(spec, *shares[0])]
        total = sum(r[0] for r in results)
        in_place = sum(r[1] for r in results)
        left = [(e[i], r[i]) for (e, r), res in zip(shares, results) for i in res[2]]
        if in_place:
            with self._lock:
                self.stats.in_place_reads += in_place
        left_e, left_r = [e for e, _ in left], [r for _, r in left]
        runs = sum(len(_runs(*share)) for share in shares) - len(_runs(left_e, left_r))
        return total, runs * len(locs), left_e, left_r


_READ_ROWS: list = []  # the extension's read_rows, looked up once


def _native_read_rows():
    """The extension's ``read_rows`` (None where it is not built)."""
    if not _READ_ROWS:
        from edge0.backend import io

        _READ_ROWS.append(io.read_rows())
    return _READ_ROWS[0]


def _preadv(fd: int, buffers, offset: int) -> int:
    """``os.preadv``, as the reader's Python path (``ExpertReader(native=False)``) calls it."""
    return os.preadv(fd, buffers, offset)


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

    # optional: ``read_many(layer, experts, slots) -> [bytes each]``, several reads of one layer
    # in one call (the scheduler reads a share so where the store has it)


class SlotStore:
    """Reads expert rows from the checkpoint into per-layer slot buffers."""

    def __init__(self, reader: ExpertReader, buffers: dict[int, Sequence]):
        self.reader = reader
        self.buffers = buffers  # layer -> the RowBuffers of its slots (one per stacked tensor)

    def read(self, layer: int, expert: int, slot: int) -> int:
        return self.reader.read_experts(layer, [expert], [slot], self.buffers[layer], parallel=False)

    def read_many(self, layer: int, experts: list[int], slots: list[int]) -> list[int]:
        """Each ``experts[i]`` into ``slots[i]`` of ``layer``, in one call (the extension reads
        them with the interpreter's lock released once); the bytes each took."""
        total = self.reader.read_experts(layer, experts, slots, self.buffers[layer], parallel=False)
        return [total // len(experts)] * len(experts)
