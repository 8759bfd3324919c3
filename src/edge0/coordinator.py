"""Who decides what the batch loop does: one process alone (``Local``), or the ranks of a
pipeline in step (``Piped``: rank 0 decides each iteration, the others follow; every rank
samples, ends and counts alike). The engine chooses one when it opens; the batch loop, the
prefill and the engine ask it instead of checking whether there is a pipeline."""

from __future__ import annotations

import dataclasses

from edge0.errors import ConfigError, DistributedError


class NotAskedFor(DistributedError):
    """A rank after the first was not asked for what rank 0 started; ``rows``: what waited
    on this rank, failed with it."""

    def __init__(self, rows: list, message: str):
        super().__init__(message)
        self.rows = rows


class Local:
    """One process: it admits what it is asked for, and nothing waits on another rank."""

    pipeline = None
    leads = True  # admits generations and answers for them (prints, serves)
    prefill_together = True  # short prompts arriving together may prefill in one pass, chunks wait their share
    token_wait_s: float | None = None  # how long a consumer waits for a token (None: no bound)
    plans_ahead = True  # a decode step plans the next at its end (a pipeline's ranks relay each step's tokens first)
    drafts = True  # a generation may decode with drafts (a pipeline's ranks step together a token at a time)

    def agree(self, waiting, joining: list, decoding: list, admitted: list,
              micro_ready: bool) -> tuple[list, dict | None, bool]:
        """(the iteration's admitted rows, the cancel flags of the earlier rows by ``id``
        (None: each row's own), whether the batch decodes in micro-batches). ``waiting``:
        the line not started yet (``edge0.batch.Waiting``); ``joining``, ``decoding``: the
        rows prefilling and decoding; ``admitted``: what this process admitted (rank 0);
        ``micro_ready``: whether the batch could decode in micro-batches."""
        return admitted, None, False

    def typed(self, error: BaseException) -> BaseException:
        return error

    def has_heads(self, streaming) -> bool:
        """Whether prerouter heads run (on any rank)."""
        return streaming.prerouter is not None

    def unseen(self, streaming, row) -> bool:
        """Whether the heads have observed nothing of ``row``'s sequence."""
        pre = streaming.prerouter
        return pre is not None and (row.heads is None or not row.heads.seen(pre.owners))

    def whole(self, nbytes: int) -> int:
        """A prompt cache entry's bytes as the whole model's (every rank keeps and evicts alike)."""
        return nbytes

    def params(self, params):
        """A generation's sampling as every rank must draw it."""
        return params

    def ends_unread(self) -> bool:
        """Whether a row whose consumer took no token leaves the batch at once."""
        return True

    def finish_stats(self, stats) -> None:
        """A generation's last stats, as the whole model's (one exchange under a pipeline)."""

    def refuse_given_cache(self) -> None:
        """A given prompt cache (``Engine.stream(prompt_cache=)``) runs here."""

    def close(self, worker, lost: bool) -> None:
        """The engine closes."""

    def lead(self) -> None:
        """``Engine.lead()``: from now on rank 0 hands each generation it starts to the others."""
        raise ConfigError("Engine.lead() is for rank 0 of a pipeline (under mlx.launch)")

    def check_follows(self) -> None:
        """``Engine.follow()`` is for the ranks after the first."""
        raise ConfigError("Engine.follow() is for the ranks after the first of a pipeline (under mlx.launch)")

    def lost(self, seconds: float) -> DistributedError:
        return DistributedError(f"no token for {seconds:g} s")


class Piped(Local):
    """A rank of a pipeline (``edge0.exec.pipeline``): rank 0's batch loop decides each
    iteration (what it admits, which rows were cancelled, micro-batches) and the other ranks
    run the same iteration."""

    prefill_together = False
    plans_ahead = False
    drafts = False

    def __init__(self, pipeline, config):
        self.pipeline, self.config = pipeline, config
        self.leads = pipeline.rank == 0
        self.token_wait_s = config.pipeline_timeout_s

    def agree(self, waiting, joining: list, decoding: list, admitted: list,
              micro_ready: bool) -> tuple[list, dict | None, bool]:
        """Rank 0 tells the other ranks what this iteration admits (``admitted``, its own) and
        which of the rows already in the batch it cancelled; the others admit the same
        generations (the next ones submitted to them, waiting for them where they are not
        submitted yet: ``NotAskedFor`` when they are not within half the pipeline's bound)
        and whether the batch decodes in micro-batches."""
        pipe = self.pipeline
        prior = [r for r in joining if r not in admitted] + decoding
        if pipe.rank == 0:
            specs = [r.spec() for r in admitted] if pipe.leading and admitted else None
            flags = [r.job.cancelled for r in prior]
            micro = (self.config.pipeline_micro_batches == 2 and not admitted and not joining
                     and not len(waiting) and not any(flags) and micro_ready)
            schedule = pipe.schedule(flags, len(admitted), specs, micro=micro)
            return admitted, self.cancelled(schedule, prior), micro
        schedule = pipe.schedule()
        cancelled = self.cancelled(schedule, prior)
        bound = self.config.pipeline_timeout_s / 2  # within the generations' own bound, so that this says why
        if not waiting.wait_for(schedule.admitted, bound):
            raise NotAskedFor(waiting.take_all(),
                              f"rank 0 started {schedule.admitted} generations this rank was not asked for within "
                              f"{bound:g} s: every rank must ask for the same generations in the same order")
        return waiting.take(schedule.admitted), cancelled, schedule.micro

    @staticmethod
    def cancelled(schedule, prior: list) -> dict[int, bool]:
        """The schedule's cancel flags by row of ``prior`` (the rows before this iteration's
        admissions); a row rank 0 cancelled is cancelled here too."""
        if len(schedule.cancelled) != len(prior):
            raise DistributedError(f"rank 0's batch holds {len(schedule.cancelled)} generations, this rank's "
                                   f"{len(prior)}: every rank must ask for the same generations in the same order")
        for row, flag in zip(prior, schedule.cancelled):
            if flag and not row.job.cancelled:
                row.job.cancel()
        return {id(r): flag for r, flag in zip(prior, schedule.cancelled)}

    def typed(self, error: BaseException) -> BaseException:
        """MLX's RuntimeError of a transfer (a rank gone, the link broken) as a
        ``DistributedError`` naming this rank's pipeline."""
        if not isinstance(error, RuntimeError):
            return error
        pipe = self.pipeline
        typed = DistributedError(f"rank {pipe.rank} of the {pipe.layout.describe()}: {error} (another rank stopped "
                                 "or the link between them broke)")
        typed.__cause__ = error
        return typed

    def has_heads(self, streaming) -> bool:
        return self.pipeline.heads is not None

    def unseen(self, streaming, row) -> bool:
        # every rank must decide alike, also one that runs no head: whether the model has
        # heads and none of the row's prompt was forwarded (what the heads observe)
        return self.has_heads(streaming) and row.pos == row.cached

    def whole(self, nbytes: int) -> int:
        return sum(v for (v,) in self.pipeline.gather([nbytes]))

    def params(self, params):
        if params.prompt_logprobs is not None:
            raise ConfigError("prompt_logprobs cannot be scored under a pipeline: its pass ends with the last "
                              "position's logits only")
        if params.seed is None:  # every rank samples alike
            params = dataclasses.replace(params, seed=self.pipeline.next_seed())
        return params

    def ends_unread(self) -> bool:
        return False  # the ranks drop it together, at the next boundary

    def finish_stats(self, stats) -> None:
        pipe = self.pipeline  # every rank ends the generation at this token: one exchange
        stats.pipeline = pipe.layout.describe()
        per_rank = pipe.gather([stats.prefill_expert_bytes, stats.decode_expert_bytes])
        stats.rank_expert_bytes = [d for _, d in per_rank]
        stats.prefill_expert_bytes = sum(p for p, _ in per_rank)
        stats.decode_expert_bytes = sum(stats.rank_expert_bytes)

    def refuse_given_cache(self) -> None:
        raise ConfigError("a given prompt cache cannot start a pipeline's generation (each rank holds its layers)")

    def close(self, worker, lost: bool) -> None:
        pipe = self.pipeline
        if pipe.leading and not lost and worker.alive:
            worker.call(lambda: pipe.schedule(stop=True))  # the ranks that follow stop following

    def lead(self) -> None:
        if self.pipeline.rank != 0:
            super().lead()
        self.pipeline.leading = True

    def check_follows(self) -> None:
        if self.pipeline.rank == 0:
            super().check_follows()

    def lost(self, seconds: float) -> DistributedError:
        pipe = self.pipeline
        return DistributedError(f"rank {pipe.rank} of the {pipe.layout.describe()}: no token for {seconds:g} s; "
                                "another rank stopped or the link between them broke (pipeline_timeout_s)")


def coordinator(streaming, config) -> Local:
    """The coordinator of an engine opened on ``streaming``."""
    return Piped(streaming.pipeline, config) if streaming.pipeline is not None else Local()
