"""The whole-layer path: every expert of a layer in one read per stacked tensor, for prefill.

A prefill touches nearly every expert, so reading the layer's stacked tensors whole
(a few large reads) beats assembling bundles. Two buffers of E experts alternate: while
layer l computes from one, layer l+1 loads into the other. The routing indices are used
as they are (every expert is present): no host sync on the routing.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from edge0.backend import core as B
from edge0.model.checkpoint import CheckpointIndex
from edge0.errors import ConfigError
from edge0.exec.rows import ExpertRows, Split
from edge0.io_sched.reader import ExpertReader


class WholeLayerExecutor:
    def __init__(self, index: CheckpointIndex, reader: ExpertReader, layers: list[int], templates: dict, log=None,
                 split=None):
        self.index = index
        self.split = split if split is not None else Split(1)
        self.templates = templates
        self.reader = reader
        self.layers = sorted(layers)  # the layers on this path, in execution order
        layouts = {index.layers[l].layout for l in self.layers}
        if len(layouts) > 1:
            raise ConfigError("whole_layer needs every layer on it to share one expert layout (bits, group "
                              f"size, shapes); layers {self.layers} differ: use layer_paths to exclude some")
        self.log = log
        self.buffers: list[ExpertRows] = []
        self.holds: list[tuple[int, Future] | None] = [None, None]  # buffer -> (layer, load)
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge0-layer-load")

    def close(self) -> None:
        self._loader.shutdown(wait=True)

    def invalidate(self) -> None:
        """Forget which layer each buffer holds (after a read error or a changed file)."""
        for i, hold in enumerate(self.holds):
            if hold is not None:
                try:
                    hold[1].result()
                except BaseException:
                    pass
            self.holds[i] = None

    def _buffers(self) -> list[ExpertRows]:
        if not self.buffers:
            layer = self.index.layers[self.layers[0]]
            self.buffers = [ExpertRows(layer, self.index.spec.num_experts) for _ in range(2)]
        return self.buffers

    def _load(self, layer: int, buf: int) -> Future:
        rows = self._buffers()[buf].use(self.index.layers[layer])  # the layer's phases: reads land in place

        def run():
            t0 = time.perf_counter()
            n = self.reader.read_layer(layer, rows.buffers)
            if self.log is not None:
                self.log.debug("whole_layer.load", layer=layer, bytes=n, ms=round(1e3 * (time.perf_counter() - t0), 3))
            return n

        future = self._loader.submit(run)
        self.holds[buf] = (layer, future)
        return future

    def __call__(self, layer: int, x, inds):
        B.eval(x)  # the layers below are done, so the buffer they used may be refilled
        buffers = self._buffers()
        buf = next((i for i, h in enumerate(self.holds) if h and h[0] == layer), None)
        if buf is None:
            buf = next((i for i, h in enumerate(self.holds) if h is None or h[1].done()), 0)
            self._load(layer, buf)
        try:
            self.holds[buf][1].result()
        except BaseException:
            self.holds[buf] = None
            raise
        later = [l for l in self.layers if l > layer]
        other = 1 - buf
        if later and not (self.holds[other] and self.holds[other][0] == later[0]):
            buffers[other].settle()
            if self.holds[other] is not None:
                self.holds[other][1].result()  # never refill a buffer a load is still writing
            self._load(later[0], other)
        out = buffers[buf].run(self.split, self.templates[layer], x, inds)
        buffers[buf].pending = out
        return out
