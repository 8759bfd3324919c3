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

from edge0.backend import core as B
from edge0.decoding import Batch, Decoder
from edge0.errors import ExpertReadError


def ready(batch: Batch, joining: bool) -> bool:
    """Whether ``batch`` can decode in micro-batches: two rows or more, all decoding in one
    batch cache, none joining (``joining``: rows prefill)."""
    return (len(batch) >= 2 and not joining and batch.cache is not None
            and not any(r.alone for r in batch.rows))


def run_phase(host, decoder: Decoder, batch: Batch, waiting) -> tuple[Batch, list, int]:
    """Decode steps of ``batch``'s rows in two halves that take turns until rank 0 stops
    them (``waiting``: the line of generations not yet started; one waiting stops them);
    returns (the halves joined back, in the batch's order: the batch decoding on; the rows
    that ended, once each, in the batch's order; the turns run). ``batch`` is spent."""
    pipe = host.streaming.pipeline
    rows = list(batch.rows)
    halves = list(batch.split((len(rows) + 1) // 2))
    bytes0, ended, pending, turn = host.reader.stats.bytes, [], None, 0
    pipe.deferred = True
    try:
        while True:
            h = turn % 2
            go = pipe.control(_go(rows, ended, waiting)) if pipe.rank == 0 else pipe.control()
            local = None
            if go and pipe.rank == 0:
                local = _pass(decoder, halves[h])
            elif go:
                pipe.prereceive(len(halves[h]))
            if pending is not None:
                ph, logits = pending
                ended += decoder.take_tokens(list(halves[ph].rows), pipe.share(logits)[:, -1, :])
            if not go:
                break
            if pipe.rank != 0:
                local = _pass(decoder, halves[h])
            pending, turn = (h, local), turn + 1
    except BaseException as e:
        if isinstance(e, ExpertReadError):
            host.after_read_error(e)
        typed = decoder.typed(e)
        if typed is e:
            raise
        raise typed from e
    finally:
        pipe.deferred = False
        pipe.drop_held()  # (after a failure: nothing received ahead may reach a later pass)
    joined = halves[0]
    heads = [half.heads for half in halves]
    seen = host.streaming.prerouter is not None and all(s is not None and s.seen(host.streaming.prerouter.owners)
                                                        for s in heads)
    if not seen:  # (a half that never observed every owner: the joined batch keeps no heads' state)
        halves[0].observed(None)
        halves[1].observed(None)
    joined.join(halves[1])
    decoder.decode_bytes += host.reader.stats.bytes - bytes0
    return joined, [r for r in rows if r in ended], turn


def _go(rows: list, ended: list, waiting) -> bool:
    """Rank 0: whether the next turn runs (no row ended or cancelled, none waiting)."""
    return not ended and not len(waiting) and not any(r.job.cancelled for r in rows)


def _pass(decoder: Decoder, half: Batch):
    """One half's decode pass on this rank, evaluated (on rank 0 that sends it on), its
    heads' state kept in the half; the last position's logits, not yet summed."""
    local, heads = decoder.forward(list(half.rows), half.cache, half.heads)
    B.eval(local)
    half.observed(heads)
    return local
