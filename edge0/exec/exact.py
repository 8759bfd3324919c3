"""The exact path: route, deduplicate, read the experts, run the stack. The oracle.

For the current tokens the distinct experts are read into a bundle (one row buffer per
stacked tensor, ``capacity`` rows, shared by the layers with the same layout), the routing
indices are mapped to bundle rows through a table with ``take``, and the block's own
switch module runs on the bundle (``edge0.exec.taps.bind``). When a prefill needs more
distinct experts than the bundle holds, the (token, expert) pairs are processed in expert
chunks, each pair exactly once.

The computation is the switch module's own code on the same rows, so outputs are
bit-identical to the resident model.
"""

from __future__ import annotations

import time

import numpy as np

from edge0.backend import core as B
from edge0.model.checkpoint import CheckpointIndex, LayerExperts
from edge0.exec.rows import ExpertRows, lookup_table
from edge0.exec.split import Split
from edge0.io_sched.reader import ExpertReader


class ExactExecutor:
    """On-demand, deduplicated expert execution over a shared bundle (host sync per layer)."""

    def __init__(self, index: CheckpointIndex, reader: ExpertReader, capacity: int, templates: dict, log=None):
        self.index = index
        self.reader = reader
        self.num_experts = index.spec.num_experts
        self.capacity = max(capacity, index.spec.k)
        self._bundles: dict[tuple, ExpertRows] = {}
        self.templates = templates  # layer -> its switch module (the kernel's code)
        self.recorder = None  # a RoutingRecorder while an oracle is being recorded
        self.log = log
        self.split = Split(1)  # the loader sets the engine's (edge0.exec.split)

    def bundle_for(self, layer: LayerExperts) -> ExpertRows:
        key = layer.layout
        if key not in self._bundles:
            self._bundles[key] = ExpertRows(layer, self.capacity)
        return self._bundles[key].use(layer)  # one bundle for the layers of a layout, in place for each

    @property
    def resident_bytes(self) -> int:
        return sum(b.nbytes for b in self._bundles.values())

    def _load(self, bundle: ExpertRows, layer: int, experts: np.ndarray) -> None:
        t0 = time.perf_counter()
        bundle.settle()
        t1 = time.perf_counter()
        n = self.reader.read_experts(layer, experts, range(len(experts)), bundle.buffers)
        if self.log is not None:
            self.log.debug("exact.read", layer=layer, experts=len(experts), bytes=n,
                           ms=round(1e3 * (time.perf_counter() - t1), 3), settle_ms=round(1e3 * (t1 - t0), 3))

    def __call__(self, layer_id: int, x, inds):
        layer = self.index.layers[layer_id]
        bundle = self.bundle_for(layer)
        ids = B.to_host(inds)  # the host sync the exact path pays per layer
        if self.recorder is not None:
            self.recorder.record(layer_id, ids)
        distinct = np.unique(ids)
        if len(distinct) <= bundle.capacity:
            self._load(bundle, layer_id, distinct)
            table = lookup_table(self.num_experts, distinct, np.arange(len(distinct)))
            out = bundle.run(self.split, self.templates[layer_id], x, B.take(table, inds))
            bundle.pending = out
            return out
        return self._chunked(bundle, layer, x, ids, distinct)

    def _chunked(self, bundle: ExpertRows, layer: LayerExperts, x, ids: np.ndarray, distinct: np.ndarray):
        """Pairs grouped by expert, one bundle-full of experts at a time. Each chunk runs the
        switch module on its pairs as rows of one expert each (k = 1): per pair, the same
        computation the whole call would do."""
        k = ids.shape[-1]
        flat = ids.reshape(-1)
        order = np.argsort(flat, kind="stable")  # pair positions grouped by expert, ascending
        sorted_ids = flat[order]
        x_rows = x.reshape(-1, x.shape[-1])  # [tokens, D]
        kernel = bundle.kernel(self.templates[layer.layer])
        outs, positions = [], []
        for start in range(0, len(distinct), bundle.capacity):
            chunk = distinct[start:start + bundle.capacity]
            lo = np.searchsorted(sorted_ids, chunk[0], side="left")
            hi = np.searchsorted(sorted_ids, chunk[-1], side="right")
            pos = order[lo:hi]
            self._load(bundle, layer.layer, chunk)
            local = np.searchsorted(chunk, sorted_ids[lo:hi]).astype(np.int32)
            xs = x_rows[B.array((pos // k).astype(np.int32))]
            out = self.split(kernel, xs, B.array(local[:, None]))[:, 0]  # [pairs, D]
            B.eval(out)  # the next chunk overwrites the bundle
            outs.append(out)
            positions.append(pos)
        inverse = np.argsort(np.concatenate(positions), kind="stable").astype(np.int32)
        y = B.concatenate(outs, axis=0)[B.array(inverse)]
        return y.reshape(*ids.shape, y.shape[-1])
