"""The exact path: route, deduplicate, read the experts, gather matmul. The oracle.

For the current tokens the distinct experts are read into a bundle (nine row buffers of
``capacity`` rows, shared by every layer), the routing indices are mapped to bundle rows
through a table with ``take``, and the quantized gather matmul runs over the bundle.
When a prefill needs more distinct experts than the bundle holds, the (token, expert)
pairs are processed in expert chunks, each pair exactly once.

The computation mirrors mlx-lm's SwitchGLU op for op (same sorting rule, same kernel), so
outputs are bit-identical to the resident model.
"""

from __future__ import annotations

import time

import numpy as np

from edge0.backend import core as B
from edge0.backend import io as bio
from edge0.backend import quant as Q
from edge0.checkpoint import CheckpointIndex, LayerExperts
from edge0.io_sched.reader import ExpertReader
from edge0.spec import PARTS, PROJECTIONS


def switch_glu(x, inds, weights: dict, layer: LayerExperts):
    """SwitchGLU over stacked expert weights ``weights[(proj, part)]`` indexed by ``inds``.

    x: [..., D]; inds: [..., k] into axis 0 of the weights. Returns [..., k, D].
    """
    x = B.expand_dims(x, (-2, -3))
    inds = B.stop_gradient(inds)
    do_sort = inds.size >= 64
    idx, inv_order = inds, None
    if do_sort:
        x, idx, inv_order = Q.sort_rows(x, inds)

    def proj(h, name):
        return Q.gather_qmm(h, weights[(name, "weight")], weights[(name, "scales")], weights[(name, "biases")],
                            idx, bits=layer.bits[name], group_size=layer.group_size[name], sorted_indices=do_sort)

    h = Q.glu(proj(x, "up_proj"), proj(x, "gate_proj"))
    out = proj(h, "down_proj")
    if do_sort:
        out = Q.unsort_rows(out, inv_order, inds.shape)
    return out.squeeze(-2)


class ExpertRows:
    """Nine row buffers (one per stacked tensor) of ``capacity`` expert rows each: the exact
    path's bundle, a staged layer's slots, a hot set, a whole-layer buffer."""

    def __init__(self, layer: LayerExperts, capacity: int):
        self.capacity = capacity
        self.layout = tuple((t.dtype, t.row_shape, t.row_bytes) for t in layer.tensors)
        self.buffers = [bio.RowBuffer(capacity, t.row_bytes) for t in layer.tensors]
        self.weights = {
            (p, q): buf.typed(t.dtype, t.row_shape)
            for (p, q), buf, t in zip(((p, q) for p in PROJECTIONS for q in PARTS), self.buffers, layer.tensors)
        }
        self.pending = None  # last lazy output that reads these buffers

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def settle(self) -> None:
        """Evaluate the pending graph that reads the buffers, so they can be overwritten."""
        if self.pending is not None:
            B.eval(self.pending)
            self.pending = None


class ExactExecutor:
    """On-demand, deduplicated expert execution over a shared bundle (host sync per layer)."""

    def __init__(self, index: CheckpointIndex, reader: ExpertReader, capacity: int, log=None):
        self.index = index
        self.reader = reader
        self.num_experts = index.spec.num_experts
        self.capacity = max(capacity, index.spec.k)
        self._bundles: dict[tuple, ExpertRows] = {}
        self.recorder = None  # a RoutingRecorder while an oracle is being recorded
        self.log = log

    def bundle_for(self, layer: LayerExperts) -> ExpertRows:
        key = tuple((t.dtype, t.row_shape, t.row_bytes) for t in layer.tensors)
        if key not in self._bundles:
            self._bundles[key] = ExpertRows(layer, self.capacity)
        return self._bundles[key]

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
            table = np.zeros(self.num_experts, dtype=np.int32)
            table[distinct] = np.arange(len(distinct), dtype=np.int32)
            out = switch_glu(x, B.take(B.array(table), inds), bundle.weights, layer)
            bundle.pending = out
            return out
        return self._chunked(bundle, layer, x, ids, distinct)

    def _chunked(self, bundle: ExpertRows, layer: LayerExperts, x, ids: np.ndarray, distinct: np.ndarray):
        """Pairs grouped by expert, one bundle-full of experts at a time."""
        k = ids.shape[-1]
        flat = ids.reshape(-1)
        order = np.argsort(flat, kind="stable")  # pair positions grouped by expert, ascending
        sorted_ids = flat[order]
        x_rows = x.reshape(-1, 1, x.shape[-1])  # [tokens, 1, D], as SwitchGLU after sorting
        outs, positions = [], []
        for start in range(0, len(distinct), bundle.capacity):
            chunk = distinct[start:start + bundle.capacity]
            lo = np.searchsorted(sorted_ids, chunk[0], side="left")
            hi = np.searchsorted(sorted_ids, chunk[-1], side="right")
            pos = order[lo:hi]
            self._load(bundle, layer.layer, chunk)
            local = np.searchsorted(chunk, sorted_ids[lo:hi]).astype(np.int32)
            xs = x_rows[B.array((pos // k).astype(np.int32))]
            w = bundle.weights

            def proj(h, name, local_idx):
                return Q.gather_qmm(h, w[(name, "weight")], w[(name, "scales")], w[(name, "biases")], local_idx,
                                    bits=layer.bits[name], group_size=layer.group_size[name], sorted_indices=True)

            li = B.array(local)
            h = Q.glu(proj(xs, "up_proj", li), proj(xs, "gate_proj", li))
            out = proj(h, "down_proj", li)
            B.eval(out)  # the next chunk overwrites the bundle
            outs.append(out)
            positions.append(pos)
        inverse = np.argsort(np.concatenate(positions), kind="stable").astype(np.int32)
        y = B.concatenate(outs, axis=0)[B.array(inverse)]
        return y.reshape(*ids.shape, x.shape[-1])
