"""What an engine's batch loop runs on: its compute thread, the streaming model and the
step model, the tokenizer, the generations in flight and the line they wait in, the prompt
cache and the compiled output formats, who decides (``coordinator``), and what a batch's start and end and a failed read
do. ``Engine`` is the public face; the batch loop (``edge0.batch``) and the passes it
makes (``edge0.prefill``, ``edge0.micro``) use this object and nothing private of the
engine."""

from __future__ import annotations

import functools

from edge0.admission import Line
from edge0.backend import core as B
from edge0.constrain import ConstraintCache
from edge0.coordinator import coordinator
from edge0.errors import ExpertReadError
from edge0.streaming import StepModel, Streaming
from edge0.prompt_cache import PromptCache
from edge0.stats import GenerationStats
from edge0.row import Job
from edge0.worker import ComputeThread


class Runtime:
    def __init__(self, worker: ComputeThread, streaming: Streaming, tokenizer, config, log, draft=None):
        self.worker, self.streaming, self.tokenizer, self.config, self.log = worker, streaming, tokenizer, config, log
        self.draft = draft  # the draft model generations draft with (edge0.draft_model.DraftModel; None: none)
        self.reader = streaming.reader  # the checkpoint's reader (its stats are the batch's reads)
        self.step_model = StepModel(streaming)  # the forward pass every batch and prefill makes
        self.coord = coordinator(streaming, config)  # one process alone, or a pipeline's ranks in step
        self.jobs: set[Job] = set()  # the generations submitted and not ended
        self.line = Line(config.max_batch)  # requests in flight and waiting
        self.prompt_cache = PromptCache(config.prompt_cache_mb * 2**20) if config.prompt_cache_mb else None
        self.constraints = ConstraintCache(tokenizer, whitespace=config.json_whitespace)
        self.last_stats: GenerationStats | None = None  # the last finished generation's
        self.resources: dict = {}  # as counted when the compute thread last finished a generation

    @functools.cached_property
    def xtc_special(self) -> tuple:
        """What XTC sampling never drops, as mlx-lm's server has it: the newline's tokens and EOS."""
        return tuple(self.tokenizer.encode("\n")) + tuple(self.tokenizer.eos_token_ids)

    def begin_batch(self) -> None:
        """A batch starts from nothing: what the last one left in the staged machinery goes
        (slots keep their experts; what the heads observed was the batch's own)."""
        if (stager := self.streaming.stager) is not None:
            stager.reset()

    def end_generation(self) -> None:
        """The batch is empty: cancel what it left in flight, unpin its slots, trim MLX's
        buffer cache."""
        if (stager := self.streaming.stager) is not None:
            stager.reset(keep_report=True)
        if self.streaming.recorder is not None:
            self.streaming.set_recorder(None)
        B.trim_buffer_cache()

    def typed(self, error: BaseException) -> BaseException:
        """``error`` raised by a pass (prefill or decode) as the engine names it: the typed
        error behind a staged layer's failed wait or a mapped file truncated under the pass
        (``Streaming.explain``), and under a pipeline a failed transfer as a
        ``DistributedError`` naming this rank's pipeline (the coordinator's)."""
        return self.coord.typed(self.streaming.explain(error))

    def after_read_error(self, e: ExpertReadError) -> None:
        """What was read from a file that just failed may not match it: forget it all."""
        self.log.warning("io.read_failed", error=str(e), action="cached experts invalidated")
        self.end_generation()
        self.streaming.invalidate()

    def describe_adapter(self, name: str | None) -> str | None:
        bank = self.streaming.adapters
        return bank.adapters[name].describe() if bank is not None and name is not None else None

    def count_resources(self) -> dict:  # on the compute thread
        """Live generations, pinned expert slots, reads in flight and open checkpoint files."""
        stager = self.streaming.stager
        self.resources = {"generations": len(self.jobs), "pinned_slots": self.streaming.pinned_slots(),
                          "pending_reads": stager.pending_reads() if stager is not None else 0,
                          "open_files": self.reader.open_files}
        return self.resources
