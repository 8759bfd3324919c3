"""The hot path: a per-layer LRU set of resident experts.

Each hot layer keeps ``size`` experts resident in slots. A step's hits are computed from
the slots with no read; its misses are read on demand, as exact reads them, but straight
into the least recently used slots, where they stay for later steps. A call that needs
more distinct experts than the set holds (a long prefill) is handed to exact whole.
Like exact, it brings the routing to the host once per layer.
"""

from __future__ import annotations

import numpy as np

from edge0.backend import core as B
from edge0.model.checkpoint import CheckpointIndex
from edge0.exec.rows import ExactExecutor, ExpertRows, lookup_table
from edge0.io_sched.reader import ExpertReader
from edge0.io_sched.slots import SlotTable


class HotExecutor:
    def __init__(self, index: CheckpointIndex, reader: ExpertReader, size: int, exact: ExactExecutor, log=None):
        self.index = index
        self.reader = reader
        self.size = max(size, index.spec.k)
        self.exact = exact
        self.log = log
        self.rows: dict[int, ExpertRows] = {}
        self.tables: dict[int, SlotTable] = {}
        self.hits = 0
        self.misses = 0

    def _layer(self, layer: int) -> tuple[ExpertRows, SlotTable]:
        if layer not in self.rows:
            self.rows[layer] = ExpertRows(self.index.layers[layer], self.size)
            self.tables[layer] = SlotTable(layer, self.size)
        return self.rows[layer], self.tables[layer]

    def invalidate(self) -> None:
        """Forget every resident expert (after a read error or a changed file)."""
        for table in self.tables.values():
            table.invalidate()

    def pinned_slots(self) -> int:
        return sum(t.pinned() for t in self.tables.values())

    def __call__(self, layer: int, x, inds):
        ids = B.to_host(inds)
        distinct = np.unique(ids)
        if len(distinct) > self.size:
            return self.exact(layer, x, inds)
        rows, table = self._layer(layer)
        claimed = {int(e): table.claim(int(e), 0) for e in distinct}  # pins all: none evicts another
        misses = [(e, slot) for e, (slot, needs_read) in claimed.items() if needs_read]
        if misses:
            rows.settle()  # the slots being refilled may feed a pending graph
            try:
                self.reader.read_experts(layer, [e for e, _ in misses], [s for _, s in misses], rows.buffers)
            except BaseException:
                for _, slot in misses:
                    table.complete(slot, False)
                table.release(0)
                raise
            for _, slot in misses:
                table.complete(slot, True)
        table.release(0)
        self.hits += len(distinct) - len(misses)
        self.misses += len(misses)
        if self.log is not None:
            self.log.debug("hot.step", layer=layer, hits=len(distinct) - len(misses), misses=len(misses))
        lut = lookup_table(self.index.spec.num_experts, list(claimed), [slot for slot, _ in claimed.values()])
        out = rows.run(self.exact.split, self.exact.templates[layer], x, B.take(lut, inds))
        rows.pending = out
        return out
