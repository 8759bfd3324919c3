"""Device buffers that reader threads fill in place (MLX, CPU / unified memory).

An evaluated, row-contiguous MLX array exposes its memory to NumPy without a copy, and
writes through that view are what MLX sees (FACTS: no copy, no re-upload). Reader threads
touch only these NumPy views, made up front; they never call MLX.

Hazard: a lazy graph built before a row is overwritten and evaluated after it reads the
new bytes. Callers overwrite a row only when no pending graph references the buffer.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from edge0.backend.mlx.core import SAFETENSORS_DTYPES


PAGE = 4096


class RowBuffer:
    """``rows`` rows of ``row_bytes`` raw bytes, resident in device memory.

    ``host`` is the writable NumPy view ([rows, row_bytes] uint8), ``address`` where its row 0
    is in memory; ``typed(dtype, shape)`` reinterprets the same memory as an array of
    [rows, *shape] of a safetensors dtype.
    """

    def __init__(self, rows: int, row_bytes: int, phase: int | None = None):
        """``phase``: where, modulo ``PAGE``, row 0 starts in memory (every row too when
        ``row_bytes`` is a multiple of ``PAGE``): given the file offset of the rows' bytes,
        a direct read lands in place, every page of the file on a page of the buffer.
        ``set_phase`` moves the rows to another phase within the same memory (a buffer
        shared by layers whose tensors sit at other offsets)."""
        self.rows = rows
        self.row_bytes = row_bytes
        self.device = None
        self.phase = None
        self._flat = None
        if phase is not None:  # one page more, and the rows start where their address has the file's phase
            self._flat = mx.zeros((rows * row_bytes + PAGE,), dtype=mx.uint8)
            mx.eval(self._flat)
            self._base = np.array(self._flat, copy=False).ctypes.data
            self._placed: dict[int, tuple] = {}  # phase -> (device rows, host view) laid out there
            if not self.set_phase(phase):
                self._flat = None  # the slice did not share the buffer: plain rows (reads bounce)
        if self.device is None:
            self.device = mx.zeros((rows, row_bytes), dtype=mx.uint8)
            mx.eval(self.device)
            self.host = np.array(self.device, copy=False)
            self.address = self.host.ctypes.data
        if not self.host.flags.writeable or self.address == 0:
            raise RuntimeError("the MLX backend did not expose a writable host view")

    def set_phase(self, phase: int | None) -> bool:
        """Lay the rows out from an address with ``phase`` modulo ``PAGE``, in this buffer's
        own memory (what the rows held is not kept). False, and nothing changed, when the
        buffer was not made with a phase or ``phase`` is None. Each phase's views are made
        once: moving back to a phase seen before calls no MLX function."""
        if self._flat is None or phase is None:
            return False
        if phase == self.phase:
            return True
        placed = self._placed.get(phase)
        if placed is None:
            n = self.rows * self.row_bytes
            start = (phase - self._base) % PAGE
            device = self._flat[start:start + n].reshape(self.rows, self.row_bytes)
            mx.eval(device)
            host = np.array(device, copy=False)
            if host.ctypes.data % PAGE != phase:
                return False
            placed = self._placed[phase] = (device, host)
        self.device, self.host = placed
        self.address = self.host.ctypes.data
        self.phase = phase
        return True

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def typed(self, st_dtype: str, shape: tuple[int, ...]):
        return self.device.view(SAFETENSORS_DTYPES[st_dtype]).reshape(self.rows, *shape)



def read_rows():
    """Edge0's extension's ``read_rows``: a layer's expert byte ranges into slot rows in one
    call that releases the interpreter's lock (``edge0.io_sched.reader``'s fast path), or None
    where the extension is not built or predates it."""
    from edge0.backend.mlx.kernels import _loader

    return getattr(_loader.ext(), "read_rows", None) if _loader.available() else None
