"""Prediction as routing at decode: observe the owner layers, flush every head once per step.

Each owner layer's ``RouterTap`` hands its router's input and its ``StreamingSwitch`` the
experts the block routed to (lazy arrays: no sync) to the pass's ``Observing`` (in its
``Step``); the batch keeps what they observed as a value (``Observed``). ``flush`` evaluates
every head on it in one batch: the head owned by layer l predicts the router logits of its
consumer (the next MoE layer, l+1 in most models) for the next token. Each consumer layer's
own block code turns those logits into its routing (``PrerouterPlanner``, through the
layer's ``RoutingProbe``): the plan of what to read, and, through the consumer's router at
the next step, the routing the block computes with, combine weights included.

What the heads observed is a value, ``Observed`` (one row per sequence): the batch owns
one (``edge0.decoding.Batch``), a joining row one of its own; joining, filtering and
splitting a batch join, select and split it alike. A forward pass collects the owners'
observations in the ``Observing`` its ``Step`` gives and returns the new value
(``Observing.after``); the prerouter keeps none of it.

The flush on the host (``prerouter_flush numpy``): every head as float32 NumPy products. A
decode step's flush is a few matrix-vector products per head over weights much larger than
its inputs (39 heads at the 35B tier's shapes: about 300 MB of float32 per flush), so it is
bound by how fast the weights stream through the cores. MLX's CPU wheel runs such products
on a reference BLAS; NumPy's OpenBLAS streams them at several times its rate
(``tools/prerouter_flush_cost.py``: 39 heads, 40 ms in MLX against 16 ms here). Inside the
engine NumPy's BLAS threads would compete with MLX's compute threads and the readers for
the cores, so every flush holds NumPy's OpenBLAS to the calling thread (``one_blas_thread``).
``EngineConfig.prerouter_flush`` "auto" flushes there on the CPU backend where that thread
count can be set, in MLX elsewhere (docs/PREROUTER.md). Its layout (``HostHeads``) serves one
flush: per head, the two products of the hidden state (the residual path and fc1's hidden
part) are one matrix, and the multi-hot inputs are row gathers of fc1 (a multi-hot vector
times a matrix is the sum of the rows it selects).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import numpy as np

from edge0.backend import core as B
from edge0.prerouter.heads import PrerouterHeads
from edge0.prerouter.quantized import QuantizedHeads


_EMPTY: Mapping = MappingProxyType({})


@dataclass(frozen=True)
class Observed:
    """``last``: owner layer -> (router input [R, D], experts [R, k]) at the last step seen;
    ``prev``: owner -> experts [R, k] the step before (None, or rows of -1: none yet). One
    row per sequence, in the batch's order."""

    last: Mapping[int, tuple] = field(default_factory=lambda: _EMPTY)
    prev: Mapping[int, object] = field(default_factory=lambda: _EMPTY)

    def seen(self, owners) -> bool:
        """Whether every owner layer was observed (a flush can predict from it)."""
        return all(o in self.last for o in owners)

    def select(self, rows: list[int]) -> Observed:
        """The sequences ``rows`` (row numbers) only, in that order."""
        idx = B.array(rows, dtype=B.int32)
        return Observed({o: (x[idx], i[idx]) for o, (x, i) in self.last.items()},
                        {o: (p[idx] if p is not None else None) for o, p in self.prev.items()})

    @staticmethod
    def join(states: list[Observed]) -> Observed:
        """One value whose rows are ``states``' rows, in order (each one saw the owners the
        first saw)."""
        last, prev = {}, {}
        for o in states[0].last:
            rows = [s.last[o] for s in states]
            last[o] = (B.concat([r[0] for r in rows]), B.concat([r[1] for r in rows]))
            prev[o] = B.concat([s.prev[o] if s.prev.get(o) is not None else B.full(r[1].shape, -1, B.int32)
                                for s, r in zip(states, rows)])
        return Observed(last, prev)


class Observing:
    """One forward pass's observations, collected by the owners' taps: made from the value
    before the pass (``before``), read back with ``after``. ``sequences``: a prefill pass
    of that many sequences left-padded alike (each one's last row is "t", the one before
    "t-1"); a decode step has one row per sequence."""

    def __init__(self, before: Observed | None = None, sequences: int = 1):
        before = before or Observed()
        self.before, self.sequences = before, sequences
        self._last, self._prev, self._x = dict(before.last), dict(before.prev), {}

    def router_input(self, layer: int, x) -> None:
        self._x[layer] = x

    def experts(self, layer: int, inds, decode: bool | None = None) -> None:
        """Layer ``layer``'s block routed to ``inds``; paired with its router input."""
        x = self._x.pop(layer, None)
        if x is not None:
            self.observe(layer, x, inds, decode)

    def observe(self, layer: int, x, inds, decode: bool | None = None) -> None:
        """``decode``: the pass is a decode step; None: a call on one token is one."""
        rows_x = x.reshape(-1, x.shape[-1])
        rows_i = inds.reshape(-1, inds.shape[-1])
        n = rows_i.shape[0]
        if decode is None:
            decode = n == 1
        if decode or n == 1:
            if layer in self._last:
                self._prev[layer] = self._last[layer][1]
            self._last[layer] = (rows_x, rows_i)
        elif self.sequences > 1:
            xs = rows_x.reshape(self.sequences, -1, rows_x.shape[-1])
            ks = rows_i.reshape(self.sequences, -1, rows_i.shape[-1])
            self._last[layer] = (xs[:, -1], ks[:, -1])
            self._prev[layer] = ks[:, -2]
        else:
            self._last[layer] = (rows_x[-1:], rows_i[-1:])
            self._prev[layer] = rows_i[-2:-1]

    def after(self) -> Observed:
        """The value after the pass (lazy arrays, evaluated with the pass)."""
        return Observed(MappingProxyType(dict(self._last)), MappingProxyType(dict(self._prev)))


class Prerouter:
    def __init__(self, heads: PrerouterHeads, dtype=None, on_host: bool = False, width: int | None = None,
                 quantized: bool = False):
        """``on_host``: the flush runs as float32 NumPy products (``HostHeads``, below);
        ``quantized``: on Edge0's kernels in 8-bit weights (``edge0.prerouter.quantized``);
        else as MLX's on its device, in ``dtype``; ``width``: experts staged per consumer
        (select routing), None: k (the prediction is the routing). Complete when made: a
        flush is a function of what the heads observed (``Observed``), which the batch
        owns."""
        self.heads = heads
        self.host = HostHeads(heads) if on_host else None
        self.quantized = QuantizedHeads(heads) if quantized else None
        if not on_host and not quantized:
            heads.freeze_for_inference(dtype or heads.head(heads.owners[0]).residual.weight.dtype)
        heads.drop_weights()  # the flush has its own copy: the loaded one is memory the cache can use
        B.clear_cache()
        self.owners = frozenset(heads.owners)
        self.width = width  # experts staged per consumer (None: k, the prediction is the routing)

    def flush(self, state: Observed, tok=None) -> dict[int, object]:
        """consumer layer -> its predicted router logits [R, E] (float32, lazy) for the coming
        step, one row per sequence of ``state`` (which saw every owner): every head in one
        batched evaluation (the consumer: the next MoE layer after the owner). ``tok``
        [R, token_dim]: the embedding rows of the tokens the coming step decodes (heads that
        see the token need them)."""
        owners = self.heads.owners
        rows = state.last[owners[0]][1].shape[0]
        x = B.concat([state.last[o][0].reshape(1, rows, -1) for o in owners])
        inds = B.concat([state.last[o][1].reshape(1, rows, -1) for o in owners])
        k = inds.shape[-1]
        prev = B.concat([state.prev[o].reshape(1, rows, -1) if state.prev.get(o) is not None
                         else B.full((1, rows, k), -1, B.int32) for o in owners])
        if self.heads.token_dim:  # these heads see the token
            if tok is None:
                raise ValueError("these heads see the token being decoded: flush(state, tok) needs its embedding")
            tok = tok.reshape(1, rows, -1)
        else:
            tok = None
        logits = self.logits(x, inds, prev, tok)
        return {self.heads.consumer[o]: logits[i].reshape(rows, -1) for i, o in enumerate(owners)}

    def predict(self, owner: int, x, inds, prev, tok=None):
        """The predicted router logits [R, E] (float32, lazy) of ``owner``'s consumer for R
        positions, from that owner's inputs alone (x [R, D], inds and prev [R, k], tok
        [R, token_dim]): one head's share of a ``flush``'s products, each row what a flush
        of that row alone gives (bit for bit for one row; for several, up to the rounding of
        products over several rows, as everywhere else in a pass over several positions). A
        verify pass predicts its drafted positions so, from what the owner observed at the
        positions before, inside the same pass."""
        rows, h = x.shape[0], self.heads.owners.index(owner)
        tok = tok.reshape(1, rows, -1) if self.heads.token_dim else None
        return self.logits(x.reshape(1, rows, -1), inds.reshape(1, rows, -1), prev.reshape(1, rows, -1), tok,
                           heads=slice(h, h + 1))[0]

    def logits(self, x, inds, prev, tok=None, heads: slice | None = None):
        """Every head's predicted router logits [H, R, E] (float32) from their inputs
        (``PrerouterHeads.predict_all``'s), on the device or, with ``on_host``, in NumPy after
        one host read of the inputs (computed already: the step before is evaluated).
        ``heads``: the heads the inputs are for (a slice of the owners; None: all)."""
        if self.quantized is not None:
            return self.quantized.logits(x, inds, prev, tok, heads)
        if self.host is None:
            return self.heads.predict_all(x, inds, prev, tok, heads).astype(B.float32)
        parts = [x, inds, prev] + ([] if tok is None else [tok])
        flat = B.to_host(B.concat([p.astype(B.float32).reshape(-1) for p in parts]))
        cut = np.cumsum([0] + [p.size for p in parts])
        host = [flat[a:b].reshape(p.shape) for p, a, b in zip(parts, cut[:-1], cut[1:])]
        h, i, ip = host[0], host[1].astype("int64"), host[2].astype("int64")
        t = host[3].reshape(x.shape[1], -1) if tok is not None else None
        return B.array(self.host.logits(h, i, ip, t, heads))


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

    def logits(self, h: np.ndarray, inds_t: np.ndarray, inds_prev: np.ndarray, tok: np.ndarray | None = None,
               heads: slice | None = None):
        """As ``PrerouterHeads.predict_all``, on float32 NumPy arrays: h [H, R, D], inds_*
        [H, R, k] (distinct experts per row; inds_prev rows of -1: no previous token),
        tok [R, token_dim] -> logits [H, R, E]; ``heads``: the heads they are for (a slice
        of the owners; None: all). NumPy multiplies a stack head by head, so one head's rows
        do not depend on the others'."""
        with one_blas_thread():
            return self._logits(h, inds_t, inds_prev, tok, heads or slice(None))

    def _logits(self, h, inds_t, inds_prev, tok, heads):
        e = self.experts
        a = h @ self.hidden_w[heads]  # [H, R, E + width]: the residual path, then fc1's hidden part
        if self.token_w is not None:
            if tok is None:
                raise ValueError("these heads see the token being decoded: logits(..., tok) needs it")
            a = a + tok[None] @ self.token_w[heads]
        onehot = self.onehot_w[heads]
        rows = np.arange(h.shape[0])[:, None, None]
        pre = a[..., e:] + self.b1[heads] + onehot[rows, inds_t].sum(axis=2)
        has_prev = (inds_prev[..., :1] >= 0).astype(np.float32)  # [H, R, 1]
        pre += onehot[rows, e + np.maximum(inds_prev, 0)].sum(axis=2) * has_prev
        act = pre * (0.5 + 0.5 * np.tanh(0.5 * pre))  # silu, without exp's overflow
        return a[..., :e] + act @ self.w2[heads] + self.b2[heads]
