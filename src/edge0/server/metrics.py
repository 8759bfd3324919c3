"""The server's counters and gauges in Prometheus' text format (``GET /metrics``), written by
``prometheus_client`` (the families of one snapshot, and its process collector: CPU
seconds, resident and virtual memory, open and maximum file descriptors, start time)."""

from __future__ import annotations

from collections import Counter

from edge0.admission import EngineMetrics
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class Metrics:
    def __init__(self):
        self.requests: Counter = Counter()  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.completion_tokens = 0
        self.decode_tps = 0.0  # of the last finished generation
        self.prefill_tps = 0.0
        self.stall_ms_per_step = 0.0
        self.guard_recall: float | None = None
        self.disconnects = 0
        self.address_bans = 0  # edge0.server.address_gate

    def count(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def finished(self, stats) -> None:
        self.prompt_tokens += stats.prompt_tokens
        self.cached_prompt_tokens += stats.cached_tokens
        self.completion_tokens += stats.generated_tokens
        if stats.decode_tps:
            self.decode_tps = stats.decode_tps
        self.prefill_tps = stats.prefill_tps
        self.stall_ms_per_step = stats.stall_ms_per_step
        if stats.guard_recall:
            self.guard_recall = sum(stats.guard_recall.values()) / len(stats.guard_recall)

    def render(self, m: EngineMetrics, *, loaded: bool, resources: dict | None = None,
               process: dict | None = None) -> str:
        """The text format of the server's counters, the engine's ``m`` (``EngineMetrics()``
        before it loads), its ``resources`` and the ``process``'s figures."""
        families: list = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[tuple, float]], labels=()):
            if kind == "counter":
                family = CounterMetricFamily(f"edge0_{name.removesuffix('_total')}", help_, labels=list(labels))
            else:
                family = GaugeMetricFamily(f"edge0_{name}", help_, labels=list(labels))
            for values, value in samples:
                family.add_metric(list(values), value)
            families.append(family)

        metric("requests_total", "counter", "HTTP requests answered, by endpoint and status.",
               [((e, str(s)), n) for (e, s), n in sorted(self.requests.items())], labels=("endpoint", "status"))
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished generations.", [((), self.prompt_tokens)])
        metric("cached_prompt_tokens_total", "counter", "Prompt tokens taken from the prompt cache (not prefilled).",
               [((), self.cached_prompt_tokens)])
        metric("completion_tokens_total", "counter", "Tokens generated.", [((), self.completion_tokens)])
        metric("client_disconnects_total", "counter", "Generations cancelled because the client went away.",
               [((), self.disconnects)])
        metric("address_bans_total", "counter", "Client addresses whose new connections the kernel dropped for a "
               "while, for cycling through their connection share faster than it once a second.",
               [((), self.address_bans)])
        metric("decode_tokens_per_second", "gauge", "Decode speed of the last finished generation.",
               [((), round(self.decode_tps, 3))])
        metric("prefill_tokens_per_second", "gauge", "Prefill speed of the last finished generation.",
               [((), round(self.prefill_tps, 3))])
        metric("stall_ms_per_step", "gauge", "Staged layers' wait for expert reads per decode step (last "
               "generation).", [((), round(self.stall_ms_per_step, 3))])
        if self.guard_recall is not None:
            metric("guard_recall", "gauge", "Prerouter recall@k measured by the quality guard (last generation).",
                   [((), round(self.guard_recall, 4))])
        metric("expert_bytes_read_total", "counter", "Expert bytes read from the checkpoint.", [((), m.expert_bytes)])
        metric("in_flight_requests", "gauge", "Generations admitted and not finished (running + queued).",
               [((), m.in_flight)])
        metric("queue_depth", "gauge", "Generations waiting for their turn.", [((), m.queued)])
        metric("batch_size", "gauge", "Generations decoding together now (one forward pass per step).",
               [((), m.batch_size)])
        _decode_metrics(metric, m)
        metric("expert_bytes_per_token", "gauge", "Expert bytes read per generated token at decode, since start.",
               [((), round(m.expert_bytes_per_token, 1))])
        metric("expert_cache_bytes", "gauge", "Bytes the expert cache holds now (cache_mb; 0 when off).",
               [((), m.expert_cache_bytes)])
        metric("expert_cache_hits_total", "counter", "Experts the expert cache served (memory copies, not reads).",
               [((), m.expert_cache_hits)])
        metric("expert_cache_served_bytes_total", "counter", "Bytes the expert cache served.",
               [((), m.expert_cache_served_bytes)])
        metric("slot_bytes", "gauge", "Bytes the staged layers' expert slots hold now (they grow while a batch's "
               "union of experts needs more, within slot_budget_mb).", [((), m.slot_bytes)])
        metric("over_slot_layers_total", "counter", "Staged layer-steps run exact, whole or in part, because a "
               "batch's or a verify pass's union of experts did not fit the layer's slots.", [((), m.over_slot_layers)])
        metric("prompt_cache_bytes", "gauge", "Bytes held by the prompt cache.", [((), m.prompt_cache_bytes)])
        metric("prompt_cache_hits_total", "counter", "Prompts that reused a cached KV prefix.", [((), m.prompt_cache_hits)])
        metric("prefill_passes_total", "counter", "Prompt forward passes (a chunk of one prompt, or short prompts "
               "arriving together prefilled in one pass).", [((), m.prefill_passes)])
        metric("constraint_cache_bytes", "gauge", "Heap held by the compiled response formats kept for reuse "
               "(estimated when each was compiled; within 64 MiB).", [((), m.constraint_cache_bytes)])
        metric("model_loaded", "gauge", "1 once the model is loaded and the server answers requests.",
               [((), int(loaded))])
        if resources is not None:  # live generations; the rest as of the last generation's end
            for key, help_ in (("generations", "Generations the engine holds (running or queued)."),
                               ("pinned_slots", "Expert slots pinned by a step."),
                               ("pending_reads", "Expert reads in flight."),
                               ("open_files", "Checkpoint files the reader holds open.")):
                metric(f"engine_{key}", "gauge", help_, [((), resources[key])])
        for key, value in (process or {}).items():
            metric(f"process_{key}", "gauge", f"This process's {key.replace('_', ' ')}.", [((), value)])
        return _exposition(families)


def _decode_metrics(metric, m: EngineMetrics) -> None:
    """The decode passes' counters (``metric`` as ``render`` makes them)."""
    metric("decode_steps_total", "counter", "Decode forward passes (one per step, whatever the batch).",
           [((), m.decode_steps)])
    metric("decode_tokens_total", "counter", "Tokens the decode steps generated, every generation.",
           [((), m.decode_tokens)])
    metric("verify_passes_total", "counter", "Of the decode passes, verify passes of drafted tokens "
           "(speculative decoding: prompt lookup's or a draft model's drafts).", [((), m.verify_passes)])
    metric("draft_tokens_total", "counter", "Drafted tokens the verify passes checked.", [((), m.draft_tokens)])
    metric("draft_tokens_accepted_total", "counter", "Drafted tokens the verify passes took.",
           [((), m.accepted_tokens)])
    metric("decode_micro_turns_total", "counter", "Of the decode passes, those of one half of a batch "
           "(micro-batches under a two-rank pipeline).", [((), m.micro_turns)])


class _Snapshot:
    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return self.families


def _exposition(families: list) -> str:
    """The families of one snapshot and the process collector's, in the text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(families))
    ProcessCollector(registry=registry)
    return generate_latest(registry).decode()
