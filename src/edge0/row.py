"""One generation in the batch loop: its ``Row`` (prompt, sampling, cache, what it
generated), the ``TokenEvent``s it hands its consumer, ``RowEvents``, which turns its
sampled tokens into those events (detokenizer, stops as ``StopMatcher`` finds them,
logprobs, stats), and its ``Job``, through which they reach the consumer.

A ``Job`` hands its events to one consumer through its buffer (``offer``: the compute
thread never waits on a consumer; one that leaves ``ahead`` events untaken for
``stall_timeout`` seconds is stopped). The consumer may leave at any
time from any thread or task: ``cancel()`` only sets a flag and wakes the producer, which
then closes the generation on the compute thread by itself. Nothing is released by the
consumer, so a consumer that is cancelled, breaks out of its loop or is garbage collected
in another task cannot leave a lock held or work half done.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import anyio
import numpy as np

from edge0.backend import core as B
from edge0.errors import StalledConsumerError
from edge0.sampling import SamplingParams
from edge0.stats import GenerationStats, peak_rss_bytes
from edge0.text import open_tail


@dataclass
class TokenEvent:
    """One generated token. ``stats`` is filled on the last event (finish_reason set)."""

    token: int
    text: str
    finish_reason: str | None = None  # "stop" (EOS or a stop token) or "length"
    stats: GenerationStats | None = field(default=None, repr=False)
    logprob: float | None = None  # with SamplingParams.logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # with SamplingParams.top_logprobs > 0
    stop_sequence: str | None = None  # the stop string that ended the generation (finish_reason "stop")
    # with SamplingParams.prompt_logprobs, on the first event: per prompt token, None for the
    # first (nothing predicts it), then (its log-probability, [(token id, log-probability)] of
    # the most likely tokens at its position)
    prompt_logprobs: list | None = field(default=None, repr=False)


_ARRIVALS = itertools.count()


@dataclass(eq=False)  # a row is itself: compared by identity
class Row:
    """One generation: its prompt, sampling, cache, what it generated and its consumer."""

    job: object
    ids: list[int]
    params: SamplingParams
    record: object  # a RoutingRecorder (a routing recording), or None
    adapter: str | None
    max_tokens: int
    cache_scope: str | None = None  # the prompt cache shares entries within one scope only
    constraint: object = None  # its response_format's logits processor (None: none), made where it is submitted
    generated: list[int] = field(default_factory=list)
    cache: object = None  # its own cache (mlx-lm's list, one per layer) until it joins the batch
    pos: int = 0  # tokens its cache holds
    cached: int = 0  # prompt tokens that came from the prompt cache
    start: tuple | None = None  # (a given prompt cache, the tokens it holds before ids): Engine.stream(prompt_cache=)
    next: int | None = None  # the token its next forward pass takes
    heads: object = None  # what the prerouter heads observed of its sequence (an Observed), before it joins
    seed: int | None = None  # its random stream's seed (params.seed, else drawn)
    sampler: object = None
    processors: list | None = None
    events: object = None  # its RowEvents, from the first token on
    error: BaseException | None = None
    alone: bool = False  # runs alone: nothing joins while it runs
    kv_quant: bool = False  # its KV cache is quantized once it holds quantized_kv_start tokens (it runs alone)
    passed_over: int = 0  # iterations with prefill budget in which its prompt got none
    prompt_scores: list | None = None  # with params.prompt_logprobs: its prompt tokens' scores so far (prefill)
    arrival: int = field(default_factory=lambda: next(_ARRIVALS))  # the order rows were made in (edge0.prefill.order)
    drafter: object = None  # its drafter (edge0.drafts.PromptLookup, edge0.draft_model.ModelDrafter); None: none

    def __post_init__(self):
        if self.seed is None:
            self.seed = self.params.seed if self.params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        if self.params.prompt_logprobs is not None:
            self.prompt_scores = [None]  # the first token: nothing before it predicts it

    def spec(self) -> dict:
        """What another rank needs to run this generation as this one runs (a served
        pipeline), as JSON; ``sampling_of`` turns its ``params`` back into keywords."""
        params = dataclasses.asdict(self.params)
        if params.get("logit_bias"):
            params["logit_bias"] = [[int(k), v] for k, v in params["logit_bias"].items()]
        return {"ids": list(self.ids), "params": params, "adapter": self.adapter, "cache_scope": self.cache_scope}


def sampling_of(spec: dict) -> dict:
    """The sampling keywords of a ``Row.spec``."""
    params = dict(spec["params"])
    if params.get("logit_bias"):
        params["logit_bias"] = {int(k): v for k, v in params["logit_bias"]}
    params["stop_token_ids"], params["stop"] = tuple(params["stop_token_ids"]), tuple(params["stop"])
    return params


class RowEvents:
    """Turns a row's sampled tokens into its ``TokenEvent``s: the streaming detokenizer,
    EOS and stop ids, stop strings, the length bound, logprobs, and its stats."""

    def __init__(self, row: Row, tokenizer, stats: GenerationStats, reads, stage=None, coord=None):
        self.row, self.stats, self.reads, self.stage, self.coord = row, stats, reads, stage, coord
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.eos = set(tokenizer.eos_token_ids) | set(row.params.stop_token_ids)
        self.stops = StopMatcher(row.params.stop)
        self.t0 = time.perf_counter()
        self.bytes0, self.wait0 = reads.stats.bytes, reads.stats.seconds
        self.stage0 = stage.stats() if stage is not None else None
        self.t_first = self.bytes_first = self.cache_first = None

    def event(self, token: int, logprobs) -> TokenEvent:
        row, stats, reads = self.row, self.stats, self.reads.stats
        n = len(row.generated)
        row.generated.append(token)
        now = time.perf_counter()
        if n == 0:
            self.t_first, self.bytes_first = now, reads.bytes
            self.cache_first = (reads.cache_hits, reads.cache_bytes)
            stats.prefill_seconds = now - self.t0
            stats.prefill_expert_bytes = self.bytes_first - self.bytes0
        stats.generated_tokens = n + 1
        stats.decode_seconds = now - self.t_first
        stats.decode_expert_bytes = reads.bytes - self.bytes_first
        stats.decode_cache_hits = reads.cache_hits - self.cache_first[0]
        stats.decode_cache_bytes = reads.cache_bytes - self.cache_first[1]
        finish = "stop" if token in self.eos else "length" if n + 1 == row.max_tokens else None
        lp = _logprobs(token, logprobs, row.params)
        if n == 0 and row.prompt_scores is not None:
            lp["prompt_logprobs"] = row.prompt_scores
        if finish != "stop":  # an end-of-generation token's text is not part of the answer
            self.detok.add_token(token)
        if finish is not None:
            self.detok.finalize()
        text, stopped = self.stops.feed(self.detok.last_segment)
        if stopped:
            finish = "stop"
        elif finish is not None:
            text += self.stops.flush()
        if finish is None:
            return TokenEvent(token, text, **lp)
        stats.read_wait_seconds = reads.seconds - self.wait0
        if self.stage is not None:
            stats.add_stage(self.stage0, self.stage.stats())
        stats.peak_active_memory = B.peak_memory()
        stats.peak_rss = peak_rss_bytes()
        if self.coord is not None:
            self.coord.finish_stats(stats)
        return TokenEvent(token, text, finish, stats, stop_sequence=self.stops.matched, **lp)


def _logprobs(token: int, logprobs, params: SamplingParams) -> dict:
    if not params.logprobs and not params.top_logprobs:
        return {}
    row = B.to_host(logprobs.astype(B.float32)).reshape(-1)
    out = {"logprob": float(row[token])}
    if params.top_logprobs:
        top = np.argpartition(-row, params.top_logprobs - 1)[: params.top_logprobs]
        top = top[np.argsort(-row[top], kind="stable")]
        # tokens a constraint or logit_bias rules out (-inf) are no alternatives
        out["top_logprobs"] = [(int(i), float(row[i])) for i in top if np.isfinite(row[i])]
    return out


class StopMatcher:
    """Stop strings over streamed text: ``feed`` returns the text safe to emit (a tail that
    may still grow into a stop string is held back) and whether a stop string was reached
    (the text is then cut where it begins; ``matched`` is that string: the one that begins
    first, the first listed of those beginning there)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.pending += text
        hits = [(i, n) for n, i in enumerate(self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            at, n = min(hits)
            out, self.pending, self.matched = self.pending[:at], "", self.stops[n]
            return out, True
        cut = len(self.pending) - open_tail(self.pending, self.stops)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


END = object()  # the last item a job hands out
TIMEOUT = object()  # Job.get's answer when nothing came within its timeout


class Job:
    """One generation's hand-off from the compute thread to its consumer."""

    def __init__(self, ahead: int = 2):
        self.ahead = ahead
        self._items: deque = deque()
        self._cond = threading.Condition()
        self.cancelled = False
        self.started = False  # the compute thread has begun it (it is no longer queued)
        self.finished = False
        self.error: BaseException | None = None
        self.admission = None  # the engine's Admission this generation was started with, if any
        self.stall_timeout: float | None = None  # longest wait for the consumer in put (None: no bound)
        self._wakers: list = []  # called (without arguments, any thread) whenever the job changes
        self._behind_since: float | None = None  # offer: since when ``ahead`` items wait for the consumer

    def add_waker(self, fn) -> None:
        """Call ``fn`` whenever an item, the start, the end or a cancellation happens: an
        async consumer's way to wait without holding a thread. ``fn`` must not block."""
        with self._cond:
            self._wakers.append(fn)

    def remove_waker(self, fn) -> None:
        with self._cond:
            if fn in self._wakers:
                self._wakers.remove(fn)

    def _changed(self) -> None:  # under the condition's lock
        self._cond.notify_all()
        for fn in self._wakers:
            fn()

    # -- producer (compute thread) --------------------------------------------------------
    def offer(self, item) -> bool:
        """Hand ``item`` to the consumer without waiting (a batch's step must not wait for
        one consumer): False when the consumer has left, or has taken nothing for
        ``stall_timeout`` seconds while ``ahead`` items waited for it (the job is then
        cancelled with ``StalledConsumerError``)."""
        with self._cond:
            if self.cancelled:
                return False
            now = time.monotonic()
            if len(self._items) < self.ahead:
                self._behind_since = None
            elif self._behind_since is None:
                self._behind_since = now
            elif self.stall_timeout is not None and now - self._behind_since >= self.stall_timeout:
                self.error = StalledConsumerError(
                    f"the consumer took no token for {self.stall_timeout:g} s; the generation was stopped")
                self.cancelled = True
                self._items.clear()
                self._changed()
                return False
            self._items.append(item)
            self._changed()
            return True

    def _took(self) -> None:  # under the condition's lock: the consumer took an item
        self._behind_since = None
        self._cond.notify_all()

    def start(self) -> None:
        with self._cond:
            self.started = True
            self._changed()

    def finish(self, error: BaseException | None = None) -> None:
        with self._cond:
            self.error = error or self.error
            self.finished = True
            self._changed()

    # -- consumer (any thread) --------------------------------------------------------------
    def get(self, timeout: float | None = None):
        """The next item, waiting for it; ``END`` once the job finished or was cancelled
        (then ``error`` holds what stopped it, if anything); ``TIMEOUT`` when ``timeout``
        seconds passed without either (nothing is consumed then)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items or self.finished or self.cancelled, timeout):
                return TIMEOUT
            if self._items and not self.cancelled:
                item = self._items.popleft()
                self._took()
                return item
            return END

    def poll(self):
        """The next item if one is waiting, ``END`` if none will come, else None."""
        with self._cond:
            if self._items and not self.cancelled:
                item = self._items.popleft()
                self._took()
                return item
            return END if (self.finished or self.cancelled) else None

    def cancel(self) -> None:
        with self._cond:
            self.cancelled = True
            self._items.clear()
            self._changed()


class DiscardingJob(Job):
    """A generation whose events nobody takes (a pipeline rank that follows rank 0, which
    answers the client): each is dropped as it comes."""

    def offer(self, item) -> bool:
        return not self.cancelled


class AsyncWaker:
    """An async consumer's wait for its job to change (``job.add_waker(waker)``): the
    compute thread schedules the event's ``set`` on the consumer's event loop (asyncio or
    trio, ``anyio.lowlevel.current_token()``), never blocking itself."""

    def __init__(self, token):
        self._token = token
        self._event = anyio.Event()

    def __call__(self) -> None:  # any thread
        try:
            self._token.backend_class.run_sync_soon(self._set, (), self._token.native_token)
        except Exception:  # noqa: BLE001 - the loop is gone: nobody is waiting
            pass

    def _set(self) -> None:
        self._event.set()

    async def wait(self, job: Job, timeout: float | None):
        """The job's next item or END, or TIMEOUT after ``timeout`` seconds."""
        while True:
            self._event = anyio.Event()  # armed before the check: a change after it sets this one
            event = job.poll()
            if event is not None:
                return event
            with anyio.move_on_after(timeout):
                await self._event.wait()
                continue
            return TIMEOUT
