"""The hot path: a per-layer LRU set of resident experts.

Each hot layer keeps ``size`` experts resident in slots. A step's hits are computed from
the slots with no read; its misses are read on demand, as exact reads them, but straight
into the least recently used slots, where they stay for later steps. A call that needs
more distinct experts than the set holds (a long prefill) is handed to exact whole.
Like exact, it brings the routing to the host once per layer, except where the set holds
every expert of its layer (``hot_experts`` at least the layer's experts): that layer is
read whole at its first call and computes from then on without its routing on the host, so
a step through it evaluates nothing. The first MoE layer of a staged model, which no head
predicts, is kept resident this way (``unpredicted_layers``: one evaluation per decode step),
whatever ``hot_experts`` is for other hot layers.
"""

from __future__ import annotations

import numpy as np

from edge0.backend import core as B
from edge0.model.checkpoint import CheckpointIndex
from edge0.exec.rows import ExactExecutor, ExpertRows, lookup_table
from edge0.io_sched.reader import ExpertReader
from edge0.io_sched.slots import SlotTable


class HotExecutor:
    def __init__(self, index: CheckpointIndex, reader: ExpertReader, size: int, exact: ExactExecutor, log=None,
                 resident=()):
        """``resident``: layers whose set holds every expert whatever ``size`` is (the
        layers no prerouter head predicts, held so by ``unpredicted_layers``)."""
        self.index = index
        self.reader = reader
        self.size = min(max(size, index.spec.k), index.spec.num_experts)
        self.every = self.size == index.spec.num_experts  # every layer's set holds every expert
        self.resident = set(resident)
        self.lookup: dict[int, object] = {}  # a resident layer -> its expert -> slot row (device), once read
        self.exact = exact
        self.log = log
        self.rows: dict[int, ExpertRows] = {}
        self.tables: dict[int, SlotTable] = {}
        self.hits = 0
        self.misses = 0

    def holds_all(self, layer: int) -> bool:
        """Whether ``layer``'s set holds every expert of it: no routing read."""
        return self.every or layer in self.resident

    def _layer(self, layer: int) -> tuple[ExpertRows, SlotTable]:
        if layer not in self.rows:
            size = self.index.spec.num_experts if self.holds_all(layer) else self.size
            self.rows[layer] = ExpertRows(self.index.layers[layer], size)
            self.tables[layer] = SlotTable(layer, size)
        return self.rows[layer], self.tables[layer]

    def invalidate(self) -> None:
        """Forget every resident expert (after a read error or a changed file)."""
        for table in self.tables.values():
            table.invalidate()
        self.lookup.clear()

    def pinned_slots(self) -> int:
        return sum(t.pinned() for t in self.tables.values())

    def __call__(self, layer: int, x, inds):
        if self.holds_all(layer):
            return self._whole(layer, x, inds)
        distinct = np.unique(B.to_host(inds))
        if len(distinct) > self.size:
            return self.exact(layer, x, inds)
        rows, table = self._layer(layer)
        slot_of, read = self._claim(layer, rows, table, distinct)
        self.hits += len(distinct) - read
        if self.log is not None:
            self.log.debug("hot.step", layer=layer, hits=len(distinct) - read, misses=read)
        lut = lookup_table(self.index.spec.num_experts, list(slot_of), list(slot_of.values()))
        return self._run(layer, rows, x, B.take(lut, inds))

    def _whole(self, layer: int, x, inds):
        """A layer whose set holds every expert: each one read at the first call (and after
        ``invalidate``), the routing then used on the device as it is."""
        rows, table = self._layer(layer)
        if layer not in self.lookup:
            slot_of, _ = self._claim(layer, rows, table, range(self.index.spec.num_experts))
            self.lookup[layer] = lookup_table(len(slot_of), list(slot_of), list(slot_of.values()))
        return self._run(layer, rows, x, B.take(self.lookup[layer], inds))

    def _claim(self, layer: int, rows: ExpertRows, table: SlotTable, experts) -> tuple[dict[int, int], int]:
        """Pin ``experts`` in the layer's slots (all at once: none evicts another), reading
        those not resident into the least recently used ones, then unpin; ({expert: slot},
        how many were read)."""
        claimed = {int(e): table.claim(int(e), 0) for e in experts}
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
        self.misses += len(misses)
        return {e: slot for e, (slot, _) in claimed.items()}, len(misses)

    def _run(self, layer: int, rows: ExpertRows, x, slots):
        out = rows.run(self.exact.split, self.exact.templates[layer], x, slots)
        rows.pending = out
        return out
