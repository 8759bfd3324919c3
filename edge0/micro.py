"""Micro-batches: a two-rank pipeline's batch decoding in two halves that take turns.

With one batch in flight the ranks of a pipeline compute one after the other on every step.
In a micro-batch phase (``pipeline_micro_batches = 2``) the batch's rows split into two
halves, each with its own KV cache and prerouter state, and turn k is one half's decode
step: rank 0 computes turn k while rank 1 computes turn k - 1 (the other half's). Rank 0
can start turn k because turn k - 2, the same half's step before, was sampled during turn
k - 1.

MLX's ring backend carries every transfer between two ranks in order on one link, without
tags, so both ranks keep one order of transfers per turn: rank 0 sends its control word
(``Pipeline.control``: a send, so it never waits for rank 1), runs its pass (which ends by
sending the hidden state on), then joins the sum of turn k - 1's logits; rank 1 receives
the control word and turn k's transfers (``Pipeline.prereceive``), joins that sum, then runs
its pass. Rank 0 stops the turns at the first one after a row ended or was cancelled or a
generation is waiting; the halves' caches and prerouter states merge back in the batch's
order and the batch loop (``edge0.batch``) goes on.
"""

from __future__ import annotations

import copy

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.errors import ExpertReadError


def ready(batch) -> bool:
    """Whether ``batch`` (a ``Batcher``) can decode in micro-batches: two rows or more, all
    decoding in one batch cache, none joining."""
    return (len(batch.rows) >= 2 and not batch.joining and batch.cache is not None
            and not any(r.alone for r in batch.rows))


def run_phase(batch) -> None:
    """Decode steps of ``batch``'s rows in two halves that take turns until rank 0 stops
    them; then the halves merge back and the rows that ended leave the batch."""
    host = batch.host
    pipe, pre = host.streaming.pipeline, host.streaming.prerouter
    rows, n = list(batch.rows), len(batch.rows)
    cut = (n + 1) // 2
    halves = [rows[:cut], rows[cut:]]
    caches = [batch.cache, [copy.copy(c) for c in batch.cache]]  # (filter replaces the arrays it keeps)
    bnn.filter_batch_cache(caches[1], list(range(cut, n)))
    bnn.filter_batch_cache(caches[0], list(range(cut)))
    states = [None, None]
    if pre is not None:
        whole = pre.take_state()
        states = [pre.select_rows(whole, list(range(cut))), pre.select_rows(whole, list(range(cut, n)))]
    bytes0, ended, pending, turn = host.reader.stats.bytes, [], None, 0
    pipe.deferred = True
    try:
        while True:
            h = turn % 2
            go = pipe.control(_go(batch, rows, ended)) if pipe.rank == 0 else pipe.control()
            local = None
            if go and pipe.rank == 0:
                local = _pass(batch, halves[h], caches[h], states, h)
            elif go:
                pipe.prereceive(len(halves[h]))
            if pending is not None:
                ph, logits = pending
                ended += batch.take_tokens(halves[ph], pipe.share(logits)[:, -1, :])
            if not go:
                break
            if pipe.rank != 0:
                local = _pass(batch, halves[h], caches[h], states, h)
            pending, turn = (h, local), turn + 1
    except BaseException as e:
        if isinstance(e, ExpertReadError):
            host.after_read_error(e)
        typed = batch.typed(e)
        if typed is e:
            raise
        raise typed from e
    finally:
        pipe.deferred = False
        pipe.drop_held()  # (after a failure: nothing received ahead may reach a later pass)
    batch.micro_turns += turn
    bnn.extend_batch_cache(caches[0], caches[1])
    batch.cache = caches[0]
    if pre is not None and all(pre.seen(s) for s in states):
        pre.put_state(pre.merge_states(states))
    batch.decode_bytes += host.reader.stats.bytes - bytes0
    ended = [r for r in rows if r in ended]  # (once each, in the batch's order)
    if ended:
        batch.leave(ended)


def _go(batch, rows: list, ended: list) -> bool:
    """Rank 0: whether the next turn runs (no row ended or cancelled, none waiting)."""
    with batch.lock:
        waiting = bool(batch.waiting)
    return not ended and not waiting and not any(r.job.cancelled for r in rows)


def _pass(batch, rows: list, cache, states: list, h: int):
    """One half's decode pass on this rank, evaluated (on rank 0 that sends it on), its
    prerouter state in place; the last position's logits, not yet summed."""
    pre = batch.host.streaming.prerouter
    if pre is not None:
        pre.put_state(states[h])
    try:
        local = batch.forward(rows, cache)
        B.eval(local)
    finally:
        if pre is not None:
            states[h] = pre.take_state()
    return local
