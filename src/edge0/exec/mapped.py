"""Experts computed where the page cache holds them: no copy into a slot.

Where the checkpoint fits in memory and its reads are buffered, the bytes of every expert
a step needs are already in the page cache; reading them into slots copies them once more
(at the 35B tier about 130 MiB a token on 12 layers). ``MappedExperts`` maps each checkpoint
file read-only and binds every MoE layer's switch module to its stacked tensors where the
mapping holds them (``MappedSwitchLinear``: Edge0's kernel reading the file's bytes in
place), so a layer computes on the routing as it is: no read, no lookup table, no host
sync. Every path keeps its routing (exact the layer's own gate, staged the plan's routes);
only where the experts' bytes come from changes, and the numbers do not (the same kernel
on the same bytes as over slots).

A file changed under the engine: before each generation a file whose size or modification
time changed is mapped anew (``remap``, through ``Streaming.invalidate``); a layer whose
file is now shorter than its experts fails its request with an ``ExpertReadError``. A file
truncated during a step would turn the read past its end into SIGBUS; the kernels' guard
reads zeros there instead and fails the op (``MAPPED_TRUNCATED``), which the engine raises
as an ``ExpertReadError`` naming the file and answers by mapping it anew. ``expert_source``
chooses: ``mapping``, ``slots``, or ``auto`` (the mapping when Edge0's kernels run, reads are
buffered and the checkpoint fits with everything else planned; see ``resolve_source``).

A page of a mapping is in the process's page tables only once touched: the first step to
compute on an expert took a fault per 64 KiB of it. Once mapped, a thread puts every
expert's pages into the page tables (``Mapping.populate``: madvise ``MADV_POPULATE_READ``, in
chunks, stopped by a remap or close), as llama.cpp's ``MAP_POPULATE`` does at load.
"""

from __future__ import annotations

import threading

import numpy as np

from edge0.backend import io as bio
from edge0.backend import kernels as bk
from edge0.backend import nn as bnn
from edge0.errors import ConfigError, ExpertReadError, KernelError
from edge0.exec.taps import replaced
from edge0.model.checkpoint import CheckpointIndex, LayerExperts

SOURCES = ("auto", "mapping", "slots")
MAPPED_TRUNCATED = "edge0: the checkpoint file "  # how the kernels' guard names a file truncated while mapped
STACKS = ("weight", "scales", "biases")


def resolve_source(choice: str, *, kernels: str, direct: bool, fits: bool) -> str:
    """``expert_source`` -> ``mapping`` or ``slots``. ``auto``: the mapping when Edge0's
    kernels compute (``kernels``), expert reads go through the page cache (not ``direct``)
    and the checkpoint's files fit in memory beside everything else planned (``fits``);
    slots otherwise. ``mapping`` asked for where it cannot run is a ConfigError."""
    if choice not in SOURCES:
        raise ConfigError(f"expert_source must be one of {', '.join(SOURCES)}, got {choice!r}")
    if choice == "slots":
        return "slots"
    if choice == "mapping":
        if kernels != "edge0":
            raise ConfigError("expert_source='mapping' computes with Edge0's kernels, and kernels resolve to mlx "
                              "here (kernels='edge0' on MLX's CPU device with compute_dtype float32)")
        if direct:
            raise ConfigError("expert_source='mapping' reads experts through the page cache; direct_io is on "
                              "(direct_io='off', or expert_source='slots')")
        return "mapping"
    return "mapping" if kernels == "edge0" and not direct and fits else "slots"


class MappedExperts:
    """Each MoE layer's switch module bound to its experts where the checkpoint's mapping
    holds them; one read-only mapping per file, held while the engine is open."""

    def __init__(self, index: CheckpointIndex, templates: dict, layers: list[int]):
        self.index = index
        self.templates, self.layers = templates, list(layers)
        self.maps: dict[str, object] = {}  # file -> its mapping
        self.kernels: dict[int, object] = {}
        self.short: dict[int, tuple[str, int, int]] = {}  # a layer whose file is shorter than its experts
        self.populating: Populating | None = None
        self.remap()

    def remap(self) -> None:
        """Map every file anew and bind each layer to the new mappings (a file changed under
        the engine); a layer whose file no longer holds its experts is kept as short."""
        self._stop_populating()
        self.maps = {}
        self.kernels, self.short = {}, {}
        for layer in self.layers:
            experts = self.index.layers[layer]
            for t in experts.tensors:
                need = t.offset + self.index.spec.num_experts * t.row_bytes
                size = self._map(t.file).size
                if size < need:
                    self.short[layer] = (t.file, size, need)
                    break
            else:
                self.kernels[layer] = self._bind(experts, self.templates[layer])
        ranges = [(self.maps[t.file], t.offset, self.index.spec.num_experts * t.row_bytes)
                  for layer in self.kernels for t in self.index.layers[layer].tensors]
        self.populating = Populating(ranges)

    def _stop_populating(self) -> None:
        if self.populating is not None:
            self.populating.stop()
            self.populating = None

    def _map(self, path: str):
        if path not in self.maps:
            self.maps[path] = bk.mapping(path)
        return self.maps[path]

    def _bind(self, layer: LayerExperts, template):
        """``template`` with each quantized projection replaced by its mapped twin."""
        projections: dict[str, dict] = {}
        for name in layer.names:
            path, _, leaf = name.rpartition(".")
            projections.setdefault(path, {})[leaf] = layer.location(name)
        mapped = {}
        for path, locs in projections.items():
            module = bnn.module_at(template, path)
            if not all(s in locs for s in STACKS) or not bk.supported(module) or set(locs) - {*STACKS, "bias"}:
                raise ConfigError(f"layer {layer.layer}: {path} is not an affine-quantized expert stack Edge0's "
                                  "kernels compute; expert_source='slots'")
            weight = locs["weight"]
            stacks = {s: (self._map(locs[s].file), locs[s].offset, locs[s].dtype) for s in STACKS}
            try:
                mapped[path] = bk.MappedSwitchLinear(stacks, self.index.spec.num_experts, weight.row_shape[0],
                                                     module.bits, module.group_size,
                                                     bias=_rows(locs["bias"], self.index.spec.num_experts)
                                                     if "bias" in locs else None)
            except KernelError as e:
                raise ConfigError(f"layer {layer.layer}: {path}: {e}; expert_source='slots'") from None
        return replaced(template, mapped)

    def run(self, split, layer: int, x, inds):
        """Layer ``layer``'s routed experts for ``x`` on routing ``inds`` (expert ids)."""
        if layer in self.short:
            file, size, need = self.short[layer]
            raise ExpertReadError(f"short: the file holds {size} bytes, the layer's experts end at byte {need} "
                                  "(it changed under the engine)", file=file, layer=layer)
        return split(self.kernels[layer], x, inds)

    def close(self) -> None:
        """Let go of the mappings (unmapped once no pending computation holds them): a file
        a process maps keeps its pages in the page cache, which a direct-reads engine opened
        later drops to give the memory to its own cache."""
        self._stop_populating()
        self.kernels, self.maps, self.short = {}, {}, {}

    def resident_bytes(self) -> int:
        """Bytes of the mapped files in memory now (the page cache's pages they map)."""
        return sum(m.resident() for m in self.maps.values())


class Populating:
    """A thread that puts ``ranges`` ((mapping, offset, bytes)) into the process's page
    tables, a chunk at a time; ``done`` is set when it ends (every range populated, a
    range refused, or stopped); ``populated``: the bytes it put there."""

    CHUNK = 16 * 2**20

    def __init__(self, ranges: list):
        self.ranges = ranges
        self.populated, self.refused = 0, False
        self.done, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="edge0-populate", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for mapping, offset, size in self.ranges:
                for start in range(offset, offset + size, self.CHUNK):
                    if self._stop.is_set():
                        return
                    if not mapping.populate(start, min(self.CHUNK, offset + size - start)):
                        self.refused = True  # a kernel before 5.14, or a file cut short: pages fault in as touched
                        return
                    self.populated += min(self.CHUNK, offset + size - start)
        finally:
            self.ranges = []  # the mappings are let go with the engine's
            self.done.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _rows(loc, num_experts: int):
    """A small stacked tensor (a per-expert output bias) read whole into memory."""
    buf = bio.RowBuffer(num_experts, loc.row_bytes)
    buf.host[:] = np.fromfile(loc.file, dtype=np.uint8, count=num_experts * loc.row_bytes,
                              offset=loc.offset).reshape(num_experts, loc.row_bytes)
    return buf.typed(loc.dtype, loc.row_shape)
