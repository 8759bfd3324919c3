"""The store the scheduler reads through: a protocol, the real one, and nothing else.

``read(layer, expert, slot)`` is called from a reader thread and blocks until the expert's
bytes are in the slot, or raises. Tests substitute a fake store (latency, faults) and
drive the scheduler without MLX or a model.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from edge0.io_sched.reader import ExpertReader


class Store(Protocol):
    def read(self, layer: int, expert: int, slot: int) -> int:
        """Fill ``slot`` of ``layer`` with ``expert``'s rows; return the bytes read."""


class SlotStore:
    """Reads expert rows from the checkpoint into per-layer slot buffers."""

    def __init__(self, reader: ExpertReader, buffers: dict[int, Sequence]):
        self.reader = reader
        self.buffers = buffers  # layer -> the RowBuffers of its slots (one per stacked tensor)

    def read(self, layer: int, expert: int, slot: int) -> int:
        return self.reader.read_experts(layer, [expert], [slot], self.buffers[layer], parallel=False)
