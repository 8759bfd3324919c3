"""What one decode step will do, decided before it runs, as plain frozen data.

A planner (the prerouter's heads, an oracle file) produces one ``DecodePlan`` per decode
step: for each staged layer the experts to stage (what the prefetch scheduler reads into
slots) and its ``LayerRoute`` (what the layer's router does at that step). The plan is
handed to the routers (``RouterTap.route``) and to the staged executor; nothing else
decides routing during the step. The same ``LayerRoute`` carries a training sequence's
routing (``where``: the positions that route by prediction) and a probe's (``scope="probe"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol


class Executor(Protocol):
    """One executor path (exact, staged, hot, whole-layer): the routed experts' output of
    layer ``layer`` for input ``x`` [..., D] and routing indices ``inds`` [..., k], shaped
    [..., k, D], computed by the layer's own switch module on rows of expert weights."""

    def __call__(self, layer: int, x, inds): ...


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
