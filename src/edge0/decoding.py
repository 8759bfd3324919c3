"""The batch as a value, and the decode step as a function of it.

``Batch``: the rows decoding together, in order, with what is theirs together: the KV
cache (mlx-lm's left-padded ``BatchKVCache`` per layer; a row that runs alone, its own
cache) and what the prerouter heads observed of each row's sequence (``Observed``, one row
per sequence; None without heads). A row that finished its prefill becomes a batch of its
own (``Batch.of``); the loop ``join``s it to the batch it decodes, ``filter``s the rows
that stay when some leave, ``extract``s a leaving row's cache, and a two-rank pipeline's
micro-batches ``split`` it in halves and join them back. Only a batch changes its state.

``Decoder``: one decode step of a batch's rows is ``step`` (or, where the halves of a
pipeline take turns, ``forward`` then ``take_tokens``): the rows' last tokens, their cache,
their heads' state and each row's adapter go in; one graph is built and evaluated once,
when the sampled tokens are read; the tokens and the heads' new state come out.
"""

from __future__ import annotations

import copy

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.drafts import BatchPace
from edge0.errors import ExpertReadError
from edge0.exec.plan import DraftedRouting, PrerouterPlanner
from edge0.prerouter.runtime import Observed, Observing


class Batch:
    """``rows`` (decoding, in order), ``cache`` (theirs: one ``BatchKVCache`` per layer, or an
    alone row's own cache; None while empty) and ``heads`` (the heads' ``Observed`` of
    their sequences; None without heads)."""

    def __init__(self, rows=(), cache=None, heads: Observed | None = None):
        self._rows, self._cache, self._heads = list(rows), cache, heads

    rows = property(lambda self: tuple(self._rows))
    cache = property(lambda self: self._cache)
    heads = property(lambda self: self._heads)

    def __len__(self) -> int:
        return len(self._rows)

    @classmethod
    def of(cls, row, cache, heads: Observed | None) -> "Batch":
        """``row`` alone, after its prefill: ``cache`` its own cache (as it is when the row
        runs alone, else a batch cache of one row)."""
        return cls([row], cache if row.alone else bnn.batch_cache([cache]), None if row.alone else heads)

    def join(self, other: "Batch") -> None:
        """``other``'s rows after this batch's, their cache and heads' state with them."""
        rows, cache, heads = other.rows, other.cache, other.heads
        if not self._rows:
            self._rows, self._cache, self._heads = list(rows), cache, heads
            return
        bnn.extend_batch_cache(self._cache, cache)
        both = self._heads is not None and heads is not None and set(self._heads.last) == set(heads.last)
        # (one without a state: the batch has none until its next step observes every row)
        self._heads = Observed.join([self._heads, heads]) if both and self._heads.last else None
        self._rows.extend(rows)

    def filter(self, keep: list[int]) -> None:
        """Keep the rows numbered ``keep`` only, in that order."""
        if not keep:
            self._rows, self._cache, self._heads = [], None, None
            return
        if self._cache is not None:
            bnn.filter_batch_cache(self._cache, keep)
        if self._heads is not None and self._heads.last:
            self._heads = self._heads.select(keep)
        self._rows = [self._rows[i] for i in keep]

    def extract(self, i: int):
        """Row ``i``'s cache as a sequence's own (new arrays)."""
        if len(self._rows) == 1 and self._rows[0].alone:
            return self._cache
        return bnn.extract_batch_row(self._cache, i)

    def split(self, cut: int) -> tuple["Batch", "Batch"]:
        """Two batches, rows ``[:cut]`` and ``[cut:]``; this one is spent (its cache is the
        first half's)."""
        n = len(self._rows)
        second = [copy.copy(c) for c in self._cache]  # (filter replaces the arrays it keeps)
        bnn.filter_batch_cache(second, list(range(cut, n)))
        bnn.filter_batch_cache(self._cache, list(range(cut)))
        heads = [None, None]
        if self._heads is not None:
            heads = [self._heads.select(list(range(cut))), self._heads.select(list(range(cut, n)))]
        return Batch(self._rows[:cut], self._cache, heads[0]), Batch(self._rows[cut:], second, heads[1])

    def observed(self, heads: Observed | None) -> None:
        """The heads' state after a pass of this batch's rows."""
        self._heads = heads


class Decoder:
    """The decode step of one engine, on its compute thread; ``host`` its ``Runtime``.
    Counts the steps, tokens and expert bytes of the steps it ran."""

    def __init__(self, host):
        self.host = host
        self.steps = 0  # decode forward passes
        self.tokens = 0  # tokens they generated, every row
        self.decode_bytes = 0  # expert bytes read during them
        self.verify_passes = 0  # of them, verify passes of drafted tokens (speculative decoding)
        self.drafted = 0  # tokens those passes checked
        self.accepted = 0  # and took
        self.pace = BatchPace()  # whether rows sharing steps draft (the batch loop times them)

    def typed(self, error: BaseException) -> BaseException:
        """``error`` as the coordinator names it (under a pipeline, a failed transfer is a
        ``DistributedError`` naming this rank's pipeline)."""
        return self.host.typed(error)

    def step(self, batch: Batch) -> list:
        """One forward pass of ``batch``'s rows (one token each), each row's token sampled and
        handed to its consumer, the heads' new state kept in the batch; the rows that ended
        (finished, left, failed)."""
        rows = list(batch.rows)
        bytes0 = self.host.reader.stats.bytes
        try:
            logits, heads = self.forward(rows, batch.cache, batch.heads)
            logits = logits[:, -1, :]
        except BaseException as e:  # the step itself: every row of it fails
            return self.failed(rows, e)
        batch.observed(heads)
        stager = self.host.streaming.stager
        ahead = None
        if stager is not None and heads is not None and self.host.coord.plans_ahead:
            ahead = lambda tokens: stager.plan_ahead(tokens, heads)  # noqa: E731
        done = self.take_tokens(rows, logits, ahead)
        self.decode_bytes += self.host.reader.stats.bytes - bytes0
        return done

    def forward(self, rows: list, cache, heads: Observed | None):
        """The decode pass of ``rows`` (lazy): each row's adapter, its last token; the step's
        plan first (the Stager's, from ``heads``: its reads start before the forward pass).
        Returns (the logits, the heads' state after the pass)."""
        inputs = B.array([[r.next] for r in rows], dtype=B.int32)
        model = self.host.step_model
        sink = Observing(heads) if self.host.streaming.prerouter is not None else None
        model.plan(inputs, decode=True, heads=sink)
        logits = model.forward(inputs, cache=cache, decode=True, adapters=[r.adapter for r in rows], heads=sink)
        return logits, (sink.after() if sink is not None else None)

    def verify(self, batch: Batch, drafts: list[list[int]]) -> list:
        """A verify pass of ``batch``'s rows: each row's last token and its draft (``drafts``,
        one per row, some empty) forwarded in one pass (the decode step's path over those
        positions: each MoE layer the union of their experts once; a row with a shorter
        draft padded with its last token, those positions routed as its last own one where
        the heads route), each position's token sampled as a decode step would sample it
        there (the same processors' history, the same draw of the row's random stream), each
        row's tokens handed out up to the first that differs from its draft, and that one;
        the cache trimmed, row by row, to what was handed out. Returns the rows that ended."""
        rows = list(batch.rows)
        bytes0, width = self.host.reader.stats.bytes, 1 + max(len(d) for d in drafts)
        try:
            tokens = [[r.next] + d + [(d or [r.next])[-1]] * (width - 1 - len(d)) for r, d in zip(rows, drafts)]
            routing = self._drafted(batch.heads, tokens, [1 + len(d) for d in drafts])
            if routing is False:  # the heads cannot plan the step's own position yet
                return self.step(batch)
            logits = self.host.step_model.forward(B.array(tokens, dtype=B.int32), cache=batch.cache, decode=True,
                                                  adapters=[r.adapter for r in rows], heads=routing,
                                                  routes=routing.routes if routing is not None else None)
            sampled = [_sample_draft(r, logits[i:i + 1], d) for i, (r, d) in enumerate(zip(rows, drafts))]
            live = [t.reshape(-1).astype(B.int32) for s in sampled for t, _ in s]
            flat = B.to_host(B.concat(live)).tolist() if live else []
        except BaseException as e:  # the pass itself: every row of it fails
            return self.failed(rows, e)
        self.steps, self.verify_passes = self.steps + 1, self.verify_passes + 1
        done, handed, at = [], [], 0
        for row, draft, row_sampled in zip(rows, drafts, sampled):
            got, at = flat[at:at + len(row_sampled)], at + len(row_sampled)
            n, ended = self._take(row, draft, got, row_sampled) if row.error is None else (0, True)
            handed.append(n)
            if ended:
                done.append(row)
        bnn.trim_rows(batch.cache, [width - n for n in handed])
        if routing is not None:
            batch.observed(routing.taken(handed))
        self.decode_bytes += self.host.reader.stats.bytes - bytes0
        return done

    def _take(self, row, draft: list[int], tokens: list[int], sampled: list) -> tuple[int, bool]:
        """After a verify pass: ``row``'s ``tokens`` (sampled at each position of its
        ``draft``, and one more; their log-probabilities in ``sampled``) handed out up to the
        first that differs from the draft, and that one. Returns (how many were handed out,
        whether the row ended)."""
        n = len(draft)
        taken = 0
        while taken < n and tokens[taken] == draft[taken]:
            taken += 1
        if n:
            row.drafter.accepted(n, taken)
            stats = row.events.stats
            stats.verify_passes, stats.draft_tokens = stats.verify_passes + 1, stats.draft_tokens + n
            self.drafted += n
        handed = 0
        for token, (_, lp) in zip(tokens[:taken + 1], sampled):
            if handed:  # a draft the pass took, handed out
                row.events.stats.accepted_tokens += 1
                self.accepted += 1
            handed += 1
            if self._hand(row, token, lp):
                return handed, True
        return handed, False

    def _drafted(self, before: Observed | None, tokens: list[list[int]], lengths: list[int]):
        """A verify pass's routing by the heads over ``tokens`` (a row per sequence, its own
        positions ``lengths``; ``DraftedRouting``): None without heads (every layer routes on
        its own gate); False where the heads cannot plan the pass's first position (they have
        not seen every owner), as a step could not: that step runs without drafts."""
        streaming = self.host.streaming
        if streaming.prerouter is None:
            return None
        planner = getattr(streaming.stager, "planner", None)
        if not isinstance(planner, PrerouterPlanner):  # the heads observe; no staged layer routes by them
            return DraftedRouting(None, before or Observed(), tokens, None, lengths)
        first = planner.flush(B.array([t[:1] for t in tokens], dtype=B.int32), before)
        if first is None:
            return False
        streaming.stager.begin_verify()
        return DraftedRouting(planner, before, tokens, first, lengths)

    def _hand(self, row, token: int, lp) -> bool:
        """``token`` (sampled for ``row``, its log-probabilities ``lp``) to the row's consumer;
        whether the row ended (finished, or its consumer left where that ends it)."""
        host = self.host
        row.pos += 1
        self.tokens += 1
        event = row.events.event(token, lp)
        row.next = token
        offered = row.job.offer(event)
        if not offered and row.job.error is not None:
            host.log.warning("generation.consumer_stalled", error=str(row.job.error))
        if event.finish_reason is not None:
            host.last_stats = event.stats
            return True
        return not offered and host.coord.ends_unread()

    def failed(self, rows: list, e: BaseException) -> list:
        e = self.typed(e)
        for row in rows:
            row.error = row.error or e
        if isinstance(e, ExpertReadError):
            self.host.after_read_error(e)
        return rows

    def take_tokens(self, rows: list, logits, ahead=None) -> list:
        """Each row's token sampled from its row of ``logits`` [rows, vocab] and handed to its
        consumer; the rows that ended (finished, left, failed). ``ahead`` (the sampled tokens
        [rows], lazy) -> what the next step's plan reads to the host (``Stager.plan_ahead``):
        read with the tokens, one read for both; the next step is planned (its reads
        submitted) once the tokens are handed out, unless a row ended."""
        host = self.host
        extra = []
        try:
            sampled, logprobs = [], []
            for i, row in enumerate(rows):
                try:
                    token, lp = _sample(row, logits[i:i + 1])
                except BaseException as e:  # this row's processors or sampler: this row fails
                    row.error = e
                    token, lp = None, None
                sampled.append(token)
                logprobs.append(lp)
            live = [t.reshape(-1).astype(B.int32) for t in sampled if t is not None]
            if ahead is not None and live and len(live) == len(rows):
                extra = ahead(B.concat(live))
            flat = B.to_host(B.concat(live + extra)) if live else None  # one read for the step
            values = iter(flat[:len(live)].tolist() if live else [])
        except BaseException as e:  # the step itself: every row of it fails
            if extra:
                host.streaming.stager.drop_ahead()
            return self.failed(rows, e)
        self.steps += 1
        done = []
        for row, token, lp in zip(rows, sampled, logprobs):
            if row.error is not None or self._hand(row, int(next(values)), lp):
                done.append(row)
        if extra:
            stager = host.streaming.stager
            if done or (_drafts_next(rows) and self.pace.allows(len(rows))):  # (a verify pass routes its own
                # positions: the plan would read for nothing)
                stager.drop_ahead()
            else:
                stager.take_ahead(flat[len(live):])
        return done


def _drafts_next(rows: list) -> bool:
    """Whether the next pass of ``rows`` is a verify pass (a row whose drafter will propose
    a draft, with tokens left to make)."""
    for row in rows:
        if row.drafter is not None:
            row.drafter.follow(row.ids, row.generated)
            if row.drafter.ready() and row.max_tokens - len(row.generated) > 1:
                return True
    return False


def _sample_draft(row, logits, draft: list[int]) -> list:
    """``row``'s tokens and log-probabilities (``_sample``) at each position of its ``draft``
    and one more, from its row of a verify pass's ``logits`` [1, positions, vocab]; none
    where its processors or sampler fail (the row fails: ``row.error``)."""
    try:
        return [_sample(row, logits[:, j, :], draft[:j]) for j in range(len(draft) + 1)]
    except BaseException as e:  # this row's processors or sampler: this row fails
        row.error = e
        return []


def _sample(row, logits, ahead: list[int] = ()):
    """``row``'s token from ``logits`` [1, vocab] (lazy), and its log-probabilities; ``ahead``:
    drafted tokens between what the row generated and this position (a verify pass), part of
    the processors' history and of the random stream's position."""
    if row.processors:
        history = B.array(row.ids + row.generated + list(ahead), dtype=B.int32)
        for proc in row.processors:
            logits = proc(history, logits)
    logprobs = logits - B.logsumexp(logits, keepdims=True)
    key = B.draw_key(row.seed, len(row.generated) + len(ahead))  # the row's own random stream, passed as a key
    return row.sampler(logprobs, key), logprobs.squeeze(0)
