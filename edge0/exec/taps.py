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
  input, and follows its ``route`` when one is set: at a planned decode step, the step's
  ``DecodePlan`` route (``edge0.exec.plan.LayerRoute``); in training, a sequence's; in a
  probe, the logits to route on:

  - *replace*: it returns the predicted logits instead, so the block's own routing code
    turns the prediction into the routing (prediction as routing). Gates that multiply by
    their weight inline (DeepSeek's ``MoEGate``) are called on the predicted logits with
    their weight set to the identity, which reproduces the logits exactly;
  - *select*: it computes its own logits and masks every expert outside the staged set,
    so the block's own routing chooses its k among the staged experts only. For a linear
    router the masked logits are -inf (softmax gives them probability 0; a sigmoid, 0).
    For a gate with a score-correction bias (sigmoid-group routing) the mask enters the
    bias, which only ranks: staged experts keep bias b, the others get b - 1e4, so their
    selection scores lose to every staged expert's, a group holding fewer than two staged
    experts loses the group ranking to every group holding two, and the combine weights
    (the unbiased sigmoid scores of the chosen experts) are untouched. With every expert
    staged the mask changes no bit.

Outside the MoE blocks, a projection a recovery adapter targets (``edge0.adapters``: files,
checks, loading) becomes an ``AdaptedLinear``, the base untouched plus the active adapter's
low-rank delta, or each row's own in a batch of mixed adapters; an ``AdapterBank`` holds the
adapters resident on the model and which one each row applies.
"""

from __future__ import annotations

import copy

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.errors import ConfigError
from edge0.exec.plan import Executor


def bind(template, views: dict):
    """A clone of ``template`` whose stacked tensors are ``views`` (name -> array with a
    leading axis of buffer rows): calling it computes the template's ops on those rows. The
    template and its children are never changed: each module on a view's path is copied."""
    clone = copy.copy(template)
    copied = {"": clone}
    for name, view in views.items():
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


class StepPhase:
    """What the forward pass running now is, shared by a model's taps and switches: set by
    the engine's step hook (``StepModel``) before each pass. ``decode`` True: a decode step,
    one new token for each row of a batch (however many rows); False: a prefill; None
    (outside the step hook: training, probes, tools): a call on one token is a decode step."""

    def __init__(self):
        self.decode: bool | None = None

    def is_decode(self, x) -> bool:
        """Whether a call on ``x`` ([..., D] or indices [..., k]) belongs to a decode step."""
        if self.decode is not None:
            return self.decode
        return x.size // x.shape[-1] == 1


class StreamingSwitch(bnn.Module):
    """Stands where the block's switch stack stood; the experts stream from disk."""

    def __init__(self, layer: int, template, executors: dict, width_out: int, phase: StepPhase | None = None):
        super().__init__()
        object.__setattr__(self, "phase", phase or StepPhase())  # not a child module
        self.layer_id = layer
        object.__setattr__(self, "_template", template)  # not a parameter: its weights are on disk
        self.executors: dict[str, Executor] = executors  # phase ("decode", "prefill") -> its path
        self.width_out = width_out
        self.observer = None  # (layer, inds) for the prerouter and tracing
        self.capture = None  # probing: a list that receives the indices; no expert runs

    @property
    def template(self):
        return self._template

    def __call__(self, x, indices):
        if self.capture is not None:
            self.capture.append(indices)
            return B.zeros((*indices.shape, self.width_out), dtype=x.dtype)
        if self.observer is not None:
            self.observer(self.layer_id, indices)
        decode = self.phase.is_decode(indices)
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

    def __init__(self, layer: int, original, kind: str, num_outputs: int, phase: StepPhase | None = None):
        super().__init__()
        object.__setattr__(self, "phase", phase or StepPhase())  # not a child module
        self.layer_id = layer
        self.original = original
        self.kind = kind
        self.num_outputs = num_outputs
        self.route = None  # a LayerRoute to follow, or None: the router's own output
        self.watch = None  # (layer, x, tap) at every real call (not a probe): sees the router's input
        self._eye = None

    def logits(self, x):
        """The router's own logits for ``x``."""
        if self.kind == "linear":
            return self.original(x)
        w = self.original.weight
        return x.astype(B.float32) @ w.astype(B.float32).T

    def __call__(self, x):
        route = self.route
        if self.watch is not None and (route is None or route.scope != "probe"):
            self.watch(self.layer_id, x, self)
        if route is None or (route.scope == "decode" and not self.phase.is_decode(x)):
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
        return self._route_inline(forced)

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
            return self._route_inline(B.where(_aligned(staged, own), own, B.array(float("-inf"), dtype=own.dtype)))
        bias = getattr(gate, name)
        if staged.size == bias.size:
            staged = staged.reshape(bias.shape)
        elif staged.size == (x.size // x.shape[-1]) * bias.size:  # one set per token: per-token biases
            staged = staged.reshape(*x.shape[:-1], bias.size)
        setattr(gate, name, B.where(staged, bias, bias - MASKED_BIAS))
        try:
            return gate(x)
        finally:
            setattr(gate, name, bias)

    def _route_inline(self, logits):
        """The gate's own routing of ``logits``: its weight set to the identity for the call."""
        gate = self.original
        if self._eye is None or self._eye.shape[0] != logits.shape[-1]:
            self._eye = B.eye(logits.shape[-1], dtype=gate.weight.dtype)
            B.eval(self._eye)
        weight = gate.weight
        gate.weight = self._eye
        try:
            return gate(logits.astype(weight.dtype))
        finally:
            gate.weight = weight


class AdaptedLinear(bnn.Module):
    """A projection with an optional low-rank delta: ``linear`` is the untouched base;
    ``lora_a`` / ``lora_b`` (present while an adapter is active) are mlx-lm's names, so a
    trainer sees exactly mlx-lm's parameter tree."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear
        self.scale = 0.0
        object.__setattr__(self, "row_deltas", None)  # a batch of mixed adapters: [(a, b, scale, rows)]

    def set_delta(self, a, b, scale: float) -> None:
        if a is None:
            for leaf in ("lora_a", "lora_b"):
                if leaf in self:
                    del self[leaf]
            self.scale = 0.0
        else:
            self.lora_a, self.lora_b, self.scale = a, b, scale

    def set_row_deltas(self, deltas) -> None:
        """A batch whose rows use different adapters: ``deltas`` [(a, b, scale, rows)],
        ``rows`` a bool mask over the batch's rows (the rows that apply that delta; rows in
        no mask apply none); None: the one delta of ``set_delta`` for every row."""
        object.__setattr__(self, "row_deltas", deltas)

    def __call__(self, x):
        y = self.linear(x)
        if self.row_deltas is not None:
            out = y
            for a, b, scale, rows in self.row_deltas:  # each row: exactly its own adapter's sum
                mask = rows.reshape(-1, *(1,) * (x.ndim - 1))
                out = B.where(mask, y + (scale * ((x @ a) @ b)).astype(x.dtype), out)
            return out
        if "lora_a" not in self:
            return y
        z = (x @ self.lora_a) @ self.lora_b
        return y + (self.scale * z).astype(x.dtype)


class AdapterBank:
    """Adapters resident on one model, and which one is active."""

    def __init__(self, model, spec):
        self.model, self.spec = model, spec
        self.adapters: dict = {}  # name -> its edge0.adapters.Adapter
        self.wrapped: dict[str, AdaptedLinear] = {}
        self.active: str | None = None

    def add(self, adapter) -> None:
        if adapter.name in self.adapters:
            raise ConfigError(f"two adapters are named {adapter.name!r}; give each a distinct directory name")
        for module in adapter.tensors:
            if module not in self.wrapped:
                base = bnn.module_at(self.model, module)
                wrapper = AdaptedLinear(base)
                bnn.set_module_at(self.model, module, wrapper)
                self.wrapped[module] = wrapper
        self.adapters[adapter.name] = adapter

    def activate(self, name: str | None) -> None:
        """Make ``name`` (or no adapter) the one every wrapped projection applies."""
        if self.active == "<mixed>":
            for wrapper in self.wrapped.values():
                wrapper.set_row_deltas(None)
            self.active = None
        if name == self.active:
            return
        if name is not None and name not in self.adapters:
            raise ConfigError(f"no adapter named {name!r}; loaded: {sorted(self.adapters) or 'none'}")
        adapter = self.adapters.get(name) if name is not None else None
        for module, wrapper in self.wrapped.items():
            pair = adapter.tensors.get(module) if adapter is not None else None
            wrapper.set_delta(*(pair or (None, None)), adapter.scale if pair else 0.0)
        self.active = name

    def activate_rows(self, names: list) -> None:
        """A batch's adapters, one name (or None) per row, applied in one forward pass:
        each row gets exactly the sum it would get alone with its adapter."""
        if len(set(names)) <= 1:
            self.activate(names[0] if names else None)
            for wrapper in self.wrapped.values():
                wrapper.set_row_deltas(None)
            return
        for name in set(names):
            if name is not None and name not in self.adapters:
                raise ConfigError(f"no adapter named {name!r}; loaded: {sorted(self.adapters) or 'none'}")
        self.activate(None)
        for module, wrapper in self.wrapped.items():
            deltas = []
            for name in dict.fromkeys(n for n in names if n is not None):
                pair = self.adapters[name].tensors.get(module)
                if pair is not None:
                    rows = B.array([n == name for n in names])
                    deltas.append((*pair, self.adapters[name].scale, rows))
            wrapper.set_row_deltas(deltas)
        self.active = "<mixed>"

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.adapters.values())
