"""The loaded model as it runs: ``Streaming`` (the model, its executors, heads and adapters)
and ``StepModel``, its forward pass with Edge0's step hook in front, which the batch loop
calls; the hooks the owners' blocks feed the prerouter through; ``RoutingProbe``, which runs a
layer's own routing code on given logits (the prerouter's predictions become experts there).
``edge0.loader`` builds a ``Streaming``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.backend import kernels as bk
from edge0.errors import ConfigError, ExpertReadError
from edge0.exec.mapped import MAPPED_TRUNCATED
from edge0.exec.taps import AdapterBank, Step, StepContext, eye_gate, replaced
from edge0.prerouter.runtime import Observing


@dataclass(frozen=True)
class Parts:
    """What a loaded model is made of, handed whole to ``Streaming`` (``edge0.loader`` makes
    it): the model, its checkpoint's index and reader, the executor paths, the routing
    recorder, the prerouter and its file, the adapters, the ``StepContext`` its taps read,
    the kernels, ``layout`` (the loader's ``Layout``: a pipeline rank's part, the layers
    held, each layer's paths, the compute dtype, the memory plan), the routing served
    (None without heads), the heads the stats line names, the token embedding (a pipeline
    rank's: the rows the first rank relays), the decode hooks, in order, and the layers'
    routing functions (``Probes``)."""

    model: object
    index: object
    reader: object
    exact: object
    hot: object
    whole: object
    stager: object
    recorder: object
    prerouter: object
    heads_path: object
    adapters: object
    context: StepContext
    layout: object
    kernels: str
    kernels_label: str
    routing: tuple | None
    shown_heads: object
    embed: object
    decode_hooks: tuple
    probes: "Probes"


def _part(name: str):
    return property(lambda self: getattr(self.parts, name))


def _laid_out(name: str):
    return property(lambda self: getattr(self.parts.layout, name))


class Streaming:
    """A loaded streaming model and the machinery behind its MoE layers, complete when
    constructed from its ``Parts``: its prerouter checked and wired to the owners, and the
    consumers' routing functions made."""

    model, index, reader, exact, hot, whole, stager = (_part(n) for n in ("model", "index", "reader", "exact", "hot",
                                                                         "whole", "stager"))
    prerouter, heads_path, adapters, kernels, kernels_label = (_part(n) for n in ("prerouter", "heads_path", "adapters",
                                                                                  "kernels", "kernels_label"))
    routing, shown_heads, embed, decode_hooks = (_part(n) for n in ("routing", "shown_heads", "embed", "decode_hooks"))
    compute_dtype, plan, layers, path_of = (_laid_out(n) for n in ("compute_dtype", "plan", "layers", "path_of"))
    pipeline = _laid_out("pipe")  # this rank's part of a pipeline (edge0.exec.pipeline), or None: one process
    over_memory_routing = _laid_out("over_memory_routing")  # the routing is the heads file's choice over memory

    def __init__(self, parts: Parts):
        self.parts = parts
        self.spec = parts.layout.opened.spec
        self.context = parts.context  # the Step its taps read, installed for each pass
        self.recorder = parts.recorder
        if parts.prerouter is not None:
            check_prerouter_fits(self, parts.prerouter, parts.layout.routing, parts.layout.extra)
            wire_prerouter(self, parts.prerouter)

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
        return self.parts.probes.route(layer, logits, width)

    def step(self, decode: bool, adapters=None, rows: int = 1, heads=None, routes=None) -> Step:
        """The ``Step`` of a forward pass of ``rows`` rows: its phase, the staged layers'
        routes (a decode step's plan) and slot routes (where the plan's reads put their
        experts), each row's adapter deltas (``adapters``: a name or
        None per row; None: the default adapter for every row), where the prerouter's
        owners put what they observe (``heads``, an ``Observing``). ``routes``: a verify
        pass's (made during the pass, ``DraftedRouting.routes``) in place of the plan's; its
        staged layers compute on their fallback path (its positions' experts were not read
        ahead)."""
        staged = decode and self.stager is not None and routes is None
        deltas = None
        if self.adapters is not None:
            deltas = self.adapters.deltas(adapters if adapters is not None else [self.adapters.active] * rows)
        return Step(decode=decode, routes=self.stager.routes() if staged else routes if routes is not None else {},
                    slots=self.stager.slot_routes() if staged else {}, deltas=deltas, heads=heads)

    @property
    def embed_dim(self) -> int:
        """Width of the token embedding's rows (0 when the model has none)."""
        rows = self.embed(B.array([0])) if self.embed is not None else None
        return 0 if rows is None else int(rows.shape[-1])

    def set_recorder(self, recorder) -> None:
        """Record the exact path's routing into ``recorder`` (None: stop recording)."""
        self.recorder = self.exact.recorder = recorder

    def begin_step(self, inputs, decode: bool | None = None, heads=None) -> None:
        """Called before every forward pass (the step hook); ``decode`` False: a prompt
        chunk (of any length), which the staged layers do not plan; ``heads``: what the
        prerouter observed of the rows' sequences (an ``Observed``), which plans the step."""
        if decode is None:
            decode = inputs.shape[-1] == 1
        if self.recorder is not None:
            self.recorder.begin_step(decode)
        if decode:
            for hook in self.decode_hooks:  # a pipeline's relay, the Stager's plan
                hook(inputs, heads)

    def invalidate(self) -> None:
        """Forget every expert cached in slots, hot sets, whole-layer buffers and the expert cache."""
        for cache in (self.stager, self.hot, self.whole):
            if cache is not None:
                cache.invalidate()
        if self.reader.cache is not None:
            self.reader.cache.clear()
        if self.exact.mapped is not None:  # the files mapped anew: a changed one as it is now
            self.exact.mapped.remap()

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
        layer's failed reads raise inside the step's graph; a mapped file truncated under a
        step is named by the kernels' guard)."""
        if isinstance(error, RuntimeError) and str(error).startswith(MAPPED_TRUNCATED):
            file = str(error)[len(MAPPED_TRUNCATED):].partition(" was truncated")[0]
            return ExpertReadError("truncated while mapped: the experts past its new end cannot be read", file=file)
        return self.stager.explain(error) if self.stager is not None else error

    def pinned_slots(self) -> int:
        return sum(c.pinned_slots() for c in (self.stager, self.hot) if c is not None)

    def close(self) -> None:
        try:
            if self.exact.mapped is not None:
                self.exact.mapped.close()
            if self.stager is not None:
                self.stager.close()
            if self.whole is not None:
                self.whole.close()
        finally:
            self.reader.close()


class StepModel:
    """The model's forward pass with Edge0's step hook in front: what the batch loop
    (``edge0.decoding``, ``edge0.prefill``) calls. ``inputs`` [rows, tokens]: one sequence's
    prompt chunk, or a decode step of one token for each row of a batch; ``decode``: which it
    is (None: a pass on one token per row is a decode step). A step is ``plan`` then
    ``forward``; calling the model does both. Each runs under its ``Step`` (what the taps
    read: the phase, the staged layers' routes, each row's adapter, where the prerouter's
    owners put what they observe), installed in the model's ``StepContext`` for the call and
    put back after.

    ``heads``: the pass's ``Observing``, made from what the prerouter observed of the rows'
    sequences; its ``after()`` is their value after the pass. A caller that gives none (one
    sequence: tools, benchmarks, training's quality runs) has this object keep that value
    for it from call to call (``observed``)."""

    def __init__(self, streaming: Streaming):
        self.streaming = streaming
        self.observed = None  # what the heads observed of the one sequence of callers that give no ``heads``

    def __call__(self, inputs, cache=None, decode: bool | None = None, adapters=None, heads=None, **kwargs):
        decode = inputs.shape[-1] == 1 if decode is None else decode
        own = heads is None and self.streaming.prerouter is not None
        if own:  # (a sequence's first chunk, on an empty cache, starts from nothing observed)
            heads = Observing(None if not decode and _empty(cache) else self.observed)
        self.plan(inputs, decode, heads)
        out = self.forward(inputs, cache, decode, adapters=adapters, heads=heads, **kwargs)
        if own:
            self.observed = heads.after()
        return out

    def plan(self, inputs, decode: bool, heads=None) -> None:
        """Before the step's forward pass: the decode hooks (a pipeline's relay, then the
        Stager's plan from what the heads observed, ``heads.before``: one flush of the
        heads, the step's reads submitted); a recording oracle's step."""
        with self.streaming.context.installed(Step(decode=decode)):
            self.streaming.begin_step(inputs, decode, heads.before if heads is not None else None)

    def forward(self, inputs, cache=None, decode: bool = True, adapters=None, heads=None, routes=None, **kwargs):
        """The model's own forward pass (lazy), its staged layers on the plan; ``adapters``:
        each row's adapter name (None: the default adapter for every row); ``heads``: where
        the owners' observations go (an ``Observing``); ``routes``: a verify pass's
        (``Streaming.step``)."""
        edge0 = self.streaming.kernels == "edge0"  # norms, rope and a prompt's attention on Edge0's kernels
        with self.streaming.context.installed(self.streaming.step(decode, adapters, inputs.shape[0], heads, routes)), \
                (bk.attention.active() if edge0 else contextlib.nullcontext()):
            return self.streaming.model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self.streaming.model, name)


def _empty(cache) -> bool:
    """Whether ``cache`` (mlx-lm's, one per layer) holds no token yet."""
    return cache is not None and all(getattr(c, "offset", 0) == 0 for c in cache)


def wire_prerouter(streaming: Streaming, prerouter) -> None:
    """The owners hand what they observe (their router's input, then the experts their
    block routed to) to the pass's ``Observing`` (its ``Step``'s ``heads``); the consumers'
    routing functions are made now, before any step."""
    held = set(streaming.held_layers())
    for layer in [c for c in prerouter.heads.consumers() if c in held]:
        for width in {None, prerouter.width}:
            streaming.parts.probes.probe(layer, width)
    routers = streaming.routers()
    context = streaming.context
    for l, switch in streaming.switches().items():
        if l in prerouter.owners:
            routers[l].watch = _watcher(context)
            switch.observer = _observer(context)


def _observer(context: StepContext):
    def observe(layer: int, inds) -> None:
        step = context.now
        if step.heads is not None:
            step.heads.experts(layer, inds, step.decode)
    return observe


def _watcher(context: StepContext):
    def watch(layer: int, x, tap) -> None:
        if context.now.heads is not None:
            context.now.heads.router_input(layer, x)
    return watch


class TokenEmbedding:
    """``model``'s token embedding as a function, the module found at the first call (made
    before the resident weights load, which may replace it by its quantized twin); None
    for a model without one."""

    def __init__(self, model):
        self.model, self.module = model, None

    def __call__(self, ids):
        if self.module is None:
            self.module = bnn.token_embedding(self.model)
        return self.module(ids) if self.module is not None else None


class Probes:
    """Each MoE layer's routing function (its ``RoutingProbe``), one per (layer, width),
    made on first use, on the wired ``model`` (the prerouter's consumers' are made when
    the model is wired)."""

    def __init__(self, model, spec, context: StepContext):
        self.model, self.spec, self.context = model, spec, context
        self._made: dict = {}

    def route(self, layer: int, logits, width: int | None = None):
        """The expert indices [N, width or k] layer ``layer``'s block routes ``logits`` to."""
        return self.probe(layer, width)(logits)

    def probe(self, layer: int, width: int | None = None) -> "RoutingProbe":
        width = None if width == self.spec.k else width
        if (layer, width) not in self._made:
            self._made[layer, width] = routing_probe(self, layer, width)
        return self._made[layer, width]


# the names mlx-lm's blocks and gates give their routing width
WIDTH_ATTRIBUTES = ("top_k", "num_experts_per_tok", "num_experts_per_token", "n_activated_experts",
                    "experts_per_token", "moe_topk", "k")


def width_attributes(streaming: Streaming, layer: int) -> list[tuple[object, str]]:
    """(module, attribute) pairs holding layer ``layer``'s routing width k in its block and
    router (and the router's original module): what a ``RoutingProbe`` widens. Empty when
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


def routing_probe(owner, layer: int, width: int | None = None) -> "RoutingProbe":
    """Layer ``layer``'s ``RoutingProbe`` at ``width`` (None or k: k) on ``owner``'s model
    (``owner``: what holds ``model``, ``spec`` and the ``context`` its taps read: a
    ``Streaming``, the training student); a ``ConfigError`` when the width is to change and
    the block keeps it where Edge0 cannot find it."""
    widened = ()
    if width is not None and width != owner.spec.k:
        widened = width_attributes(owner, layer)
        if not widened:
            raise ConfigError(f"{owner.spec.model_type}: the routing width of layer {layer} is kept where Edge0 cannot "
                              f"change it (none of {WIDTH_ATTRIBUTES} on its block or gate), so select routing cannot "
                              "choose its candidates; use routing 'replace'")
    else:
        width = None
    return RoutingProbe(owner.model, owner.spec, layer, owner.context, width, widened)


class RoutingProbe:
    """Layer ``layer``'s own routing code as a function, router logits [N, E] -> the expert
    indices [N, width] its block routes them to (``width`` None: k): a clone of the block,
    made once, whose router returns the logits it is given (an inline gate: its clone with
    the identity for a weight, so its own code routes them) and whose expert stack records
    the indices instead of computing; the routing width set on the clones. The model is
    never touched; the logits reach the clone through the model's ``StepContext``."""

    def __init__(self, model, spec, layer: int, context: StepContext, width: int | None = None, widened=()):
        if spec.prerouter_problem:
            raise ConfigError(f"{spec.model_type}: {spec.prerouter_problem}")
        block_path, m = spec.block_path(layer), spec.layers[layer]
        block, tap = bnn.module_at(model, block_path), bnn.module_at(model, m.router_path)
        inside = [p[len(block_path) + 1:] for p in (m.router_path, spec.switch_path(layer))
                  if p.startswith(block_path + ".")]
        if len(inside) != 2:
            raise ConfigError(f"{spec.model_type}: layer {layer}'s router or expert stack is not inside its block")
        attrs = {name: width for module, name in widened if module is tap.original}
        gate = eye_gate(tap.original, **attrs) if tap.kind == "inline" else None
        self.clone = replaced(block, {inside[0]: _Given(gate, context), inside[1]: _Captured(context)})
        for module, name in widened:
            if module is block:
                setattr(self.clone, name, width)
        self.context, self.input_width = context, spec.block_input

    def __call__(self, logits):
        captured: list = []
        n = logits.shape[0]
        with self.context.installed(Step(probe=(logits, captured))):
            self.clone(B.zeros((n, 1, self.input_width), dtype=logits.dtype))
        return captured[0].reshape(n, -1)


class _Given(bnn.Module):
    """A probe's router: the logits the probe was given (through an inline gate's clone)."""

    def __init__(self, gate, context: StepContext):
        super().__init__()
        object.__setattr__(self, "gate", gate)
        object.__setattr__(self, "context", context)

    def __call__(self, x):
        logits = self.context.now.probe[0]
        logits = logits.reshape(*x.shape[:-1], logits.shape[-1])  # shaped as the router's output would be
        return logits.astype(x.dtype) if self.gate is None else self.gate(logits.astype(self.gate.weight.dtype))


class _Captured(bnn.Module):
    """A probe's expert stack: records the indices its block routed to, computes nothing."""

    def __init__(self, context: StepContext):
        super().__init__()
        object.__setattr__(self, "context", context)

    def __call__(self, x, indices, *args, **kwargs):
        self.context.now.probe[1].append(indices)
        return B.zeros((*indices.shape, x.shape[-1]), dtype=x.dtype)


def check_prerouter_fits(streaming: "Streaming", prerouter, routing: str, extra: int) -> None:
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
