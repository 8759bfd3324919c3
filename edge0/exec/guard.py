"""The quality guard: how often a predicted step's staged experts hold the router's own.

Every ``every``-th planned decode step, each staged layer's router also computes its own
logits, and the guard counts (on the device) how many of the router's own top-k experts the
plan staged. The counts come back to the host with the next step's one read
(``device_counts`` / ``collect``): no host sync of their own.
"""

from __future__ import annotations

from edge0.backend import core as B


class QualityGuard:
    def __init__(self, layers: list[int], every: int, route, log=None):
        """``route`` (layer, logits [N, E]) -> the indices [N, k] the layer's own routing
        code makes of ``logits``."""
        self.layers, self.every, self._route, self.log = list(layers), every, route, log
        self._sums = None  # layer -> hit count of the current step (on device), when guarded
        self._per = 1
        self.recall: dict[int, list[float]] = {}

    def reset(self, keep_report: bool = False) -> None:
        self._sums = None
        if not keep_report:
            self.recall = {}

    def arm(self, step: int) -> bool:
        """Start counting for ``step`` when it is a guarded step; whether it is."""
        self._sums = None
        if self.every and step % self.every == 0:
            self._sums = {l: B.zeros((), dtype=B.float32) for l in self.layers}
        return self._sums is not None

    def observer(self, staged_of: dict):
        """(layer, own logits) -> None for this step's routes: counts the router's own k
        experts that ``staged_of[layer]`` (predicted indices [.., n]) holds."""
        def observe(layer: int, own_logits) -> None:
            if self._sums is None or layer not in self._sums:
                return
            true = self._route(layer, own_logits.reshape(-1, own_logits.shape[-1]))
            k = true.shape[-1]
            hit = (B.expand_dims(staged_of[layer], -1) == B.expand_dims(true, -2)).any(axis=-1).sum()
            self._sums[layer] = self._sums[layer] + hit.astype(B.float32)
            self._per = k * max(1, true.size // k)
        return observe

    def device_counts(self) -> list:
        """The current step's counts, to read with the next step's host read ([] when the
        step is not guarded)."""
        return [self._sums[l].reshape(1) for l in self.layers] if self._sums is not None else []

    def collect(self, host, step: int) -> int:
        """Take the counts ``device_counts`` put at the front of ``host``; how many values
        were taken."""
        if self._sums is None:
            return 0
        for i, l in enumerate(self.layers):
            self.recall.setdefault(l, []).append(float(host[i]) / self._per)
        if self.log is not None:
            self.log.info("guard", step=step, recall={l: round(v[-1], 4) for l, v in self.recall.items()})
        self._sums = None
        return len(self.layers)
