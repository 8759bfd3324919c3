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
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Iterator, Sequence

import anyio

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.checkpoint import CheckpointIndex, refuse_unsafe
from edge0.config import PATHS, PHASES, EngineConfig
from edge0.errors import ConfigError
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
    spec = spec_from_config(raw)
    index = CheckpointIndex(model_dir, spec, raw)
    layers = list(spec.moe_layers)
    for layer, _, _ in config.layer_paths:
        if layer not in layers:
            raise ConfigError(f"layer_paths names layer {layer}, which is not a MoE layer; MoE layers: {layers}")
    if oracle is None and config.oracle_file and config.staged_source != "prerouter":
        oracle = OracleRouting.load(config.oracle_file)
    heads, heads_meta = _load_heads(model_dir, config, oracle)
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
    reader = ExpertReader(index, threads=config.reader_threads)
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


def _load_heads(model_dir: Path, config: EngineConfig, oracle):
    """The prerouter heads to use, or (None, None)."""
    if config.prerouter == "off" or config.staged_source == "oracle" or (
            config.staged_source == "auto" and oracle is not None):
        return None, None
    path = Path(config.prerouter_file) if config.prerouter_file else model_dir / HEADS_FILENAME
    if not path.exists():
        if config.prerouter == "on" or config.staged_source == "prerouter" or config.prerouter_file:
            raise ConfigError(f"prerouter heads {path} do not exist (train them with `edge0 train heads`)")
        return None, None
    return load_heads(path, model_dir)


class Engine:
    """A streaming MoE model ready to generate. Use ``Engine.open`` from async code."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, *,
                 oracle: OracleRouting | None = None):
        self.model_dir = Path(model_dir)
        self.config = config or EngineConfig()
        configure_logs(self.config.log_format, self.config.log_level)
        self.log = get_logger("edge0")
        self.streaming = load_streaming_model(self.model_dir, self.config, oracle=oracle, log=self.log)
        self.model, self.spec, self.index = self.streaming.model, self.streaming.spec, self.streaming.index
        self.reader = self.streaming.reader
        self._step_model = StepModel(self.streaming)
        self.tokenizer = bnn.load_tokenizer(self.model_dir)
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge0-compute")
        self._lock = anyio.Lock()
        self._closed = False

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
        if not self._closed:
            self._closed = True
            self._compute.shutdown(wait=True)
            self.streaming.close()

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

    def stream(self, prompt: str | Sequence[int], **sampling) -> Iterator[TokenEvent]:
        """Synchronous token stream (runs in the calling thread)."""
        if self._closed:
            raise ConfigError("the engine is closed")
        params = SamplingParams(**sampling)
        ids = self.encode(prompt)
        if params.seed is not None:
            B.seed(params.seed)
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
        t_first = bytes_first = None
        token = None
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
                finish = None
                if token in eos:
                    finish = "stop"
                elif n + 1 == params.max_tokens:
                    finish = "length"
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

    async def generate(self, prompt: str | Sequence[int], **sampling) -> AsyncIterator[TokenEvent]:
        """Async token stream: each step runs on the engine's compute thread."""
        async with self._lock:
            gen = self.stream(prompt, **sampling)
            try:
                while True:
                    future = self._compute.submit(next, gen, None)
                    event = await anyio.to_thread.run_sync(future.result, abandon_on_cancel=True)
                    if event is None:
                        return
                    yield event
                    if event.finish_reason is not None:
                        return
            finally:
                # Runs after any in-flight step, on the same thread; never leaves work behind.
                closing = self._compute.submit(gen.close)
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(closing.result)

    def record_routing(self, prompt: str | Sequence[int], **sampling) -> OracleRouting:
        """Run a generation on the exact path and return its per-step routing (the oracle)."""
        rec = RoutingRecorder()
        self.streaming.recorder = self.streaming.exact.recorder = rec
        try:
            for _ in self.stream(prompt, **sampling):
                pass
        finally:
            self.streaming.recorder = self.streaming.exact.recorder = None
        return rec.routing(str(self.model_dir))

    def generate_text(self, prompt: str | Sequence[int], **sampling) -> tuple[str, GenerationStats]:
        text, stats = [], None
        for event in self.stream(prompt, **sampling):
            text.append(event.text)
            stats = event.stats or stats
        return "".join(text), stats


def generate(model_dir: str | Path, prompt: str | Sequence[int], config: EngineConfig | None = None,
             **sampling) -> str:
    """Synchronous helper: open ``model_dir``, generate, close; returns the text."""
    with Engine(model_dir, config) as engine:
        return engine.generate_text(prompt, **sampling)[0]
