"""The loaded model as it runs: ``Streaming`` (the model, its executors, heads and adapters)
and ``StepModel``, its forward pass with Edge0's step hook in front, which the batch loop
calls; the hooks the owners' blocks feed the prerouter through; ``probe_routing``, which runs a
layer's own routing code on given logits (the prerouter's predictions become experts there).
``edge0.loader`` builds a ``Streaming``."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.errors import ConfigError
from edge0.exec.plan import LayerRoute
from edge0.exec.taps import AdapterBank, StepPhase


class Streaming:
    """A loaded streaming model and the machinery behind its MoE layers."""

    pipeline = None  # this rank's part of a pipeline (edge0.exec.pipeline), or None: one process
    layers = None  # the MoE layers held here (None: every one)
    shown_heads = None  # the heads the stats line names (a pipeline's: all ranks')
    over_memory_routing = False  # the routing is the heads file's choice for a checkpoint over memory
    decode_hooks: tuple = ()  # called with the inputs before each decode step, in order (set when wired)

    def __init__(self, model, spec, index, reader, exact, hot, whole, stager, recorder, prerouter=None,
                 heads_path=None, adapters=None):
        self.model, self.spec, self.index, self.reader = model, spec, index, reader
        self.exact, self.hot, self.whole, self.stager, self.recorder = exact, hot, whole, stager, recorder
        self.prerouter, self.heads_path = prerouter, heads_path
        self.adapters: AdapterBank | None = adapters

    def describe_artifacts(self) -> tuple[str | None, str | None]:
        """(heads, adapter) as the stats line names them: what changes the output."""
        heads, h = None, self.shown_heads
        if h is not None:
            mode, extra = getattr(self, "routing", None) or ("replace", 0)
            how = (f"select k+{extra}" if mode == "select" else "replace") + \
                (", over memory" if self.over_memory_routing else "")
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
        if decode:
            for hook in self.decode_hooks:  # a pipeline's relay, the Stager's plan
                hook(inputs)

    def invalidate(self) -> None:
        """Forget every expert cached in slots, hot sets, whole-layer buffers and the expert cache."""
        for cache in (self.stager, self.hot, self.whole):
            if cache is not None:
                cache.invalidate()
        if self.reader.cache is not None:
            self.reader.cache.clear()

    def check_files(self, log=None) -> None:
        """Before a generation: a shard changed in place since the last one (size or
        modification time) invalidates what was cached from it; a changed header raises."""
        changed = self.reader.changed_files()
        if changed:
            if log is not None:
                log.warning("checkpoint.changed", files=changed, action="cached experts invalidated")
            self.invalidate()

    def explain(self, error: BaseException) -> BaseException:
        """``error`` raised by evaluating a step, as the typed error behind it (a staged
        layer's failed reads raise inside the step's graph)."""
        return self.stager.explain(error) if self.stager is not None else error

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
    (``edge0.batch``, ``edge0.prefill``) calls. ``inputs`` [rows, tokens]: one sequence's
    prompt chunk, or a decode step of one token for each row of a batch; ``decode``: which it
    is (None: a pass on one token per row is a decode step), which every tap and switch is
    told for the call (``StepPhase``). A step is ``plan`` then ``forward``; calling the model
    does both."""

    def __init__(self, streaming: Streaming):
        self.streaming = streaming

    def __call__(self, inputs, cache=None, decode: bool | None = None, **kwargs):
        decode = inputs.shape[-1] == 1 if decode is None else decode
        self.plan(inputs, decode)
        return self.forward(inputs, cache, decode, **kwargs)

    def plan(self, inputs, decode: bool) -> None:
        """Before the step's forward pass: the decode hooks (a pipeline's relay, then the
        Stager's plan: one flush of the heads, the step's reads submitted); a recording
        oracle's step."""
        with self._phase(decode):
            self.streaming.begin_step(inputs, decode)

    def forward(self, inputs, cache=None, decode: bool = True, **kwargs):
        """The model's own forward pass (lazy), its staged layers on the plan."""
        with self._phase(decode):
            return self.streaming.model(inputs, cache=cache, **kwargs)

    @contextmanager
    def _phase(self, decode: bool):
        phase = getattr(self.streaming, "phase", None)
        if phase is not None:
            phase.decode = decode
        try:
            yield
        finally:
            if phase is not None:
                phase.decode = None

    def __getattr__(self, name):
        return getattr(self.streaming.model, name)


def wire_prerouter(streaming: Streaming, prerouter, stager) -> None:
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


def _layer_parts(streaming: Streaming, layer: int) -> tuple:
    """Layer ``layer``'s block, router tap and switch (found once per layer)."""
    cache = streaming.__dict__.setdefault("_layer_parts", {})
    if layer not in cache:
        spec, model = streaming.spec, streaming.model
        cache[layer] = (bnn.module_at(model, spec.block_path(layer)), bnn.module_at(model, spec.layers[layer].router_path),
                        bnn.module_at(model, spec.switch_path(layer)))
    return cache[layer]


def probe_routing(streaming: Streaming, layer: int, logits, width: int | None = None):
    """Run layer ``layer``'s block on a dummy input with its router returning ``logits``
    [N, E] and its switch capturing instead of computing: the indices [N, k] the block's own
    routing code makes of those logits (or [N, width] with the block's width set to
    ``width`` for the call)."""
    spec = streaming.spec
    if spec.prerouter_problem:
        raise ConfigError(f"{spec.model_type}: {spec.prerouter_problem}")
    block, router, switch = _layer_parts(streaming, layer)
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


