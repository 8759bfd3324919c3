"""The planners: where a staged decode step's ``DecodePlan`` comes from.

``PrerouterPlanner``: the prerouter's heads, one batched flush per step; their prediction
is the staged layers' routing (replace) or the candidates the layers' own routers choose
among (select). ``OraclePlanner``: a recorded routing (``edge0 record-routing``), step by
step; the layers route on their own gates and the plan only stages what they will pick.
The Stager (``edge0.exec.staged``) asks its planner for each step's plan and runs it.
"""

from __future__ import annotations

from typing import Protocol

from edge0.backend import core as B
from edge0.exec.oracle import OracleRouting
from edge0.exec.plan import DecodePlan, LayerRoute


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

    def __init__(self, prerouter, layers: list[int], routing: str):
        self.prerouter, self.layers, self.routing = prerouter, list(layers), routing

    def reset(self) -> None:
        self.prerouter.reset()

    def flush(self, inputs) -> dict | None:
        """consumer layer -> (predicted experts, predicted logits), lazy; None before the
        heads have seen a step (the step then runs on the fallback path)."""
        return self.prerouter.flush(inputs) if self.prerouter.ready() else None

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
