"""The prerouter's flush on the host: every head as float32 NumPy products.

A decode step's flush is a few matrix-vector products per head over weights much larger
than its inputs (39 heads at the 35B tier's shapes: about 300 MB of float32 per flush), so
it is bound by how fast the weights stream through the cores. MLX's CPU wheel runs such
products on a reference BLAS; NumPy's OpenBLAS streams them at several times its rate
(``tools/prerouter_flush_cost.py``: 39 heads, 40 ms in MLX against 16 ms here). Inside the
engine NumPy's BLAS threads would compete with MLX's compute threads and the readers for
the cores, so every flush holds NumPy's OpenBLAS to the calling thread (``one_blas_thread``).
``EngineConfig.prerouter_flush`` "auto" flushes here on the CPU backend where that thread
count can be set, in MLX elsewhere (docs/PREROUTER.md).

The layout serves one flush: per head, the two products of the hidden state (the residual
path and fc1's hidden part) are one matrix, and the multi-hot inputs are row gathers of
fc1 (a multi-hot vector times a matrix is the sum of the rows it selects).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from contextlib import contextmanager

import numpy as np

from edge0.backend import core as B

_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
            "openblas_set_num_threads")


@functools.cache
def _blas_threads():
    """(get, set) of the thread count of the OpenBLAS NumPy computes with, or None where it
    cannot be found (not Linux, another BLAS); looked up once."""
    found = None
    if sys.platform.startswith("linux"):
        np.ones((2, 2)) @ np.ones((2, 2))  # (NumPy's BLAS is loaded with NumPy; this makes sure)
        try:
            paths = {line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line.lower()}
        except OSError:
            paths = set()
        for path in sorted(paths):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for name in _SETTERS:
                getter = getattr(lib, name.replace("set_num", "get_num"), None)
                setter = getattr(lib, name, None)
                if getter is not None and setter is not None:
                    getter.restype, setter.argtypes = ctypes.c_int, [ctypes.c_int]
                    found = (getter, setter)
                    break
            if found:
                break
    return found


def blas_threads_controllable() -> bool:
    """Whether the flush can hold NumPy's BLAS to one thread (``one_blas_thread``)."""
    return _blas_threads() is not None


@contextmanager
def one_blas_thread():
    """Inside, NumPy's BLAS computes on one thread (the calling one), so that a flush does
    not wake BLAS threads that compete with MLX's compute threads and the reader threads
    for the cores; the count before is put back after. A no-op where it cannot be set."""
    blas = _blas_threads()
    if blas is None:
        yield
        return
    get, set_ = blas
    before = get()
    set_(1)
    try:
        yield
    finally:
        set_(before)


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
        with one_blas_thread():
            return self._logits(h, inds_t, inds_prev, tok)

    def _logits(self, h, inds_t, inds_prev, tok):
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
