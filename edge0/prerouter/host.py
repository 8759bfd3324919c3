"""The prerouter's flush on the host: every head as float32 NumPy products.

A decode step's flush is a few matrix-vector products per head over weights much larger
than its inputs (39 heads at the 35B tier's shapes: about 300 MB of float32 per flush), so
it is bound by how fast the weights stream through the cores. MLX's CPU wheel runs such
products on a reference BLAS; NumPy's OpenBLAS streams them at several times its rate
(``tools/prerouter_flush_cost.py``: 39 heads, 40 ms in MLX against 16 ms here). Inside the
engine NumPy's BLAS threads compete with MLX's for the cores, so this flush is an opt-in
(``EngineConfig.prerouter_flush`` "numpy", with ``OPENBLAS_NUM_THREADS=1``); the default
flushes in MLX (docs/PREROUTER.md).

The layout serves one flush: per head, the two products of the hidden state (the residual
path and fc1's hidden part) are one matrix, and the multi-hot inputs are row gathers of
fc1 (a multi-hot vector times a matrix is the sum of the rows it selects).
"""

from __future__ import annotations

import numpy as np

from edge0.backend import core as B


def _host(w) -> np.ndarray:
    return B.to_host(w.astype(B.float32))


class HostHeads:
    def __init__(self, heads):
        """``heads``: a ``PrerouterHeads`` (its weights are copied; it is frozen while serving)."""
        hs = [heads.head(o) for o in heads.owners]
        d, t, e = heads.hidden, heads.token_dim, heads.experts
        self.experts, self.token_dim = e, t
        fc1 = [_host(h.fc1.weight).T for h in hs]  # [in, width] each; in = D (+ T) + 2E
        self.hidden_w = np.ascontiguousarray(
            np.stack([np.concatenate([_host(h.residual.weight).T, w[:d]], axis=1) for h, w in zip(hs, fc1)]))
        self.token_w = (np.ascontiguousarray(np.stack([np.concatenate([_host(h.token.weight).T, w[d:d + t]], axis=1)
                                                       for h, w in zip(hs, fc1)])) if t else None)
        self.onehot_w = np.ascontiguousarray(np.stack([w[d + t:] for w in fc1]))  # [H, 2E, width]
        self.b1 = np.stack([_host(h.fc1.bias)[None] for h in hs])  # [H, 1, width]
        self.w2 = np.ascontiguousarray(np.stack([_host(h.fc2.weight).T for h in hs]))  # [H, width, E]
        self.b2 = np.stack([_host(h.fc2.bias)[None] for h in hs])  # [H, 1, E]

    @property
    def nbytes(self) -> int:
        parts = (self.hidden_w, self.token_w, self.onehot_w, self.b1, self.w2, self.b2)
        return sum(p.nbytes for p in parts if p is not None)

    def logits(self, h: np.ndarray, inds_t: np.ndarray, inds_prev: np.ndarray, tok: np.ndarray | None = None):
        """As ``PrerouterHeads.predict_all``, on float32 NumPy arrays: h [H, R, D], inds_*
        [H, R, k] (distinct experts per row; inds_prev rows of -1: no previous token),
        tok [R, token_dim] -> logits [H, R, E]."""
        e = self.experts
        a = h @ self.hidden_w  # [H, R, E + width]: the residual path, then fc1's hidden part
        if self.token_w is not None:
            if tok is None:
                raise ValueError("these heads see the token being decoded: logits(..., tok) needs it")
            a = a + tok[None] @ self.token_w
        rows = np.arange(h.shape[0])[:, None, None]
        pre = a[..., e:] + self.b1 + self.onehot_w[rows, inds_t].sum(axis=2)
        has_prev = (inds_prev[..., :1] >= 0).astype(np.float32)  # [H, R, 1]
        pre += self.onehot_w[rows, e + np.maximum(inds_prev, 0)].sum(axis=2) * has_prev
        act = pre * (0.5 + 0.5 * np.tanh(0.5 * pre))  # silu, without exp's overflow
        return a[..., :e] + act @ self.w2 + self.b2
