"""A decode step as the batch loop runs it, counted on a model with 7 and with 39 staged
layers (warm-start heads on every MoE layer after the first): what MLX evaluates and reads
to the host, the hand-offs between threads, and writes to the model's modules. None of
them grows with the number of staged layers: a staged layer adds ops to the step's graph
and nothing else."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import Counter

import anyio.from_thread
import mlx.nn as nn
import pytest

from edge0 import Engine, EngineConfig
from edge0.batch import Batcher
from tests.syncs import count_syncs

PROMPT = "def add(a, b):\n    return"
TOKENS = 8


@pytest.fixture(scope="module")
def staged_models(tiny_model_factory, tmp_path_factory):
    """layers -> a tiny qwen3_moe of that many layers with warm-start heads beside it."""
    from edge0.train.heads import make_warm_heads
    from tests.ckpt_tools import copy_model

    out = {}
    for layers in (8, 40):
        d = copy_model(tiny_model_factory("qwen3_moe", layers=layers), tmp_path_factory.mktemp(f"one-step-{layers}") / "m")
        make_warm_heads(d, d / "prerouter.safetensors", width=32)
        out[layers] = d
    return out


class StepWatch:
    """Per decode step of the batch loop (``Batcher._decode_step``, on the compute thread):
    MLX's evaluations and host reads (tests/syncs.py), the compute thread's hand-offs to
    other threads, and writes to the model's modules (``modules``: their ids)."""

    HANDOFFS = ((anyio.from_thread.BlockingPortal, "call"), (anyio.from_thread.BlockingPortal, "start_task_soon"),
                (asyncio.BaseEventLoop, "call_soon_threadsafe"), (concurrent.futures.Future, "result"),
                (threading.Condition, "notify"), (threading.Condition, "notify_all"))
    WRITES = ("__setattr__", "__delattr__", "__setitem__", "__delitem__")

    def __init__(self, monkeypatch, modules: set[int]):
        self.steps: list[dict] = []
        self.writes: list[tuple] = []
        self._in_step = threading.local()
        self._handoffs = Counter()
        self._modules = modules
        for owner, name in self.HANDOFFS:
            monkeypatch.setattr(owner, name, self._counted(getattr(owner, name), name))
        for name in self.WRITES:
            monkeypatch.setattr(nn.Module, name, self._guarded(getattr(nn.Module, name), name))
        step = Batcher._decode_step

        def watched(batcher):
            before = self.counter.snapshot()
            self._handoffs.clear()
            self._in_step.on = True
            try:
                return step(batcher)
            finally:
                self._in_step.on = False
                after = self.counter.snapshot()
                self.steps.append({"syncs": {k: after[k] - before[k] for k in after if after[k] != before[k]},
                                   "handoffs": dict(self._handoffs), "rows": len(batcher.rows)})

        monkeypatch.setattr(Batcher, "_decode_step", watched)

    def _inside(self) -> bool:
        return getattr(self._in_step, "on", False)

    def _counted(self, fn, name):
        def counted(*args, **kwargs):  # the outermost call only (a portal's call uses a future)
            outer = self._inside() and not getattr(self._in_step, "handing", False)
            if outer:
                self._handoffs[name] += 1
                self._in_step.handing = True
            try:
                return fn(*args, **kwargs)
            finally:
                if outer:
                    self._in_step.handing = False
        return counted

    def _guarded(self, fn, name):
        def guarded(module, key, *value):
            if self._inside() and id(module) in self._modules:
                self.writes.append((type(module).__name__, name, key))
            return fn(module, key, *value)
        return guarded


def snapshot(model) -> dict:
    """Each module of ``model``: its class, attributes and items, by identity."""
    return {id(m): (type(m), {k: id(v) for k, v in vars(m).items()}, {k: id(v) for k, v in m.items()})
            for m in model.modules()}


def watched_run(engine, monkeypatch, mode: str) -> StepWatch:
    model = engine.streaming.model
    watch = StepWatch(monkeypatch, {id(m) for m in model.modules()})
    before = snapshot(model)
    with count_syncs() as counter:
        watch.counter = counter
        if mode == "sync":
            tokens = [ev.token for ev in engine.stream(PROMPT, max_tokens=TOKENS)]
        else:
            async def run():
                return [ev async for ev in engine.generate(PROMPT, max_tokens=TOKENS) if ev is not None]
            tokens = [ev.token for ev in asyncio.run(run())]
    assert len(tokens) == TOKENS
    assert snapshot(model) == before  # no module of the model was changed by a step and left so
    return watch


def counted_at_both_sizes(staged_models, monkeypatch, mode: str, config: EngineConfig, opened) -> list:
    """Each decode step's (syncs, hand-offs) at 7 staged layers, checked to be those at 39;
    ``opened(engine)`` checks each engine before it runs."""
    per_size = {}
    for layers, d in staged_models.items():
        with Engine(d, config) as engine:
            opened(engine)
            watch = watched_run(engine, monkeypatch, mode)
        steps = [s for s in watch.steps[1:] if s["rows"] == 1]  # the first is planned from the prefill's state
        assert len(steps) >= TOKENS - 3
        assert watch.writes == []  # no attribute or child of a model module written during a step
        per_size[layers] = steps
    small, large = ([(s["syncs"], s["handoffs"]) for s in per_size[n]] for n in (8, 40))
    assert small == large  # nothing per staged layer
    return small


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_staged_step_costs_the_same_at_7_and_39_staged_layers(staged_models, monkeypatch, mode):
    def opened(engine):
        stager = engine.streaming.stager
        assert stager is not None and stager.layers == list(range(1, engine.spec.num_layers))  # 7, 39 staged layers
        assert stager.pool.flags.in_graph  # each layer's wait is an op of the step's graph

    config = EngineConfig(prerouter_flush="mlx", expert_source="slots", unpredicted_layers="exact")
    for syncs, handoffs in counted_at_both_sizes(staged_models, monkeypatch, mode, config, opened):
        # evaluations: the sampled tokens' read, with the next step's predicted sets (its
        # plan made ahead: one read for both); the exact first layer's (which no head
        # predicts: its routing read, its bundle's last reader settled); no evaluation and
        # no wait per staged layer
        assert syncs == {"numpy": 2, "eval": 1}, syncs
        # hand-offs: the staged layers' one call into the scheduler (unpin the step before,
        # submit, every slot map back); the exact first layer's reads, on the reader pool's
        # two threads; the token handed to its consumer (its job's condition; an async
        # consumer's loop woken too)
        consumer = {"notify_all": 1} if mode == "sync" else {"notify_all": 1, "call_soon_threadsafe": 1}
        assert handoffs == {"call": 1, "result": 2, **consumer}, handoffs


@pytest.mark.parametrize("mode,flush", [("sync", "mlx"), ("async", "mlx"), ("sync", "edge0")])
def test_over_the_mapping_a_staged_step_is_one_read_and_one_delivery_at_7_and_39_layers(staged_models, monkeypatch,
                                                                                         mode, flush):
    """Where the checkpoint fits (the default, ``expert_source`` auto: the experts computed
    where its mapping holds them), a staged step is one evaluation, the tokens' read that
    also brings the next step's plan; nothing goes to the scheduler or the readers (the
    first MoE layer's exact path reads no routing either), the one hand-off is the token's
    delivery; the same at 7 and 39 staged layers; with the heads' flush in MLX or on Edge0's
    kernels in 8-bit weights (both in the step's graph)."""
    def opened(engine):
        assert engine.streaming.plan.source == "mapping" and engine.streaming.stager.pool is None

    for syncs, handoffs in counted_at_both_sizes(staged_models, monkeypatch, mode, EngineConfig(prerouter_flush=flush),
                                                 opened):
        assert syncs == {"numpy": 1}, syncs
        assert handoffs == ({"notify_all": 1} if mode == "sync" else {"notify_all": 1, "call_soon_threadsafe": 1}), \
            handoffs


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_over_slots_with_the_unpredicted_layer_resident_a_step_is_one_read_one_call_one_delivery(staged_models,
                                                                                                 monkeypatch, mode):
    """Where the experts are read into slots with direct reads (a checkpoint larger than the
    memory: the engine's own expert cache), ``unpredicted_layers`` resident holds the first
    MoE layer, which no head predicts, whole in memory (its bytes out of the cache): a staged
    step is one evaluation, the tokens' read that also brings the next step's plan; its
    hand-offs are the plan's one call into the scheduler and the token's delivery; the same
    at 7 and 39 staged layers."""
    def opened(engine):
        plan = engine.streaming.plan
        assert plan.source == "slots" and plan.direct and plan.cache > 0 and plan.whole_layers == 1
        assert engine.streaming.hot.resident == {0}

    config = EngineConfig(prerouter_flush="mlx", direct_io="on", unpredicted_layers="resident")
    for syncs, handoffs in counted_at_both_sizes(staged_models, monkeypatch, mode, config, opened):
        assert syncs == {"numpy": 1}, syncs
        consumer = {"notify_all": 1} if mode == "sync" else {"notify_all": 1, "call_soon_threadsafe": 1}
        assert handoffs == {"call": 1, **consumer}, handoffs


def test_a_step_whose_first_moe_layer_is_resident_evaluates_once(staged_models, monkeypatch):
    """With the layer no head predicts held resident whole (a hot set of every expert), a staged
    step is one evaluation: the tokens' read, which also brings the next step's plan; the
    only hand-offs are the plan's one call into the scheduler and the token's delivery."""
    d = staged_models[8]
    config = EngineConfig(prerouter_flush="mlx", layer_paths=((0, "decode", "hot"),), hot_experts=4096,
                          expert_source="slots")
    with Engine(d, config) as engine:
        watch = watched_run(engine, monkeypatch, "sync")
    steps = [s for s in watch.steps[1:] if s["rows"] == 1]
    assert len(steps) >= TOKENS - 3
    for step in steps:
        assert step["syncs"] == {"numpy": 1}, step
        assert step["handoffs"] == {"call": 1, "notify_all": 1}, step
