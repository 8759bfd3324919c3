"""The C heap as the process sees it: the bytes it has handed out, and its free pages
handed back to the system (glibc's ``mallinfo2`` and ``malloc_trim``; elsewhere the resident
set, and no trim)."""

from __future__ import annotations

import ctypes
import functools
import os


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (``malloc_trim``, which walks every
    thread's arena); a no-op where the C library has no such call."""
    trim = _libc("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)
    if trim is not None:
        trim(0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


def allocated_bytes() -> int:
    """Bytes the C heap has handed out and not got back (``mallinfo2``: every arena, mapped
    blocks included), else the resident set (which a reused free block does not grow)."""
    mallinfo2 = _libc("mallinfo2", (), _MallInfo2)
    if mallinfo2 is not None:
        info = mallinfo2()
        return info.uordblks + info.hblkhd
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@functools.cache
def _libc(name: str, argtypes: tuple, restype):
    """The C library's function ``name``, or None where it has none."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn
