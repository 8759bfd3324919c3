"""Loads the extension module (``_ext``) and says why when it cannot."""


from __future__ import annotations

import importlib

import mlx.core as mx  # loads libmlx.so, which the extension links against

_ext = None
_reason: str | None = None


def _load():
    global _ext, _reason
    try:
        ext = importlib.import_module("edge0.backend.mlx.kernels._ext")
    except ImportError as e:
        _reason = f"the extension is not built ({e}); reinstall with cmake and a C++ compiler on PATH"
        return
    if ext.mlx_version() != mx.__version__:
        _reason = (f"the extension was built against mlx {ext.mlx_version()}, this process runs mlx "
                   f"{mx.__version__}; reinstall Edge0 to rebuild it")
        return
    _ext = ext


_load()


def available() -> bool:
    """Whether the kernels can run in this process."""
    return _ext is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True)."""
    return _reason


def ext():
    """The loaded extension module (``available()`` must be True)."""
    if _ext is None:
        raise RuntimeError(f"Edge0's kernels are unavailable: {_reason}")
    return _ext


def set_threads(n: int) -> None:
    """Threads the kernels split output rows over (process-wide)."""
    ext().set_threads(int(n))


def set_int8_products(on: bool) -> bool:
    """Integer products for the one-row loops, 4 and 8 bits (process-wide, as the threads):
    x quantized to int8 per 32 values and multiplied with AVX-512 VNNI. False where the CPU
    lacks VNNI (nothing changed)."""
    return bool(ext().set_int8_products(bool(on)))


def int8_products() -> bool:
    """Whether the integer products run now (asked for, on a CPU with VNNI, the AVX-512 loops
    allowed)."""
    return bool(ext().int8_products())


def get_threads() -> int:
    return ext().get_threads()


def isa() -> str:
    """``avx512``, ``avx2`` or ``portable``: which loops run on this CPU (the widest it has,
    unless ``EDGE0_KERNEL_ISA`` or ``ext().limit_isa`` caps them)."""
    return ext().isa()


