"""Continuous batching: the generations of one engine decode together, one forward pass
per step for all of them.

Every generation is a ``Row``. A new row prefills in chunks of ``prefill_step_size``
tokens; between two decode steps of the running rows, new rows' chunks run until that many
prompt tokens were forwarded (running streams keep flowing), short prompts arriving
together in one pass (``edge0.prefill``); then the row joins the batch at a step boundary,
its KV cache merged into the batch's (mlx-lm's left-padded ``BatchKVCache``). Each decode step
forwards one token of every row: the attention weights, every layer's expert reads (the
exact path reads the union of the rows' experts once; the staged path plans the union of
the rows' predictions, one prerouter flush for the batch) and the projections are shared;
each row keeps its own cache, sampling parameters and random stream, logits processors,
stops, logprobs and adapter (each row's deltas in the step's ``Step``). A row that finishes, is
cancelled or fails leaves at the next boundary, its cache going to the prompt cache.

On MLX's CPU backend a row's numbers do not depend on the batch: the matmuls (plain,
quantized, gathered) compute each row on its own and attention over left padding equals
attention without it, so a row's greedy tokens in a batch equal its tokens alone
(``tests/test_batch.py``). Generations that cannot share a batch run alone, one after the
other, in the same loop: a routing recording, a bounded KV size (a rotating cache), a
model whose caches are not plain KV caches (state-space and linear-attention layers).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from edge0 import micro as micro_batches
from edge0 import prefill
from edge0.backend import nn as bnn
from edge0.decoding import Batch, Decoder
from edge0.drafts import pace
from edge0.coordinator import NotAskedFor
from edge0.errors import DistributedError
from edge0.row import Row, RowEvents
from edge0.stats import GenerationStats


def batchable(cache: list) -> bool:
    """Whether a sequence with this cache can share a batch (every layer a plain KV cache)."""
    return bool(cache) and all(bnn.is_plain_kv_cache(c) for c in cache)


class Waiting:
    """The generations submitted and not started yet, in order; any thread's. ``lock`` also
    guards the batch loop's own lists (``Batcher``)."""

    def __init__(self):
        self.lock = threading.Lock()
        self._submitted = threading.Condition(self.lock)  # a row was submitted (a pipeline's followers wait on it)
        self._line: deque[Row] = deque()

    def __len__(self) -> int:  # (a glance: under the lock where it must hold)
        return len(self._line)

    def put(self, row: Row) -> None:  # under the lock
        self._line.append(row)
        self._submitted.notify_all()

    def peek(self) -> Row:  # under the lock
        return self._line[0]

    def pop(self) -> Row:  # under the lock
        return self._line.popleft()

    def drop_cancelled(self) -> list[Row]:  # under the lock
        """The rows whose consumer left, out of line now."""
        left = [r for r in self._line if r.job.cancelled]
        if left:
            self._line = deque(r for r in self._line if not r.job.cancelled)
        return left

    def wait_for(self, n: int, timeout: float) -> bool:
        """Wait until ``n`` rows wait (False: not within ``timeout`` seconds)."""
        with self._submitted:
            return self._submitted.wait_for(lambda: len(self._line) >= n, timeout)

    def take(self, n: int) -> list[Row]:
        """The next ``n`` rows, out of line."""
        with self.lock:
            return [self._line.popleft() for _ in range(n)]

    def take_all(self) -> list[Row]:
        with self.lock:
            rows, self._line = list(self._line), deque()
        return rows


class Batcher:
    """The batch loop of one engine, on its compute thread: rows waiting, prefilling and
    decoding; ``submit`` from any thread. ``host`` is the engine's ``Runtime`` (its
    streaming model, tokenizer, prompt cache, line, log and the hooks of a batch's start and
    end). The rows decoding are one ``Batch`` value, which only this loop replaces."""

    def __init__(self, host, max_batch: int):
        self.host = host
        self.max_batch = max_batch
        self.waiting = Waiting()
        self.lock = self.waiting.lock
        self._running = False
        self.joining: list[Row] = []  # admitted, prefilling
        self.batch = Batch()  # decoding: the rows, their cache and heads' state
        self.decoder = Decoder(host)
        self.micro_turns = 0  # micro-batch turns (a half's decode pass each) under a two-rank pipeline
        self.prefill_passes = 0  # prompt forward passes (a chunk of one row, or rows prefilled together)
        self.share = prefill.Share(host.config.prefill_share)  # prefill's time while rows decode

    rows = property(lambda self: list(self.batch.rows))  # decoding, in the batch's row order
    steps = property(lambda self: self.decoder.steps)  # decode forward passes
    tokens = property(lambda self: self.decoder.tokens)  # tokens they generated, every row
    decode_bytes = property(lambda self: self.decoder.decode_bytes)  # expert bytes read during them

    # -- any thread -----------------------------------------------------------------------
    def submit(self, row: Row) -> None:
        with self.lock:
            self.waiting.put(row)
            if self._running:
                return
            self._running = True
        self.host.worker.submit(self.run)

    def counts(self) -> tuple[int, int]:
        """(rows decoding, rows waiting or prefilling)."""
        with self.lock:
            return len(self.batch), len(self.waiting) + len(self.joining)

    # -- the compute thread -----------------------------------------------------------------
    def run(self) -> None:
        coord = self.host.coord
        while True:
            with self.lock:
                left = self.waiting.drop_cancelled()  # (never handed to a pipeline's other ranks,
                # which only hear of admitted rows)
                done = not len(self.waiting) and not self.joining and not len(self.batch)
                if done:
                    self._running = False
                admitted = self._admit() if not done and coord.leads else []
            for row in left:
                self._end_unstarted(row)
            if done:
                return
            try:
                admitted, cancelled, micro = coord.agree(self.waiting, self.joining, list(self.batch.rows), admitted,
                                                         self._micro_ready())
                self._admitted(admitted, coord.leads)
                self._iteration(admitted, cancelled, micro)
            except NotAskedFor as e:  # what waited here fails with it, then the batch's rows
                for row in e.rows:
                    row.error = e
                    self._end_unstarted(row)
                self._fail_all(e)
            except BaseException as e:  # a fault of the loop itself: its rows fail, the engine goes on
                self._fail_all(e)

    def follow(self, make_row) -> int:
        """A rank after the first of a served pipeline: run every iteration of rank 0's batch
        loop, its generations made from the specs it hands over, until rank 0's engine closes.
        ``make_row``: a handed-over spec -> its ``Row``. Returns how many generations ran."""
        coord, done = self.host.coord, 0
        pipe = coord.pipeline
        while True:
            schedule = pipe.schedule()
            if schedule.stop:
                return done
            try:
                cancelled = coord.cancelled(schedule, self.joining + self.rows)
                admitted = [make_row(spec) for spec in schedule.specs or ()]
                if len(admitted) != schedule.admitted:
                    raise DistributedError("rank 0 admitted generations without handing them over "
                                           "(Engine.lead() was not called on rank 0)")
                done += len(admitted)
                self._admitted(admitted, False)
                self._iteration(admitted, cancelled, schedule.micro)
            except BaseException as e:  # noqa: BLE001 - as run()
                self._fail_all(e)

    def _admitted(self, admitted: list[Row], joined: bool) -> None:
        """``admitted`` join the rows prefilling (``joined``: they already did)."""
        if not joined:
            with self.lock:
                self.joining.extend(r for r in admitted if r not in self.joining)

    def _micro_ready(self) -> bool:
        return micro_batches.ready(self.batch, bool(self.joining))

    def _iteration(self, admitted: list[Row], cancelled: dict[int, bool] | None, micro: bool = False) -> None:
        """Start the admitted rows, drop the cancelled ones (under a pipeline: those rank 0
        cancelled, ``cancelled``), prefill up to ``prefill_step_size`` prompt tokens of the
        joining rows (within ``prefill_share`` of the time), then one decode step of the
        batch (``micro``: decode steps in two micro-batches until rank 0 stops them)."""
        host = self.host
        for row in admitted:
            self._start(row, piped=cancelled is not None)
        self._drop_cancelled(cancelled)
        self.joining = prefill.order(self.joining)
        allowed = self.share.allows(bool(len(self.batch)), bool(self.joining), host.coord.prefill_together)
        with self.share.timed(decoding=False):
            self._prefill(host.config.prefill_step_size if allowed else 0)
        if len(self.batch) and micro:
            if not self._micro_ready():
                raise DistributedError(f"rank 0 decodes {len(self.batch)} generations in micro-batches, which this "
                                       "rank cannot: every rank must ask for the same generations in the same order")
            batch, ended, turns = micro_batches.run_phase(host, self.decoder, self.batch, self.waiting)
            self.batch, self.micro_turns = batch, self.micro_turns + turns
            if ended:
                self.leave(ended)
        elif len(self.batch):
            with self.share.timed(decoding=True):
                self._decode_step()

    def _prefill(self, budget: int) -> None:
        """One iteration's prefill (``edge0.prefill``); what it made joins the batch."""
        out = prefill.run(self.host, self.joining, budget)
        self.prefill_passes += out.passes
        for group in out.groups:
            with self.lock:
                self.joining = [r for r in self.joining if r not in group.rows]
            self._join(group)
        for row in out.ready:
            self.join(row)

    def typed(self, error: BaseException) -> BaseException:
        """``error`` as the coordinator names it (under a pipeline, a failed transfer is a
        ``DistributedError`` naming this rank's pipeline)."""
        return self.decoder.typed(error)

    def _fail_all(self, error: BaseException) -> None:
        error = self.typed(error)
        self.host.log.error("batch.failed", error=f"{type(error).__name__}: {error}")
        gone = list(self.batch.rows) + self.joining
        for row in gone:
            row.error = row.error or error
        with self.lock:
            self.batch = Batch()
        for row in gone:
            try:
                self._end_row(row)
            except BaseException:  # noqa: BLE001 - each row still gets its end
                row.job.finish(row.error)

    def _end_unstarted(self, row: Row) -> None:
        self.host.jobs.discard(row.job)
        self.host.line.ended(row.job.admission, started=False)
        row.job.finish(row.error)

    def _admit(self) -> list[Row]:  # under the lock
        out = []
        busy = list(self.batch.rows) + self.joining
        if any(r.alone for r in busy):
            return out
        while len(self.waiting) and len(busy) + len(out) < self.max_batch:
            row = self.waiting.peek()
            if row.alone and (busy or out):
                break
            out.append(self.waiting.pop())
            if row.alone:
                break
        self.joining.extend(out)
        return out

    def _start(self, row: Row, piped: bool = False) -> None:
        host, job = self.host, row.job
        job.start()
        host.line.started()
        if job.cancelled and not piped:  # (a pipeline's rows start alike on every rank: dropped together next)
            return
        try:
            host.streaming.check_files(host.log)
            if not len(self.batch) and not any(r.cache is not None for r in self.joining if r is not row):
                host.begin_batch()
            cache, cached = row.start if row.start is not None else (None, 0)
            if self._cached(row) and row.prompt_scores is None:  # (a scored prompt is forwarded whole)
                cache, cached = host.prompt_cache.take((row.adapter, row.cache_scope), row.ids, 3 if self._has_heads() else 1)
            row.cache = cache if cache is not None else bnn.make_cache(host.step_model, row.params.max_kv_size)
            row.pos = row.cached = cached if row.start is None else 0
            row.sampler, row.processors = bnn.row_sampling(
                row.params, (row.constraint,) if row.constraint is not None else (), host.xtc_special)
            # a given cache's tokens precede the prompt: counted as its cached part
            stats = GenerationStats(prompt_tokens=len(row.ids) + (cached if row.start is not None else 0),
                                    cached_tokens=cached)
            stats.heads, _ = host.streaming.describe_artifacts()
            stats.adapter = host.describe_adapter(row.adapter)
            stats.compute_dtype = host.streaming.compute_dtype
            stats.kernels = host.streaming.kernels_label
            stats.reads = ("mapped" if host.streaming.plan.source == "mapping" else
                           "direct" if host.reader.direct else "buffered")
            cache = host.reader.cache
            stats.expert_cache = f"{cache.name}, {cache.budget / 2**20:.0f} MiB" if cache is not None else None
            row.events = RowEvents(row, host.tokenizer, stats, host.reader, host.streaming.stager,
                                   host.coord)
            if row.record is not None:
                host.streaming.set_recorder(row.record)
        except BaseException as e:
            row.error = e

    def _drop_cancelled(self, cancelled: dict[int, bool] | None) -> None:
        if cancelled is None:
            ends = lambda r: r.job.cancelled or r.error is not None
        else:  # a pipeline's ranks drop a row together, when rank 0's was cancelled as they agreed
            ends = lambda r: cancelled.get(id(r), False) or r.error is not None  # (a later cancel: next iteration)
        for row in [r for r in self.joining if ends(r)]:
            self._end_row(row)
        gone = [r for r in self.batch.rows if ends(r)]
        if gone:
            self.leave(gone)

    def join(self, row: Row) -> None:
        """``row``, its prompt forwarded, joins the batch (``Batch.of`` then ``_join``)."""
        with self.lock:
            self.joining.remove(row)
        row.next = row.ids[-1]
        if not row.alone and self._unseen(row):
            # the heads have seen nothing of this sequence (a prompt of one token, or all but
            # one cached): its first step runs alone on its own cache, as it would alone
            alone = Batch([row], row.cache, row.heads)
            done = self.decoder.step(alone)
            row.heads = alone.heads
            if done:
                self._end_row(row)
                return
        self._join(Batch.of(row, row.cache, row.heads))
        row.cache, row.heads = None, None

    def _join(self, batch: Batch) -> None:
        with self.lock:
            self.batch.join(batch)

    def _has_heads(self) -> bool:
        """Whether prerouter heads run (on any rank of a pipeline)."""
        return self.host.coord.has_heads(self.host.streaming)

    def _unseen(self, row: Row) -> bool:
        """Whether the prerouter heads have observed nothing of ``row``'s sequence. Under a
        pipeline every rank must decide alike, also one that runs no head: there, whether
        the model has heads and none of the row's prompt was forwarded (what the heads
        observe)."""
        return self.host.coord.unseen(self.host.streaming, row)

    def _decode_step(self) -> None:
        batch, n = self.batch, len(self.batch)
        row = batch.rows[0] if n == 1 else None
        timed = row is not None and row.drafter is not None and row.drafter.timed
        drafting = any(r.drafter is not None for r in batch.rows)
        made, t0 = [len(r.generated) for r in batch.rows], time.perf_counter()
        drafts = self._drafts(batch) if drafting and self.decoder.pace.allows(n) else []
        done = self.decoder.verify(batch, drafts) if any(drafts) else self.decoder.step(batch)
        seconds = time.perf_counter() - t0
        made = [len(r.generated) - m for r, m in zip(batch.rows, made) if r not in done]
        if timed and made:  # a draft model's drafts cost time to make: what a token costs with them (drafts.pace)
            pace(row.drafter, seconds, made[0], any(drafts))
        if drafting and made:  # rows sharing steps: the slowest row's (drafts.BatchPace)
            self.decoder.pace.record(n, seconds, min(made), any(drafts))
        rows = batch.rows
        if rows and rows[0].kv_quant:  # (it runs alone) as mlx-lm quantizes after each step
            bnn.quantize_kv(batch.cache, self.host.config)
        if done:
            self.leave(done)

    def _drafts(self, batch: Batch) -> list[list[int]]:
        """Each row's draft for the batch's step (all empty: a step without one): what the
        drafter of a row that drafts (``Row.drafter``) proposes, within the tokens it has
        left to make (the pass makes one more than it took)."""
        out = []
        for row in batch.rows:
            if row.drafter is None:
                out.append([])
                continue
            row.drafter.follow(row.ids, row.generated)  # the prompt, then what was generated
            out.append(row.drafter.propose()[:max(0, row.max_tokens - len(row.generated) - 1)])
        return out

    def leave(self, gone: list[Row]) -> None:
        """Take ``gone`` out of the batch: their caches to the prompt cache, the batch's
        cache and heads' state filtered to the rows that stay."""
        batch = self.batch
        rows = list(batch.rows)
        keep = [i for i, r in enumerate(rows) if r not in gone]
        for i, row in enumerate(rows):
            if row in gone and row.error is None and batch.cache is not None:
                self._keep_cache(row, i)
        with self.lock:
            batch.filter(keep)
        for row in gone:
            self._end_row(row)

    def _cached(self, row: Row) -> bool:
        """Whether ``row`` takes its cache from the prompt cache and gives it back (not with
        a bounded KV size, a routing recording, nor a KV cache that is quantized)."""
        return (self.host.prompt_cache is not None and row.params.max_kv_size is None and row.record is None
                and not row.kv_quant and row.start is None)

    def _keep_cache(self, row: Row, i: int) -> None:
        host = self.host
        if not self._cached(row):
            return
        covered = (row.ids + row.generated)[: row.pos]
        cache = self.batch.extract(i)
        if cache is not None and len(covered) == row.pos:
            size = host.coord.whole(bnn.cache_nbytes(cache))
            host.prompt_cache.put((row.adapter, row.cache_scope), covered, cache, size)

    def _end_row(self, row: Row) -> None:
        if row in self.joining:
            with self.lock:
                self.joining.remove(row)
        row.cache = row.heads = None  # its KV now, not when a garbage collection finds its cycles
        host = self.host
        host.jobs.discard(row.job)
        host.line.ended(row.job.admission, started=True)
        try:
            if row.record is not None:
                host.streaming.set_recorder(None)
            if not len(self.batch) and not self.joining:
                host.end_generation()
                host.count_resources()
        finally:
            row.job.finish(row.error)
