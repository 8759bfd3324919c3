"""One explicit plan per decode step, and the engine owning its line: prompts, admission,
metrics, and async waits woken by the compute thread (no polling)."""

from __future__ import annotations

import dataclasses
import threading
import time

import anyio
import pytest

from edge0 import Engine, EngineConfig
from edge0.errors import EngineBusyError
from edge0.exec.plan import DecodePlan, LayerRoute
from edge0.train.heads import make_warm_heads
from edge0.row import Job

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def staged(tiny_model_factory, tmp_path_factory):
    from tests.ckpt_tools import copy_model

    d = copy_model(tiny_model_factory("qwen3_moe"), tmp_path_factory.mktemp("plan") / "m")
    make_warm_heads(d, d / "prerouter.safetensors", width=32)
    return d


@pytest.mark.parametrize("routing", ["replace", "select"])
def test_each_decode_step_has_one_frozen_plan_that_the_routers_follow(staged, routing):
    with Engine(staged, EngineConfig(routing=routing, stage_extra=2 if routing == "select" else 0)) as engine:
        stager = engine.streaming.stager
        context = engine.streaming.context
        blocks = engine.streaming.blocks()
        seen = []
        for layer in stager.layers:
            cls = type(blocks[layer])

            def call(inner, x, _cls=cls, _l=layer):  # (the flush's routing probes run on clones, not here)
                route = context.now.routes.get(_l)  # what the layer's router follows: the step's
                if x.shape[-2] == 1 and stager.plan is not None:
                    seen.append((_l, stager.plan, route))
                return _cls.__call__(inner, x)

            blocks[layer].__class__ = type(f"Seen{cls.__name__}", (cls,), {"__call__": call})
        engine.generate_text(PROMPT, max_tokens=10)
    assert len({id(p) for _, p, _ in seen}) >= 8  # one plan per planned step
    for layer, plan, route in seen:
        assert isinstance(plan, DecodePlan) and route is plan.route(layer) and route.mode == routing
        assert set(plan.experts) == set(stager.layers)
        assert len(plan.experts[layer]) == engine.spec.k + (2 if routing == "select" else 0)
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.step = 0
    # the generation ended: no plan is left, and no step is installed
    assert stager.routes() == {} and context.now.routes == {} and context.now.decode is None


@pytest.mark.parametrize("source", ["slots", "mapping"])
def test_each_staged_layer_reads_where_its_experts_are_from_the_step(staged, source):
    """Over slots, the step's ``Step`` gives each staged layer its slot route, made when the
    step's reads were issued: its lookup row maps exactly the plan's experts of the layer,
    each to its own slot, and its flag is the one the step's reads set. Over the mapping
    nothing is read and the Step holds no slot route."""
    import numpy as np

    with Engine(staged, EngineConfig(expert_source=source)) as engine:
        stager = engine.streaming.stager
        context = engine.streaming.context
        switches = {l: engine.streaming.blocks()[l] for l in stager.layers}
        seen = []
        for layer in stager.layers:
            cls = type(switches[layer])

            def call(inner, x, _cls=cls, _l=layer):
                if x.shape[-2] == 1 and stager.plan is not None:
                    flag = stager.pool.flag(_l, stager.step) if stager.pool is not None else None
                    seen.append((_l, stager.plan, context.now.slots.get(_l), flag))
                return _cls.__call__(inner, x)

            switches[layer].__class__ = type(f"Seen{cls.__name__}", (cls,), {"__call__": call})
        engine.generate_text(PROMPT, max_tokens=10)
        assert len({id(p) for _, p, _, _ in seen}) >= 8
        for layer, plan, route, flag in seen:
            if source == "mapping":
                assert route is None
                continue
            lookup = np.array(route.lookup)
            staged_experts = np.flatnonzero(lookup >= 0)
            assert set(staged_experts.tolist()) == set(plan.experts[layer])
            assert len(set(lookup[staged_experts].tolist())) == len(staged_experts)  # a slot each
            assert (route.flag, route.ticket) == flag  # the step's own
    assert context.now.slots == {}


def test_a_staged_layer_computes_from_its_slots_only_where_the_step_gives_their_route(staged, monkeypatch):
    """The Stager takes a staged layer's slots from the step's ``Step``: with the slot routes
    left out of every decode step's Step, each staged layer computes on its fallback (the
    exact path, on the same plan's routing: the same text), never on the slots."""
    from edge0.exec.rows import ExactExecutor
    from edge0.streaming import Streaming

    def run(drop: bool):
        fell_back = []
        exact_call = ExactExecutor.__call__
        with monkeypatch.context() as m:
            m.setattr(ExactExecutor, "__call__", lambda ex, layer, x, inds: (fell_back.append(layer),
                                                                              exact_call(ex, layer, x, inds))[1])
            if drop:
                step = Streaming.step
                m.setattr(Streaming, "step", lambda s, *a, **k: dataclasses.replace(step(s, *a, **k), slots={}))
            with Engine(staged, EngineConfig(expert_source="slots")) as engine:
                layers = set(engine.streaming.stager.layers)
                text = engine.generate_text(PROMPT, max_tokens=8, temp=0.0)[0]
        return text, [layer for layer in fell_back if layer in layers]

    text, fell_back = run(drop=False)
    assert len(fell_back) == len(set(fell_back))  # no layer twice: at most the first step, unplanned, fell back
    dropped_text, dropped = run(drop=True)
    assert len(dropped) >= 6 * len(set(dropped)) and set(dropped)  # every planned step fell back
    assert dropped_text == text


def test_a_route_says_what_it_is():
    with pytest.raises(ValueError, match="mode must be 'replace' or 'select'"):
        LayerRoute("both")
    with pytest.raises(ValueError, match="scope must be"):
        LayerRoute("replace", scope="sometimes")


def test_prompt_ids_build_prompts_as_mlx_lm_does(tiny_model_factory):
    with Engine(tiny_model_factory("qwen3_moe")) as engine:
        tok = engine.tokenizer
        assert tok.has_chat_template
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        templated = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                               add_special_tokens=False)
        assert engine.prompt_ids("hi", system_prompt="be brief") == templated
        assert engine.prompt_ids(messages=msgs) == templated
        assert engine.prompt_ids("hi", chat_template=False) == tok.encode("hi", add_special_tokens=True)
        assert engine.prompt_ids(messages=msgs, chat_template=False) == engine.encode("be brief\nhi")


def test_admission_bounds_the_line_and_counts_until_the_generation_ends(tiny_model_factory):
    # one at a time (max_batch 1): the second request waits (tests/test_batch.py: the line of a batch)
    with Engine(tiny_model_factory("qwen3_moe"), EngineConfig(max_batch=1)) as engine:
        first = engine.admit(max_waiting=0)
        assert engine.metrics().in_flight == 1 and engine.metrics().queued == 1
        with pytest.raises(EngineBusyError, match="1 requests are waiting|0 requests are waiting") as info:
            engine.admit(max_waiting=0)
        assert info.value.limit == 0
        second = engine.admit(max_waiting=1)
        assert engine.metrics().in_flight == 2
        second.release()
        second.release()  # idempotent
        assert engine.metrics().in_flight == 1
        text, stats = "", None
        for event in engine.stream(PROMPT, max_tokens=4, admission=first):
            stats = event.stats or stats
        deadline = time.monotonic() + 10
        while engine.metrics().in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        m = engine.metrics()
        assert m.in_flight == 0 and m.queued == 0 and first.released
        assert m.last_generation is stats and m.expert_bytes == engine.reader.stats.bytes
        list(engine.stream(PROMPT, max_tokens=2))  # without an admission: counted while it runs
        assert engine.metrics().in_flight == 0


@pytest.mark.anyio
async def test_a_queued_async_generation_waits_without_polling(tiny_model_factory, monkeypatch):
    """Behind a long generation, a queued one is woken by its job's changes: it does not
    look at its job every few milliseconds."""
    polls = {"n": 0}
    poll = Job.poll

    def counted(self):
        polls["n"] += 1
        return poll(self)

    engine = await anyio.to_thread.run_sync(Engine, tiny_model_factory("qwen3_moe"), EngineConfig(max_batch=1))
    try:
        started = threading.Event()

        def long():
            for i, _ in enumerate(engine.stream(PROMPT, max_tokens=300)):
                if i == 0:
                    started.set()

        t = threading.Thread(target=long)
        t.start()
        await anyio.to_thread.run_sync(started.wait)
        monkeypatch.setattr(Job, "poll", counted)
        t0 = time.monotonic()
        events = [e async for e in engine.generate(PROMPT, max_tokens=3)]
        queued_for = time.monotonic() - t0
        await anyio.to_thread.run_sync(t.join)
    finally:
        await anyio.to_thread.run_sync(engine.close)
    assert len(events) == 3
    assert queued_for > 0.2  # it did wait behind the long one
    # a few polls per token and per wake-up, not one every 5 ms of the wait
    assert polls["n"] < 40, (polls["n"], queued_for)
