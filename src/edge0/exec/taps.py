"""What Edge0 puts inside an mlx-lm model, which otherwise runs unchanged.

A block keeps its own routing code, combine and shared experts, so every architecture's
math is mlx-lm's, bit for bit. Edge0 replaces only:

- the **switch stack** (``SwitchGLU`` / ``SwitchMLP``, the routed experts) by a
  ``StreamingSwitch``: same call ``switch(x, inds)``, same ops, but the expert rows come
  from the checkpoint on disk through an executor path (exact, staged, hot, whole-layer).
  The computation is the original module's own ``__call__`` on a clone whose stacked
  weights are a small buffer of rows, with the indices remapped into it;
- the **router** (the linear map whose output the block routes on) by a ``RouterTap``: it
  passes the router's output through, lets a watcher (the prerouter) see the router's
  input, and follows the route the running ``Step`` gives its layer, when it gives one:
  at a planned decode step, the step's ``DecodePlan`` route
  (``edge0.exec.plan.LayerRoute``); in training, a sequence's:

  - *replace*: it returns the predicted logits instead, so the block's own routing code
    turns the prediction into the routing (prediction as routing). Gates that multiply by
    their weight inline (DeepSeek's ``MoEGate``) route the predicted logits through a clone
    of themselves whose weight is the identity, which reproduces the logits exactly;
  - *select*: it computes its own logits and masks every expert outside the staged set,
    so the block's own routing chooses its k among the staged experts only. For a linear
    router the masked logits are -inf (softmax gives them probability 0; a sigmoid, 0).
    For a gate with a score-correction bias (sigmoid-group routing) the mask enters the
    bias (of a clone of the gate, for the call), which only ranks: staged experts keep bias b, the others get b - 1e4, so their
    selection scores lose to every staged expert's, a group holding fewer than two staged
    experts loses the group ranking to every group holding two, and the combine weights
    (the unbiased sigmoid scores of the chosen experts) are untouched. With every expert
    staged the mask changes no bit.

Outside the MoE blocks, a projection a recovery adapter targets (``edge0.adapters``: files,
checks, loading) becomes an ``AdaptedLinear``, the base untouched plus each row's low-rank
delta from the running ``Step`` (outside a step, the default adapter's); an ``AdapterBank``
holds the adapters resident on the model and makes each batch's deltas.

What a forward pass is, its ``Step`` (decode or prefill, the routes, the rows' deltas), is
installed in the model's ``StepContext`` for the pass and put back after; no module of the
model is written during a step.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.errors import ConfigError
from edge0.exec.plan import Executor, LayerRoute, SlotRoute


def bind(template, views: dict):
    """A clone of ``template`` whose stacked tensors are ``views`` (name -> array with a
    leading axis of buffer rows): calling it computes the template's ops on those rows."""
    return replaced(template, views)


def replaced(module, values: dict):
    """A clone of ``module`` with each dotted path of ``values`` (an array or a module) set
    to its value; ``module`` and its children are never changed: each module on a path is
    copied (shallowly: everything else is shared)."""
    clone = copy.copy(module)
    copied = {"": clone}
    for name, view in values.items():
        path, _, leaf = name.rpartition(".")
        node, walked = clone, ""
        for part in path.split(".") if path else ():
            walked = f"{walked}.{part}" if walked else part
            if walked not in copied:
                key = int(part) if isinstance(node, list) else part
                copied[walked] = copy.copy(node[key])
                node[key] = copied[walked]
            node = copied[walked]
        node[leaf] = view
    return clone


NO_ROUTES: Mapping = MappingProxyType({})


@dataclass(frozen=True)
class Step:
    """What one forward pass of the model is, as its taps read it. ``decode`` True: a decode
    step, one new token for each row of a batch; False: a prefill; None (outside the step
    hook: training, tools): a call on one token is a decode step. ``routes``: each planned
    layer's ``LayerRoute`` (a staged decode step's plan; a training sequence's). ``slots``:
    each staged layer's ``SlotRoute`` at a decode step (where its experts are; a layer
    without one computes on the staged path's fallback). ``deltas``:
    each adapted projection's low-rank deltas, ``(a, b, scale, rows)`` with ``rows`` a bool
    mask over the batch's rows or None (every row); None: not given for this pass (the
    projections apply their own adapter, ``AdaptedLinear.set_delta``). ``probe``: the router
    logits a routing probe routes (``RoutingProbe``). ``heads``: where the prerouter's owner
    layers put what they observe in this pass (an ``edge0.prerouter.runtime.Observing``;
    None: nowhere)."""

    decode: bool | None = None
    routes: Mapping[int, LayerRoute] = field(default_factory=lambda: NO_ROUTES)
    slots: Mapping[int, SlotRoute] = field(default_factory=lambda: NO_ROUTES)
    deltas: Mapping[str, tuple] | None = None
    probe: object = None
    heads: object = None

    def is_decode(self, x) -> bool:
        """Whether a call on ``x`` ([..., D] or indices [..., k]) belongs to a decode step."""
        if self.decode is not None:
            return self.decode
        return x.size // x.shape[-1] == 1


class StepContext:
    """The ``Step`` a model's taps read (``now``), shared by them: installed for one forward
    pass by ``installed`` and put back after, the one place it changes. The model's modules
    are never written during a step."""

    def __init__(self):
        self.now = Step()

    @contextmanager
    def installed(self, step: Step):
        before, self.now = self.now, step
        try:
            yield step
        finally:
            self.now = before


class StreamingSwitch(bnn.Module):
    """Stands where the block's switch stack stood; the experts stream from disk."""

    def __init__(self, layer: int, template, executors: dict, width_out: int, context: StepContext | None = None):
        super().__init__()
        object.__setattr__(self, "context", context or StepContext())  # not a child module
        self.layer_id = layer
        object.__setattr__(self, "_template", template)  # not a parameter: its weights are on disk
        self.executors: dict[str, Executor] = executors  # phase ("decode", "prefill") -> its path
        self.width_out = width_out
        self.observer = None  # (layer, inds) for the prerouter and tracing (set when wired)

    @property
    def template(self):
        return self._template

    def __call__(self, x, indices):
        if self.observer is not None:
            self.observer(self.layer_id, indices)
        decode = self.context.now.is_decode(indices)
        return self.executors["decode" if decode else "prefill"](self.layer_id, x, indices)


# the bias that gates of sigmoid-group routing add to their scores for ranking only
BIAS_ATTRIBUTES = ("e_score_correction_bias", "expert_bias")
MASKED_BIAS = 1e4  # subtracted from an unstaged expert's ranking bias (scores are in (0, 1))


def _aligned(staged, logits):
    """A staged-set mask shaped to broadcast against ``logits``: one set for every token
    ([E]), or one per token (a batch's rows at a decode step, a sequence's positions)."""
    if staged.size == logits.shape[-1]:
        return staged.reshape(*(1,) * (logits.ndim - 1), -1)
    return staged.reshape(logits.shape) if staged.size == logits.size else staged


class RouterTap(bnn.Module):
    """Stands where the block's router stood (``kind`` "linear": a module mapping x to
    logits; "inline": a gate module that multiplies by its ``weight`` itself and returns
    the routing)."""

    def __init__(self, layer: int, original, kind: str, num_outputs: int, context: StepContext | None = None):
        super().__init__()
        object.__setattr__(self, "context", context or StepContext())  # not a child module
        self.layer_id = layer
        self.original = original
        self.kind = kind
        self.num_outputs = num_outputs
        self.watch = None  # (layer, x, tap) at every call (set when wired): sees the router's input
        # an inline gate's own routing of given logits: a clone of the gate whose weight is
        # the identity, made once (not a child module: no parameters of its own)
        object.__setattr__(self, "gate_eye", eye_gate(original) if kind == "inline" else None)

    def logits(self, x):
        """The router's own logits for ``x``."""
        if self.kind == "linear":
            return self.original(x)
        w = self.original.weight
        return x.astype(B.float32) @ w.astype(B.float32).T

    def __call__(self, x):
        step = self.context.now
        route = step.routes.get(self.layer_id)
        if self.watch is not None:
            self.watch(self.layer_id, x, self)
        if route is None or (route.scope == "decode" and not step.is_decode(x)):
            return self.original(x)  # the prompt's prefill routes on its own
        if route.observe is not None:
            route.observe(self.layer_id, self.logits(x))
        lead = x.shape[:-1]
        if route.mode == "select":
            staged = route.staged
            if route.where is not None:  # the other positions keep every expert
                staged = B.logical_or(B.logical_not(route.where.reshape(*lead, 1)), staged.reshape(*lead, -1))
            return self.select(x, staged)
        forced = route.logits
        if route.where is not None:
            forced = B.where(route.where.reshape(*lead, 1), forced.reshape(*lead, forced.shape[-1]),
                             self.logits(x).astype(forced.dtype))
        forced = forced.reshape(*lead, forced.shape[-1])
        if self.kind == "linear":
            return forced.astype(x.dtype)  # what a linear router on x would have returned
        return self.gate_eye(forced.astype(self.gate_eye.weight.dtype))

    def select(self, x, staged):
        """The router's own routing of ``x``, restricted to the ``staged`` experts (bool,
        broadcast over the tokens of ``x``): see the module docstring."""
        if self.kind == "linear":
            own = self.original(x)
            return B.where(_aligned(staged, own), own, B.array(float("-inf"), dtype=own.dtype))
        gate = self.original
        name = next((n for n in BIAS_ATTRIBUTES if isinstance(getattr(gate, n, None), B.array)), None)
        if name is None:  # no ranking bias: route the masked logits through the gate's own code
            own = self.logits(x)
            masked = B.where(_aligned(staged, own), own, B.array(float("-inf"), dtype=own.dtype))
            return self.gate_eye(masked.astype(self.gate_eye.weight.dtype))
        bias = getattr(gate, name)
        if staged.size == bias.size:
            staged = staged.reshape(bias.shape)
        elif staged.size == (x.size // x.shape[-1]) * bias.size:  # one set per token: per-token biases
            staged = staged.reshape(*x.shape[:-1], bias.size)
        return replaced(gate, {name: B.where(staged, bias, bias - MASKED_BIAS)})(x)  # a clone: the gate is untouched


def eye_gate(gate, **attributes):
    """A clone of the inline ``gate`` whose weight is the identity (its own routing code on
    the logits it is given), with ``attributes`` (a routing width) set on the clone."""
    clone = replaced(gate, {"weight": B.eye(gate.weight.shape[0], dtype=gate.weight.dtype)})
    for name, value in attributes.items():
        setattr(clone, name, value)
    return clone


class AdaptedLinear(bnn.Module):
    """A projection with an optional low-rank delta: ``linear`` is the untouched base. A
    step gives each row its delta (``Step.deltas``, by ``path``); outside one (training,
    tools) ``lora_a`` / ``lora_b`` are the delta (present while an adapter is set), mlx-lm's
    names, so a trainer sees exactly mlx-lm's parameter tree."""

    def __init__(self, linear, path: str = "", context: StepContext | None = None):
        super().__init__()
        self.linear = linear
        self.scale = 0.0
        object.__setattr__(self, "path", path)  # where it stands in the model: the key of its deltas
        object.__setattr__(self, "context", context or StepContext())

    def set_delta(self, a, b, scale: float) -> None:
        if a is None:
            for leaf in ("lora_a", "lora_b"):
                if leaf in self:
                    del self[leaf]
            self.scale = 0.0
        else:
            self.lora_a, self.lora_b, self.scale = a, b, scale

    def __call__(self, x):
        y = self.linear(x)
        deltas = self.context.now.deltas
        if deltas is not None:  # the step's: each row exactly its own adapter's sum
            out = y
            for a, b, scale, rows in deltas.get(self.path, ()):
                with_delta = y + (scale * ((x @ a) @ b)).astype(x.dtype)
                out = with_delta if rows is None else B.where(rows.reshape(-1, *(1,) * (x.ndim - 1)), with_delta, out)
            return out
        if "lora_a" not in self:
            return y
        z = (x @ self.lora_a) @ self.lora_b
        return y + (self.scale * z).astype(x.dtype)


class AdapterBank:
    """Adapters resident on one model: the default one (``active``, which the projections
    apply outside a step) and the deltas a step gives a batch's rows (``deltas``)."""

    def __init__(self, model, spec, context: StepContext | None = None):
        self.model, self.spec = model, spec
        self.context = context or StepContext()
        self.adapters: dict = {}  # name -> its edge0.adapters.Adapter
        self.wrapped: dict[str, AdaptedLinear] = {}
        self.active: str | None = None
        self._deltas: dict[tuple, Mapping] = {}  # a batch's names -> its deltas (a few kept)

    def add(self, adapter) -> None:
        if adapter.name in self.adapters:
            raise ConfigError(f"two adapters are named {adapter.name!r}; give each a distinct directory name")
        for module in adapter.tensors:
            if module not in self.wrapped:
                base = bnn.module_at(self.model, module)
                wrapper = AdaptedLinear(base, module, self.context)
                bnn.set_module_at(self.model, module, wrapper)
                self.wrapped[module] = wrapper
        self.adapters[adapter.name] = adapter
        self._deltas.clear()

    def activate(self, name: str | None) -> None:
        """Make ``name`` (or no adapter) the one every wrapped projection applies outside a
        step (the default; not called during one)."""
        if name == self.active:
            return
        self._check([name])
        adapter = self.adapters.get(name) if name is not None else None
        for module, wrapper in self.wrapped.items():
            pair = adapter.tensors.get(module) if adapter is not None else None
            wrapper.set_delta(*(pair or (None, None)), adapter.scale if pair else 0.0)
        self.active = name

    def deltas(self, names) -> Mapping[str, tuple]:
        """What a step gives the wrapped projections (``Step.deltas``) for a batch whose
        rows apply ``names`` (an adapter name or None per row): each row gets exactly the
        sum it would get alone with its adapter. Made once per distinct ``names``."""
        names = tuple(names)
        got = self._deltas.get(names)
        if got is None:
            self._check(names)
            distinct = [n for n in dict.fromkeys(names) if n is not None]
            out = {}
            for module in self.wrapped:
                parts = []
                for name in distinct:
                    pair = self.adapters[name].tensors.get(module)
                    if pair is not None:
                        rows = None if all(n == name for n in names) else B.array([n == name for n in names])
                        parts.append((*pair, self.adapters[name].scale, rows))
                out[module] = tuple(parts)
            if len(self._deltas) >= 64:
                self._deltas.pop(next(iter(self._deltas)))
            got = self._deltas[names] = MappingProxyType(out)
        return got

    def _check(self, names) -> None:
        for name in set(names):
            if name is not None and name not in self.adapters:
                raise ConfigError(f"no adapter named {name!r}; loaded: {sorted(self.adapters) or 'none'}")

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.adapters.values())
