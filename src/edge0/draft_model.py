"""Speculative decoding with a draft model (mlx-lm's ``--draft-model``).

``DraftModel``: a checkpoint mlx-lm opens (dense or MoE, every weight resident) whose
tokenizer maps every token as the model's does, computing as the model does (its
activations' dtype, Edge0's kernels where they run). Each sequence drafting with it has a
``ModelDrafter``: its own KV cache of the draft model, fed the sequence as it grows and
trimmed to what the verify passes took. Its drafts are greedy; the verify pass
(``edge0.decoding.Decoder.verify``) samples each position as a step would (the same random
stream) and takes a draft token where the sample equals it, so the tokens are those decoding
without drafts gives. How many it drafts adapts, and it pauses, as prompt lookup does
(``edge0.drafts``).
"""

from __future__ import annotations

from pathlib import Path

from edge0.backend import core as B
from edge0.backend import kernels as bk
from edge0.backend import nn as bnn
from edge0.drafts import BACKOFF_STEPS, MADE_AT_START, MAX_BACKOFF, adapt
from edge0.errors import ConfigError


class DraftModel:
    def __init__(self, path, tokenizer, compute_dtype: str = "float32", edge0_kernels: bool = False):
        """The checkpoint at ``path`` (mlx-lm's model class, every weight resident, every
        float cast to ``compute_dtype``, its quantized products on Edge0's kernels where
        ``edge0_kernels``), refused (``ConfigError``) where mlx-lm cannot open it or its
        tokenizer's vocabulary is not the model's (``tokenizer``)."""
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ConfigError(f"draft_model {self.path.name!r}: not a model directory (no config.json)")
        try:
            own = bnn.load_tokenizer(self.path)
            self.model = bnn.load_full_model(self.path)
            bnn.cast_model(self.model, B.dtype(compute_dtype))
            if edge0_kernels:
                bk.use_edge0(self.model)
            B.eval(self.model.parameters())
        except ConfigError:
            raise
        except Exception as e:  # mlx-lm's loader: any failure is this directory's
            raise ConfigError(f"draft_model {self.path.name!r}: mlx-lm cannot open it: {e}") from None
        if own.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"draft_model {self.path.name!r}: its tokenizer's vocabulary is not the model's "
                              "(a draft's tokens must be the model's)")
        # seconds a token without drafts and with them (running means over its generations, drafts.pace),
        # and whether drafting did not pay when last timed (its generations then start paused)
        self.step_time = self.draft_time = None
        self.unpaid = False

    def drafter(self, most: int) -> "ModelDrafter":
        """A sequence's drafter: at most ``most`` tokens a draft."""
        return ModelDrafter(self, most)


class ModelDrafter:
    """One sequence's drafts from a ``DraftModel``: its own cache of the draft model, fed
    the sequence (``follow``) as ``propose`` needs it, and trimmed to what a verify pass took
    (``accepted``)."""

    timed = True  # its drafts take time to make: the batch loop times what a token costs with them (drafts.pace)

    def __init__(self, draft: DraftModel, max_draft: int):
        self.draft, self.max_draft, self.k = draft, max_draft, max_draft
        self.cache = bnn.make_cache(draft.model)
        self.tokens: list[int] = []  # the sequence: the prompt, then what was generated
        self.valid = 0  # tokens at the cache's start that are the sequence's
        self.cached = 0  # tokens in the cache
        self.last = (0, 0)  # the last draft: (the sequence's length then, tokens drafted)
        self.misses, self.pause, self.backoff = 0, MAX_BACKOFF if draft.unpaid else 0, BACKOFF_STEPS
        self.made = MADE_AT_START  # the passes' running mean of tokens made (drafts.adapt)

    # what drafts.pace keeps: the draft model's, shared by the generations that draft with it
    step_time = property(lambda self: self.draft.step_time, lambda self, v: setattr(self.draft, "step_time", v))
    draft_time = property(lambda self: self.draft.draft_time, lambda self, v: setattr(self.draft, "draft_time", v))
    unpaid = property(lambda self: self.draft.unpaid, lambda self, v: setattr(self.draft, "unpaid", v))

    def follow(self, ids: list[int], generated: list[int]) -> None:
        seen = len(self.tokens)
        self.tokens.extend(ids[seen:] if seen < len(ids) else ())
        self.tokens.extend(generated[max(0, seen - len(ids)):])

    def ready(self) -> bool:
        return self.pause == 0 and bool(self.tokens)

    def propose(self) -> list[int]:
        if self.pause > 0:
            self.pause -= 1
            return []
        if not self.tokens:
            return []
        n = len(self.tokens)
        keep = min(self.valid, n - 1)  # the last token is the draft's first input: never in the cache before
        if self.cached > keep:
            bnn.trim_cache(self.cache, self.cached - keep)
        draft = bnn.draft_greedy(self.draft.model, self.cache, self.tokens[keep:n - 1], self.tokens[-1], self.k)
        self.valid, self.cached, self.last = n, n + len(draft) - 1, (n, len(draft))
        return draft

    def accepted(self, drafted: int, taken: int) -> None:
        n, made = self.last
        self.valid = n + min(taken, made - 1)  # the sequence's tokens the cache holds now
        adapt(self, drafted, taken)


def open_draft(config, tokenizer, streaming) -> DraftModel | None:
    """The engine's draft model (``config.draft_model``; None: none), checked against the
    model's ``tokenizer``, computing as the model's ``streaming`` does (its activations'
    dtype, its kernels); a ``ConfigError`` naming what is wrong."""
    if config.draft_model is None:
        return None
    if config.prompt_lookup:
        raise ConfigError("draft_model and prompt_lookup are two ways to draft: give one (a request may still ask "
                          "for prompt lookup with its prompt_lookup)")
    return DraftModel(config.draft_model, tokenizer, streaming.compute_dtype, streaming.kernels == "edge0")
