"""Who is in line for an engine: admission, queue depth, and the engine's metrics.

An engine decodes up to ``max_batch`` generations together (its room), in arrival order;
the others wait. A caller that wants a bound on
the line (the server) asks ``Engine.admit(max_waiting)`` before it does any work for a
request (before the prompt is tokenized); the request counts from then until its
generation ends or it is released. Generations started without an admission count from
submission to their end. ``Engine.metrics()`` reads the counts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from edge0.errors import EngineBusyError


class Admission:
    """One admitted request. ``release()`` (idempotent; also a context manager) ends it;
    a generation started with it (``Engine.generate(..., admission=...)``) releases it
    when it ends."""

    def __init__(self, line: "Line"):
        self._line = line
        self.released = False

    def release(self) -> None:
        self._line.release(self)

    def __enter__(self) -> "Admission":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Line:
    """The counts behind ``Engine.admit`` and ``Engine.metrics`` (any thread)."""

    def __init__(self, room: int = 1):
        self.room = room  # generations that run together; beyond them, requests wait
        self._lock = threading.Lock()
        self._admitted: set[Admission] = set()
        self._unadmitted = 0  # generations submitted without an admission, not yet ended
        self._running = 0

    def admit(self, max_waiting: int | None) -> Admission:
        with self._lock:
            n = len(self._admitted) + self._unadmitted
            waiting = max(0, n - self.room)  # those the batch has no room for
            if max_waiting is not None and n >= self.room and waiting >= max_waiting:
                raise EngineBusyError(f"{waiting} requests are waiting (at most {max_waiting}); retry later",
                                      waiting=waiting, limit=max_waiting)
            a = Admission(self)
            self._admitted.add(a)
            return a

    def release(self, a: Admission) -> None:
        with self._lock:
            if not a.released:
                a.released = True
                self._admitted.discard(a)

    def submitted(self, admission: Admission | None) -> None:
        if admission is None:
            with self._lock:
                self._unadmitted += 1

    def started(self) -> None:
        with self._lock:
            self._running += 1

    def ended(self, admission: Admission | None, started: bool) -> None:
        with self._lock:
            if started:
                self._running -= 1
            if admission is None:
                self._unadmitted -= 1
        if admission is not None:
            admission.release()

    def counts(self) -> tuple[int, int]:
        """(in flight, queued): requests admitted or generating, and those not running."""
        with self._lock:
            n = len(self._admitted) + self._unadmitted
            return n, max(0, n - self._running)


@dataclass(frozen=True)
class EngineMetrics:
    """What an engine reports about itself (``Engine.metrics()``): the line (``in_flight``
    requests admitted or generating, ``queued`` of them not running), expert bytes read
    from the checkpoint so far, the prompt cache, and the last finished generation's
    ``GenerationStats`` (None before the first). Every field has its zero: ``EngineMetrics()``
    is an engine that has done nothing (or none loaded yet)."""

    in_flight: int = 0
    queued: int = 0
    expert_bytes: int = 0  # read from the checkpoint so far
    expert_cache_bytes: int = 0  # the expert cache holds now
    expert_cache_hits: int = 0  # experts it served so far (memory copies, not reads)
    expert_cache_served_bytes: int = 0  # their bytes
    prompt_cache_bytes: int = 0
    prompt_cache_hits: int = 0
    last_generation: object | None = None
    batch_size: int = 0  # generations decoding together now
    decode_steps: int = 0  # decode forward passes so far (one per step, for every row of it)
    decode_tokens: int = 0  # tokens those steps generated, every row
    decode_expert_bytes: int = 0  # expert bytes read during those steps
    verify_passes: int = 0  # of the decode steps, verify passes of drafted tokens (speculative decoding)
    draft_tokens: int = 0  # tokens those passes checked
    accepted_tokens: int = 0  # and took (each pass also makes one token more)
    slot_bytes: int = 0  # bytes the staged layers' slots hold now (grown while a batch needs more)
    over_slot_layers: int = 0  # staged layer-steps run exact: a batch's union did not fit the slots
    micro_turns: int = 0  # of the decode passes, those of one half of a batch (two-rank micro-batches)
    prefill_passes: int = 0  # prompt forward passes: a chunk of one prompt, or short prompts prefilled together
    constraint_cache_bytes: int = 0  # heap the compiled response formats kept for reuse hold (estimated)

    @property
    def expert_bytes_per_token(self) -> float:
        """Expert bytes read per generated token at decode (0 before the first)."""
        return self.decode_expert_bytes / self.decode_tokens if self.decode_tokens else 0.0
