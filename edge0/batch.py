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
from collections import deque

from edge0 import micro as micro_batches
from edge0 import prefill
from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.errors import DistributedError, ExpertReadError
from edge0.row import Row, RowEvents
from edge0.stats import GenerationStats


def batchable(cache: list) -> bool:
    """Whether a sequence with this cache can share a batch (every layer a plain KV cache)."""
    return bool(cache) and all(bnn.is_plain_kv_cache(c) for c in cache)


class Batcher:
    """The batch loop of one engine, on its compute thread: rows waiting, prefilling and
    decoding; ``submit`` from any thread. ``host`` is the engine's ``Runtime`` (its
    streaming model, tokenizer, prompt cache, line, log and the hooks of a batch's start and
    end)."""

    def __init__(self, host, max_batch: int):
        self.host = host
        self.max_batch = max_batch
        self.lock = threading.Lock()
        self._submitted = threading.Condition(self.lock)  # a row was submitted (a pipeline's followers wait on it)
        self.waiting: deque[Row] = deque()
        self._running = False
        self.joining: list[Row] = []  # admitted, prefilling
        self.rows: list[Row] = []  # decoding, in the batch's row order
        self.cache = None  # the batch's cache (one BatchKVCache per layer), or the alone row's
        self.steps = 0  # decode forward passes
        self.tokens = 0  # tokens they generated, every row
        self.decode_bytes = 0  # expert bytes read during them
        self.micro_turns = 0  # micro-batch turns (a half's decode pass each) under a two-rank pipeline
        self.prefill_passes = 0  # prompt forward passes (a chunk of one row, or rows prefilled together)
        self.share = prefill.Share(host.config.prefill_share)  # prefill's time while rows decode

    # -- any thread -----------------------------------------------------------------------
    def submit(self, row: Row) -> None:
        with self.lock:
            self.waiting.append(row)
            self._submitted.notify_all()
            if self._running:
                return
            self._running = True
        self.host.worker.submit(self.run)

    def counts(self) -> tuple[int, int]:
        """(rows decoding, rows waiting or prefilling)."""
        with self.lock:
            return len(self.rows), len(self.waiting) + len(self.joining)

    # -- the compute thread -----------------------------------------------------------------
    def run(self) -> None:
        coord = self.host.coord
        while True:
            with self.lock:
                left = [r for r in self.waiting if r.job.cancelled]  # whose consumer left: out of line now
                if left:  # (never handed to a pipeline's other ranks, which only hear of admitted rows)
                    self.waiting = deque(r for r in self.waiting if not r.job.cancelled)
                done = not self.waiting and not self.joining and not self.rows
                if done:
                    self._running = False
                admitted = self._admit() if not done and coord.leads else []
            for row in left:
                self._end_unstarted(row)
            if done:
                return
            try:
                admitted, cancelled, micro = coord.agree(self, admitted)
                self._iteration(admitted, cancelled, micro)
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
                self.joining.extend(admitted)
                self._iteration(admitted, cancelled, schedule.micro)
            except BaseException as e:  # noqa: BLE001 - as run()
                self._fail_all(e)

    def _iteration(self, admitted: list[Row], cancelled: dict[int, bool] | None, micro: bool = False) -> None:
        """Start the admitted rows, drop the cancelled ones (under a pipeline: those rank 0
        cancelled, ``cancelled``), prefill up to ``prefill_step_size`` prompt tokens of the
        joining rows (within ``prefill_share`` of the time), then one decode step of the
        batch (``micro``: decode steps in two micro-batches until rank 0 stops them)."""
        for row in admitted:
            self._start(row, piped=cancelled is not None)
        self._drop_cancelled(cancelled)
        budget = self.host.config.prefill_step_size if self.share.allows(self) else 0  # between two steps
        with self.share.timed(decoding=False):
            prefill.run(self, budget)
        if self.rows and micro:
            if not self.micro_ready():
                raise DistributedError(f"rank 0 decodes {len(self.rows)} generations in micro-batches, which this "
                                       "rank cannot: every rank must ask for the same generations in the same order")
            micro_batches.run_phase(self)
        elif self.rows:
            with self.share.timed(decoding=True):
                self._decode_step()

    def typed(self, error: BaseException) -> BaseException:
        """``error`` as the coordinator names it (under a pipeline, a failed transfer is a
        ``DistributedError`` naming this rank's pipeline)."""
        return self.host.coord.typed(self.host.streaming.explain(error))

    # -- what a pipeline's other ranks do while rank 0 decides (edge0.coordinator) -----------
    def wait_submitted(self, n: int, timeout: float) -> bool:
        """Wait until ``n`` rows wait (False: not within ``timeout`` seconds)."""
        with self._submitted:
            return self._submitted.wait_for(lambda: len(self.waiting) >= n, timeout)

    def admit_next(self, n: int) -> list[Row]:
        """The next ``n`` waiting rows, now joining."""
        with self.lock:
            admitted = [self.waiting.popleft() for _ in range(n)]
            self.joining.extend(admitted)
        return admitted

    def fail_waiting(self, error: BaseException) -> BaseException:
        """Every waiting row fails with ``error`` (what this rank was asked for no longer
        matches rank 0's); returns ``error``."""
        with self.lock:
            waiting, self.waiting = list(self.waiting), deque()
        for row in waiting:
            self.host.jobs.discard(row.job)
            self.host.line.ended(row.job.admission, started=False)
            row.job.finish(error)
        return error

    def _fail_all(self, error: BaseException) -> None:
        error = self.typed(error)
        self.host.log.error("batch.failed", error=f"{type(error).__name__}: {error}")
        for row in self.rows + self.joining:
            row.error = row.error or error
        with self.lock:
            gone, self.rows, self.cache = self.rows + self.joining, [], None
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
        busy = self.rows + self.joining
        if any(r.alone for r in busy):
            return out
        while self.waiting and len(busy) + len(out) < self.max_batch:
            row = self.waiting[0]
            if row.alone and (busy or out):
                break
            out.append(self.waiting.popleft())
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
            if not self.rows and not any(r.cache is not None for r in self.joining if r is not row):
                host.begin_batch()
            cache, cached = row.start if row.start is not None else (None, 0)
            if self._cached(row):
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
            stats.reads = "direct" if host.reader.direct else "buffered"
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
        gone = [r for r in self.rows if ends(r)]
        if gone:
            self.leave(gone)

    def join(self, row: Row) -> None:
        self.joining.remove(row)
        row.next = row.ids[-1]
        pre = self.host.streaming.prerouter
        if not row.alone and self._unseen(row):
            # the heads have seen nothing of this sequence (a prompt of one token, or all but
            # one cached): its first step runs alone on its own cache, as it would alone
            if not self._solo_step(row):
                return
        if row.alone:
            self.cache = row.cache
        elif not self.rows:
            self.cache = bnn.batch_cache([row.cache])
        else:
            bnn.extend_batch_cache(self.cache, bnn.batch_cache([row.cache]))
        if pre is not None and not row.alone:
            states = ([pre.take_state()] if self.rows else []) + [row.pstate]
            pre.put_state(pre.merge_states(states))
        row.cache, row.pstate = None, None
        with self.lock:
            self.rows.append(row)

    def _has_heads(self) -> bool:
        """Whether prerouter heads run (on any rank of a pipeline)."""
        return self.host.coord.has_heads(self.host.streaming)

    def _unseen(self, row: Row) -> bool:
        """Whether the prerouter heads have observed nothing of ``row``'s sequence. Under a
        pipeline every rank must decide alike, also one that runs no head: there, whether
        the model has heads and none of the row's prompt was forwarded (what the heads
        observe)."""
        return self.host.coord.unseen(self.host.streaming, row)

    def _solo_step(self, row: Row) -> bool:
        """``row``'s next token from a forward pass of its own; False when it ended there."""
        with prefill.heads_on(self, row):
            done = self._step([row], row.cache)
        if done:
            self._end_row(row)
        return not done

    def _decode_step(self) -> None:
        rows = list(self.rows)
        done = self._step(rows, self.cache)
        if rows and rows[0].kv_quant:  # (it runs alone) as mlx-lm quantizes after each step
            bnn.quantize_kv(self.cache, self.host.config)
        if done:
            self.leave(done)

    def _step(self, rows: list[Row], cache) -> list[Row]:
        """One forward pass of ``rows`` (one token each) on ``cache``, each row's token
        sampled and handed to its consumer; the rows that ended (finished, left, failed)."""
        bytes0 = self.host.reader.stats.bytes
        try:
            logits = self.forward(rows, cache)[:, -1, :]
        except BaseException as e:  # the step itself: every row of it fails
            return self._failed(rows, e)
        done = self.take_tokens(rows, logits)
        self.decode_bytes += self.host.reader.stats.bytes - bytes0
        return done

    def forward(self, rows: list[Row], cache):
        """The decode pass of ``rows`` (lazy): each row's adapter, its last token; the step's
        plan first (the Stager's: its reads start before the forward pass)."""
        inputs = B.array([[r.next] for r in rows], dtype=B.int32)
        self.host.step_model.plan(inputs, decode=True)
        return self.host.step_model.forward(inputs, cache=cache, decode=True, adapters=[r.adapter for r in rows])

    def _failed(self, rows: list[Row], e: BaseException) -> list[Row]:
        e = self.typed(e)
        for row in rows:
            row.error = row.error or e
        if isinstance(e, ExpertReadError):
            self.host.after_read_error(e)
        return rows

    def take_tokens(self, rows: list[Row], logits) -> list[Row]:
        """Each row's token sampled from its row of ``logits`` [rows, vocab] and handed to its
        consumer; the rows that ended (finished, left, failed)."""
        host = self.host
        try:
            sampled, logprobs = [], []
            for i, row in enumerate(rows):
                try:
                    token, lp = self._sample(row, logits[i:i + 1])
                except BaseException as e:  # this row's processors or sampler: this row fails
                    row.error = e
                    token, lp = None, None
                sampled.append(token)
                logprobs.append(lp)
            live = [t.reshape(-1) for t in sampled if t is not None]
            values = iter(B.to_host(B.concat(live)).tolist() if live else [])  # one read for the step
        except BaseException as e:  # the step itself: every row of it fails
            return self._failed(rows, e)
        self.steps += 1
        done = []
        for row, token, lp in zip(rows, sampled, logprobs):
            if row.error is not None:
                done.append(row)
                continue
            row.pos += 1
            token = int(next(values))
            self.tokens += 1
            event = row.events.event(token, lp)
            row.next = token
            offered = row.job.offer(event)
            if not offered and row.job.error is not None:
                host.log.warning("generation.consumer_stalled", error=str(row.job.error))
            if event.finish_reason is not None:
                host.last_stats = event.stats
                done.append(row)
            elif not offered and host.coord.ends_unread():
                done.append(row)
        return done

    # -- micro-batches (a two-rank pipeline: edge0.micro) -----------------------------------------
    def micro_ready(self) -> bool:
        return micro_batches.ready(self)

    def _sample(self, row: Row, logits):
        if row.processors:
            history = B.array(row.ids + row.generated, dtype=B.int32)
            for proc in row.processors:
                logits = proc(history, logits)
        logprobs = logits - B.logsumexp(logits, keepdims=True)
        key = B.draw_key(row.seed, len(row.generated))  # the row's own random stream, passed as a key
        return row.sampler(logprobs, key), logprobs.squeeze(0)

    def leave(self, gone: list[Row]) -> None:
        """Take ``gone`` out of the batch: their caches to the prompt cache, the batch's
        cache and the prerouter's state filtered to the rows that stay."""
        host = self.host
        index = {id(r): i for i, r in enumerate(self.rows)}
        keep = [i for i, r in enumerate(self.rows) if r not in gone]
        for row in gone:
            if row.error is None and self.cache is not None and id(row) in index:
                self._keep_cache(row, index[id(row)])
        pre = host.streaming.prerouter
        if keep and self.cache is not None:
            bnn.filter_batch_cache(self.cache, keep)
            if pre is not None and pre.ready():
                pre.put_state(pre.select_rows(pre.take_state(), keep))
        with self.lock:
            self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = None
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
        cache = self.cache if row.alone else bnn.extract_batch_row(self.cache, i)
        if cache is not None and len(covered) == row.pos:
            size = host.coord.whole(bnn.cache_nbytes(cache))
            host.prompt_cache.put((row.adapter, row.cache_scope), covered, cache, size)

    def _end_row(self, row: Row) -> None:
        if row in self.joining:
            self.joining.remove(row)
        row.cache = row.pstate = None  # its KV now, not when a garbage collection finds its cycles
        host = self.host
        host.jobs.discard(row.job)
        host.line.ended(row.job.admission, started=True)
        try:
            if row.record is not None:
                host.streaming.set_recorder(None)
            if not self.rows and not self.joining:
                host.end_generation()
                host.count_resources()
        finally:
            row.job.finish(row.error)
