"""The heads' flush on Edge0's kernels, in 8-bit weights (``prerouter_flush edge0``).

A decode step's flush is bound by how fast the heads' weights stream through the cores: at
the 35B tier's shapes each head's products of the hidden state and of the token's embedding
read two 2048 x 768 float32 matrices, 140 MB a step for 11 heads, about 9 ms of one core in
NumPy. Here those matrices, and fc2's, are quantized once when the engine opens (MLX's
affine layout, 8 bits, groups of 64: a quarter of the bytes) and multiplied by Edge0's
gather kernel, one call for all heads (the head is the kernel's expert index), on the
kernels' threads; the multi-hot inputs stay row gathers of fc1's float32 rows. The graph is
lazy, so the flush joins the step's graph as MLX's does (one host read a step).

The predictions are the float heads' up to the 8-bit rounding of their weights (each
weight within half a step of its group's 255 steps): close, not equal, so under replace
routing the routing, and so the text, may differ from the float32 flushes' where two
experts' predicted logits are that close. On the CPU backend it is the default where the
kernels resolve to edge0 and the heads' widths quantize (``prerouter_flush`` auto): on the
demo, served token by token over 4,080 tokens, its perplexity is 1.000006x the float32
flush's (``tools/flush_quality.py``).
"""

from __future__ import annotations

import numpy as np

from edge0.backend import core as B
from edge0.backend import kernels as bk
from edge0.backend import nn as bnn
from edge0.errors import ConfigError

BITS = 8


def width_of(heads) -> int:
    """fc1's outputs, the same in every head."""
    return heads.head(heads.owners[0]).fc1.weight.shape[0]


def group_of(heads) -> int:
    """The quantization group of ``heads``' products: 64, else 32, inputs (ConfigError when
    a width is a multiple of neither)."""
    dims = (heads.hidden, heads.token_dim or heads.hidden, width_of(heads))
    for g in (64, 32):
        if all(d % g == 0 for d in dims):
            return g
    raise ConfigError(f"prerouter_flush edge0 quantizes the heads in groups of 64 or 32 inputs; their widths {dims} "
                      "are not multiples of 32 (prerouter_flush numpy or mlx)")


def quantizable(heads) -> bool:
    """Whether ``heads``' widths quantize in groups (``prerouter_flush`` auto flushes them in
    8 bits only then)."""
    try:
        group_of(heads)
    except ConfigError:
        return False
    return True


def planned_bytes(heads) -> int:
    """What ``QuantizedHeads(heads)`` will hold, from the heads' shapes: the quantized
    matrices (a byte a weight, a float32 scale and bias a group) and the float32 rest."""
    d, t, e = heads.hidden, heads.token_dim, heads.experts
    width, group = width_of(heads), group_of(heads)
    quantized = (e + width) * (d + t) + e * width
    floats = 2 * e * width + width + e
    return len(heads.owners) * int(quantized * (1 + 8 / group) + 4 * floats)


class QuantizedHeads:
    def __init__(self, heads):
        """``heads``: a ``PrerouterHeads`` (its weights are copied, quantized; it is frozen
        while serving)."""
        if not bk.available():
            raise ConfigError(f"prerouter_flush edge0 runs on Edge0's kernels: {bk.unavailable_reason()}")
        hs = [heads.head(o) for o in heads.owners]
        d, t, e = heads.hidden, heads.token_dim, heads.experts
        self.experts = e
        self.group = group_of(heads)
        f32 = lambda w: w.astype(B.float32)  # noqa: E731
        # [N, K] per head (the kernel multiplies by the transpose): the residual path's and
        # fc1's products of the hidden state as one matrix, likewise the token's, then fc2
        self.hidden = self._quantized([B.concat([f32(h.residual.weight), f32(h.fc1.weight)[:, :d]]) for h in hs])
        self.token = (self._quantized([B.concat([f32(h.token.weight), f32(h.fc1.weight)[:, d:d + t]]) for h in hs])
                      if t else None)
        self.w2 = self._quantized([f32(h.fc2.weight) for h in hs])
        self.onehot = B.stack([f32(h.fc1.weight)[:, d + t:].T for h in hs])  # [H, 2E, width]: rows gathered
        self.b1 = B.stack([f32(h.fc1.bias)[None] for h in hs])  # [H, 1, width]
        self.b2 = B.stack([f32(h.fc2.bias)[None] for h in hs])  # [H, 1, E]
        self.index = B.array(np.arange(len(hs), dtype=np.uint32))  # head h: the kernel's expert h
        self.rows = B.array(np.arange(len(hs), dtype=np.int32)).reshape(-1, 1, 1)
        B.eval([*self.hidden, *self.w2, self.onehot, self.b1, self.b2, *(self.token or ())])

    def _quantized(self, mats: list) -> tuple:
        """Each head's matrix quantized and evaluated on its own (so that opening holds one
        head's float32 copy at a time, not every head's), then stacked: (weight, scales,
        biases) [H, N, ...]."""
        parts = []
        for m in mats:
            q = bk.quantize(m, bits=BITS, group_size=self.group)
            B.eval(list(q))
            parts.append(q)
        stacked = tuple(B.stack([p[i] for p in parts]) for i in range(3))
        B.eval(list(stacked))
        return stacked

    @property
    def nbytes(self) -> int:
        parts = [*self.hidden, *self.w2, self.onehot, self.b1, self.b2, *(self.token or ())]
        return sum(p.nbytes for p in parts)

    def _mm(self, x, stack, index):
        return bk.gather_qmm(x, *stack, index, bits=BITS, group_size=self.group)

    def logits(self, h, inds_t, inds_prev, tok=None, heads: slice | None = None):
        """As ``PrerouterHeads.predict_all``: h [H, R, D], inds_* [H, R, k] (inds_prev rows
        of -1: no previous token), tok [1, R, token_dim] -> logits [H, R, E] (lazy);
        ``heads``: the heads they are for (a slice of the owners; None: all). The kernel
        computes each head's product on its own, so one head's rows do not depend on the
        others'."""
        heads = heads or slice(None)
        e, index, onehot = self.experts, self.index[heads], self.onehot[heads]
        rows = self.rows[:onehot.shape[0]]
        a = self._mm(h.astype(B.float32), self.hidden, index)  # [H, R, E + width]
        if self.token is not None:
            if tok is None:
                raise ValueError("these heads see the token being decoded: logits(..., tok) needs it")
            a = a + self._mm(tok.astype(B.float32), self.token, index)  # one embedding row per sequence, every head
        has_prev = (inds_prev[..., :1] >= 0).astype(B.float32)[..., None]  # [H, R, 1, 1]
        pre = (a[..., e:] + self.b1[heads] + onehot[rows, inds_t].sum(axis=2)
               + (onehot[rows, e + B.maximum(inds_prev, 0)] * has_prev).sum(axis=2))
        return a[..., :e] + self._mm(bnn.silu(pre), self.w2, index) + self.b2[heads]
