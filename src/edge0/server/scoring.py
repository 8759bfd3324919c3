"""What evaluation harnesses ask of completions (lm-evaluation-harness's ``local-completions``,
OpenAI's legacy API as vLLM answers it): the prompt scored (``echo``), a list of prompts in
one request, and ``n`` choices per prompt.

- ``echo``: the answer's text is the prompt's then the completion's; with ``logprobs: N``
  the prompt's tokens come first in ``choices[i].logprobs`` (``tokens``, ``token_logprobs``,
  ``top_logprobs``, ``text_offset``), the first with a null log-probability (nothing before
  it predicts it). The numbers are the engine's prefill logits read as ``edge0 eval`` reads
  text (``SamplingParams.prompt_logprobs``, ``edge0.prefill.score``). ``max_tokens: 0``
  (only with ``echo``) scores the prompt and generates nothing.
- ``prompt``: a string, token ids, or a list of strings or of token-id lists (at most
  ``MAX_CHOICES``), each answered as its own choice.
- ``n``: choices per prompt, ``index = prompt_i * n + j``; with a ``seed``, choice ``j``
  samples with ``seed + j`` (as vLLM seeds them), so a request asked twice gets the same
  choices and its choices differ from each other.
"""

from __future__ import annotations

import math
from typing import Any

from edge0.server import schema as S
from edge0.server.api_error import bad

MAX_CHOICES = 128  # prompts times n in one request: the generations it submits at once
IMPOSSIBLE_LOGPROB = -9999.0  # OpenAI's stand-in for log(0): JSON has no -Infinity


def prompt_room(prompt: Any, context: int | None) -> int:
    """The token ids a completion's ``prompt`` may hold beside the body's other values, the
    model's context per prompt; a 400 for a prompt of token ids longer than the context
    (before the body is walked: bounds first)."""
    if not isinstance(prompt, list):
        return 0
    lists = [p for p in prompt if isinstance(p, list)]
    if not lists:
        lists, where = [prompt], ["prompt"]
    else:
        where = [f"prompt[{i}]" for i, p in enumerate(prompt) if isinstance(p, list)]
    if len(lists) > MAX_CHOICES:
        raise bad(f"'prompt' holds {len(lists)} prompts; at most {MAX_CHOICES} in one request", "prompt")
    if context is not None:
        for name, ids in zip(where, lists):
            if len(ids) > context:
                raise bad(f"'{name}' holds {len(ids)} token ids, more than the model's context of {context} "
                          "tokens", "prompt")
    return (context or 0) * len(lists)


def prompts(prompt: Any, vocab_size: int | None) -> list[str | list[int]]:
    """A completion's prompts: one string or token-id list, or a list of strings or of
    token-id lists (one kind in one list), each non-empty."""
    if isinstance(prompt, list) and not prompt:
        raise bad("'prompt' must not be an empty list", "prompt")
    kinds = {"token ids" if _is_id(p) else type(p).__name__ for p in prompt} if isinstance(prompt, list) else set()
    if len(kinds) > 1 and kinds <= {"token ids", "str", "list"}:
        raise bad(f"'prompt' mixes {' and '.join(sorted(k if k == 'token ids' else k + 's' for k in kinds))}: a "
                  "list of prompts holds one kind (strings, or lists of token ids)", "prompt")
    if isinstance(prompt, str) or kinds == {"token ids"}:
        out, single = [prompt], True
    elif kinds in ({"str"}, {"list"}):
        out, single = list(prompt), False
    else:
        raise bad("'prompt' must be a non-empty string, a list of token ids, or a list of those (one kind)", "prompt")
    if len(out) > MAX_CHOICES:
        raise bad(f"'prompt' holds {len(out)} prompts; at most {MAX_CHOICES} in one request", "prompt")
    for i, p in enumerate(out):
        name = "prompt" if single else f"prompt[{i}]"
        if not p:
            raise bad(f"'{name}' must not be empty", "prompt")
        if isinstance(p, list) and not all(_is_id(t) for t in p):
            raise bad(f"'{name}' must be a list of token ids (integers)", "prompt")
        if isinstance(p, list) and vocab_size is not None and any(not 0 <= t < vocab_size for t in p):
            raise bad(f"'{name}' token ids must be in [0, {vocab_size})", "prompt")
    return out


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def check_choices(n: int, prompts_given: int) -> None:
    if n * prompts_given > MAX_CHOICES:
        raise bad(f"{prompts_given} prompts with 'n' {n} ask for {n * prompts_given} choices; at most "
                  f"{MAX_CHOICES} in one request", "n")


def choice_seed(seed: int | None, j: int) -> int | None:
    """The seed choice ``j`` of a prompt samples with (None: each draws its own)."""
    return None if seed is None else (seed + j) % (1 << 63)


def echoed(tokenizer, ids: list[int], scores: list | None) -> S.CompletionLogprobs:
    """The prompt's part of an echoed answer's legacy logprobs: its tokens, with
    ``scores`` (``TokenEvent.prompt_logprobs``) their log-probabilities and most likely
    tokens (the first token's null); without, tokens only (the caller asked no logprobs)."""
    tokens = [tokenizer.decode([i]) for i in ids]
    lps: list[float | None] = [None] * len(ids)
    tops: list[dict | None] = [None] * len(ids)
    for i, entry in enumerate(scores or ()):
        if entry is not None:
            lps[i] = _finite(entry[0])
            tops[i] = {tokenizer.decode([t]): _finite(lp) for t, lp in entry[1]}
    return S.CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops, text_offset=[])


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else IMPOSSIBLE_LOGPROB
