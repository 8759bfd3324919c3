"""Prediction as routing at decode: observe the owner layers, flush every head once per step.

Each owner layer's ``RouterTap`` hands over its router's input and its ``StreamingSwitch``
the experts the block routed to (lazy arrays: no sync). ``flush`` evaluates every head in
one batch: the head owned by layer l predicts the router logits of its consumer (the next
MoE layer, l+1 in most models) for the next token. Each consumer
layer's own block code turns those logits into its routing (``Streaming.route``): the
plan of what to read, and, through the consumer's router at the next step, the routing
the block computes with, combine weights included.
"""

from __future__ import annotations

from edge0.backend import core as B
from edge0.prerouter.heads import PrerouterHeads


class Prerouter:
    def __init__(self, heads: PrerouterHeads, dtype=None):
        self.heads = heads
        heads.freeze_for_inference(dtype or heads.head(heads.owners[0]).residual.weight.dtype)
        self.owners = set(heads.owners)
        self.route = None  # set by connect(): (consumer, logits, width) -> that block's routing of them
        self.embed = None  # set by connect(): token ids -> embedding rows (heads that see the token)
        self.width = None  # experts staged per consumer (None: k, the prediction is the routing)
        self.reset()

    def connect(self, *, route, embed) -> None:
        """``route`` (consumer layer, logits [N, E], width) -> the indices its own block's
        routing code makes of them; ``embed`` (token ids) -> their embedding rows."""
        self.route, self.embed = route, embed

    def reset(self) -> None:
        self.last: dict[int, tuple] = {}  # owner -> (router input at t [1, D], experts at t [1, k])
        self.prev: dict[int, object] = {}  # owner -> experts at t-1
        self._x: dict[int, object] = {}

    def on_router_input(self, layer: int, x) -> None:
        self._x[layer] = x

    def on_experts(self, layer: int, inds) -> None:
        x = self._x.pop(layer, None)
        if x is not None and layer in self.owners:
            self.observe(layer, x, inds)

    def observe(self, layer: int, x, inds) -> None:
        rows_x = x.reshape(-1, x.shape[-1])
        rows_i = inds.reshape(-1, inds.shape[-1])
        n = rows_i.shape[0]
        if n == 1:
            if layer in self.last:
                self.prev[layer] = self.last[layer][1]
            self.last[layer] = (rows_x[-1:], rows_i[-1:])
        else:  # a prefill pass: its last row is "t", the one before "t-1"
            self.last[layer] = (rows_x[-1:], rows_i[-1:])
            self.prev[layer] = rows_i[-2:-1]

    def ready(self) -> bool:
        return all(o in self.last for o in self.owners)

    def flush(self, tokens=None) -> dict[int, tuple]:
        """consumer layer -> (predicted experts [1, k] (or [1, width]), predicted router
        logits [1, E]) for the coming step (lazy): every head in one batched evaluation,
        each prediction routed by its consumer's own block (the consumer: the next MoE layer
        after the owner). ``tokens`` [1, 1]: the token the coming step decodes (heads that
        see the token need it)."""
        owners = self.heads.owners
        x = B.concat([self.last[o][0].reshape(1, 1, -1) for o in owners])
        inds = B.concat([self.last[o][1].reshape(1, 1, -1) for o in owners])
        k = inds.shape[-1]
        prev = B.concat([self.prev[o].reshape(1, 1, -1) if self.prev.get(o) is not None
                         else B.full((1, 1, k), -1, B.int32) for o in owners])
        tok = None
        if self.heads.sees_token:
            if tokens is None:
                raise ValueError("these heads see the token being decoded: flush(tokens) needs it")
            tok = self.embed(tokens.reshape(1, 1))
        logits = self.heads.predict_all(x, inds, prev, tok).astype(B.float32)
        out = {}
        for i, o in enumerate(owners):
            z = logits[i].reshape(1, -1)
            c = self.heads.consumer[o]
            out[c] = (self.route(c, z, self.width), z)
        return out
