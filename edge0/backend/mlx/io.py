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

    ``host`` is the writable NumPy view ([rows, row_bytes] uint8); ``typed(dtype, shape)``
    reinterprets the same memory as an array of [rows, *shape] of a safetensors dtype.
    """

    def __init__(self, rows: int, row_bytes: int, phase: int | None = None):
        """``phase``: where, modulo ``PAGE``, row 0 starts in memory (every row too when
        ``row_bytes`` is a multiple of ``PAGE``): given the file offset of the rows' bytes,
        a direct read lands in place, every page of the file on a page of the buffer."""
        self.rows = rows
        self.row_bytes = row_bytes
        n = rows * row_bytes
        self.device = None
        if phase is not None:  # one page more, and the rows start where their address has the file's phase
            flat = mx.zeros((n + PAGE,), dtype=mx.uint8)
            mx.eval(flat)
            start = (phase - np.array(flat, copy=False).ctypes.data) % PAGE
            self.device = flat[start:start + n].reshape(rows, row_bytes)
            mx.eval(self.device)
            if np.array(self.device, copy=False).ctypes.data % PAGE != phase:
                self.device = None  # the slice did not share the buffer: plain rows (reads bounce)
        if self.device is None:
            self.device = mx.zeros((rows, row_bytes), dtype=mx.uint8)
            mx.eval(self.device)
        self.host = np.array(self.device, copy=False)
        if not self.host.flags.writeable or self.host.ctypes.data == 0:
            raise RuntimeError("the MLX backend did not expose a writable host view")

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def typed(self, st_dtype: str, shape: tuple[int, ...]):
        return self.device.view(SAFETENSORS_DTYPES[st_dtype]).reshape(self.rows, *shape)
