"""Prediction as routing at decode: observe the owner layers, flush every head once per step.

``observe`` is called by each owner layer's ``StreamingMoE`` with its post-attention-norm
input and the routing it executed (lazy arrays: no sync). ``flush`` evaluates every head
in one batch and runs each prediction through the consumer layer's own routing function
(``routing.make_route_fn``, with the consumer's score-correction bias): the result is that
layer's routing at the next step, used both to plan the reads and to compute.
"""

from __future__ import annotations

from typing import Callable

from edge0.backend import core as B
from edge0.prerouter.heads import PrerouterHeads


class Prerouter:
    def __init__(self, heads: PrerouterHeads, route: Callable, bias_of: Callable[[int], object], dtype=None):
        self.heads = heads
        heads.freeze_for_inference(dtype or heads.head(heads.owners[0]).residual.weight.dtype)
        self.route = route  # the family's routing function: (logits, bias) -> (inds, scores)
        self.bias_of = bias_of  # consumer layer -> its router's score-correction bias (or None)
        self.owners = set(heads.owners)
        self.reset()

    def reset(self) -> None:
        self.last: dict[int, tuple] = {}  # owner -> (x at t [1,1,D], inds at t [1,1,k])
        self.prev: dict[int, object] = {}  # owner -> inds at t-1

    def observe(self, layer: int, x, inds) -> None:
        if layer not in self.owners:
            return
        n = x.shape[-2]
        if n == 1:
            if layer in self.last:
                self.prev[layer] = self.last[layer][1]
            self.last[layer] = (x, inds)
        else:  # a prefill pass: its last row is "t", the one before "t-1"
            self.last[layer] = (x[..., -1:, :], inds[..., -1:, :])
            self.prev[layer] = inds[..., -2:-1, :] if n >= 2 else self.prev.get(layer)

    def ready(self) -> bool:
        return all(o in self.last for o in self.owners)

    def flush(self) -> dict[int, tuple]:
        """consumer layer -> predicted (inds, scores) for the coming step (lazy): every head
        in one batched evaluation, then each consumer's own routing function."""
        owners = self.heads.owners
        x = B.concat([self.last[o][0].reshape(1, 1, -1) for o in owners])
        inds = B.concat([self.last[o][1].reshape(1, 1, -1) for o in owners])
        k = inds.shape[-1]
        prev = B.concat([self.prev[o].reshape(1, 1, -1) if self.prev.get(o) is not None
                         else B.full((1, 1, k), -1, B.int32) for o in owners])
        logits = self.heads.predict_all(x, inds, prev).astype(B.float32)
        return {o + 1: self.route(logits[i], self.bias_of(o + 1)) for i, o in enumerate(owners)}
