"""The engine: open a checkpoint for streaming and generate tokens.

Contract: everything except the routed experts is resident (mlx-lm's model classes); each
MoE block is a ``StreamingMoE`` whose experts are read from the checkpoint on demand. The
engine owns one compute thread; the async API runs every MLX step there, so an event loop
embedding Edge0 is never blocked by compute or reads.

    async with Engine.open("model_dir") as engine:
        async for event in engine.generate("def f(x):", max_tokens=32):
            print(event.text, end="")

    text = edge0.generate("model_dir", "def f(x):", max_tokens=32)   # synchronous helper
"""

from __future__ import annotations

import time
import weakref
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Iterator, Sequence

import anyio

from edge0.admission import Admission, EngineMetrics
from edge0.batch import Batcher, batchable
from edge0.row import END, TIMEOUT, AsyncWaker, DiscardingJob, Job, Row, sampling_of
from edge0.row import TokenEvent  # noqa: F401 - part of this module's API
from edge0.backend import nn as bnn
from edge0.config import EngineConfig
from edge0.draft_model import open_draft
from edge0.drafts import check_request, drafter_for
from edge0.errors import DistributedError, ConfigError, EngineClosedError
from edge0.exec.oracle import OracleRouting, RoutingRecorder
from edge0.loader import load_streaming_model
from edge0.streaming import Streaming
from edge0.prompt_cache import PromptCache, check_scope
from edge0.runtime import Runtime
from edge0.prompts import check_text_size, longest_token_chars
from edge0.prompts import prompt_ids as build_prompt_ids
from edge0.logs import configure as configure_logs
from edge0.logs import get_logger
from edge0.sampling import SamplingParams
from edge0.stats import GenerationStats
from edge0.worker import ComputeThread
from edge0.worker import acquire as acquire_thread
from edge0.worker import release as release_thread


class _DefaultAdapter:
    def __repr__(self) -> str:
        return "<the engine's default adapter>"


DEFAULT_ADAPTER = _DefaultAdapter()


class Engine:
    """A streaming MoE model ready to generate. Use ``Engine.open`` from async code.

    Every MLX call of an engine runs on its compute thread (``edge0.worker``). Concurrent
    generations decode together, up to ``max_batch`` of them in one forward pass per step
    (``edge0.batch``), the others waiting their turn in submission order; a consumer may
    leave at any point without disturbing the others."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, *,
                 oracle: OracleRouting | None = None):
        self.model_dir = Path(model_dir)
        self.config = config or EngineConfig()
        configure_logs(self.config.log_format, self.config.log_level)
        self.log = get_logger("edge0")
        self._worker = acquire_thread()
        self._closed = False
        self._lost = False  # a pipeline's rank stopped answering: the compute thread may never return
        try:
            self.streaming, self.tokenizer, draft = self._worker.call(_open, self.model_dir, self.config, oracle,
                                                                      self.log)
        except BaseException:
            release_thread(self._worker)
            raise
        self._rt = Runtime(self._worker, self.streaming, self.tokenizer, self.config, self.log, draft)
        problem = self.config.kv_bits is not None and bnn.kv_group_problem(self.model, self.config.kv_group_size)
        if problem:
            _shutdown(self._worker, self.streaming, set())
            raise ConfigError(problem)
        # under a pipeline rank 0's batch loop decides what each iteration admits; the other ranks follow it
        self._batcher = Batcher(self._rt, self.config.max_batch)
        # a model whose caches are not all plain KV caches (state-space, linear attention)
        # runs its generations one at a time
        self._own_cache = self._worker.call(lambda: bnn.make_cache(self._rt.step_model))  # the kinds a given one must be
        self._batchable = batchable(self._own_cache)
        self._constraints = self._rt.constraints
        self._longest_token: int | None = None
        self._worker.call(self._rt.count_resources)
        # closes the engine if it is garbage collected or still open at exit
        self._finalizer = weakref.finalize(self, _shutdown, self._worker, self.streaming, self._rt.jobs)

    @property
    def model(self):
        """The mlx-lm model, its MoE blocks streaming."""
        return self.streaming.model

    @property
    def spec(self):
        return self.streaming.spec

    @property
    def index(self):
        return self.streaming.index

    @property
    def reader(self):
        return self.streaming.reader

    @property
    def plan(self):
        """The memory plan the engine was opened by (``edge0.exec.budget.MemoryPlan``; what
        ``edge0 plan`` prints)."""
        return self.streaming.plan

    @property
    def coordinator(self):
        """Who decides what the batch loop does (``edge0.coordinator``: this process alone, or
        a pipeline's ranks in step); ``coordinator.leads``: this process answers."""
        return self._rt.coord

    @property
    def prompt_cache(self) -> PromptCache | None:
        """The prompt cache (``prompt_cache_mb``), or None."""
        return self._rt.prompt_cache

    # -- lifecycle ----------------------------------------------------------------------
    @classmethod
    @asynccontextmanager
    async def open(cls, model_dir: str | Path, config: EngineConfig | None = None) -> AsyncIterator["Engine"]:
        engine = await anyio.to_thread.run_sync(cls, model_dir, config)
        try:
            yield engine
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(engine.close)

    def close(self) -> None:
        """Stop every generation, release the slots, threads and file descriptors."""
        if not self._closed:
            self._closed = True
            self._rt.coord.close(self._worker, self._lost)
            if self._lost:  # the compute thread waits on a rank that is gone: leave it
                self._finalizer.detach()
                for job in list(self._rt.jobs):
                    job.cancel()
                return
            self._finalizer()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- generation -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int | None:
        return getattr(self.model.args, "vocab_size", None) if hasattr(self.model, "args") else None

    @property
    def context_length(self) -> int | None:
        """The longest sequence the model was built for (config.json's
        ``max_position_embeddings``), or None when it does not say."""
        args = getattr(self.model, "args", None)
        n = getattr(args, "max_position_embeddings", None)
        if n is None and isinstance(getattr(args, "text_config", None), dict):
            n = args.text_config.get("max_position_embeddings")
        return n if isinstance(n, int) and n > 0 else None

    def _check_length(self, ids: list[int], params: SamplingParams) -> None:
        ctx = self.context_length
        if ctx is not None and len(ids) >= ctx:
            raise ConfigError(f"the prompt is {len(ids)} tokens; the model's context is {ctx} tokens "
                              "(max_position_embeddings): shorten the prompt")

    def _longest(self) -> int | None:
        """The most characters one token covers (found once), or None without a vocabulary size."""
        if self._longest_token is None and self.vocab_size:
            self._longest_token = longest_token_chars(self.tokenizer, self.vocab_size)
        return self._longest_token

    def _check_text_size(self, chars: int) -> None:
        if self._longest():
            check_text_size(self._longest_token, self.context_length, chars)

    @property
    def max_prompt_chars(self) -> int | None:
        """The most characters a prompt's text can have and still fit the context (no token
        covers more than the longest token's text), or None when that is not known."""
        ctx, longest = self.context_length, self._longest()
        return ctx * longest if ctx and longest else None

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            self._check_text_size(len(prompt))
            bos = self.tokenizer.bos_token
            ids = self.tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ConfigError("prompt is empty: give at least one token")
        vocab = self.model.args.vocab_size if hasattr(self.model.args, "vocab_size") else None
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            raise ConfigError(f"prompt token ids must be in [0, {vocab})")
        return ids

    @property
    def adapters(self) -> list[str]:
        """Names of the adapters this engine holds (the first is the default)."""
        bank = self.streaming.adapters
        return list(bank.adapters) if bank is not None else []

    def _adapter_for(self, adapter) -> str | None:
        if adapter is DEFAULT_ADAPTER:
            return self.adapters[0] if self.adapters and self.config.adapter != "off" else None
        if adapter is not None and adapter not in self.adapters:
            raise ConfigError(f"no adapter named {adapter!r}; this engine holds {self.adapters or 'none'}")
        return adapter

    def validate(self, prompt: str | Sequence[int], **sampling) -> tuple[list[int], SamplingParams]:
        """The token ids and sampling a generation would use, every value checked (a
        ``ConfigError`` naming the one that is wrong); nothing runs."""
        params = SamplingParams(**sampling)
        check_request(params, self._rt.draft)
        ids = self.encode(prompt)
        self._check_length(ids, params)
        params = params.for_vocab(self.vocab_size)
        self._constraints.get(params.response_format, params.grammar)  # a schema the library refuses: ConfigError now
        return ids, params


    def _submit(self, prompt, sampling: dict, record: RoutingRecorder | None = None,
                adapter=None, admission: Admission | None = None, consumer_timeout: float | None = None,
                cache_scope: str | None = None, prompt_cache: list | None = None) -> Job:
        """Validate, then queue a generation for the batch loop on the compute thread."""
        if self._closed:
            raise EngineClosedError("the engine is closed")
        check_scope(cache_scope)
        ids, params = self.validate(prompt, **sampling)
        start = None if prompt_cache is None else (prompt_cache, self._start_offset(prompt_cache, ids))
        params = self._rt.coord.params(params)
        job = Job()
        job.admission = admission
        job.stall_timeout = consumer_timeout
        self._batcher.submit(self._row(job, ids, params, record, adapter, cache_scope, start))
        return job

    def _start_offset(self, cache: list, ids: list[int]) -> int:
        """The tokens a given prompt cache holds before ``ids``, checked against the model and
        its context."""
        self._rt.coord.refuse_given_cache()
        offset = bnn.check_start_cache(self._own_cache, cache, self.config.kv_bits, self.config.kv_group_size)
        if self.context_length is not None and offset + len(ids) >= self.context_length:
            raise ConfigError(f"the prompt cache's {offset} tokens and the prompt's {len(ids)} fill the model's "
                              f"context of {self.context_length} tokens: shorten the prompt")
        return offset

    def _row(self, job: Job, ids: list[int], params: SamplingParams, record, adapter,
             cache_scope: str | None = None, start: tuple[list, int] | None = None) -> Row:
        """A generation for the batch loop, counted in line; ``start``: (a given prompt
        cache, the tokens it holds)."""
        ctx, offset = self.context_length, start[1] if start is not None else 0
        max_tokens = min(params.max_tokens, ctx - offset - len(ids)) if ctx is not None else params.max_tokens
        row = Row(job, ids, params, record, adapter, max_tokens, cache_scope)
        row.start = start
        # its format compiled (a cache hit after validate) and its matcher copied here, on the submitting
        # thread, before the row is counted in line (a large grammar's copy took 0.18 s)
        constraint = self._constraints.get(params.response_format, params.grammar)
        row.constraint = constraint.processor() if constraint is not None else None
        stager = self.streaming.stager
        # alone: a recording, a rotating cache, an oracle's step-by-step routing of one sequence, a KV
        # cache that will be quantized
        cfg = self.config
        row.kv_quant = cfg.kv_bits is not None and offset + len(ids) + max_tokens > cfg.quantized_kv_start
        row.alone = (record is not None or params.max_kv_size is not None or not self._batchable or row.kv_quant
                     or start is not None
                     or (stager is not None and stager.oracle is not None))
        row.drafter = drafter_for(row, cfg, self._batchable and self._rt.coord.drafts
                                  and (stager is None or stager.oracle is None), self._rt.draft)
        self._rt.jobs.add(job)
        self._rt.line.submitted(job.admission)
        return row

    def _follower_row(self, spec: dict) -> Row:
        """A rank that follows a served pipeline: the generation rank 0 handed over (its
        events go nowhere: rank 0 answers the client)."""
        ids, params = self.validate(spec["ids"], **sampling_of(spec))
        return self._row(DiscardingJob(), ids, params, None, spec["adapter"], spec.get("cache_scope"))

    def stream(self, prompt: str | Sequence[int], *, adapter=DEFAULT_ADAPTER, admission: Admission | None = None,
               cache_scope: str | None = None, prompt_cache: list | None = None,
               **sampling) -> Iterator[TokenEvent]:
        """Synchronous token stream. Leaving the loop early stops the generation.
        ``adapter``: the name of a loaded adapter, ``None`` for the bare base; by default the
        engine's default adapter (if any). ``admission``: from ``admit()``, released when the
        generation ends. ``cache_scope``: the prompt cache shares entries only among
        generations of the same scope (e.g. one per tenant; None is one scope of its own).
        ``prompt_cache``: as mlx-lm's, a KV cache holding a prefix (``mlx_lm.cache_prompt``'s
        file, ``edge0.load_prompt_cache``); ``prompt`` is what follows it. It is extended in
        place, and the generation runs alone."""
        job = self._submit(prompt, sampling, adapter=self._adapter_for(adapter), admission=admission,
                           cache_scope=cache_scope, prompt_cache=prompt_cache)
        wait = self._pipeline_wait()
        try:
            while (event := job.get(wait)) is not END:
                if event is TIMEOUT:
                    raise self._pipeline_lost(wait)
                yield event
            if job.error is not None:
                raise job.error
        finally:
            job.cancel()

    async def generate(self, prompt: str | Sequence[int], *, adapter=DEFAULT_ADAPTER, heartbeat: float | None = None,
                       admission: Admission | None = None, consumer_timeout: float | None = None,
                       cache_scope: str | None = None, prompt_cache: list | None = None,
                       **sampling) -> AsyncIterator[TokenEvent | None]:
        """Async token stream; the event loop is never blocked by compute or reads.

        Leaving it by any route (``break``, an exception, cancellation, ``aclosing``, the
        generator being garbage collected) stops the generation: the compute thread
        closes it by itself, and the next generation starts from a clean state.

        Up to ``max_batch`` generations decode together, the others wait in the order they
        were asked for; one waiting its turn holds no thread, nor does one waiting for its next token: the compute thread
        wakes the event loop when the job changes. ``heartbeat``: yield ``None`` whenever that
        many seconds pass without a token (waiting in line, a long prefill), e.g. to keep a
        connection alive. ``admission``: from ``admit()``, released when the generation ends.
        ``consumer_timeout``: when this consumer takes no token for that many seconds, the
        generation stops (``StalledConsumerError``) so that it holds the engine no longer.
        ``cache_scope``, ``prompt_cache``: as ``stream``'s."""
        job = self._submit(prompt, sampling, adapter=self._adapter_for(adapter), admission=admission,
                           consumer_timeout=consumer_timeout, cache_scope=cache_scope, prompt_cache=prompt_cache)
        wake = AsyncWaker(anyio.lowlevel.current_token())
        job.add_waker(wake)
        lost_after = self._pipeline_wait()
        try:
            last = time.monotonic()
            while True:
                event = job.poll()
                if event is None:
                    wait = max(0.0, last + heartbeat - time.monotonic()) if heartbeat else None
                    if lost_after is not None:
                        until = max(0.0, last + lost_after - time.monotonic())
                        wait = until if wait is None else min(wait, until)
                    event = await wake.wait(job, wait)
                else:  # one already waiting: still a checkpoint, so a cancellation takes effect between any two
                    await anyio.lowlevel.checkpoint()
                if event is TIMEOUT:
                    if lost_after is not None and time.monotonic() - last >= lost_after:
                        raise self._pipeline_lost(lost_after)
                    if heartbeat and time.monotonic() - last >= heartbeat:
                        last = time.monotonic()
                        yield None
                    continue
                if event is END:
                    break
                last = time.monotonic()
                yield event
            if job.error is not None:
                raise job.error
        finally:
            job.remove_waker(wake)
            job.cancel()

    # -- a served pipeline ----------------------------------------------------------------
    def lead(self) -> None:
        """Rank 0 of a pipeline that serves requests only it receives (``edge0 serve``): from
        now on each generation it starts is handed to the other ranks, which ``follow``."""
        self._rt.coord.lead()

    def follow(self) -> int:
        """The other ranks of a served pipeline: run every generation rank 0 hands over, in
        the batches rank 0 runs them in, until rank 0's engine closes. Returns how many ran."""
        self._rt.coord.check_follows()
        return self._worker.call(self._batcher.follow, self._follower_row)

    def _pipeline_wait(self) -> float | None:
        """Under a pipeline, how long a generation waits for a token (None: alone, no bound)."""
        return self._rt.coord.token_wait_s

    def _pipeline_lost(self, seconds: float) -> DistributedError:
        self._lost = True
        return self._rt.coord.lost(seconds)

    def record_routing(self, prompt: str | Sequence[int], **sampling) -> OracleRouting:
        """Run a generation on the exact path and return its per-step routing (the oracle).
        Every MoE layer must decode on the exact path (the router's own choice, recorded
        there): an engine whose heads stage layers is refused before anything runs."""
        off_exact = {l: p for (l, ph), p in self.streaming.path_of.items() if ph == "decode" and p != "exact"}
        if off_exact:
            paths = ", ".join(f"{l}: {p}" for l, p in sorted(off_exact.items())[:8])
            raise ConfigError(f"record_routing records the routing the exact path computes, and layers decode "
                              f"elsewhere ({paths}){' (the prerouter heads stage them)' if self.streaming.prerouter else ''}"
                              f": open the engine with decode_path='exact' and prerouter='off'")
        rec = RoutingRecorder()
        job = self._submit(prompt, sampling, record=rec, adapter=self._adapter_for(DEFAULT_ADAPTER))
        while job.get() is not END:
            pass
        if job.error is not None:
            raise job.error
        return rec.routing(str(self.model_dir))

    def generate_text(self, prompt: str | Sequence[int], **sampling) -> tuple[str, GenerationStats]:
        text, stats = [], None
        for event in self.stream(prompt, **sampling):
            text.append(event.text)
            stats = event.stats or stats
        return "".join(text), stats

    # -- prompts, admission, metrics ----------------------------------------------------------
    def prompt_ids(self, prompt: str | None = None, *, messages: Sequence[dict] | None = None,
                   **options) -> list[int]:
        """Token ids of a prompt as mlx-lm builds them (``edge0.prompts.prompt_ids``, whose
        keywords ``options`` are): with a chat template, ``prompt`` as one user message after
        an optional ``system_prompt``, or ``messages`` (and ``tools``, OpenAI function
        definitions); without, the text (a base model continues the messages' contents, or,
        with ``role_mapping``, mlx-lm's prompt of them). ``template_kwargs``: the chat
        template's variables (``enable_thinking``); ``prefill_response``: the start of the
        assistant's answer, which the model continues; ``after_cache``: the prompt follows a
        prefix a given prompt cache holds (``stream(prompt_cache=)``)."""
        self._check_text_size(len(prompt or "") + sum(len(str(m.get("content") or "")) for m in messages or ()))
        return build_prompt_ids(self.tokenizer, self.encode, prompt, messages=messages,
                                check_chars=self._check_text_size, **options)

    def admit(self, max_waiting: int | None = None) -> Admission:
        """Count a request in line from now (before any work for it) until its generation
        ends or ``release()``. ``EngineBusyError`` when ``max_waiting`` requests already wait
        beyond the ``max_batch`` that run together (None: no bound)."""
        if self._closed:
            raise EngineClosedError("the engine is closed")
        return self._rt.line.admit(max_waiting)

    def metrics(self) -> EngineMetrics:
        """The line (requests in flight and queued), expert bytes read, the prompt cache and
        the last finished generation's stats. Any thread; never waits for the compute thread."""
        in_flight, queued = self._rt.line.counts()
        cache = self.prompt_cache
        batch, stager = self._batcher, self.streaming.stager
        return EngineMetrics(
            in_flight=in_flight, queued=queued, expert_bytes=self.reader.stats.bytes,
            expert_cache_bytes=self.reader.cache.nbytes if self.reader.cache is not None else 0,
            expert_cache_hits=self.reader.stats.cache_hits, expert_cache_served_bytes=self.reader.stats.cache_bytes,
            prompt_cache_bytes=cache.nbytes if cache is not None else 0,
            prompt_cache_hits=cache.hits if cache is not None else 0, last_generation=self._rt.last_stats,
            batch_size=batch.counts()[0], decode_steps=batch.steps, decode_tokens=batch.tokens,
            decode_expert_bytes=batch.decode_bytes, verify_passes=batch.decoder.verify_passes,
            draft_tokens=batch.decoder.drafted, accepted_tokens=batch.decoder.accepted,
            slot_bytes=stager.slot_bytes() if stager is not None else 0,
            over_slot_layers=stager.over_slot_layers if stager is not None else 0, micro_turns=batch.micro_turns,
            prefill_passes=batch.prefill_passes, constraint_cache_bytes=self._constraints.nbytes)

    # -- introspection (tests, the server's leak checks) ----------------------------------
    def resources(self, wait: bool = True) -> dict:
        """Live generations, pinned expert slots, reads in flight and open checkpoint files,
        counted on the compute thread (after the running generation, if any). ``wait=False``
        never waits: the live generation count, the rest as counted when the compute thread
        last finished a generation."""
        if not wait:
            return {**self._rt.resources, "generations": len(self._rt.jobs)}
        return self._worker.call(self._rt.count_resources)


def _open(model_dir: Path, config: EngineConfig, oracle, log) -> tuple[Streaming, object, object]:
    """The streaming model, its tokenizer and draft model, on the compute thread; none open if one fails."""
    streaming = load_streaming_model(model_dir, config, oracle=oracle, log=log)
    try:
        tokenizer = bnn.load_tokenizer(model_dir)
        return streaming, tokenizer, open_draft(config, tokenizer, streaming)
    except BaseException:
        streaming.close()
        raise


def _shutdown(worker: ComputeThread, streaming: Streaming, jobs: set) -> None:
    """Close an engine: stop its generations, free everything on its compute thread, give
    the thread back to the pool. Runs from ``Engine.close``, when the engine is garbage
    collected, or at exit."""
    for job in list(jobs):
        job.cancel()
    if worker.alive:
        try:
            worker.call(streaming.close)
        finally:
            release_thread(worker)
    else:
        streaming.close()


def generate(model_dir: str | Path, prompt: str | Sequence[int], config: EngineConfig | None = None,
             **sampling) -> str:
    """Synchronous helper: open ``model_dir``, generate, close; returns the text."""
    with Engine(model_dir, config) as engine:
        return engine.generate_text(prompt, **sampling)[0]
