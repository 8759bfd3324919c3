"""Row buffers of expert weights, the computation every path shares, and the exact path.

Every executor path computes a layer's routed experts the same way: the experts it needs
are rows of an ``ExpertRows`` buffer (one row buffer per stacked tensor), a table built on
the host maps each expert id to its row (``lookup_table``), ``take`` maps the routing
indices through it on the device, and the layer's own switch module, bound to the rows,
computes (``ExpertRows.run``).

Both cores on one MoE layer (``Split``): a single MLX op runs on one core, and the expert
stack is most of a decode step. The stack's output has one row per (token, expert slot),
each computed from its own expert's weights alone, so the call can be cut along the expert
slots (or, for single-slot calls, along the tokens) into groups that run on different
streams (MLX gives each CPU stream its own thread) and be put back together in order: every
row is the same computation on the same inputs, and the result is bit-identical to one
call. The graph stays lazy: nothing waits.

The exact path (``ExactExecutor``), the oracle the others are checked against: for the
current tokens the distinct experts are read into a bundle (``capacity`` rows, shared by
the layers with the same layout), the routing indices are mapped to bundle rows, and the
block's own switch module runs on the bundle. When a prefill needs more distinct experts
than the bundle holds, the (token, expert) pairs are processed in expert chunks, each pair
exactly once. The computation is the switch module's own code on the same rows, so outputs
are bit-identical to the resident model.

The staged path's rows (``SlotPool``): each staged layer's slots, an ``ExpertRows`` the
``PrefetchScheduler`` reads into from its own event-loop thread, and each layer's
readiness flags, which the step's graph waits on (``edge0.exec.staged`` plans the steps).
"""

from __future__ import annotations

import os
import time

import numpy as np

from edge0.backend import core as B
from edge0.backend import io as bio
from edge0.model.checkpoint import CheckpointIndex, LayerExperts
from edge0.exec.taps import bind
from edge0.io_sched.reader import ExpertReader, SlotStore
from edge0.io_sched.scheduler import READY_TIMEOUT_S, PrefetchScheduler
from edge0.worker import EventLoopThread


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

    def run(self, split, template, x, local, gate=None):
        """``template``'s computation over these rows for input ``x`` and ``local`` routing
        indices (row numbers in this buffer, not expert ids), on ``split``'s streams.
        ``gate`` (view -> view): what every stacked tensor passes through first, so that
        each op reading the rows (a cast of the scales included) waits for what the gate
        waits for (a staged layer's readiness)."""
        if gate is None:
            return split(self.kernel(template), x, local)
        return split(bind(template, {name: gate(view) for name, view in self.views.items()}), x, local)


def lookup_table(num_experts: int, experts, rows, missing: int = 0):
    """An expert id -> buffer row table (int32, on the device) for ``take``: ``experts[i]`` is
    in row ``rows[i]``; every other expert maps to ``missing``. Built on the host from the
    step's plan, so the routing indices never leave the device."""
    table = np.full(num_experts, missing, dtype=np.int32)
    table[np.asarray(list(experts), dtype=np.int64)] = np.asarray(list(rows), dtype=np.int32)
    return B.array(table)


def resolve_threads(n: int) -> int:
    """``compute_threads`` 0 (auto): every core this process may run on (its CPU affinity:
    ``taskset``, a cpuset) on the CPU backend, 1 elsewhere."""
    if n:
        return n
    if not B.is_cpu():
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform (macOS)
        return max(1, os.cpu_count() or 1)


class Split:
    """Runs ``kernel(x, inds)`` over ``threads`` streams of the thread that builds the graph
    (streams belong to their thread, so each calling thread uses its own)."""

    def __init__(self, threads: int):
        self.threads = threads

    @property
    def streams(self) -> list:
        return B.compute_streams(self.threads)

    def __call__(self, kernel, x, inds):
        n = self.threads
        k = inds.shape[-1]
        if n == 1:
            return kernel(x, inds)
        streams = self.streams
        if k >= 2:  # groups of expert slots: output [..., k, D]
            parts = min(n, k)
            bounds = [k * i // parts for i in range(parts + 1)]
            outs = []
            for i in range(parts):
                with B.on_stream(streams[i]):
                    outs.append(kernel(x, inds[..., bounds[i]:bounds[i + 1]]))
            return B.concatenate(outs, axis=-2)
        rows = inds.shape[0]  # one slot per row (chunked prefill): groups of rows
        if inds.ndim != 2 or x.ndim != 2 or rows < n:
            return kernel(x, inds)
        bounds = [rows * i // n for i in range(n + 1)]
        outs = []
        for i in range(n):
            with B.on_stream(streams[i]):
                outs.append(kernel(x[bounds[i]:bounds[i + 1]], inds[bounds[i]:bounds[i + 1]]))
        return B.concatenate(outs, axis=0)


class ExactExecutor:
    """On-demand, deduplicated expert execution over a shared bundle (host sync per layer)."""

    def __init__(self, index: CheckpointIndex, reader: ExpertReader, capacity: int, templates: dict, log=None,
                 mapped=None):
        """``mapped``: an ``edge0.exec.mapped.MappedExperts``: every layer computes from the
        checkpoint's mapping on its routing as it is (no read, no bundle, no host sync but a
        recorder's)."""
        self.index = index
        self.mapped = mapped
        self.reader = reader
        self.num_experts = index.spec.num_experts
        self.capacity = max(capacity, index.spec.k)
        self._bundles: dict[tuple, ExpertRows] = {}
        self.templates = templates  # layer -> its switch module (the kernel's code)
        self.recorder = None  # a RoutingRecorder while an oracle is being recorded
        self.log = log
        self.split = Split(1)  # the loader sets the engine's

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
        if self.mapped is not None:
            if self.recorder is not None:
                self.recorder.record(layer_id, B.to_host(inds))
            return self.mapped.run(self.split, layer_id, x, inds)
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


class SlotPool:
    """The staged layers' slots and the scheduler that fills them: each layer's S slots (an
    ``ExpertRows``), read into by the ``PrefetchScheduler`` on its own event-loop thread
    (``portal`` calls into it from the compute thread). A layer's slots grow, doubling up to
    ``max_slots``, while a batch's union of experts needs more, and go back to S when the
    batch empties. The Stager plans the steps and computes on them."""

    def __init__(self, index: CheckpointIndex, layers: list[int], slots: int, reader: ExpertReader, *,
                 readers: int, prefetch_depth: int, max_slots: int | None = None, log=None):
        self.index, self.log = index, log
        self.slots = slots  # per layer, at open and after a batch empties
        self.max_slots = max(slots, min(max_slots or slots, index.spec.num_experts))
        self.rows = {l: ExpertRows(index.layers[l], slots) for l in layers}
        # each staged layer's readiness, two flags (a step's, and the next one's submitted
        # ahead): set by the reader that fills its slots, awaited inside the step's graph
        self.flags = B.ReadyFlags(2 * len(layers), READY_TIMEOUT_S)
        self.flag_of = {l: 2 * i for i, l in enumerate(layers)}
        self.tickets: dict[int, int] = {}  # step -> the value its flags take when ready (unique per pool)
        self._ticket = 0
        self.loop = EventLoopThread(name="edge0-io")
        self.portal = self.loop.portal
        self.scheduler = PrefetchScheduler(SlotStore(reader, {l: r.buffers for l, r in self.rows.items()}),
                                           {l: slots for l in layers}, readers=readers,
                                           prefetch_depth=prefetch_depth, log=log, signal=self._signal)
        self._entered = self.portal.wrap_async_context_manager(self.scheduler)
        self._entered.__enter__()

    def ticket(self, step: int) -> int:
        """The value ``step``'s flags take when its layers are ready (given once per step)."""
        if step not in self.tickets:
            self._ticket += 1
            self.tickets[step] = self._ticket
            for old in [s for s in self.tickets if s < step - 2]:
                del self.tickets[old]
        return self.tickets[step]

    def flag(self, layer: int, step: int) -> tuple[int, int]:
        """(flag index, value) that says ``layer``'s slots are ready for ``step``."""
        ticket = self.ticket(step)
        return self.flag_of[layer] + ticket % 2, ticket

    def _signal(self, layer: int, step: int, ok: bool) -> None:  # a reader thread or the loop
        ticket = self.tickets.get(step)
        if ticket is not None:
            self.flags.set(self.flag_of[layer] + ticket % 2, ticket if ok else -ticket)

    def nbytes(self) -> int:
        """Bytes the slots hold now (more than at open while a batch grew them)."""
        return sum(r.nbytes for r in self.rows.values())

    def resize(self, layer: int, n: int) -> bool:
        """Give ``layer`` ``n`` slots, keeping the experts of those kept; False (nothing
        changed) while a step still uses its slots."""
        if not self.portal.call(self.scheduler.idle, layer):
            return False
        old = self.rows[layer]
        new = ExpertRows(self.index.layers[layer], n)
        keep = min(n, old.capacity)
        for src, dst in zip(old.buffers, new.buffers):
            dst.host[:keep] = src.host[:keep]
        self.portal.call(self.scheduler.resize, layer, n, new.buffers)
        self.rows[layer] = new
        if self.log is not None:
            self.log.info("stage.slots", layer=layer, slots=n, was=old.capacity, mib=round(new.nbytes / 2**20, 1))
        return True

    def fits(self, layer: int, need: int) -> bool:
        """Whether ``need`` experts fit ``layer``'s slots, growing them (doubling, at most
        ``max_slots``) when they do not and the layer is idle."""
        have = self.rows[layer].capacity
        if need > have and have < self.max_slots:
            self.resize(layer, min(self.max_slots, max(need, 2 * have)))
        return need <= self.rows[layer].capacity

    def shrink(self) -> None:
        """Grown slots go back to ``slots``: memory follows the batch."""
        for layer, rows in self.rows.items():
            if rows.capacity > self.slots:
                self.resize(layer, self.slots)

    def close(self) -> None:
        if self.portal is None:
            return
        try:
            self._entered.__exit__(None, None, None)
        finally:
            self.loop.close()
            self.portal = None
