"""Prerouter heads: one small MLP plus a linear residual per owner layer."""

from __future__ import annotations

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.spec import MoESpec


def consumer_of(spec: MoESpec, owner: int) -> int | None:
    """The MoE layer a head owned by ``owner`` predicts: the next MoE layer after it (layer
    owner+1 in models whose layers are all MoE; further on where dense or state-space
    layers sit between MoE layers)."""
    later = [l for l in spec.moe_layers if l > owner]
    return later[0] if later else None


def eligible_owners(spec: MoESpec) -> list[int]:
    """MoE layers followed by another MoE layer (a head needs both), where the prerouter
    can drive the model at all."""
    if spec.prerouter_problem:
        return []
    return [l for l in spec.moe_layers if consumer_of(spec, l) is not None]


class Head(bnn.Module):
    """logits_c(t+1) = residual(h) + fc2(silu(fc1([h, onehot_t, onehot_{t-1}]))), where c is
    the consumer (the next MoE layer) of the owner layer whose router input is h.

    ``fc2`` starts at zero, so an untrained head is its residual path: warm-started from
    the consumer's router, "apply the next router to this hidden state"."""

    def __init__(self, hidden: int, experts: int, width: int):
        super().__init__()
        self.residual = bnn.Linear(hidden, experts, bias=False)
        self.fc1 = bnn.Linear(hidden + 2 * experts, width)
        self.fc2 = bnn.Linear(width, experts)
        self.residual.weight = B.zeros(self.residual.weight.shape)
        self.fc2.weight = B.zeros(self.fc2.weight.shape)
        self.fc2.bias = B.zeros(self.fc2.bias.shape)

    def __call__(self, h, onehot_t, onehot_prev):
        z = B.concat([h, onehot_t, onehot_prev], axis=-1)
        return self.residual(h) + self.fc2(bnn.silu(self.fc1(z)))


class PrerouterHeads(bnn.Module):
    def __init__(self, owners: list[int], hidden: int, experts: int, k: int, width: int = 512,
                 consumers: list[int] | None = None):
        """``consumers``: the layer each owner's head predicts (default: the next layer)."""
        super().__init__()
        self.owners = list(owners)
        consumers = [o + 1 for o in self.owners] if consumers is None else list(consumers)
        if len(consumers) != len(self.owners) or any(c <= o for o, c in zip(self.owners, consumers)):
            raise ValueError(f"each owner needs one later consumer layer: owners {self.owners}, consumers {consumers}")
        self.consumer = dict(zip(self.owners, consumers))
        self.hidden, self.experts, self.k, self.width = hidden, experts, k, width
        # keys must not look like list indices (tree_unflatten would make a list of them)
        self.heads = {f"layer{l}": Head(hidden, experts, width) for l in self.owners}

    def consumers(self) -> list[int]:
        return [self.consumer[o] for o in self.owners]

    def head(self, owner: int) -> Head:
        return self.heads[f"layer{owner}"]

    def warm_start(self, router_weights: dict[int, object]) -> None:
        """Residual path of each head := its consumer's router weight [E, D]
        (``router_weights``: consumer layer -> weight)."""
        for owner in self.owners:
            w = router_weights[self.consumer[owner]]
            self.head(owner).residual.weight = w.astype(self.head(owner).residual.weight.dtype)

    def features(self, inds_t, inds_prev, dtype):
        on_t = B.one_hot_k(inds_t, self.experts, dtype)
        on_prev = B.zeros(on_t.shape, dtype=dtype) if inds_prev is None else B.one_hot_k(inds_prev, self.experts, dtype)
        return on_t, on_prev

    def freeze_for_inference(self, dtype) -> None:
        """Stack every head's weights once, so that a flush is a handful of batched ops
        instead of a dozen per head (heads are frozen while serving)."""
        hs = [self.head(o) for o in self.owners]
        t = lambda w: w.astype(dtype).T
        self._stacked = dict(
            res=B.stack([t(h.residual.weight) for h in hs]), w1=B.stack([t(h.fc1.weight) for h in hs]),
            b1=B.stack([h.fc1.bias.astype(dtype)[None] for h in hs]), w2=B.stack([t(h.fc2.weight) for h in hs]),
            b2=B.stack([h.fc2.bias.astype(dtype)[None] for h in hs]))
        B.eval(list(self._stacked.values()))
        self._stacked_dtype = dtype

    def predict_all(self, h, inds_t, inds_prev):
        """Every head at once. h [H, 1, D], inds_* [H, 1, k] (inds_prev may hold -1 rows:
        no previous token) -> logits [H, 1, E], in owner order."""
        st, dtype = self._stacked, self._stacked_dtype
        on_t = B.one_hot_k(inds_t, self.experts, dtype)
        on_prev = B.one_hot_k(B.maximum(inds_prev, 0), self.experts, dtype) * (inds_prev[..., :1] >= 0).astype(dtype)
        h = h.astype(dtype)
        z = B.concat([h, on_t, on_prev], axis=-1)
        return h @ st["res"] + bnn.silu(z @ st["w1"] + st["b1"]) @ st["w2"] + st["b2"]

    def predict(self, owner: int, h, inds_t, inds_prev):
        """Predicted router logits of the owner's consumer layer at the next token."""
        head = self.head(owner)
        dtype = head.residual.weight.dtype
        on_t, on_prev = self.features(inds_t, inds_prev, dtype)
        return head(h.astype(dtype), on_t, on_prev)
