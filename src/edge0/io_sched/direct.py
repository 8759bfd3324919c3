"""Direct reads (O_DIRECT): expert bytes from the disk without the page cache.

A buffered read copies out of the page cache, and under a memory cap the kernel also
reclaims the pages it has just filled, which nothing reuses: both cost CPU on the cores the
compute needs. With O_DIRECT the device writes into the process's memory. Its rules: the
file offset, the length and the buffer address are multiples of the block size (``ALIGN``).
Expert byte ranges in a safetensors file are not aligned, so each read covers the aligned
range around the wanted bytes, lands in a page-aligned bounce buffer of the reading thread
(at most ``CHUNK`` bytes at a time), and the wanted bytes are copied out.

``wants_direct`` decides ``direct_io = "auto"``: on when the checkpoint's files are larger
than the memory this process may use (physical memory, or its memory cgroup's limit), so
they could not stay in the page cache anyway. O_DIRECT is Linux's: where the platform has
none (macOS), ``auto`` is off and ``on`` reads buffered with a log line.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import numpy as np

ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and buffers (a page; covers 512-byte devices)
CHUNK = 8 * 2**20  # the most one direct read covers (the bounce buffer's size per thread)
IN_PLACE_MAX = 64 * 2**20  # the most one in-place direct read covers (a whole number of pages)
O_DIRECT = getattr(os, "O_DIRECT", 0)
CGROUP_ROOT = Path("/sys/fs/cgroup")


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroup_levels(proc_cgroup: str, root: Path):
    """(directory, limit file, usage file) of this process's memory cgroup and each parent
    (v2, and v1's memory controller)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 (at the root, or beside v1 controllers under unified/)
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            names = ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, names = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        here = base / path.lstrip("/")
        while True:
            yield (here, *names)
            if here == base or base not in here.parents:
                break
            here = here.parent


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _binding_level(proc_cgroup: str, root: Path):
    """(limit, usage file) of the level with the smallest memory limit, or None."""
    levels = [(limit, here / usage) for here, name, usage in _cgroup_levels(proc_cgroup, root)
              if (limit := _read_int(here / name)) is not None]
    return min(levels, key=lambda x: x[0]) if levels else None


def cgroup_limit(proc_cgroup: str = "/proc/self/cgroup", root: Path = CGROUP_ROOT) -> int | None:
    """The smallest memory limit of this process's cgroup and its parents (v2 ``memory.max``,
    v1 ``memory.limit_in_bytes``), or None when there is none."""
    level = _binding_level(proc_cgroup, root)
    return level[0] if level else None


def cgroup_current(proc_cgroup: str = "/proc/self/cgroup", root: Path = CGROUP_ROOT) -> int | None:
    """What the cgroup whose limit binds holds now (``memory.current`` / ``usage_in_bytes``:
    its processes' memory and the page cache charged to it), or None."""
    level = _binding_level(proc_cgroup, root)
    return _read_int(level[1]) if level else None


def rlimit_memory() -> int | None:
    """The smaller finite address-space or data-segment limit (``ulimit -v`` / ``-d``), or None."""
    try:
        import resource
    except ImportError:
        return None
    limits = []
    for name in ("RLIMIT_AS", "RLIMIT_DATA"):
        which = getattr(resource, name, None)
        if which is not None:
            soft, _ = resource.getrlimit(which)
            if soft != resource.RLIM_INFINITY and soft > 0:
                limits.append(soft)
    return min(limits) if limits else None


def memory_limit() -> int:
    """The memory this process may use: physical memory, or less under a cgroup limit or
    an address-space / data rlimit."""
    return min(x for x in (physical_memory(), cgroup_limit(), rlimit_memory()) if x)


def over_memory(files: list[str], limit: int | None = None) -> bool:
    """Whether ``files`` are larger than ``limit`` (None: ``memory_limit()``): a checkpoint
    that could not stay in the page cache, whose experts come from the disk."""
    return sum(os.path.getsize(f) for f in files) > (memory_limit() if limit is None else limit)


def wants_direct(mode: str, files: list[str], limit: int | None = None) -> bool:
    """``direct_io`` ``on`` / ``off``, or ``auto``: on when ``files`` are larger than
    ``limit`` (None: ``memory_limit()``)."""
    if mode != "auto":
        return mode == "on"
    return bool(O_DIRECT) and over_memory(files, limit)


def direct_reads(mode: str, files: list[str], limit: int | None = None) -> bool:
    """``wants_direct``, and every file opens with O_DIRECT (a filesystem may refuse it: its
    reads are then buffered)."""
    if not wants_direct(mode, files, limit):
        return False
    for path in files:
        fd = open_direct(path)
        if fd is None:
            return False
        os.close(fd)
    return True


def drop_cached(files, strict: bool = False) -> None:
    """Drop the files' pages from the page cache (clean pages only; these are read-only):
    after the resident weights are loaded with direct expert reads, their pages would
    only take memory (a cgroup counts them) that the plan gives to the expert cache. Best
    effort (a platform without ``posix_fadvise``, or a filesystem that refuses it, keeps
    them) unless ``strict``."""
    if not hasattr(os, "posix_fadvise"):
        return
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError:
            if strict:
                raise


def open_direct(path: str) -> int | None:
    """A read-only O_DIRECT descriptor of ``path``, or None where the filesystem (or the
    platform) refuses it."""
    if not O_DIRECT:
        return None
    try:
        return os.open(path, os.O_RDONLY | O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


class Bounce:
    """One page-aligned buffer of ``CHUNK`` bytes per reading thread."""

    def __init__(self):
        self._local = threading.local()

    def get(self) -> memoryview:
        view = getattr(self._local, "view", None)
        if view is None:
            buf = mmap.mmap(-1, CHUNK)  # anonymous memory: page-aligned
            view = self._local.view = memoryview(buf)
        return view


def read_direct(pread, fd: int, bounce: memoryview, dest: memoryview, offset: int) -> int:
    """Bytes of the file at ``offset`` .. into ``dest`` through one aligned read of at most
    ``CHUNK`` bytes (``pread``: ``os.preadv``'s signature); returns how many were copied (0
    at the end of the file)."""
    lo = offset - offset % ALIGN
    hi = min(-(-(offset + len(dest)) // ALIGN) * ALIGN, lo + CHUNK)
    need, got = min(hi - lo, offset - lo + len(dest)), 0
    while got < need:  # a short read (whole blocks) goes on where it stopped
        n = pread(fd, [bounce[got:hi - lo]], lo + got)
        if n == 0:
            break
        got += n
    usable = min(got - (offset - lo), len(dest))
    if usable <= 0:
        return 0
    dest[:usable] = bounce[offset - lo:offset - lo + usable]
    return usable


def read_in_place(pread, fd: int, bounce: memoryview, dest: memoryview, offset: int) -> int | None:
    """``dest``'s bytes from the file at ``offset`` with one direct read that lands in place:
    the pages between the first and the last go straight into ``dest`` (its address has the
    offset's phase: ``RowBuffer(phase=...)``), the partial first and last pages through the
    bounce buffer, and their bytes are copied over. None when ``dest`` does not have the
    phase, is too short, or the read came back short: the caller reads it through the
    bounce buffer instead."""
    address = np.frombuffer(dest, dtype=np.uint8).ctypes.data if len(dest) else 0
    if len(dest) < 2 * ALIGN or (address - offset) % ALIGN:
        return None
    dest = dest[:IN_PLACE_MAX]  # longer: the caller reads on from where this one stopped
    head = -offset % ALIGN  # bytes of the first, partial page (0: the offset is aligned)
    end = offset + len(dest)
    tail = end % ALIGN
    mid = len(dest) - head - tail
    if mid <= 0:
        return None
    iov = ([bounce[:ALIGN]] if head else []) + [dest[head:head + mid]] + ([bounce[ALIGN:2 * ALIGN]] if tail else [])
    first = offset - (ALIGN - head) if head else offset
    n = pread(fd, iov, first)
    if n < end - first:
        return None
    if head:
        dest[:head] = bounce[ALIGN - head:ALIGN]
    if tail:
        dest[len(dest) - tail:] = bounce[ALIGN:ALIGN + tail]
    return len(dest)
