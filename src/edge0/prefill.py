"""Prefill of the rows joining the batch: alone in chunks, together where that is cheaper,
and within a share of the compute thread's time while other rows decode.

A row joining the batch prefills its prompt alone, in chunks of ``prefill_step_size``
tokens (``chunk``; a row's chunks never depend on what runs beside it, so its numbers are
its solo numbers).
When several joining rows each have a whole short prompt still to prefill, one forward
pass of all of them costs less than one pass each: the weights are read once, each MoE
layer gathers the union of the rows' experts once (on the streaming paths: one read of
the union instead of one per row), and the per-pass overhead is paid once. ``together``
takes those rows, left-pads their prompts into one ``[rows, tokens]`` pass on a batch
cache (mlx-lm's ``BatchKVCache``, whose mask keeps the padding out of attention), and the
rows join the decoding batch at once, cache and prerouter state included.

Which rows go together (``group``): rows not running alone, with nothing of their prompt
forwarded yet and nothing from the prompt cache, whose prompt but its last token is at
least two tokens (the heads' state needs two positions) and fits one prefill chunk, so a
row's prompt is forwarded in the one chunk it would have alone; at least two of them;
their padded size (rows x longest) within the iteration's prompt-token budget. Not under
a pipeline (its ranks must decide every pass alike; they prefill row by row). A row's
numbers are those it gets alone: on MLX's CPU backend each row of a matmul or a gather is
computed on its own, and attention over left padding equals attention without it
(``tests/test_batch.py`` compares every path's tokens with each row's alone).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.decoding import Batch
from edge0.prerouter.runtime import Observing
from edge0.row import Row


STARVE_PASSES = 32  # iterations a prompt may be passed over before it goes first


@dataclass
class Prefilled:
    """What one iteration's prefill made: ``groups``, the rows prefilled together, each a
    ``Batch`` to join; ``ready``, the rows whose prompt is now forwarded (each with its own
    cache and heads' state), to join one by one; ``passes``, the forward passes it ran."""

    groups: list[Batch] = field(default_factory=list)
    ready: list[Row] = field(default_factory=list)
    passes: int = 0


def run(host, joining: list[Row], budget: int) -> Prefilled:
    """One iteration's prefill of ``joining`` (in ``order``) within ``budget`` prompt
    tokens: short prompts arriving together in one pass (``together``), then chunks of the
    joining rows, in their order. A chunk that does not fit what is left of the budget
    waits for the next iteration (the first always runs, so every iteration makes
    progress): a short prompt's row joins the batch without waiting for a long prompt's
    whole chunk after it. Nothing here changes the batch: the loop joins what it returns."""
    out = Prefilled()
    if budget <= 0:
        return out
    served = set()
    grouped = 0
    rows = group(host, joining, budget)
    if rows:
        batch, grouped = together(host, rows)
        out.passes += batch is not None
        if batch is not None:
            out.groups.append(batch)
    budget -= grouped
    step = host.config.prefill_step_size
    for row in joining:
        if budget <= 0:
            break
        if row.error is not None or any(row in g.rows for g in out.groups):
            continue
        if (served or grouped) and min(step, len(row.ids) - row.pos - 1) > budget:
            continue
        n, passed = chunk(host, row)
        budget -= n
        out.passes += passed
        served.add(id(row))
        if row.error is None and len(row.ids) - row.pos <= 1:
            out.ready.append(row)
    for row in joining:
        row.passed_over = 0 if id(row) in served else row.passed_over + 1
    return out


def order(joining: list[Row]) -> list[Row]:
    """The joining rows in the order their prompts are prefilled: the fewest prompt tokens
    left first, so that a short prompt gets its first token after one chunk rather than
    after every long prompt that arrived before it (a client that sends long prompts and
    leaves holds no one's first token); a row passed over ``STARVE_PASSES`` times goes
    first (the first to arrive first), so a long prompt still finishes under a stream of
    short ones. Ties go by arrival. Every input is the same on every rank of a pipeline,
    so its ranks order alike. A row's chunks are the same in any order."""
    return sorted(joining, key=lambda r: (0, 0, r.arrival) if r.passed_over >= STARVE_PASSES
                  else (1, len(r.ids) - r.pos, r.arrival))


def group(host, joining: list[Row], budget: int) -> list[Row]:
    """The joining rows to prefill in one pass (none, or at least two), in their order."""
    if not host.coord.prefill_together or budget <= 0:
        return []
    chunk = host.config.prefill_step_size
    out, longest = [], 0
    for row in joining:
        n = len(row.ids) - 1
        if (row.alone or row.error is not None or row.job.cancelled or row.cache is None or row.pos != 0
                or not 2 <= n <= chunk):  # (a row whose cache cannot join a batch runs alone)
            continue
        if (len(out) + 1) * max(longest, n) > budget:
            break
        out.append(row)
        longest = max(longest, n)
    return out if len(out) >= 2 else []


def together(host, rows: list[Row]) -> tuple[Batch | None, int]:
    """Prefill ``rows`` in one forward pass: (the batch they make, ready to join (None: the
    pass failed, each row's error says why), the prompt tokens that pass forwarded, padding
    included)."""
    lengths = [len(r.ids) - 1 for r in rows]
    width = max(lengths)
    pads = [width - n for n in lengths]
    inputs = B.array([[0] * p + r.ids[:n] for r, p, n in zip(rows, pads, lengths)], dtype=B.int32)
    cache = bnn.empty_batch_cache(len(rows[0].cache), pads)
    sink = Observing(None, sequences=len(rows)) if host.streaming.prerouter is not None else None
    try:
        logits = host.step_model(inputs, cache=cache, decode=False, adapters=[r.adapter for r in rows], heads=sink)
        scores = [score(logits[i:i + 1, p:], r, 0) for i, (r, p) in enumerate(zip(rows, pads))]
        B.eval([(c.keys, c.values) for c in cache], [s for s in scores if s is not None])
        for row, s in zip(rows, scores):
            keep_scores(row, s)
    except BaseException as e:  # the pass itself: every row of it fails
        e = host.typed(e)
        for row in rows:
            row.error = e
        return None, width * len(rows)
    for row, n in zip(rows, lengths):
        row.pos, row.next, row.cache, row.heads = n, row.ids[-1], None, None
    return Batch(rows, cache, sink.after() if sink is not None else None), width * len(rows)


def chunk(host, row: Row) -> tuple[int, int]:
    """One chunk of ``row``'s prompt (all but its last token; ``prefill_step_size`` tokens
    at most), its heads' state kept in the row. Returns (the tokens forwarded, at least 1
    so that every call makes progress; the passes run, 0 or 1)."""
    rest = row.ids[row.pos:]
    if len(rest) <= 1:
        return 1, 0
    n = min(host.config.prefill_step_size, len(rest) - 1)  # never cut by the budget:
    # a row's chunks are the same whatever runs beside it
    sink = Observing(row.heads) if host.streaming.prerouter is not None else None
    try:
        logits = host.step_model(B.array([rest[:n]]), cache=row.cache, decode=False, adapters=[row.adapter],
                                 heads=sink)
        scores = score(logits, row, row.pos)
        if row.kv_quant:
            bnn.quantize_kv(row.cache, host.config)
        B.eval([c.state for c in row.cache], scores if scores is not None else [])
        keep_scores(row, scores)
    except BaseException as e:
        row.error = host.typed(e)
        return n, 0
    row.pos += n
    if sink is not None:
        row.heads = sink.after()
    return n, 1


class Share:
    """The compute thread's time between prefill and the rows decoding
    (``EngineConfig.prefill_share``, a percentage): while rows decode, prefill chunks run
    only while their time stays within that share of the whole. A credit in seconds: each decode step
    earns ``share / (1 - share)`` of its time, each iteration's prefill spends its own; a
    chunk waits while the credit is negative (50%: the decoding rows get at least half
    the time, so their step at most about doubles). Nothing decoding: prefill runs and the
    credit starts over; nothing joining: no credit is saved up. 100% (the default):
    prefill runs every iteration, its token budget the only bound. Under a pipeline every
    rank must decide alike, so there the budget alone decides. Chunks are delayed, never
    cut: a row's numbers do not change."""

    def __init__(self, percent: int):
        self.share, self.credit = percent / 100.0, 0.0

    def allows(self, decoding: bool, joining: bool, together: bool) -> bool:
        """Whether prefill runs this iteration (``decoding``: rows decode; ``joining``:
        rows prefill; ``together``: the coordinator's ``prefill_together``)."""
        if self.share >= 1.0 or not decoding or not together:
            self.credit = 0.0
            return True
        if not joining:
            self.credit = min(self.credit, 0.0)
        return self.credit >= 0.0

    @contextmanager
    def timed(self, decoding: bool):
        t0 = time.perf_counter()
        yield
        if self.share < 1.0:
            spent = time.perf_counter() - t0
            self.credit += spent * self.share / (1.0 - self.share) if decoding else -spent


def score(logits, row: Row, start: int):
    """The scores of ``row``'s prompt tokens after ``start`` (lazy; None when the row does
    not score its prompt): ``logits`` [1, n, vocab] are the pass's over its tokens
    ``start .. start + n - 1``, each predicting the next. Each token's log-probability and
    the ``prompt_logprobs`` most likely tokens at its position, as ``edge0 eval`` scores
    text (``B.score_tokens``): the model's own distribution, before any sampling filter."""
    k = row.params.prompt_logprobs
    if row.prompt_scores is None:
        return None
    n = logits.shape[1]
    logp, picked = B.score_tokens(logits, B.array([row.ids[start + 1:start + n + 1]], dtype=B.int32))
    return [picked, *B.top_tokens(logp, k)] if k else [picked]


def keep_scores(row: Row, scores) -> None:
    """Evaluated ``score``s onto the row, as host values: (log-probability, [(token id,
    log-probability)] most likely first) per token."""
    if scores is None:
        return
    picked = B.to_host(scores[0]).reshape(-1).tolist()
    tops = [[] for _ in picked]
    if len(scores) == 3:
        ids, values = B.to_host(scores[1])[0], B.to_host(scores[2])[0]
        tops = [sorted(zip(i.tolist(), v.tolist()), key=lambda t: -t[1]) for i, v in zip(ids, values)]
    row.prompt_scores.extend(zip(picked, tops))
