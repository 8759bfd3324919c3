"""Drafts for speculative decoding: by prompt lookup (the tokens that followed the last place
where the sequence's last n tokens occurred before, in the prompt or the text so far), or by
a draft model (mlx-lm's ``--draft-model``: a small model's greedy continuation).

``PromptLookup`` keeps, for each n in ``ngram_min..ngram_max`` (2 and 3 by default: a
single repeated token proposes mostly what is not taken), where each n-gram of the
sequence last ended, updated as tokens are appended (a few dictionary writes a token), so
a lookup costs the same after a prompt of 100,000 tokens as after one of 10. The longest
n that matches wins; a match proposes what followed it, at most ``k`` tokens. Until a pass
took one of a sequence's drafts, only matches of ``ngram_max`` tokens draft.

How many it proposes adapts to what the verify passes accepted: after a pass that took
every draft, one more (up to ``max_draft``); after one that took ``a`` of them, ``a + 1``.
A sequence whose drafts keep being rejected (``BACKOFF_AFTER`` passes in a row that took
none) stops drafting for a while (``BACKOFF_STEPS``, doubling while it goes on, reset by a
pass that took something), so text that does not repeat pays no verify pass.

A draft model's drafts: ``edge0.draft_model``. How many either drafts adapts, and where its
passes make too few tokens to pay for themselves it pauses (``adapt``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from edge0.errors import ConfigError

MAX_DRAFT = 16  # the most tokens a verify pass may check (a pass is that many positions plus one)
BACKOFF_AFTER = 3  # verify passes in a row that took no draft before drafting pauses
BACKOFF_STEPS = 8  # decode steps drafting pauses for the first time (doubling, at most MAX_BACKOFF)
MAX_BACKOFF = 256
PROBE_STEPS = 3  # steps a batch size's first verify pass is followed by, timed (``BatchPace``)


def check(max_draft: int, ngram_max: int, ngram_min: int = 2) -> None:
    """A ``ConfigError`` naming the value that is wrong."""
    for name, value in (("prompt_lookup (tokens drafted at most)", max_draft), ("prompt_lookup_ngram", ngram_max)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer, got {value!r:.40}")
    if not 1 <= max_draft <= MAX_DRAFT:
        raise ConfigError(f"prompt_lookup (tokens drafted at most) must be in 1..{MAX_DRAFT}, got {max_draft}")
    if not ngram_min <= ngram_max <= 8:
        raise ConfigError(f"prompt_lookup_ngram must be in {ngram_min}..8, got {ngram_max}")


def drafter_for(row, config, engine_drafts: bool, draft=None):
    """``row``'s drafter (None: it decodes without drafts): prompt lookup where its request's
    ``prompt_lookup``, else the engine's (``config``), asks for it; else the engine's draft
    model (``draft``, an ``edge0.draft_model.DraftModel``) unless the request's
    ``num_draft_tokens`` is 0. Only where a pass's
    extra positions can be trimmed off its cache and nothing steps with it a token at a time
    (``engine_drafts``: the engine's caches are plain KV caches, no pipeline's ranks, no
    oracle; the row: no constraint's matcher, routing recording, rotating or quantized
    cache)."""
    params = row.params
    most = config.prompt_lookup if params.prompt_lookup is None else params.prompt_lookup
    if (not engine_drafts or row.record is not None or params.max_kv_size is not None or row.kv_quant
            or row.constraint is not None):
        return None
    if most:
        return PromptLookup(most, config.prompt_lookup_ngram)
    tokens = config.num_draft_tokens if params.num_draft_tokens is None else params.num_draft_tokens
    return draft.drafter(tokens) if draft is not None and tokens else None


def check_request(params, draft) -> None:
    """A request's ``num_draft_tokens`` where the engine has no draft model: a ConfigError."""
    if params.num_draft_tokens and draft is None:
        raise ConfigError("num_draft_tokens: this engine has no draft model (open it with draft_model, "
                          "--draft-model DIR)")


MIN_TOKENS_A_PASS = 1.5  # a drafter whose passes make fewer on average pauses (``adapt``)
PACE = 0.3  # the weight of the newest pass in that average
MADE_AT_START = 2.5  # the average before any pass (three passes that take none bring it to 1.51)


def pace(d, seconds: float, tokens: int, drafted: bool) -> None:
    """A decode iteration of a sequence drafting with a draft model (``d``, its
    ``ModelDrafter``) took ``seconds`` for ``tokens``: with a draft, the draft model's tokens
    and the verify pass; without, a step. Each kind's time a token is kept as a running mean
    (the draft model's, over its generations); where drafting's exceeds a step's, the draft
    model is marked as not paying (``d.unpaid``) and drafting pauses for ``MAX_BACKOFF``
    steps, as a generation that starts then does (before any step was timed, drafting
    pauses for one, timed): a draft model whose drafts are taken too
    rarely for what it and the passes cost stops drafting. (Prompt lookup's drafts cost
    nothing to make: its pauses follow what the passes make, ``adapt``.)"""
    if tokens <= 0 or seconds <= 0:
        return
    now = seconds / tokens
    if not drafted:
        d.step_time = now if d.step_time is None else (1 - PACE) * d.step_time + PACE * now
        return
    d.draft_time = now if d.draft_time is None else (1 - PACE) * d.draft_time + PACE * now
    if d.step_time is None:  # nothing to weigh it against yet: the next iteration a step, timed
        d.pause = max(d.pause, 1)
        return
    d.unpaid = d.draft_time > d.step_time
    if d.unpaid:
        d.pause, d.misses, d.draft_time = MAX_BACKOFF, 0, None


class BatchPace:
    """Whether rows sharing a batch's steps draft: a verify pass of several rows pads the
    shorter drafts and stages every row's positions, so it costs more than the step it
    replaces, and a row whose draft is short or none makes its tokens slower than that step
    would. Drafting there must not slow any row down: the batch loop times each iteration
    of a batch of two rows or more (``record``), and for each batch size keeps the running
    means of the time a token of its slowest row takes (the fewest tokens a row made) with
    drafts and without (a step's only where the step before was one too: the first after a
    pass plans its reads when it starts). Where drafting's is the higher, drafting pauses
    for ``MAX_BACKOFF`` steps of that size, then is timed again; before steps of that size
    were timed, it pauses for ``PROBE_STEPS``. A row decoding alone is paced by its
    drafter (``adapt``, and ``pace`` for a draft model)."""

    def __init__(self):
        # batch size -> [a step's time a token, a pass's, steps left paused, whether its last was a pass]
        self._sizes: dict[int, list] = {}

    def allows(self, rows: int) -> bool:
        """Whether a batch of ``rows`` rows may draft now."""
        return rows < 2 or rows not in self._sizes or self._sizes[rows][2] == 0

    def record(self, rows: int, seconds: float, tokens: int, drafted: bool) -> None:
        """An iteration of a batch of ``rows`` rows took ``seconds``, with a verify pass
        (``drafted``) or a step, its slowest row making ``tokens`` tokens."""
        if rows < 2 or tokens <= 0 or seconds <= 0:
            return
        now = seconds / tokens
        size = self._sizes.setdefault(rows, [None, None, 0, False])
        mean = lambda old: now if old is None else (1 - PACE) * old + PACE * now  # noqa: E731
        after_pass, size[3] = size[3], drafted
        if not drafted:
            size[0] = size[0] if after_pass else mean(size[0])
            size[2] = max(0, size[2] - 1)
            return
        size[1] = mean(size[1])
        if size[0] is None:  # nothing to weigh it against yet: steps, timed
            size[2] = max(size[2], PROBE_STEPS)
        elif size[1] > size[0]:
            size[1], size[2] = None, MAX_BACKOFF


def adapt(d, drafted: int, taken: int) -> None:
    """After a verify pass of ``drafted`` tokens that took ``taken``: drafter ``d``'s next
    draft may hold one more after a pass that took every one (up to ``d.max_draft``), ``taken
    + 1`` after one that did not. Drafting pauses (``d.pause`` steps, ``d.backoff`` doubling
    while that goes on) after ``BACKOFF_AFTER`` passes in a row that took none, and where the
    passes' running mean of tokens made (``d.made``) falls under ``MIN_TOKENS_A_PASS``: a pass
    costs 1.45-1.6x a step at 1 to 4 drafts with heads on the configurations measured
    (docs/BENCHMARKS.md), so drafts taken that rarely do not pay for their passes."""
    d.k = min(d.max_draft, d.k + 1) if taken >= drafted else max(1, taken + 1)
    d.made = (1 - PACE) * d.made + PACE * (taken + 1)
    d.misses = 0 if taken else d.misses + 1
    if d.misses >= BACKOFF_AFTER or d.made < MIN_TOKENS_A_PASS:
        d.pause, d.misses, d.made = d.backoff, 0, MADE_AT_START
        d.backoff = min(MAX_BACKOFF, d.backoff * 2)
    elif taken:
        d.backoff = BACKOFF_STEPS


@dataclass
class PromptLookup:
    """One sequence's drafter: ``extend`` it with every token of the sequence (prompt, then
    each one generated), ``propose`` before a step, ``accepted`` after a verify pass."""

    timed: ClassVar[bool] = False  # its drafts cost nothing to make (``pace`` is for a draft model's)
    max_draft: int
    ngram_max: int = 3
    ngram_min: int = 2
    tokens: list[int] = field(default_factory=list)
    k: int = 0  # what the next proposal may hold (adapted)
    misses: int = 0  # verify passes in a row that took no draft
    pause: int = 0  # decode steps left without drafting
    backoff: int = BACKOFF_STEPS
    made: float = MADE_AT_START  # the verify passes' running mean of tokens made (``adapt``)
    trusted: bool = False  # a pass took one of its drafts: shorter matches than ngram_max may draft
    _ends: dict = field(default_factory=dict)  # (n-gram) -> the position after its latest occurrence

    def __post_init__(self):
        check(self.max_draft, self.ngram_max, self.ngram_min)
        self.k = self.k or min(self.max_draft, 4)

    def extend(self, tokens) -> None:
        """Append ``tokens`` to the sequence. The n-grams that end just before each new token
        become findable (the sequence's own last n-gram is never its own match)."""
        for t in tokens:
            seq, end = self.tokens, len(self.tokens)
            for n in range(self.ngram_min, self.ngram_max + 1):
                if end >= n:
                    self._ends[tuple(seq[end - n:end])] = end
            seq.append(int(t))

    def follow(self, ids: list[int], generated: list[int]) -> None:
        """Catch up with a sequence whose prompt is ``ids`` and text so far ``generated``
        (this drafter has seen a start of it)."""
        seen = len(self.tokens)
        if seen < len(ids):
            self.extend(ids[seen:])
            seen = len(ids)
        self.extend(generated[seen - len(ids):])

    def ready(self) -> bool:
        """Whether ``propose`` would propose a draft now (nothing changes)."""
        seq = self.tokens
        return self.pause == 0 and any(tuple(seq[len(seq) - n:]) in self._ends
                                       for n in range(self._shortest(), min(self.ngram_max, len(seq)) + 1))

    def _shortest(self) -> int:
        """The shortest match that drafts: ``ngram_max`` until a pass took a draft (in text
        that does not repeat, short runs recur by chance and their drafts are refused)."""
        return self.ngram_min if self.trusted else self.ngram_max

    def propose(self) -> list[int]:
        """The draft for the next step (empty: decode without one)."""
        if self.pause > 0:
            self.pause -= 1
            return []
        seq = self.tokens
        for n in range(min(self.ngram_max, len(seq)), self._shortest() - 1, -1):
            at = self._ends.get(tuple(seq[len(seq) - n:]))
            if at is not None:
                return seq[at:at + self.k]
        return []

    def accepted(self, drafted: int, taken: int) -> None:
        """After a verify pass of ``drafted`` tokens that took ``taken`` of them."""
        self.trusted = self.trusted or taken > 0
        adapt(self, drafted, taken)
