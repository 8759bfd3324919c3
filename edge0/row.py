"""One generation in the batch loop: its ``Row`` (prompt, sampling, cache, what it
generated), the ``TokenEvent``s it hands its consumer, and ``RowEvents``, which turns its
sampled tokens into those events (detokenizer, stops, logprobs, stats)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from dataclasses import dataclass, field

import numpy as np

from edge0.backend import core as B
from edge0.sampling import SamplingParams, StopMatcher
from edge0.stats import GenerationStats, peak_rss_bytes


@dataclass
class TokenEvent:
    """One generated token. ``stats`` is filled on the last event (finish_reason set)."""

    token: int
    text: str
    finish_reason: str | None = None  # "stop" (EOS or a stop token) or "length"
    stats: GenerationStats | None = field(default=None, repr=False)
    logprob: float | None = None  # with SamplingParams.logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # with SamplingParams.top_logprobs > 0


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
    pstate: object = None  # the prerouter's observations of this sequence (before it joins)
    seed: int | None = None  # its random stream's seed (params.seed, else drawn)
    sampler: object = None
    processors: list | None = None
    events: object = None  # its RowEvents, from the first token on
    error: BaseException | None = None
    alone: bool = False  # runs alone: nothing joins while it runs
    kv_quant: bool = False  # its KV cache is quantized once it holds quantized_kv_start tokens (it runs alone)
    passed_over: int = 0  # iterations with prefill budget in which its prompt got none
    arrival: int = field(default_factory=lambda: next(_ARRIVALS))  # the order rows were made in (edge0.prefill.order)

    def __post_init__(self):
        if self.seed is None:
            self.seed = self.params.seed if self.params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1

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
        self.t_first = self.bytes_first = None

    def event(self, token: int, logprobs) -> TokenEvent:
        row, stats, reads = self.row, self.stats, self.reads.stats
        n = len(row.generated)
        row.generated.append(token)
        now = time.perf_counter()
        if n == 0:
            self.t_first, self.bytes_first = now, reads.bytes
            stats.prefill_seconds = now - self.t0
            stats.prefill_expert_bytes = self.bytes_first - self.bytes0
        stats.generated_tokens = n + 1
        stats.decode_seconds = now - self.t_first
        stats.decode_expert_bytes = reads.bytes - self.bytes_first
        finish = "stop" if token in self.eos else "length" if n + 1 == row.max_tokens else None
        lp = _logprobs(token, logprobs, row.params)
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
        return TokenEvent(token, text, finish, stats, **lp)


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
