"""StreamingMoE: the one layer that replaces every family's routed-expert block.

It keeps the original block's resident children (router, shared expert) under their own
names, so their checkpoint keys load unchanged, and hands the routed experts to an
executor path. Routing goes through the family's routing function (``edge0.routing``).
"""

from __future__ import annotations

from typing import Callable

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.routing import RouteFn, combine
from edge0.spec import MoESpec

Executor = Callable[..., object]  # (layer, x, inds) -> [..., k, D]
PHASES = ("prefill", "decode")


class StreamingMoE(bnn.Module):
    def __init__(self, spec: MoESpec, layer: int, original, route: RouteFn, executors: dict[str, Executor]):
        super().__init__()
        for name in spec.resident_children:
            setattr(self, name, getattr(original, name))
        self.layer_id = layer
        self.router_kind = spec.router_kind
        self.router_bias_attr = spec.router_bias_attr
        self.shared_kind = spec.shared_expert
        self.route = route
        # one executor path per phase: "decode" for one-token steps, "prefill" otherwise
        self.executors = dict(executors)
        # At decode, a staged layer's routing may come from the prerouter's prediction
        # (``planned(layer) -> (inds, scores) | None``); ``observer(layer, x, inds)`` sees
        # every call's input and executed routing (prerouter state, trace collection).
        self.planned = None
        self.observer = None
        self.guard = None  # the Stager, when the quality guard may compare with the true router

    def router_logits(self, x):
        if self.router_kind == "linear":
            return self.gate(x)
        if self.router_kind == "matmul":
            return x @ self.gate.weight.T
        return self.gate.gate_proj(x)

    def routing(self, x):
        """(inds, scores) the model's own router picks for hidden states ``x``."""
        bias = getattr(self.gate, self.router_bias_attr) if self.router_bias_attr else None
        return self.route(self.router_logits(x), bias)

    def __call__(self, x):
        decode = x.shape[-2] == 1
        routed = self.planned(self.layer_id) if decode and self.planned is not None else None
        inds, scores = routed if routed is not None else self.routing(x)
        if routed is not None and self.guard is not None and self.guard.guard_wanted(self.layer_id):
            self.guard.guard_observe(self.layer_id, inds, self.routing(x)[0])
        if self.observer is not None:
            self.observer(self.layer_id, x, inds)
        executor = self.executors["decode" if decode else "prefill"]
        y = combine(executor(self.layer_id, x, inds), scores)
        if self.shared_kind == "plain":
            y = y + self.shared_experts(x)
        elif self.shared_kind == "gated":
            y = y + B.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y
