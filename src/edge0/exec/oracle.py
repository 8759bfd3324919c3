"""Oracle routing: the true routing of a run, recorded, to stage an identical run.

The paper's oracle experiment: with perfect knowledge of each decode step's experts, a
staged run reads them before the step starts. ``RoutingRecorder`` records, per decode step
(one-token forward) and MoE layer, the distinct experts the layer routed to; the file is
JSON. ``OracleRouting`` answers "which experts will layer l use at step s".
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from edge0.errors import ConfigError

FORMAT = "edge0-oracle-routing/1"


class OracleRouting:
    """``steps``: per decode step, each MoE layer's distinct experts; ``prefill``: the same
    per prompt chunk (what the prompt read before the first step; empty in files written
    before it was recorded). A staged run replays the steps; ``edge0 plan`` replays both to
    forecast the disk's bytes per token."""

    def __init__(self, steps: list[dict[int, tuple[int, ...]]], model: str = "",
                 prefill: list[dict[int, tuple[int, ...]]] | None = None):
        self.steps = steps
        self.model = model
        self.prefill = prefill or []

    def __len__(self) -> int:
        return len(self.steps)

    def experts(self, step: int, layer: int) -> tuple[int, ...]:
        if step >= len(self.steps):
            raise ConfigError(f"the oracle routing covers {len(self.steps)} decode steps; step {step} was "
                              "requested (record a run at least as long as this one)")
        try:
            return self.steps[step][layer]
        except KeyError:
            raise ConfigError(f"the oracle routing has no layer {layer} at step {step}") from None

    def check(self, layers, num_experts: int) -> None:
        """Every step names only MoE layers of this model, and expert ids in [0, E): an
        oracle of another model must not make the scheduler read outside a tensor."""
        allowed = set(layers)
        for i, step in enumerate(self.steps):
            for layer, experts in step.items():
                if layer not in allowed:
                    raise ConfigError(f"the oracle routing names layer {layer} at step {i}, which is not a MoE "
                                      "layer of this model")
                if any(not 0 <= e < num_experts for e in experts):
                    raise ConfigError(f"the oracle routing names expert ids outside [0, {num_experts}) at step {i}, "
                                      f"layer {layer}")

    def save(self, path: str | Path) -> None:
        doc = {"format": FORMAT, "model": self.model,
               "steps": [{str(l): list(e) for l, e in s.items()} for s in self.steps],
               "prefill": [{str(l): list(e) for l, e in s.items()} for s in self.prefill]}
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> "OracleRouting":
        try:
            doc = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"oracle routing file {path} does not exist") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"oracle routing file {path} is not valid JSON: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("steps"), list):
            raise ConfigError(f"{path} is not an oracle routing file (format {FORMAT!r})")
        try:
            steps, prefill = ([{int(l): tuple(int(e) for e in es) for l, es in s.items()} for s in doc.get(key, [])]
                              for key in ("steps", "prefill"))
        except (AttributeError, TypeError, ValueError):
            raise ConfigError(f"{path}: malformed steps") from None
        return cls(steps, doc.get("model", ""), prefill)


class RoutingRecorder:
    """Collects each forward pass's routing, layer by layer (host syncs: recording only):
    one-token steps as the oracle's steps, prompt chunks as its prefill."""

    def __init__(self):
        self.steps: list[dict[int, tuple[int, ...]]] = []
        self.prefill: list[dict[int, tuple[int, ...]]] = []
        self._current: dict[int, tuple[int, ...]] | None = None

    def begin_step(self, decode: bool) -> None:
        """A forward pass begins: a decode step or a prompt chunk."""
        self._current = {}
        (self.steps if decode else self.prefill).append(self._current)

    def record(self, layer: int, ids) -> None:
        if self._current is not None:
            self._current[layer] = tuple(sorted({int(e) for e in ids.reshape(-1)}))

    def routing(self, model: str = "") -> OracleRouting:
        return OracleRouting(self.steps, model, self.prefill)
