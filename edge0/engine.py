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
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Iterator, Sequence

import anyio

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.checkpoint import CheckpointIndex, check_half_dtypes, max_dimension, read_headers, refuse_unsafe
from edge0.config_check import check_quantization, check_values, layer_bound
from edge0.model_files import check_entry
from edge0.config import PATHS, PHASES, EngineConfig
from edge0.errors import ConfigError, ExpertReadError
from edge0.exec.exact import ExactExecutor
from edge0.exec.hot import HotExecutor
from edge0.exec.moe_layer import StreamingMoE
from edge0.exec.oracle import OracleRouting, RoutingRecorder
from edge0.exec.staged import StagedExecutor, Stager
from edge0.exec.whole_layer import WholeLayerExecutor
from edge0.prerouter.files import HEADS_FILENAME, load_heads
from edge0.prerouter.runtime import Prerouter
from edge0.io_sched.reader import ExpertReader
from edge0.logs import configure as configure_logs
from edge0.logs import get_logger
from edge0.routing import make_route_fn
from edge0.spec import load_config, spec_from_config
from edge0.stats import GenerationStats, peak_rss_bytes
from edge0.worker import END, ComputeThread, Job
from edge0.worker import acquire as acquire_thread
from edge0.worker import release as release_thread


@dataclass
class TokenEvent:
    """One generated token. ``stats`` is filled on the last event (finish_reason set)."""

    token: int
    text: str
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stats: GenerationStats | None = field(default=None, repr=False)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= 1_000_000:
            raise ConfigError(f"max_tokens must be an integer in 1..1000000, got {self.max_tokens!r}")
        if not isinstance(self.temp, (int, float)) or not 0.0 <= self.temp <= 100.0:
            raise ConfigError(f"temp must be a number in [0, 100], got {self.temp!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")


class Streaming:
    """A loaded streaming model and the machinery behind its MoE layers."""

    def __init__(self, model, spec, index, reader, exact, hot, whole, stager, recorder, prerouter=None,
                 heads_meta=None):
        self.model, self.spec, self.index, self.reader = model, spec, index, reader
        self.exact, self.hot, self.whole, self.stager, self.recorder = exact, hot, whole, stager, recorder
        self.prerouter, self.heads_meta = prerouter, heads_meta

    def blocks(self) -> dict:
        """MoE layer -> its StreamingMoE."""
        return {l: bnn.module_at(self.model, self.spec.block_path(l)) for l in self.spec.moe_layers}

    def begin_step(self, inputs) -> None:
        """Called before every forward pass (the step hook)."""
        if self.recorder is not None:
            self.recorder.begin_step(inputs.shape[-1])
        if self.stager is not None:
            self.stager.begin_step(inputs)

    def invalidate(self) -> None:
        """Forget every expert cached in slots, hot sets and whole-layer buffers."""
        for cache in (self.stager, self.hot, self.whole):
            if cache is not None:
                cache.invalidate()

    def check_files(self, log=None) -> None:
        """Before a generation: a shard changed in place since the last one (size or
        modification time) invalidates what was cached from it; a changed header raises."""
        changed = self.reader.changed_files()
        if changed:
            if log is not None:
                log.warning("checkpoint.changed", files=changed, action="cached experts invalidated")
            self.invalidate()

    def pinned_slots(self) -> int:
        return sum(c.pinned_slots() for c in (self.stager, self.hot) if c is not None)

    def close(self) -> None:
        try:
            if self.stager is not None:
                self.stager.close()
            if self.whole is not None:
                self.whole.close()
        finally:
            self.reader.close()


class StepModel:
    """The model as mlx-lm's generation loop sees it, with Edge0's step hook in front."""

    def __init__(self, streaming: Streaming):
        self._streaming = streaming

    def __call__(self, inputs, cache=None, **kwargs):
        self._streaming.begin_step(inputs)
        return self._streaming.model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self._streaming.model, name)


def _check_budget(spec, index, config: EngineConfig, staged, hot, whole) -> None:
    per_expert = max(le.expert_bytes for le in index.layers.values())
    parts = {"exact bundle": config.bundle_capacity * per_expert}
    if staged:
        parts["staged slots"] = len(staged) * max(config.slots_per_layer or 2 * spec.k, spec.k) * per_expert
    if hot:
        parts["hot sets"] = len(hot) * max(config.hot_experts, spec.k) * per_expert
    if whole:
        parts["whole-layer buffers"] = 2 * spec.num_experts * per_expert
    total = sum(parts.values())
    if config.memory_budget_mb is not None and total > config.memory_budget_mb * 2**20:
        detail = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in parts.items())
        raise ConfigError(f"expert buffers need {total / 2**20:.1f} MiB ({detail}), over memory_budget_mb="
                          f"{config.memory_budget_mb}")


def load_streaming_model(model_dir: str | Path, config: EngineConfig, *, oracle: OracleRouting | None = None,
                         record: bool = False, log=None) -> Streaming:
    """Open ``model_dir`` for streaming: resident model, index, reader and executor paths."""
    model_dir = Path(model_dir)
    raw = load_config(model_dir)
    refuse_unsafe(model_dir, raw)
    check_quantization(raw)
    headers = read_headers(model_dir)
    check_values(raw, bnn.arg_annotations(raw), max_dim=max_dimension(headers),
                 layers=layer_bound(name for h in headers for name in h.tensors))
    check_half_dtypes(headers)
    spec = spec_from_config(raw)
    index = CheckpointIndex(model_dir, spec, raw, headers=headers)
    layers = list(spec.moe_layers)
    for layer, _, _ in config.layer_paths:
        if layer not in layers:
            raise ConfigError(f"layer_paths names layer {layer}, which is not a MoE layer; MoE layers: {layers}")
    if oracle is None and config.oracle_file and config.staged_source != "prerouter":
        oracle = OracleRouting.load(config.oracle_file)
    if oracle is not None:
        oracle.check(spec.moe_layers, spec.num_experts)
    heads, heads_meta = _load_heads(model_dir, config, oracle, spec)
    decode_paths = {l: config.path_for(l, "decode") for l in layers}
    if heads is not None:
        explicit = {l for l, ph, _ in config.layer_paths if ph == "decode"}
        for l in heads.consumers():
            if l in decode_paths and l not in explicit:
                decode_paths[l] = "staged"
        unpredicted = [l for l, p in decode_paths.items() if p == "staged" and l not in heads.consumers()]
        if unpredicted:
            raise ConfigError(f"layers {unpredicted} decode staged but no prerouter head predicts them "
                              f"(heads predict {heads.consumers()})")
    path_of = {(l, "decode"): decode_paths[l] for l in layers}
    path_of.update({(l, "prefill"): config.path_for(l, "prefill") for l in layers})
    on = {p: [l for l in layers if p in (path_of[l, "prefill"], path_of[l, "decode"])] for p in PATHS}
    _check_budget(spec, index, config, on["staged"], on["hot"], on["whole_layer"])
    reader = ExpertReader(index, threads=config.reader_threads, log=log)
    stager = None
    try:
        exact = ExactExecutor(index, reader, config.bundle_capacity)
        recorder = RoutingRecorder() if record else None
        exact.recorder = recorder
        hot = HotExecutor(index, reader, config.hot_experts, exact, log=log) if on["hot"] else None
        whole = WholeLayerExecutor(index, reader, on["whole_layer"], log=log) if on["whole_layer"] else None
        route = make_route_fn(spec)
        bias_of: dict[int, object] = {}
        heads_dtype = config.prerouter_dtype
        if heads_dtype == "auto":
            heads_dtype = "float32" if B.is_cpu() else "float16"
        prerouter = (Prerouter(heads, route, lambda l: bias_of.get(l), dtype=B.dtype(heads_dtype))
                     if heads is not None else None)
        if on["staged"]:
            stager = Stager(index, on["staged"], config.slots_per_layer or 2 * spec.k, reader,
                            None if prerouter is not None else oracle,
                            readers=config.reader_threads, prefetch_depth=config.prefetch_depth, log=log,
                            prerouter=prerouter, fallback=exact, guard_every=config.guard_every)
        paths = {"exact": exact, "hot": hot, "whole_layer": whole,
                 "staged": StagedExecutor(stager) if stager is not None else None}

        def replace_blocks(model):
            for layer in layers:
                path = spec.block_path(layer)
                original = bnn.module_at(model, path)
                if original is None or "switch_mlp" not in original:
                    raise ConfigError(f"{spec.model_type}: expected a MoE block at {path!r}; config.json and "
                                      "mlx-lm's model class disagree about which layers are MoE")
                executors = {ph: paths[path_of[layer, ph]] for ph in PHASES}
                bnn.set_module_at(model, path, StreamingMoE(spec, layer, original, route, executors))

        model = bnn.load_resident(model_dir, raw, index.files, spec.is_expert_key, replace_blocks,
                                  B.dtype(config.compute_dtype))
    except BaseException:
        if stager is not None:
            stager.close()
        reader.close()
        raise
    streaming = Streaming(model, spec, index, reader, exact, hot, whole, stager, recorder, prerouter, heads_meta)
    if prerouter is not None:
        blocks = streaming.blocks()
        for l, block in blocks.items():
            if spec.router_bias_attr:
                bias_of[l] = getattr(block.gate, spec.router_bias_attr)
            if l in prerouter.owners:
                block.observer = prerouter.observe
            if stager is not None and l in stager.layers:
                block.planned = stager.planned_routing
                block.guard = stager
    return streaming


def _load_heads(model_dir: Path, config: EngineConfig, oracle, spec):
    """The prerouter heads to use, or (None, None)."""
    if config.prerouter == "off" or config.staged_source == "oracle" or (
            config.staged_source == "auto" and oracle is not None):
        return None, None
    path = Path(config.prerouter_file) if config.prerouter_file else model_dir / HEADS_FILENAME
    if not path.exists():
        if config.prerouter == "on" or config.staged_source == "prerouter" or config.prerouter_file:
            raise ConfigError(f"prerouter heads {path} do not exist (train them with `edge0 train heads`)")
        return None, None
    if not config.prerouter_file:
        check_entry(model_dir, HEADS_FILENAME)
    return load_heads(path, model_dir, spec=spec)


class Engine:
    """A streaming MoE model ready to generate. Use ``Engine.open`` from async code.

    Every MLX call of an engine runs on its compute thread (``edge0.worker``); generations
    are jobs that thread runs one at a time, in submission order, so concurrent callers
    wait their turn and a consumer may leave at any point without disturbing the next."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, *,
                 oracle: OracleRouting | None = None):
        self.model_dir = Path(model_dir)
        self.config = config or EngineConfig()
        configure_logs(self.config.log_format, self.config.log_level)
        self.log = get_logger("edge0")
        self._worker = acquire_thread()
        self._closed = False
        try:
            self.streaming, self.tokenizer = self._worker.call(_open, self.model_dir, self.config, oracle, self.log)
        except BaseException:
            release_thread(self._worker)
            raise
        self.model, self.spec, self.index = self.streaming.model, self.streaming.spec, self.streaming.index
        self.reader = self.streaming.reader
        self._step_model = StepModel(self.streaming)
        self._jobs: set[Job] = set()
        # closes the engine if it is garbage collected or still open at exit
        self._finalizer = weakref.finalize(self, _shutdown, self._worker, self.streaming, self._jobs)

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
            self._finalizer()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- generation -----------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
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

    def _submit(self, prompt, sampling: dict, record: RoutingRecorder | None = None) -> Job:
        """Validate, then queue a generation job on the compute thread."""
        if self._closed:
            raise ConfigError("the engine is closed")
        params = SamplingParams(**sampling)
        ids = self.encode(prompt)
        job = Job()
        self._jobs.add(job)
        self._worker.submit(self._run, job, ids, params, record)
        return job

    def stream(self, prompt: str | Sequence[int], **sampling) -> Iterator[TokenEvent]:
        """Synchronous token stream. Leaving the loop early stops the generation."""
        job = self._submit(prompt, sampling)
        try:
            while (event := job.get()) is not END:
                yield event
            if job.error is not None:
                raise job.error
        finally:
            job.cancel()

    async def generate(self, prompt: str | Sequence[int], **sampling) -> AsyncIterator[TokenEvent]:
        """Async token stream; the event loop is never blocked by compute or reads.

        Leaving it by any route (``break``, an exception, cancellation, ``aclosing``, the
        generator being garbage collected) stops the generation: the compute thread
        closes it by itself, and the next generation starts from a clean state."""
        job = self._submit(prompt, sampling)
        try:
            while True:
                event = job.poll()
                if event is None:
                    event = await anyio.to_thread.run_sync(job.get, abandon_on_cancel=True)
                if event is END:
                    break
                yield event
            if job.error is not None:
                raise job.error
        finally:
            job.cancel()  # wakes a reader thread abandoned by a cancellation, too

    def _run(self, job: Job, ids: list[int], params: SamplingParams, record) -> None:
        """One generation, on the compute thread."""
        error = None
        try:
            if job.cancelled:
                return
            self.streaming.check_files(self.log)
            steps = self._steps(ids, params, record)
            try:
                for event in steps:
                    if not job.put(event):
                        break
            finally:
                steps.close()
        except BaseException as e:
            error = e
            if isinstance(e, ExpertReadError):
                self._after_read_error(e)
        finally:
            self._jobs.discard(job)
            try:
                self._end_generation()
            finally:
                job.finish(error)

    def _after_read_error(self, e: ExpertReadError) -> None:
        """What was read from a file that just failed may not match it: forget it all."""
        self.log.warning("io.read_failed", error=str(e), action="cached experts invalidated")
        self._end_generation()
        self.streaming.invalidate()

    def _end_generation(self) -> None:
        """Cancel what a generation left in flight and unpin its slots."""
        stager = self.streaming.stager
        if stager is not None:
            stager.reset(keep_report=True)
        if self.streaming.recorder is not None:
            self.streaming.recorder = self.streaming.exact.recorder = None

    def _steps(self, ids: list[int], params: SamplingParams, record) -> Iterator[TokenEvent]:
        if params.seed is not None:
            B.seed(params.seed)
        if record is not None:
            self.streaming.recorder = self.streaming.exact.recorder = record
        detok = self.tokenizer.detokenizer
        detok.reset()
        eos = set(self.tokenizer.eos_token_ids)
        stats = GenerationStats(prompt_tokens=len(ids))
        reads = self.reader.stats
        bytes0, wait0 = reads.bytes, reads.seconds
        stager = self.streaming.stager
        if stager is not None:
            stager.reset()
            stall0, steps0 = stager.stall_seconds, stager.steps_run
        t0 = time.perf_counter()
        steps = bnn.generate_step(ids, self._step_model, max_tokens=params.max_tokens, temp=params.temp,
                                  top_p=params.top_p, prefill_step_size=self.config.prefill_step_size)
        t_first = None
        try:
            for n, (token, _) in enumerate(steps):
                now = time.perf_counter()
                if n == 0:
                    t_first, bytes_first = now, reads.bytes
                    stats.prefill_seconds = now - t0
                    stats.prefill_expert_bytes = bytes_first - bytes0
                stats.generated_tokens = n + 1
                stats.decode_seconds = now - t_first
                stats.decode_expert_bytes = reads.bytes - bytes_first
                finish = "stop" if token in eos else "length" if n + 1 == params.max_tokens else None
                if finish is None:
                    detok.add_token(token)
                    yield TokenEvent(token, detok.last_segment)
                    continue
                if finish == "length":
                    detok.add_token(token)
                detok.finalize()
                stats.read_wait_seconds = reads.seconds - wait0
                if stager is not None and stager.steps_run > steps0:
                    stats.stall_ms_per_step = 1e3 * (stager.stall_seconds - stall0) / (stager.steps_run - steps0)
                if stager is not None and stager.guard_recall:
                    stats.guard_recall = {l: sum(v) / len(v) for l, v in stager.guard_recall.items()}
                stats.peak_active_memory = B.peak_memory()
                stats.peak_rss = peak_rss_bytes()
                yield TokenEvent(token, detok.last_segment, finish, stats)
                return
        finally:
            steps.close()

    def record_routing(self, prompt: str | Sequence[int], **sampling) -> OracleRouting:
        """Run a generation on the exact path and return its per-step routing (the oracle)."""
        rec = RoutingRecorder()
        job = self._submit(prompt, sampling, record=rec)
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

    # -- introspection (tests, the server's leak checks) ----------------------------------
    def resources(self) -> dict:
        """Live generations, pinned expert slots, reads in flight and open checkpoint files."""
        def count():
            stager = self.streaming.stager
            return {"generations": len(self._jobs), "pinned_slots": self.streaming.pinned_slots(),
                    "pending_reads": stager.pending_reads() if stager is not None else 0,
                    "open_files": self.reader.open_files}
        return self._worker.call(count)


def _open(model_dir: Path, config: EngineConfig, oracle, log) -> tuple[Streaming, object]:
    """Load the streaming model and the tokenizer (on the compute thread); nothing stays
    open when either fails."""
    streaming = load_streaming_model(model_dir, config, oracle=oracle, log=log)
    try:
        return streaming, bnn.load_tokenizer(model_dir)
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
