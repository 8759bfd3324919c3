"""What one decode step will do, decided before it runs, as plain frozen data.

A planner (the prerouter's heads, an oracle file) produces one ``DecodePlan`` per decode
step: for each staged layer the experts to stage (what the prefetch scheduler reads into
slots) and its ``LayerRoute`` (what the layer's router does at that step). The plan is
handed to the routers (``RouterTap.route``) and to the staged executor; nothing else
decides routing during the step. The same ``LayerRoute`` carries a training sequence's
routing (``where``: the positions that route by prediction) and a probe's (``scope="probe"``).

Where the plan comes from: ``PrerouterPlanner``, the prerouter's heads, one batched flush
per step; their prediction is the staged layers' routing (replace) or the candidates the
layers' own routers choose among (select). ``OraclePlanner``: a recorded routing (``edge0
record-routing``), step by step; the layers route on their own gates and the plan only
stages what they will pick. The Stager (``edge0.exec.staged``) asks its planner for each
step's plan and runs it.

``DraftedRouting``: a verify pass's routing by prediction (speculative decoding), each
drafted position's route made inside the pass from what its owner observed at the position
before.

``QualityGuard``: every ``every``-th planned decode step, each staged layer's router also
computes its own logits, and the guard counts (on the device) how many of the router's own
top-k experts the plan staged; the counts come back with the next step's one host read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

from edge0.backend import core as B
from edge0.exec.oracle import OracleRouting
from edge0.prerouter.runtime import Observed, Observing


class Executor(Protocol):
    """One executor path (exact, staged, hot, whole-layer): the routed experts' output of
    layer ``layer`` for input ``x`` [..., D] and routing indices ``inds`` [..., k], shaped
    [..., k, D], computed by the layer's own switch module on rows of expert weights."""

    def __call__(self, layer: int, x, inds): ...


@dataclass(frozen=True)
class SlotRoute:
    """Where a staged layer's experts are at a decode step: ``lookup`` (device, one entry per
    expert: its slot, -1 where the step staged none) and the readiness flag the step's
    reads set (``flag``, the flag's index; ``ticket``, the value that says ready). Made when
    the step's reads are issued; the layer's computation maps its routing through ``lookup``
    and waits on the flag inside the step's graph."""

    lookup: object
    flag: int
    ticket: int


@dataclass(frozen=True)
class LayerRoute:
    """What a router does in place of returning its own output.

    ``mode`` "replace": the router returns ``logits`` ([1, E] at a decode step; one row per
    position in training), so the block's routing code routes on the prediction. "select":
    the router computes its own logits and masks every expert outside ``staged`` (bool,
    [1, E] or one row per position), so the block chooses its k among the staged experts.
    ``where`` (bool, one entry per position) limits the route to those positions; the others
    route on the router's own output. ``scope`` "decode": the route applies only to a call
    on one token (a decode step; the prompt's prefill routes on its own); "all": to every
    call (a training sequence); "probe": to every call, which is no real forward (a probe of
    the block's routing code: the router's watcher does not see it). ``observe`` (layer, own logits) sees the
    router's own logits at that call (the quality guard)."""

    mode: str
    logits: object = None
    staged: object | None = None
    where: object | None = None
    scope: str = "decode"
    observe: Callable | None = None

    def __post_init__(self):
        if self.mode not in ("replace", "select"):
            raise ValueError(f"LayerRoute mode must be 'replace' or 'select', got {self.mode!r}")
        if self.scope not in ("decode", "all", "probe"):
            raise ValueError(f"LayerRoute scope must be 'decode', 'all' or 'probe', got {self.scope!r}")


@dataclass(frozen=True)
class DecodePlan:
    """One decode step's plan: ``experts`` (staged layer -> the distinct experts staged for
    it, ascending) and ``routes`` (staged layer -> its router's ``LayerRoute``; empty when
    the layers route on their own gates, as with an oracle file of their own routing)."""

    step: int
    experts: Mapping[int, tuple[int, ...]]
    routes: Mapping[int, LayerRoute] = field(default_factory=dict)

    def route(self, layer: int) -> LayerRoute | None:
        return self.routes.get(layer)


@dataclass(frozen=True)
class StageStats:
    """The staged machinery's running totals, as the engine reads them: decode steps run on
    staged layers, seconds spent waiting for slots, and the quality guard's recall per layer
    (one value per guarded step)."""

    steps_run: int = 0
    stall_seconds: float = 0.0
    guard_recall: Mapping[int, tuple[float, ...]] = field(default_factory=dict)


class Planner(Protocol):
    """What the Stager asks of a planner. ``ahead``: the plans are known before the step
    runs (an oracle: the Stager submits this step's plan and the next one's as soon as it
    can); otherwise each step is planned when it begins, from what the step's input shows
    (the prerouter's flush). ``reset``: forget the generation that ended."""

    ahead: bool
    layers: list[int]

    def reset(self) -> None: ...


class PrerouterPlanner:
    ahead = False  # planned when the step begins: one flush of the heads on the step's input

    def __init__(self, prerouter, layers: list[int], routing: str, route, embed):
        """``route`` (consumer layer, logits [N, E], width) -> the indices its own block's
        routing code makes of them (``edge0.streaming.Probes.route``); ``embed`` (token ids
        [R, 1]) -> their embedding rows (heads that see the token)."""
        self.prerouter, self.layers, self.routing = prerouter, list(layers), routing
        self.route, self.embed = route, embed

    def reset(self) -> None:
        """Nothing to forget: what the heads observed is the batch's (``Observed``)."""

    def flush(self, inputs, heads) -> dict | None:
        """consumer layer -> (predicted experts, predicted logits), lazy, from ``heads`` (the
        batch's ``Observed``); None before the heads have seen every owner (the step then
        runs on the fallback path)."""
        pre = self.prerouter
        if heads is None or not heads.seen(pre.owners):
            return None
        tok = self.embed(inputs.reshape(-1, 1)) if pre.heads.token_dim else None
        logits = pre.flush(heads, tok)
        return {c: (self.route(c, z, pre.width), z) for c, z in logits.items()}

    def device_parts(self, preds: dict) -> list:
        """The predicted expert ids, one flat int32 row per staged layer, for the step's one
        host read."""
        return [preds[l][0].reshape(-1).astype(B.int32) for l in self.layers]

    def plan(self, step: int, host_rows, preds: dict, observe=None) -> DecodePlan:
        """The step's plan from the host copy of ``device_parts`` (``host_rows``: one row per
        layer) and the lazy ``preds``; ``observe``: the quality guard's, on guarded steps."""
        experts = {l: tuple(sorted(set(host_rows[i].tolist()))) for i, l in enumerate(self.layers)}
        routes = {}
        for l in self.layers:
            inds, logits = preds[l]
            staged = B.one_hot_k(inds, logits.shape[-1], B.int32) > 0 if self.routing == "select" else None
            routes[l] = LayerRoute(self.routing, logits, staged, observe=observe)
        return DecodePlan(step, experts, routes)


class DraftedRouting(Observing):
    """What a verify pass observes, and the staged layers' routes it makes: the pass's rows
    are sequences, each row's positions ``tokens[r]`` (its step's token, then its draft; all
    rows as long: ``lengths[r]`` are the row's own, the rest pad positions, routed as its
    last own one, so they stage no expert of their own). Position 0 routes on the step's own
    flush (``first``: consumer -> (indices, logits) [R, ..], from ``before``, what the heads
    observed before the pass). Position j routes on what the consumer's head makes of its
    owner's observation at position j - 1, in this same pass: the owner runs before its
    consumer, so each consumer's route is made when its owner's observation arrives and put
    in ``routes``, which the pass's ``Step`` holds. Each position is predicted from the
    inputs a decode step there would have had (the owner's experts one position earlier,
    the token's embedding), the drafted positions together by the head's share of the
    flush's products (``Prerouter.predict``): every position routes as decoding the drafted
    tokens one step at a time would route it, up to the rounding of products over several
    rows, as the pass's every other product. ``planner`` None: the heads only observe (no
    staged layer is routed by them)."""

    def __init__(self, planner: PrerouterPlanner | None, before: Observed, tokens: list[list[int]],
                 first: dict | None, lengths: list[int] | None = None):
        super().__init__(before)
        self.planner, self.first, self.routes = planner, first, {}
        self.rows, self.width = len(tokens), len(tokens[0])
        lengths = lengths or [self.width] * self.rows
        # each position's own position: a pad position's is its row's last own one
        self._own = None if min(lengths) == self.width else B.array(
            [[min(j, n - 1) for j in range(self.width)] for n in lengths], dtype=B.int32)
        self._tok = None
        if planner is not None and planner.prerouter.heads.token_dim and self.width > 1:
            self._tok = planner.embed(B.array([t[1:] for t in tokens], dtype=B.int32).reshape(-1, 1))

    def observe(self, layer: int, x, inds, decode: bool | None = None) -> None:
        super().observe(layer, x, inds, decode)
        if self.planner is None:
            return
        pre = self.planner.prerouter
        consumer = pre.heads.consumer.get(layer)
        if consumer is None or consumer not in self.planner.layers:
            return
        r, p = self.rows, self.width
        xs, ks = self._last[layer]
        xs, ks = xs.reshape(r, p, -1), ks.reshape(r, p, -1)
        prev = self._prev.get(layer)
        prev = B.full((r, 1, ks.shape[-1]), -1, B.int32) if prev is None else prev.reshape(r, 1, -1)
        first_i, first_z = self.first[consumer]
        logits, inds_ = first_z.reshape(r, 1, -1), first_i.reshape(r, 1, -1)
        if p > 1:  # positions 1..p-1, each from the owner at the position before
            flat = lambda a: a[:, :p - 1].reshape(r * (p - 1), -1)  # noqa: E731
            z = pre.predict(layer, flat(xs), flat(ks), flat(B.concat([prev, ks[:, :p - 2]], axis=1)), self._tok)
            logits = B.concat([logits, z.reshape(r, p - 1, -1)], axis=1)
            if self.planner.routing == "select":  # (a block's routing code routes each row on its own)
                inds_ = B.concat([inds_, self.planner.route(consumer, z, pre.width).reshape(r, p - 1, -1)], axis=1)
        if self._own is not None:
            logits = B.take_along_axis(logits, self._own[..., None], axis=1)
            inds_ = B.take_along_axis(inds_, self._own[..., None], axis=1)
        logits, staged = logits.reshape(r * p, -1), None
        if self.planner.routing == "select":
            staged = B.one_hot_k(inds_.reshape(r * p, -1), logits.shape[-1], B.int32) > 0
        self.routes[consumer] = LayerRoute(self.planner.routing, logits, staged)

    def taken(self, n: list[int]) -> Observed:
        """What the heads observed once each row's first ``n[r]`` positions are its
        sequence's (the rest were not taken): as those decode steps would have left it."""
        after, r, p = self.after(), self.rows, self.width
        at = B.array([max(c, 1) - 1 for c in n], dtype=B.int32).reshape(r, 1, 1)  # (0: a failed row, leaving)
        last, prev = {}, {}
        for o, (x, i) in after.last.items():
            x, i = x.reshape(r, p, -1), i.reshape(r, p, -1)
            before = after.prev.get(o)
            before = B.full((r, 1, i.shape[-1]), -1, B.int32) if before is None else before.reshape(r, 1, -1)
            last[o] = (B.take_along_axis(x, at, axis=1)[:, 0], B.take_along_axis(i, at, axis=1)[:, 0])
            prev[o] = B.take_along_axis(B.concat([before, i], axis=1), at, axis=1)[:, 0]  # (position n - 1: before's)
        return Observed(last, prev)


class OraclePlanner:
    ahead = True  # every step's plan is recorded

    def __init__(self, oracle: OracleRouting, layers: list[int]):
        self.oracle, self.layers = oracle, list(layers)

    def reset(self) -> None:
        """Nothing to forget: the recording is the same for every run of its prompt."""

    def covers(self, step: int) -> bool:
        return step < len(self.oracle)

    def plan(self, step: int) -> DecodePlan:
        """The recorded experts of ``step``; the routers route on their own (no routes)."""
        return DecodePlan(step, {l: tuple(self.oracle.experts(step, l)) for l in self.layers})

    def refuse(self, step: int) -> None:
        """Raise the oracle's own error for a step it does not cover."""
        self.oracle.experts(step, self.layers[0])


class QualityGuard:
    def __init__(self, layers: list[int], every: int, route, log=None):
        """``route`` (layer, logits [N, E]) -> the indices [N, k] the layer's own routing
        code makes of ``logits``."""
        self.layers, self.every, self._route, self.log = list(layers), every, route, log
        self._sums = None  # layer -> hit count of the current step (on device), when guarded
        self._per = 1
        self.recall: dict[int, list[float]] = {}

    def reset(self, keep_report: bool = False) -> None:
        self._sums = None
        if not keep_report:
            self.recall = {}

    def arm(self, step: int) -> bool:
        """Start counting for ``step`` when it is a guarded step; whether it is."""
        self._sums = None
        if self.every and step % self.every == 0:
            self._sums = {l: B.zeros((), dtype=B.float32) for l in self.layers}
        return self._sums is not None

    def observer(self, staged_of: dict):
        """(layer, own logits) -> None for this step's routes: counts the router's own k
        experts that ``staged_of[layer]`` (predicted indices [.., n]) holds."""
        def observe(layer: int, own_logits) -> None:
            if self._sums is None or layer not in self._sums:
                return
            true = self._route(layer, own_logits.reshape(-1, own_logits.shape[-1]))
            k = true.shape[-1]
            hit = (B.expand_dims(staged_of[layer], -1) == B.expand_dims(true, -2)).any(axis=-1).sum()
            self._sums[layer] = self._sums[layer] + hit.astype(B.float32)
            self._per = k * max(1, true.size // k)
        return observe

    def device_counts(self) -> list:
        """The current step's counts, to read with the next step's host read ([] when the
        step is not guarded)."""
        return [self._sums[l].reshape(1) for l in self.layers] if self._sums is not None else []

    def collect(self, host, step: int) -> int:
        """Take the counts ``device_counts`` put at the front of ``host``; how many values
        were taken."""
        if self._sums is None:
            return 0
        for i, l in enumerate(self.layers):
            self.recall.setdefault(l, []).append(float(host[i]) / self._per)
        if self.log is not None:
            self.log.info("guard", step=step, recall={l: round(v[-1], 4) for l, v in self.recall.items()})
        self._sums = None
        return len(self.layers)
