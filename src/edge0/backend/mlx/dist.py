"""``mx.distributed`` for the pipeline: the group, point-to-point transfers, the modules
that stand where another rank's part of the model stood.

A pipeline rank builds mlx-lm's whole model skeleton and then replaces what it does not
hold: another rank's decoder layers by a ``LayerStub`` (no weights; its KV cache holds a
one-wide key and value per token, so every cache keeps the offsets, masks and trims the
model's own code reads from it), the embedding on every rank but the first by an
``EmbedStub`` (zeros of the right shape, which the first local layer replaces with what it
receives), the final norm by ``Identity`` and the head by a ``HeadStub`` on every rank but
the last. The last rank's head output (the last position's logits) is summed over the
group with the others' zeros, so every rank samples the same token.
"""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn

from edge0.errors import DistributedError


CONNECT_TIMEOUT_S = 120.0  # EDGE0_CONNECT_TIMEOUT overrides it


def group():
    """The group ``mlx.launch`` started this process in, or None (one process). Joining
    it waits for every rank to connect, at most ``EDGE0_CONNECT_TIMEOUT`` seconds (120 by
    default); past that this process ends with a message naming the ranks' addresses."""
    if not mx.distributed.is_available():
        return None
    g = _join()
    return g if g.size() > 1 else None


_joined: list = []


def _join():
    if _joined:
        return _joined[0]
    if "MLX_RANK" not in os.environ:  # not launched: one process, nothing to connect
        _joined.append(mx.distributed.init())
        return _joined[0]
    timeout = float(os.environ.get("EDGE0_CONNECT_TIMEOUT", CONNECT_TIMEOUT_S))
    rank = os.environ.get("MLX_RANK")
    message = (f"edge0: error: rank {rank}: the other ranks did not connect within {timeout:g} s (addresses "
               f"{os.environ.get('MLX_HOSTFILE', 'unknown')}); start every rank with mlx.launch, check the hostfile "
               "and the network, or raise EDGE0_CONNECT_TIMEOUT\n")
    # mx.distributed.init blocks in C++ holding the interpreter until every rank has connected, so no
    # thread of this process can bound it: a watchdog process ends this one if it has not connected in time
    watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(timeout), message],
                                stdin=subprocess.PIPE)
    try:
        g = mx.distributed.init()
    except Exception as e:
        raise DistributedError(f"rank {rank}: joining the group failed: {e}") from None
    finally:
        watchdog.stdin.close()  # connected (or failed): the watchdog stands down
        watchdog.wait()
    _joined.append(g)
    return g


_WATCHDOG = """
import os, select, signal, sys
pid, timeout, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if not select.select([sys.stdin], [], [], timeout)[0]:
    sys.stderr.write(message)
    sys.stderr.flush()
    os.kill(pid, signal.SIGKILL)
"""


def send(x, dst: int, g):
    return mx.distributed.send(x, dst, group=g)


def recv_like(x, src: int, g):
    return mx.distributed.recv_like(x, src, group=g)


def all_sum(x, g):
    return mx.distributed.all_sum(x, group=g)


class Identity(nn.Module):
    def __call__(self, x, *args, **kwargs):
        return x


class LayerStub(nn.Module):
    """Another rank's decoder layer: passes the hidden state through unchanged and
    appends a one-wide key and value per token to its cache. ``sent()``: what this rank
    sent on in this pass (layers after the rank's own): its cache depends on it, so that
    evaluating the caches (a prompt chunk's prefill) sends it. ``like``: the layer it stands
    for, whose plain attributes it copies (hybrid models' code reads them: ``is_linear``)."""

    def __init__(self, sent=None, like: nn.Module | None = None):
        super().__init__()
        self._sent_of = sent
        if like is not None:  # what the model's own code reads of its layers (is_linear, is_attn, a layer type)
            for name, value in vars(like).items():
                if not name.startswith("_") and isinstance(value, (bool, int, float, str, type(None))):
                    setattr(self, name, value)

    def __call__(self, x, *args, cache=None, **kwargs):
        if cache is None and len(args) >= 2:
            cache = args[1]
        if cache is None:
            return x
        b, t = x.shape[0], x.shape[1]
        sent = self._sent_of() if self._sent_of is not None else None
        if hasattr(cache, "update_and_fetch"):  # a KV cache (plain or rotating): offsets advance as the model's
            blank = mx.zeros((b, 1, t, 1), dtype=x.dtype)
            if sent is not None:
                blank = mx.depends(blank, sent)
            cache.update_and_fetch(blank, blank)
        elif hasattr(cache, "cache") and isinstance(cache.cache, list) and cache.cache:  # a state cache
            state = mx.zeros((b, 1), dtype=x.dtype)  # (its masks follow its padding, not its state)
            cache.cache[0] = mx.depends(state, sent) if sent is not None else state
        return x


def cache_maker(templates: list):
    """A ``make_cache`` handing out fresh, empty copies of ``templates`` (a model's own
    caches, made before any of its layers was replaced)."""
    import copy

    def make_cache():
        return [copy.deepcopy(c) for c in templates]

    return make_cache


class EmbedStub(nn.Module):
    """The embedding on a rank that does not hold it: zeros [.., dim]."""

    def __init__(self, dim: int, dtype):
        super().__init__()
        self._dim, self._dtype = dim, dtype

    def __call__(self, ids):
        return mx.zeros((*ids.shape, self._dim), dtype=self._dtype)


class HeadStub(nn.Module):
    """The head on a rank that does not hold it: zero logits for the last position, which
    depend on what this rank sent on (so evaluating them sends it), summed over the group
    with the last rank's."""

    def __init__(self, vocab: int, dtype, group, sent, shares=lambda: True):
        super().__init__()
        self._vocab, self._dtype, self._group, self._sent, self._shares = vocab, dtype, group, sent, shares

    def __call__(self, h):
        zeros = mx.zeros((h.shape[0], 1, self._vocab), dtype=self._dtype)
        sent = self._sent()
        if sent is not None:
            zeros = mx.depends(zeros, sent)
        return mx.distributed.all_sum(zeros, group=self._group) if self._shares() else zeros


def head_that_shares(head: nn.Module, group, shares=lambda: True) -> None:
    """Make the last rank's ``head`` return its last position's logits summed over the
    group (the other ranks add zeros); while ``shares()`` is false, not summed (the caller
    sums them later)."""
    base = type(head)

    def __call__(self, h):
        out = base.__call__(self, h[:, -1:, :])
        return mx.distributed.all_sum(out, group=group) if shares() else out

    head.__class__ = type(f"Shared{base.__name__}", (base,), {"__call__": __call__})


def wrap_call(module: nn.Module, before=None, after=None) -> None:
    """Swap ``module``'s class for a subclass whose call runs ``before(x) -> x`` on its first
    argument and ``after(out) -> out`` on its output (its parameters keep their paths)."""
    base = type(module)

    def __call__(self, x, *args, **kwargs):
        if before is not None:
            x = before(x)
        out = base.__call__(self, x, *args, **kwargs)
        return after(out) if after is not None else out

    module.__class__ = type(f"Pipelined{base.__name__}", (base,), {"__call__": __call__})
