"""Opening a checkpoint for streaming: checks, the resident model, executors, artifacts.

``load_streaming_model`` validates the directory (files, config values, headers) before any
constructor runs, builds mlx-lm's model, derives what to stream from it (``edge0.model.arch``),
replaces every expert stack by a ``StreamingSwitch`` and every router by a ``RouterTap``
(``edge0.exec.taps``; the blocks themselves run unchanged), loads the resident tensors,
wires the executor paths, the prerouter heads and the adapters found beside the checkpoint
(or named by the config), and returns a ``Streaming``: everything a generation needs. The
engine (``edge0.engine``) runs it.
"""

from __future__ import annotations

from pathlib import Path

from edge0.adapters import AdapterBank, load_adapters
from edge0.backend import core as B
from edge0.backend import kernels as bk
from edge0.backend import nn as bnn
from edge0.config import PATHS, PHASES, EngineConfig
from edge0.errors import ConfigError
from edge0.exec.budget import check_budget, check_resident, slot_ceiling, staged_slots
from edge0.exec.exact import ExactExecutor
from edge0.exec.hot import HotExecutor
from edge0.exec.oracle import OracleRouting, RoutingRecorder
from edge0.exec.pipeline import pipeline_part
from edge0.exec.plan import LayerRoute
from edge0.exec.split import Split, resolve_threads
from edge0.exec.staged import StagedExecutor, Stager
from edge0.exec.whole_layer import WholeLayerExecutor
from edge0.io_sched.direct import wants_direct
from edge0.io_sched.reader import ExpertReader
from edge0.model.files import check_entry
from edge0.model.open import open_model
from edge0.prerouter.files import HEADS_FILENAME, load_heads, serving_of
from edge0.prerouter.host import blas_threads_controllable
from edge0.prerouter.runtime import Prerouter
from edge0.exec.taps import RouterTap, StepPhase, StreamingSwitch


class Streaming:
    """A loaded streaming model and the machinery behind its MoE layers."""

    pipeline = None  # this rank's part of a pipeline (edge0.exec.pipeline), or None: one process
    layers = None  # the MoE layers held here (None: every one)

    def __init__(self, model, spec, index, reader, exact, hot, whole, stager, recorder, prerouter=None,
                 heads_path=None, adapters=None):
        self.model, self.spec, self.index, self.reader = model, spec, index, reader
        self.exact, self.hot, self.whole, self.stager, self.recorder = exact, hot, whole, stager, recorder
        self.prerouter, self.heads_path = prerouter, heads_path
        self.adapters: AdapterBank | None = adapters

    def describe_artifacts(self) -> tuple[str | None, str | None]:
        """(heads, adapter) as the stats line names them: what changes the output."""
        heads = None
        pipe = self.pipeline
        if self.prerouter is not None or (pipe is not None and pipe.heads is not None):
            h = pipe.heads if pipe is not None and pipe.heads is not None else self.prerouter.heads  # all ranks' heads
            mode, extra = getattr(self, "routing", None) or ("replace", 0)
            how = f"select k+{extra}" if mode == "select" else "replace"
            seen = ", token" if h.sees_token else ""
            heads = f"{Path(self.heads_path).name} ({len(h.owners)} heads, k={h.k}{seen}, {how})"
        adapter = None
        if self.adapters is not None and self.adapters.active in self.adapters.adapters:
            adapter = self.adapters.adapters[self.adapters.active].describe()
        return heads, adapter

    def blocks(self) -> dict:
        """MoE layer -> its block (mlx-lm's own module, running unchanged)."""
        return {l: bnn.module_at(self.model, self.spec.block_path(l)) for l in self.held_layers()}

    def switches(self) -> dict:
        """MoE layer -> the StreamingSwitch standing in its expert stack's place."""
        return {l: bnn.module_at(self.model, self.spec.switch_path(l)) for l in self.held_layers()}

    def routers(self) -> dict:
        """MoE layer -> the RouterTap standing in its router's place (layers with a router)."""
        held = set(self.held_layers())
        return {l: bnn.module_at(self.model, m.router_path) for l, m in self.spec.layers.items()
                if m.router_path and l in held}

    def held_layers(self) -> list[int]:
        """The MoE layers this process holds: every one, or a pipeline rank's."""
        return list(self.spec.moe_layers if self.layers is None else self.layers)

    def route(self, layer: int, logits, width: int | None = None):
        """The routing layer ``layer``'s own block code makes of router ``logits`` [N, E]:
        the expert indices [N, k] its switch stack would receive (no expert runs); with
        ``width``, the same routing code choosing ``width`` experts instead of k (the
        candidates select routing stages)."""
        return probe_routing(self, layer, logits, width)

    @property
    def embed(self):
        """The model's token embedding (ids -> rows), or None."""
        if not hasattr(self, "_embed"):
            self._embed = bnn.token_embedding(self.model)
        return self._embed

    @embed.setter
    def embed(self, value) -> None:  # a pipeline rank's: the rows the first rank relays
        self._embed = value

    @property
    def embed_dim(self) -> int:
        """Width of the token embedding's rows (0 when the model has none)."""
        if self.embed is None:
            return 0
        return int(self.embed(B.array([0])).shape[-1])

    def set_recorder(self, recorder) -> None:
        """Record the exact path's routing into ``recorder`` (None: stop recording)."""
        self.recorder = self.exact.recorder = recorder

    def begin_step(self, inputs, decode: bool | None = None) -> None:
        """Called before every forward pass (the step hook); ``decode`` False: a prompt
        chunk (of any length), which the staged layers do not plan."""
        if decode is None:
            decode = inputs.shape[-1] == 1
        if self.recorder is not None:
            self.recorder.begin_step(decode)
        if self.pipeline is not None and decode:
            self.pipeline.begin_step(inputs, self.embed)
        if self.stager is not None and decode:
            self.stager.begin_step(inputs)

    def invalidate(self) -> None:
        """Forget every expert cached in slots, hot sets and whole-layer buffers."""
        for cache in (self.stager, self.hot, self.whole):
            if cache is not None:
                cache.invalidate()

    def check_files(self, log=None) -> None:
        """Before a generation: a shard changed in place since the last one (size or
        modification time) invalidates what was cached from it; a changed header raises."""
        changed = self.reader.changed_files()
        if changed:
            if log is not None:
                log.warning("checkpoint.changed", files=changed, action="cached experts invalidated")
            self.invalidate()

    def pinned_slots(self) -> int:
        return sum(c.pinned_slots() for c in (self.stager, self.hot) if c is not None)

    def close(self) -> None:
        try:
            if self.stager is not None:
                self.stager.close()
            if self.whole is not None:
                self.whole.close()
        finally:
            self.reader.close()


class StepModel:
    """The model's forward pass with Edge0's step hook in front: what the batch loop
    (``edge0.batch``, ``edge0.prefill``) calls."""

    def __init__(self, streaming: Streaming):
        self.streaming = streaming

    def __call__(self, inputs, cache=None, decode: bool | None = None, **kwargs):
        """``inputs`` [rows, tokens]: one sequence's prompt chunk, or a decode step of one
        token for each row of a batch. ``decode``: which it is (None: a pass on one token per
        row is a decode step)."""
        decode = inputs.shape[-1] == 1 if decode is None else decode
        phase = getattr(self.streaming, "phase", None)
        if phase is not None:
            phase.decode = decode
        self.streaming.begin_step(inputs, decode)
        try:
            return self.streaming.model(inputs, cache=cache, **kwargs)
        finally:
            if phase is not None:
                phase.decode = None

    def __getattr__(self, name):
        return getattr(self.streaming.model, name)


def resolve_compute_dtype(name: str, config: dict) -> str:
    """``auto``: float32 on MLX's CPU backend, else the checkpoint's own float dtype."""
    if name != "auto":
        return name
    if B.is_cpu():
        return "float32"
    stored = config.get("torch_dtype") or (config.get("text_config") or {}).get("torch_dtype")
    return stored if stored in ("bfloat16", "float16", "float32") else "bfloat16"


def _kernels(config: EngineConfig, compute_dtype: str, templates: list) -> tuple[str, Split]:
    """The kernels the engine computes with (``edge0`` or ``mlx``) and the expert stacks'
    split over streams. Edge0's kernels split each call's output rows over their own
    threads, so a stack is one call; MLX's run one call per stream, one stream per thread.
    Edge0's are put in the templates before any executor binds one."""
    kernels = bk.resolve(config.kernels, cpu=B.is_cpu(), compute_dtype=compute_dtype)
    threads = resolve_threads(config.compute_threads)
    if kernels == "mlx":
        return kernels, Split(threads)  # streams of this (the compute) thread
    bk.set_threads(threads)
    bk.use_edge0(*templates)
    return kernels, Split(1)


def _paths(config: EngineConfig, layers: list[int], heads) -> dict[tuple[int, str], str]:
    """(layer, phase) -> executor path; the heads' consumer layers decode staged."""
    for layer, _, _ in config.layer_paths:
        if layer not in layers:
            raise ConfigError(f"layer_paths names layer {layer}, which is not a MoE layer; MoE layers: {layers}")
    decode = {l: config.path_for(l, "decode") for l in layers}
    if heads is not None:
        explicit = {l for l, ph, _ in config.layer_paths if ph == "decode"}
        for l in heads.consumers():
            if l in decode and l not in explicit:
                decode[l] = "staged"
        unpredicted = [l for l, p in decode.items() if p == "staged" and l not in heads.consumers()]
        if unpredicted:
            raise ConfigError(f"layers {unpredicted} decode staged but no prerouter head predicts them "
                              f"(heads predict {heads.consumers()})")
    path_of = {(l, "decode"): decode[l] for l in layers}
    path_of.update({(l, "prefill"): config.path_for(l, "prefill") for l in layers})
    return path_of


def _make_prerouter(config: EngineConfig, heads, width: int | None) -> Prerouter | None:
    """The decode-time prerouter over ``heads`` (None: no heads), its flush where
    ``prerouter_flush`` and ``prerouter_dtype`` resolve to; ``width``: experts staged per
    consumer (select routing), None: k (the prediction is the routing)."""
    if heads is None:
        return None
    dtype = config.prerouter_dtype
    if dtype == "auto":
        dtype = "float32" if B.is_cpu() else "float16"
    flush = config.prerouter_flush
    if flush == "auto":  # NumPy's float32 products on the CPU backend, held to one BLAS thread; else MLX
        flush = "numpy" if B.is_cpu() and dtype == "float32" and blas_threads_controllable() else "mlx"
    if flush == "numpy" and dtype != "float32":
        raise ConfigError(f"prerouter_flush numpy computes in float32; prerouter_dtype {dtype} needs "
                          "prerouter_flush mlx (or auto)")
    prerouter = Prerouter(heads, dtype=B.dtype(dtype), on_host=flush == "numpy")
    prerouter.width = width
    return prerouter


def load_streaming_model(model_dir: str | Path, config: EngineConfig, *, oracle: OracleRouting | None = None,
                         record: bool = False, log=None) -> Streaming:
    """Open ``model_dir`` for streaming: mlx-lm's model with every expert stack replaced by a
    StreamingSwitch and every router by a RouterTap, the resident tensors loaded, the
    executor paths, prerouter heads and adapters wired."""
    model_dir = Path(model_dir)
    opened = open_model(model_dir, config.experts_per_token)
    model, spec, raw, index, templates = opened.model, opened.spec, opened.raw, opened.index, opened.templates
    if oracle is None and config.oracle_file and config.staged_source != "prerouter":
        oracle = OracleRouting.load(config.oracle_file)
    if oracle is not None:
        oracle.check(spec.moe_layers, spec.num_experts)
    heads, heads_path, heads_meta = _load_heads(model_dir, config, oracle, spec)
    routing, extra = resolve_routing(config, heads_meta, spec, heads_path)
    pipe, config, heads = pipeline_part(config, model, spec, index, heads)
    layers = [l for l in spec.moe_layers if pipe is None or pipe.layout.holds(l)]
    path_of = _paths(config, layers, heads)
    on = {p: [l for l in layers if p in (path_of[l, "prefill"], path_of[l, "decode"])] for p in PATHS}
    slots = staged_slots(config, spec, spec.k + extra)
    if on["staged"] and extra and slots < spec.k + extra:  # (fewer than k: the Stager says so)
        raise ConfigError(f"slots_per_layer={slots} cannot hold the {spec.k + extra} experts select routing stages "
                          f"per layer (k={spec.k} + stage_extra={extra})")
    others = check_budget(spec, index, config, on["staged"], on["hot"], on["whole_layer"], slots)
    check_resident(model_dir, index, spec, pipe, others)
    reader = ExpertReader(index, config.reader_threads, log=log, direct=wants_direct(config.direct_io, index.files))
    phase, stager = StepPhase(), None  # the step hook says whether each forward pass decodes or prefills
    compute_dtype = resolve_compute_dtype(config.compute_dtype, raw)
    try:
        kernels, split = _kernels(config, compute_dtype, [templates[layer] for layer in layers])
        exact = ExactExecutor(index, reader, config.bundle_capacity, templates, log=log)
        exact.split = split
        recorder = RoutingRecorder() if record else None
        exact.recorder = recorder
        hot = HotExecutor(index, reader, config.hot_experts, exact, log=log) if on["hot"] else None
        whole = (WholeLayerExecutor(index, reader, on["whole_layer"], templates, log=log, split=exact.split)
                 if on["whole_layer"] else None)
        prerouter = _make_prerouter(config, heads, spec.k + extra if routing == "select" else None)
        if on["staged"]:
            stager = Stager(index, on["staged"], slots, reader, None if prerouter is not None else oracle,
                            readers=config.reader_threads, prefetch_depth=config.prefetch_depth, log=log,
                            prerouter=prerouter, fallback=exact, guard_every=config.guard_every,
                            routing=routing if prerouter is not None else "replace",
                            max_slots=slot_ceiling(config, index, on["staged"], slots, others))
        paths = {"exact": exact, "hot": hot, "whole_layer": whole,
                 "staged": StagedExecutor(stager) if stager is not None else None}
        for layer in layers:
            template = templates[layer]
            width_out = bnn.switch_output_width(template)
            executors = {ph: paths[path_of[layer, ph]] for ph in PHASES}
            bnn.set_module_at(model, spec.switch_path(layer), StreamingSwitch(layer, template, executors, width_out,
                                                                                 phase))
        skip = spec.is_expert_key
        if pipe is not None:
            pipe.strip(B.dtype(compute_dtype))
            skip = lambda key: spec.is_expert_key(key) or pipe.remote_key(key)
        model = bnn.load_resident(model, model_dir, raw, index.files, skip, B.dtype(compute_dtype))
        if kernels == "edge0":
            bk.use_edge0(model)  # attention, shared experts, lm_head, quantized routers
        else:
            bnn.split_projections(model, exact.split.threads)  # attention and other large projections: both cores too
        for layer, m in spec.layers.items():
            if m.router_path and layer in layers:
                original = bnn.module_at(model, m.router_path)
                bnn.set_module_at(model, m.router_path, RouterTap(layer, original, m.router_kind, m.router_outputs,
                                                                             phase))
        adapters = load_adapters(model_dir, config, model, spec, heads_path, log,
                                  held=None if pipe is None else (lambda m: not pipe.remote_module(m)))
    except BaseException:
        if stager is not None:
            stager.close()
        reader.close()
        raise
    streaming = Streaming(model, spec, index, reader, exact, hot, whole, stager, recorder, prerouter, heads_path,
                          adapters)
    streaming.compute_dtype = compute_dtype
    streaming.kernels = kernels
    streaming.kernels_label = bk.describe() if kernels == "edge0" else "mlx"
    streaming.phase, streaming.pipeline, streaming.layers, streaming.path_of = phase, pipe, layers, path_of
    streaming.routing = (routing, extra) if prerouter is not None or (pipe is not None and pipe.heads) else None
    return _wired(streaming, prerouter, stager, heads, routing, extra)


def _wired(streaming: Streaming, prerouter, stager, heads, routing: str, extra: int) -> Streaming:
    """The prerouter checked and wired to its owners and the Stager; a pipeline rank's
    boundaries wired (its heads that see the token take the rows the first rank sends)."""
    pipe = streaming.pipeline
    if pipe is not None and pipe.rank > 0 and heads is not None and heads.sees_token:
        streaming.embed = pipe.relayed_embedding(heads.token_dim)
    try:
        if prerouter is not None:
            _check_prerouter_fits(streaming, prerouter, routing, extra)
            _wire_prerouter(streaming, prerouter, stager)
        if pipe is not None:
            pipe.wire(streaming, prerouter)
    except BaseException:
        streaming.close()
        raise
    return streaming


def resolve_routing(config: EngineConfig, meta: dict | None, spec, heads_path) -> tuple[str, int]:
    """(routing mode, experts staged beyond k): the config's, else what the heads file
    records (replace when it records nothing); select without a count stages 2k. Without
    heads (``meta`` None) nothing is predicted: the staged set is the routed set."""
    if meta is None:
        return "replace", 0
    recorded = serving_of(meta, heads_path)
    mode = config.routing if config.routing != "auto" else recorded["routing"]
    if mode == "replace":
        if config.stage_extra:
            raise ConfigError(f"stage_extra={config.stage_extra} applies to routing 'select' (the heads file "
                              f"{heads_path} is served with routing 'replace'; pass --routing select)")
        return "replace", 0
    if config.stage_extra is not None:
        extra = config.stage_extra
    elif recorded["routing"] == "select":
        extra = recorded["stage_extra"]
    else:
        extra = spec.k
    if spec.k + extra > spec.num_experts:
        raise ConfigError(f"stage_extra={extra}: k + stage_extra = {spec.k + extra} is more than the "
                          f"{spec.num_experts} experts of a layer")
    return "select", extra


def _check_prerouter_fits(streaming: Streaming, prerouter, routing: str, extra: int) -> None:
    """Heads that see the token need an embedding of their width; select routing needs
    a routing width Edge0 can change, and room for k + extra experts in the groups a
    sigmoid-group router keeps (or every expert staged)."""
    heads, spec = prerouter.heads, streaming.spec
    if heads.sees_token and streaming.embed_dim != heads.token_dim:
        raise ConfigError(f"prerouter heads {streaming.heads_path} see a token embedding of width {heads.token_dim}; "
                          f"this model's is {streaming.embed_dim or 'missing'}")
    if routing != "select":
        return
    for layer in heads.consumers():
        if not width_attributes(streaming, layer):
            raise ConfigError(f"{spec.model_type}: select routing needs to widen layer {layer}'s routing, whose "
                              f"width is kept where Edge0 cannot find it (none of {WIDTH_ATTRIBUTES}); use "
                              "--routing replace")
        gate = getattr(streaming.routers()[layer], "original", None)
        groups, kept = getattr(gate, "n_group", 1) or 1, getattr(gate, "topk_group", None)
        if isinstance(groups, int) and isinstance(kept, int) and groups > 1:
            room = kept * (spec.num_experts // groups)
            if room < spec.k + extra < spec.num_experts:  # every expert staged: the mask changes nothing
                raise ConfigError(f"stage_extra={extra}: layer {layer} keeps {kept} of {groups} expert groups, room "
                                  f"for {room} experts; k + stage_extra = {spec.k + extra}")


def _wire_prerouter(streaming: Streaming, prerouter, stager) -> None:
    """Owners feed the prerouter (their router's input, then the experts their block routed
    to); the prerouter routes its predictions through the consumers' own blocks and embeds
    the step's token; the Stager hands each staged router its route of every step's plan."""
    prerouter.connect(route=streaming.route, embed=lambda ids: streaming.embed(ids))
    routers = streaming.routers()
    watch = _watcher(prerouter)
    for l, switch in streaming.switches().items():
        if l in prerouter.owners:
            routers[l].watch = watch
            switch.observer = _observer(prerouter, switch.phase)
    if stager is not None:
        stager.routers = {l: routers[l] for l in stager.layers}


def _observer(prerouter, phase: StepPhase):
    def observe(layer: int, inds) -> None:
        prerouter.on_experts(layer, inds, phase.decode)
    return observe


def _watcher(prerouter):
    def watch(layer: int, x, tap) -> None:
        prerouter.on_router_input(layer, x)
    return watch


# the names mlx-lm's blocks and gates give their routing width
WIDTH_ATTRIBUTES = ("top_k", "num_experts_per_tok", "num_experts_per_token", "n_activated_experts",
                    "experts_per_token", "moe_topk", "k")


def width_attributes(streaming: Streaming, layer: int) -> list[tuple[object, str]]:
    """(module, attribute) pairs holding layer ``layer``'s routing width k in its block and
    router (and the router's original module): what ``probe_routing`` widens. Empty when
    the block keeps k where Edge0 cannot find it. Found once per layer (the flush widens
    every consumer at every step)."""
    cache = streaming.__dict__.setdefault("_width_attributes", {})
    if layer not in cache:
        cache[layer] = _find_width_attributes(streaming, layer)
    return cache[layer]


def _find_width_attributes(streaming, layer: int) -> list[tuple[object, str]]:
    spec = streaming.spec
    block = bnn.module_at(streaming.model, spec.block_path(layer))
    router = bnn.module_at(streaming.model, spec.layers[layer].router_path)
    found = []
    for module in (block, router, getattr(router, "original", None)):
        for name in WIDTH_ATTRIBUTES:
            value = getattr(module, name, None) if module is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value == spec.k:
                found.append((module, name))
    return found


def probe_routing(streaming: Streaming, layer: int, logits, width: int | None = None):
    """Run layer ``layer``'s block on a dummy input with its router returning ``logits``
    [N, E] and its switch capturing instead of computing: the indices [N, k] the block's own
    routing code makes of those logits (or [N, width] with the block's width set to
    ``width`` for the call)."""
    spec = streaming.spec
    if spec.prerouter_problem:
        raise ConfigError(f"{spec.model_type}: {spec.prerouter_problem}")
    block = bnn.module_at(streaming.model, spec.block_path(layer))
    router = bnn.module_at(streaming.model, spec.layers[layer].router_path)
    switch = bnn.module_at(streaming.model, spec.switch_path(layer))
    widened = []
    if width is not None and width != spec.k:
        widened = width_attributes(streaming, layer)
        if not widened:
            raise ConfigError(f"{spec.model_type}: the routing width of layer {layer} is kept where Edge0 cannot "
                              f"change it (none of {WIDTH_ATTRIBUTES} on its block or gate), so select routing "
                              "cannot choose its candidates; use routing 'replace'")
    n = logits.shape[0]
    captured: list = []
    previous = router.route
    router.route, switch.capture = LayerRoute("replace", logits, scope="probe"), captured
    for module, name in widened:
        setattr(module, name, width)
    try:
        block(B.zeros((n, 1, spec.block_input), dtype=logits.dtype))
    finally:
        router.route, switch.capture = previous, None
        for module, name in widened:
            setattr(module, name, spec.k)
    return captured[0].reshape(n, -1)


def _load_heads(model_dir: Path, config: EngineConfig, oracle, spec):
    """(the prerouter heads to use, their file, its metadata), or (None, None, None)."""
    if config.prerouter == "off" or config.staged_source == "oracle" or (
            config.staged_source == "auto" and oracle is not None):
        return None, None, None
    path = Path(config.prerouter_file) if config.prerouter_file else model_dir / HEADS_FILENAME
    if not path.exists():
        if config.prerouter == "on" or config.staged_source == "prerouter" or config.prerouter_file:
            raise ConfigError(f"prerouter heads {path} do not exist (train them with `edge0 train heads`)")
        return None, None, None
    if not config.prerouter_file:
        check_entry(model_dir, HEADS_FILENAME)
    if spec.prerouter_problem:
        raise ConfigError(f"prerouter heads {path} cannot drive {spec.model_type}: {spec.prerouter_problem} "
                          "(use --prerouter off)")
    heads, meta = load_heads(path, model_dir, spec=spec)
    return heads, path, meta
