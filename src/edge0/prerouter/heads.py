"""Prerouter heads: one small MLP plus a linear residual per owner layer."""

from __future__ import annotations

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.model.spec import MoESpec


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


# What a head sees. Files written before heads recorded their inputs have the first three.
BASE_INPUTS = ("hidden", "experts_t", "experts_prev")
# "token": the embedding row of the token the next step decodes (sampled before the flush).
TOKEN_INPUTS = BASE_INPUTS + ("token",)
KNOWN_INPUTS = (BASE_INPUTS, TOKEN_INPUTS)
WIDTH = 512  # a head's hidden width unless stated (warm-start heads', the speed forecast's replica's)


class Head(bnn.Module):
    """logits_c(t+1) = residual(h) + fc2(silu(fc1([h, onehot_t, onehot_{t-1}]))), where c is
    the consumer (the next MoE layer) of the owner layer whose router input is h.

    With the token input (``token_dim`` > 0), e, the embedding row of the token at t+1,
    joins fc1's input and has a linear path of its own:
    logits = residual(h) + token(e) + fc2(silu(fc1([h, e, onehot_t, onehot_{t-1}]))).

    ``fc2`` and ``token`` start at zero, so an untrained head is its residual path:
    warm-started from the consumer's router, "apply the next router to this hidden state"."""

    def __init__(self, hidden: int, experts: int, width: int, token_dim: int = 0):
        super().__init__()
        self.residual = bnn.Linear(hidden, experts, bias=False)
        self.fc1 = bnn.Linear(hidden + token_dim + 2 * experts, width)
        self.fc2 = bnn.Linear(width, experts)
        self.residual.weight = B.zeros(self.residual.weight.shape)
        self.fc2.weight = B.zeros(self.fc2.weight.shape)
        self.fc2.bias = B.zeros(self.fc2.bias.shape)
        if token_dim:
            self.token = bnn.Linear(token_dim, experts, bias=False)
            self.token.weight = B.zeros(self.token.weight.shape)

    def __call__(self, h, onehot_t, onehot_prev, tok=None):
        if "token" in self:
            z = B.concat([h, tok, onehot_t, onehot_prev], axis=-1)
            return self.residual(h) + self.token(tok) + self.fc2(bnn.silu(self.fc1(z)))
        z = B.concat([h, onehot_t, onehot_prev], axis=-1)
        return self.residual(h) + self.fc2(bnn.silu(self.fc1(z)))


class PrerouterHeads(bnn.Module):
    def __init__(self, owners: list[int], hidden: int, experts: int, k: int, width: int = WIDTH,
                 consumers: list[int] | None = None, token_dim: int = 0):
        """``consumers``: the layer each owner's head predicts (default: the next layer).
        ``token_dim``: width of the token embedding the heads see (0: no token input)."""
        super().__init__()
        self.owners = list(owners)
        consumers = [o + 1 for o in self.owners] if consumers is None else list(consumers)
        if len(consumers) != len(self.owners) or any(c <= o for o, c in zip(self.owners, consumers)):
            raise ValueError(f"each owner needs one later consumer layer: owners {self.owners}, consumers {consumers}")
        self.consumer = dict(zip(self.owners, consumers))
        self.hidden, self.experts, self.k, self.width = hidden, experts, k, width
        self.token_dim = token_dim
        self.inputs = TOKEN_INPUTS if token_dim else BASE_INPUTS
        # keys must not look like list indices (tree_unflatten would make a list of them)
        self.heads = {f"layer{l}": Head(hidden, experts, width, token_dim) for l in self.owners}

    @property
    def sees_token(self) -> bool:
        return bool(self.token_dim)

    def subset(self, owners: list[int]) -> "PrerouterHeads":
        """The heads of ``owners`` only (the same modules), in this file's owner order."""
        keep = [o for o in self.owners if o in set(owners)]
        sub = PrerouterHeads(keep, self.hidden, self.experts, self.k, 1, [self.consumer[o] for o in keep],
                             self.token_dim)
        sub.width = self.width
        sub.heads = {f"layer{o}": self.head(o) for o in keep}
        return sub

    def consumers(self) -> list[int]:
        return [self.consumer[o] for o in self.owners]

    def head(self, owner: int) -> Head:
        try:
            return self.heads[f"layer{owner}"]
        except KeyError:
            if getattr(self, "_dropped", False):
                raise RuntimeError("these heads' weights were freed when a prerouter took its own copy of them "
                                   "(load the heads file again to train or inspect them)") from None
            raise

    def drop_weights(self) -> None:
        """Free every head's weights once a flush holds its own copy of them (the prerouter's
        NumPy copy, or its stacked one): serving reads only the heads' shape after that."""
        self.heads = {}
        self._dropped = True

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
        if self.token_dim:
            self._stacked["tok"] = B.stack([t(h.token.weight) for h in hs])
        B.eval(list(self._stacked.values()))
        self._stacked_dtype = dtype

    def predict_all(self, h, inds_t, inds_prev, tok=None, heads: slice | None = None):
        """Every head at once. h [H, R, D], inds_* [H, R, k] (R: one row per sequence;
        inds_prev may hold -1 rows: no previous token), tok [1, R, token_dim] (the embedding
        of the token the next step decodes; heads with the token input only) -> logits
        [H, R, E], in owner order; ``heads``: the heads the inputs are for (a slice of the
        owners; None: all)."""
        st, dtype = self._stacked, self._stacked_dtype
        if heads is not None:
            st = {name: w[heads] for name, w in st.items()}
        on_t = B.one_hot_k(inds_t, self.experts, dtype)
        on_prev = B.one_hot_k(B.maximum(inds_prev, 0), self.experts, dtype) * (inds_prev[..., :1] >= 0).astype(dtype)
        h = h.astype(dtype)
        if not self.token_dim:
            z = B.concat([h, on_t, on_prev], axis=-1)
            return h @ st["res"] + bnn.silu(z @ st["w1"] + st["b1"]) @ st["w2"] + st["b2"]
        tok = B.broadcast_to(tok.astype(dtype).reshape(1, h.shape[1], -1), (h.shape[0], h.shape[1], self.token_dim))
        z = B.concat([h, tok, on_t, on_prev], axis=-1)
        return h @ st["res"] + tok @ st["tok"] + bnn.silu(z @ st["w1"] + st["b1"]) @ st["w2"] + st["b2"]

    def predict(self, owner: int, h, inds_t, inds_prev, tok=None):
        """Predicted router logits of the owner's consumer layer at the next token."""
        head = self.head(owner)
        dtype = head.residual.weight.dtype
        on_t, on_prev = self.features(inds_t, inds_prev, dtype)
        return head(h.astype(dtype), on_t, on_prev, None if tok is None else tok.astype(dtype))
