"""Row buffers of expert weights, and mapping routing indices onto them.

Every executor path computes a layer's routed experts the same way: the experts it needs
are rows of an ``ExpertRows`` buffer (one row buffer per stacked tensor), a table built on
the host maps each expert id to its row (``lookup_table``), ``take`` maps the routing
indices through it on the device, and the layer's own switch module, bound to the rows,
computes (``ExpertRows.run``).
"""

from __future__ import annotations

import numpy as np

from edge0.backend import core as B
from edge0.backend import io as bio
from edge0.model.checkpoint import LayerExperts
from edge0.exec.taps import bind


def row_phase(loc) -> int | None:
    """The memory phase that lets a direct read of ``loc``'s experts land in place: its file
    offset's, when every expert row keeps it (row bytes a whole number of pages) and its
    dtype stays aligned (offset a multiple of 8); else None (direct reads bounce)."""
    page = bio.PAGE
    return loc.offset % page if loc.row_bytes % page == 0 and loc.offset % 8 == 0 else None


class ExpertRows:
    """One row buffer per stacked tensor of a layer, ``capacity`` expert rows each: the
    exact path's bundle, a staged layer's slots, a hot set, a whole-layer buffer.
    ``kernel(template)`` is the switch module bound to these rows."""

    def __init__(self, layer: LayerExperts, capacity: int):
        self.capacity = capacity
        self.layout = layer.layout
        self.buffers = [bio.RowBuffer(capacity, t.row_bytes, row_phase(t)) for t in layer.tensors]
        self._names, self._tensors = layer.names, layer.tensors
        self._phases = None
        self._views: dict[tuple, dict] = {}  # the buffers' phases -> typed views of them laid out so
        self._kernels: dict[tuple, object] = {}
        self.pending = None  # last lazy output that reads these buffers
        self._lay_out()

    def _lay_out(self) -> None:
        self._phases = tuple(b.phase for b in self.buffers)
        views = self._views.get(self._phases)
        if views is None:
            views = self._views[self._phases] = {name: buf.typed(t.dtype, t.row_shape)
                                                 for name, buf, t in zip(self._names, self.buffers, self._tensors)}
        self.views = views

    def use(self, layer: LayerExperts) -> "ExpertRows":
        """These rows laid out for ``layer`` (of the same layout): each buffer moved to the
        phase of ``layer``'s tensor, so that direct reads of another layer than the one they
        were made for (a bundle or whole-layer buffer shared by layers) land in place too.
        What the rows held is not kept: call before reading ``layer``'s experts into them,
        with no pending graph reading them (``settle``)."""
        for buf, t in zip(self.buffers, layer.tensors):
            phase = row_phase(t)
            if phase is not None and phase != buf.phase:
                buf.set_phase(phase)
        self._lay_out()
        return self

    def kernel(self, template):
        """``template`` (a layer's switch module) computing over these rows as they are laid
        out now (cached per layout)."""
        key = (id(template), self._phases)
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = bind(template, self.views)
        return k

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def settle(self) -> None:
        """Evaluate the pending graph that reads the buffers, so they can be overwritten."""
        if self.pending is not None:
            B.eval(self.pending)
            self.pending = None

    def run(self, split, template, x, local):
        """``template``'s computation over these rows for input ``x`` and ``local`` routing
        indices (row numbers in this buffer, not expert ids), on ``split``'s streams."""
        return split(self.kernel(template), x, local)


def lookup_table(num_experts: int, experts, rows, missing: int = 0):
    """An expert id -> buffer row table (int32, on the device) for ``take``: ``experts[i]`` is
    in row ``rows[i]``; every other expert maps to ``missing``. Built on the host from the
    step's plan, so the routing indices never leave the device."""
    table = np.full(num_experts, missing, dtype=np.int32)
    table[np.asarray(list(experts), dtype=np.int64)] = np.asarray(list(rows), dtype=np.int32)
    return B.array(table)
