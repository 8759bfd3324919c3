"""What one generation asks for: length, sampling, stops, log-probabilities (of the
generated tokens, and with ``prompt_logprobs`` of the prompt's).

The names and meanings are mlx-lm's (``mlx_lm.generate`` and its server): a temperature
of 0 is greedy, and so is one below ``MIN_TEMP`` (1e-5: float32 logits divided by 1e-300
overflow to infinities, and mlx-lm then samples garbage, or a token a constraint masks); ``top_p`` 1, ``top_k`` 0 and ``min_p`` 0 switch those filters off;
``repetition_penalty`` scales down the logits of the last ``repetition_context_size``
tokens; ``presence_penalty`` subtracts a constant from the logit of each token among the
last ``presence_context_size``, ``frequency_penalty`` a constant times its count among the
last ``frequency_context_size`` (both in [-2, 2], the OpenAI range); ``logit_bias`` adds
a value in [-100, 100] to the logits of the token ids it names; ``response_format``
constrains the text to JSON (a JSON Schema's, with ``json_schema``) by masking the logits
(``edge0.constrain``). Every value is checked here, so a bad one is a ``ConfigError`` naming it before
anything runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from edge0.errors import ConfigError

MAX_TOKENS = 1_000_000
MAX_TOP_LOGPROBS = 20


def _int(name: str, value, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ConfigError(f"{name} must be an integer in {rng}, got {value!r}")


def _number(name: str, value, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> None:
    try:  # an integer past float's range (JSON allows 400 digits) is out of range, not a crash
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
              and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi))
    except OverflowError:
        ok = False
    if not ok:
        brackets = ("(" if lo_open else "[") + f"{lo:g}, {hi:g}" + (")" if hi_open else "]")
        raise ConfigError(f"{name} must be a number in {brackets}, got {value!r:.40}")


MIN_REPETITION_PENALTY = 0.01  # as far below 1 as the largest (100) is above it
MAX_LOGIT_BIAS_ENTRIES = 1024


def check_logit_bias(value) -> dict[int, float] | None:
    """``logit_bias``: token id -> additive bias in [-100, 100] (ids may be given as
    decimal strings, as JSON object keys are)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"logit_bias must be an object of token id -> bias, got {value!r:.60}")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ConfigError(f"logit_bias names {len(value)} tokens; at most {MAX_LOGIT_BIAS_ENTRIES}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        tok = key
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12:
            tok = int(key)
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise ConfigError(f"logit_bias keys must be token ids (non-negative integers), got {key!r:.40}")
        _number(f"logit_bias[{tok}]", bias, -100.0, 100.0)
        out[tok] = float(bias)
    return out or None


MIN_TEMP = 1e-5  # a smaller positive temperature samples greedily


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    seed: int | None = None
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    presence_context_size: int = 20
    frequency_penalty: float | None = None
    frequency_context_size: int = 20
    xtc_probability: float = 0.0  # mlx-lm's XTC: with this probability per step, drop the likeliest tokens
    xtc_threshold: float = 0.1  # above this probability (all but the least likely of them)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    stop_token_ids: tuple[int, ...] = ()  # extra end-of-generation tokens (the tokenizer's EOS always stops)
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one that appears
    logprobs: bool = False  # report each generated token's log-probability
    top_logprobs: int = 0  # and the n most likely tokens at each step
    # score the prompt: each prompt token's log-probability and the n most likely tokens at its
    # position, from the prefill's logits (None: not scored; edge0.prefill.score)
    prompt_logprobs: int | None = None
    max_kv_size: int | None = None  # a rotating KV cache of this many tokens (mlx-lm's --max-kv-size)
    response_format: dict | None = None  # OpenAI's: {"type": "json_object"} or a json_schema (edge0.constrain)
    grammar: str | None = None  # llguidance's Lark syntax the text must match (the server's forced tool calls)
    # speculative decoding by prompt lookup (edge0.drafts): at most this many tokens drafted a step from the
    # prompt and the text so far, checked in one verify pass; 0: off; None: the engine's prompt_lookup
    prompt_lookup: int | None = None
    # speculative decoding with the engine's draft model: at most this many tokens drafted a step; 0: off;
    # None: the engine's num_draft_tokens
    num_draft_tokens: int | None = None

    def __post_init__(self):
        _int("max_tokens", self.max_tokens, 1, MAX_TOKENS)
        _number("temp", self.temp, 0.0, 100.0)
        if 0.0 < self.temp < MIN_TEMP:
            object.__setattr__(self, "temp", 0.0)  # greedy: what such a temperature means, computed safely
        _number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _int("top_k", self.top_k, 0)
        _number("min_p", self.min_p, 0.0, 1.0, hi_open=True)
        _int("min_tokens_to_keep", self.min_tokens_to_keep, 1)
        if self.seed is not None:
            _int("seed", self.seed, 0, 2**63 - 1)
        if self.repetition_penalty is not None:
            _number("repetition_penalty", self.repetition_penalty, 0.0, 100.0, lo_open=True)
            if self.repetition_penalty < MIN_REPETITION_PENALTY:  # 1/p times a logit overflows to inf, then NaN
                raise ConfigError(f"repetition_penalty must be at least {MIN_REPETITION_PENALTY:g} (a smaller one "
                                  f"scales logits past float range), got {self.repetition_penalty!r}")
        _int("repetition_context_size", self.repetition_context_size, 1, 1 << 20)
        for name in ("presence", "frequency"):
            if getattr(self, f"{name}_penalty") is not None:
                _number(f"{name}_penalty", getattr(self, f"{name}_penalty"), -2.0, 2.0)
            _int(f"{name}_context_size", getattr(self, f"{name}_context_size"), 1, 1 << 20)
        _number("xtc_probability", self.xtc_probability, 0.0, 1.0)
        _number("xtc_threshold", self.xtc_threshold, 0.0, 0.5)
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise ConfigError(f"stop must be a list of non-empty strings, got {self.stop!r:.60}")
        object.__setattr__(self, "stop", tuple(stop))
        for t in self.stop_token_ids:
            _int("stop_token_ids entries", t, 0)
        if not isinstance(self.logprobs, bool):
            raise ConfigError(f"logprobs must be true or false, got {self.logprobs!r}")
        _int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.max_kv_size is not None:
            _int("max_kv_size", self.max_kv_size, 1)
        if self.prompt_lookup is not None:
            from edge0.drafts import MAX_DRAFT

            _int("prompt_lookup", self.prompt_lookup, 0, MAX_DRAFT)
        if self.num_draft_tokens is not None:
            from edge0.drafts import MAX_DRAFT

            _int("num_draft_tokens", self.num_draft_tokens, 0, MAX_DRAFT)
        if self.response_format is not None:
            from edge0.constrain import parse_response_format

            parse_response_format(self.response_format)  # the shape; the schema compiles with the tokenizer
        if self.grammar is not None and (not isinstance(self.grammar, str) or self.response_format is not None):
            raise ConfigError("grammar must be a string, and cannot be given with a response_format (one "
                              "constraint a generation)")

    def for_vocab(self, vocab: int | None) -> SamplingParams:
        """These parameters checked against a model's vocabulary: token ids inside it, and a
        ``top_k`` that keeps every token is no filter (0)."""
        if vocab is None:
            return self
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias token ids", self.logit_bias or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ConfigError(f"{name} {bad[:8]} are outside the vocabulary [0, {vocab})")
        return dataclasses.replace(self, top_k=0) if self.top_k >= vocab else self
