"""Continuous batching through the public API: a row decodes in a batch as it would alone
(every path, with and without heads and adapters, rows joining mid-stream), mixed adapters
in one batch, rows that leave or fail leave the others unchanged, resources come back."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from edge0 import Engine, EngineConfig
from edge0.errors import StalledConsumerError
from tests.test_adapters import random_adapter

DEMO = Path(__file__).resolve().parent.parent / "src" / "edge0" / "data" / "demo_model"
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def", "for i in range(10):",
           "x", "    return self._value\n\n    def __eq__(self, other):\n"]

# (name, config): each decode path; the demo's shipped heads (select, k+2) and replace
CONFIGS = {
    "exact": EngineConfig(prerouter="off"),
    "hot": EngineConfig(prerouter="off", decode_path="hot", hot_experts=8),
    "whole_layer": EngineConfig(prerouter="off", decode_path="whole_layer"),
    "staged-select": EngineConfig(),
    "staged-replace": EngineConfig(routing="replace"),
}


def _alone(model, config, prompts, **sampling) -> list[list[int]]:
    with Engine(model, EngineConfig(**{**config.__dict__, "max_batch": 1})) as e:
        return [[ev.token for ev in e.stream(p, **sampling)] for p in prompts]


def _arriving_together(engine: Engine, prompts, adapters=None, take=None, **sampling) -> list:
    """Every prompt submitted while the engine's compute thread is held, then released: the
    batch loop finds them all waiting at once. Each prompt's tokens, or ``take`` of its
    events."""
    gate, out = threading.Event(), [None] * len(prompts)
    engine._worker.submit(gate.wait)

    def run(i):
        extra = {"adapter": adapters[i]} if adapters else {}
        events = list(engine.stream(prompts[i], **extra, **sampling))
        out[i] = take(events) if take is not None else [ev.token for ev in events]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while engine.metrics().in_flight < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    for t in threads:
        t.join(120)
    return out


async def _together(engine: Engine, prompts, **sampling) -> list[list[int]]:
    async def one(p):
        return [ev.token async for ev in engine.generate(p, **sampling)]
    return list(await asyncio.gather(*(one(p) for p in prompts)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_row_decodes_in_a_batch_as_it_would_alone(name):
    config = CONFIGS[name]
    alone = _alone(DEMO, config, PROMPTS, max_tokens=20)
    with Engine(DEMO, config) as e:
        together = asyncio.run(_together(e, PROMPTS, max_tokens=20))
        m = e.metrics()
        assert e.resources() == {"generations": 0, "pinned_slots": 0, "pending_reads": 0, "open_files": 1}
    assert together == alone
    # they shared steps: far fewer forward passes than tokens
    assert m.decode_steps < 0.5 * m.decode_tokens


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rows_arriving_together_prefill_in_one_pass_as_each_would_alone(name):
    """Short prompts that arrive together prefill in one left-padded pass (edge0.prefill)
    and then decode together, every row's tokens those it gets alone; a one-token prompt
    (nothing to prefill) and a prompt longer than a chunk prefill on their own."""
    config = EngineConfig(**{**CONFIGS[name].__dict__, "prefill_step_size": 128})
    long_prompt = "def long_function(a, b, c):\n" + "    a = a + b * c - 1\n" * 12
    prompts = PROMPTS + [long_prompt]
    alone = _alone(DEMO, config, prompts, max_tokens=12)
    with Engine(DEMO, config) as e:
        assert len(e.encode(long_prompt)) > 129
        together = _arriving_together(e, prompts, max_tokens=12)
        m = e.metrics()
        assert e.resources() == {"generations": 0, "pinned_slots": 0, "pending_reads": 0, "open_files": 1}
    assert together == alone
    # the five short prompts in one pass (128 tokens allow it), the long one in its chunks
    assert m.prefill_passes == 1 + -(-(len(e.encode(long_prompt)) - 1) // 128), m.prefill_passes


def test_rows_that_join_and_leave_mid_stream_change_no_others_tokens():
    prompts = PROMPTS[:4]
    lengths = [40, 8, 25, 12]
    config = CONFIGS["staged-select"]
    alone = [_alone(DEMO, config, [p], max_tokens=n)[0] for p, n in zip(prompts, lengths)]
    with Engine(DEMO, config) as e:
        out: list = [None] * 4
        started = threading.Event()

        def run(i):
            toks = []
            for ev in e.stream(prompts[i], max_tokens=lengths[i]):
                toks.append(ev.token)
                if i == 0 and len(toks) == 5:
                    started.set()
            out[i] = toks

        first = threading.Thread(target=run, args=(0,))
        first.start()
        assert started.wait(60)
        late = [threading.Thread(target=run, args=(i,)) for i in (1, 2, 3)]
        for t in late:
            t.start()
        for t in [first, *late]:
            t.join(120)
    assert out == alone


def test_mixed_adapters_in_one_batch_equal_each_alone(tmp_path):
    a = random_adapter(DEMO, tmp_path / "alpha", seed=1, scale=12.0)
    b = random_adapter(DEMO, tmp_path / "beta", seed=2, scale=12.0, only=("q_proj", "o_proj"))
    config = EngineConfig(adapter=str(a), extra_adapters=(str(b),))
    names = ["alpha", "beta", None, "alpha", "beta", None]
    prompts = [PROMPTS[1]] * 3 + PROMPTS[3:]  # one prompt under each adapter, and others
    with Engine(DEMO, EngineConfig(**{**config.__dict__, "max_batch": 1})) as e:
        alone = [[ev.token for ev in e.stream(p, max_tokens=16, adapter=n)] for p, n in zip(prompts, names)]

    async def together(engine):
        async def one(p, n):
            return [ev.token async for ev in engine.generate(p, max_tokens=16, adapter=n)]
        return list(await asyncio.gather(*(one(p, n) for p, n in zip(prompts, names))))

    with Engine(DEMO, config) as e:
        mixed = asyncio.run(together(e))
        assert e.metrics().decode_steps < 40
        passes = e.metrics().prefill_passes
        assert _arriving_together(e, prompts, names, max_tokens=16) == alone  # prefilled in one pass
        assert e.metrics().prefill_passes == passes + 1
    assert mixed == alone
    assert len({tuple(t) for t in alone[:3]}) == 3  # each adapter changes the tokens


@pytest.mark.parametrize("budget", [None, 0, 8])
def test_staged_slots_grow_for_a_batchs_union_within_their_budget(budget):
    """Six rows' candidate sets outgrow a staged layer's 12 slots (2 x (k + 2)): the slots
    grow (default: up to 4x, here every one of the demo's 32 experts) or, with no budget
    left, the layer runs exact for that step; tokens as alone either way, and the slots go
    back to their size at open when the batch empties."""
    config = EngineConfig(slot_budget_mb=budget, expert_source="slots")
    alone = _alone(DEMO, config, PROMPTS, max_tokens=20)

    async def together(engine, seen):
        async def one(p):
            toks = []
            async for ev in engine.generate(p, max_tokens=20):
                toks.append(ev.token)
                seen.append(engine.metrics().slot_bytes)
            return toks
        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))

    with Engine(DEMO, config) as e:
        base, seen = e.metrics().slot_bytes, []
        out = asyncio.run(together(e, seen))
        m = e.metrics()
        per_slot = base // (7 * 12)  # 7 staged layers of 12 slots
        ceiling = {None: 7 * 32 * per_slot, 0: base, 8: 8 * 2**20}[budget]
        assert base > 0 and m.slot_bytes == base  # back at the end
    assert out == alone
    assert max(seen) <= ceiling
    if budget is None:
        assert max(seen) > base and m.over_slot_layers == 0
    else:
        assert m.over_slot_layers > 0
        assert (max(seen) > base) == (budget == 8)


def test_seeded_sampling_in_a_batch_equals_it_alone():
    sampling = dict(max_tokens=16, temp=0.9, top_p=0.95, seed=7, repetition_penalty=1.2)
    alone = _alone(DEMO, EngineConfig(), PROMPTS[:3], **sampling)
    with Engine(DEMO) as e:
        assert asyncio.run(_together(e, PROMPTS[:3], **sampling)) == alone


def test_a_row_that_leaves_or_stalls_leaves_the_others_unchanged():
    config = EngineConfig()
    alone = _alone(DEMO, config, PROMPTS[:3], max_tokens=30)

    async def scenario(engine):
        async def full(p):
            return [ev.token async for ev in engine.generate(p, max_tokens=30)]

        async def leaves(p):  # takes three tokens, then goes
            got = []
            async for ev in engine.generate(p, max_tokens=30):
                got.append(ev.token)
                if len(got) == 3:
                    break
            return got

        async def stalls(p):  # never reads: stopped after its consumer_timeout
            agen = engine.generate(p, max_tokens=400, consumer_timeout=0.3)
            first = await agen.__anext__()
            await asyncio.sleep(3)
            with pytest.raises(StalledConsumerError):
                async for _ in agen:
                    pass
            return first

        async def holds(p):  # takes one token, then holds its stream without reading (no timeout)
            agen = engine.generate(p, max_tokens=400)
            first = await agen.__anext__()
            await done.wait()  # the others finish meanwhile: the batch never waits for this one
            await agen.aclose()
            return first

        done = asyncio.Event()

        async def others():
            try:
                return await asyncio.wait_for(asyncio.gather(full(PROMPTS[0]), leaves(PROMPTS[1]), full(PROMPTS[2]),
                                                             stalls(PROMPTS[3])), 120)
            finally:
                done.set()

        got, _ = await asyncio.gather(others(), holds(PROMPTS[4]))
        return got

    with Engine(DEMO, config) as e:
        a, gone, c, _ = asyncio.run(scenario(e))
        assert e.resources() == {"generations": 0, "pinned_slots": 0, "pending_reads": 0, "open_files": 1}
    assert a == alone[0] and c == alone[2] and gone == alone[1][:3]


def test_the_line_counts_waiting_requests_beyond_the_batch():
    from edge0.errors import EngineBusyError

    with Engine(DEMO, EngineConfig(max_batch=2)) as e:
        running = [e.admit(0), e.admit(0)]  # both fit the batch: nobody waits
        with pytest.raises(EngineBusyError, match="0 requests are waiting"):
            e.admit(0)
        waiting = e.admit(1)  # one may wait beyond the two that run
        with pytest.raises(EngineBusyError, match="1 requests are waiting"):
            e.admit(1)
        for a in [*running, waiting]:
            a.release()
        e.admit(0).release()


def test_a_finished_rows_cache_holds_only_its_own_bytes():
    """A row's cache kept by the prompt cache is its own copy: the batch's buffers are not
    held behind it (MLX memory grows by what the prompt cache holds, not by batches)."""
    from edge0.backend import core as B

    with Engine(DEMO, EngineConfig(prerouter="off", prompt_cache_mb=512)) as e:
        asyncio.run(_together(e, PROMPTS * 2, max_tokens=48))
        B.eval()
        m0, a0 = e.metrics().prompt_cache_bytes, B.active_memory()
        for r in range(2):  # prompts that share no prefix with those before: new entries
            asyncio.run(_together(e, [f"{chr(65 + r)}{i} = {i} * {r}\n" for i in range(12)], max_tokens=48))
        grown = B.active_memory() - a0
        cached = e.metrics().prompt_cache_bytes - m0
    assert cached > 0 and grown < cached + 4 * 2**20, (grown, cached)


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_other_architectures_batch_as_they_decode_alone(tiny_model_factory, tmp_path, family):
    """Sigmoid-group routing with its ranking bias (DeepSeek-V3: the staged mask enters the
    bias, one per row) and a softmax router (Mixtral), with warm-start heads, select routing."""
    from edge0.train.heads import make_warm_heads
    from tests.ckpt_tools import copy_model

    d = copy_model(tiny_model_factory(family), tmp_path / "m")
    make_warm_heads(d, d / "prerouter.safetensors", width=32)
    for config in (EngineConfig(prerouter="off"), EngineConfig(routing="select", stage_extra=2)):
        alone = _alone(d, config, PROMPTS[:4], max_tokens=12)
        with Engine(d, config) as e:
            assert asyncio.run(_together(e, PROMPTS[:4], max_tokens=12)) == alone
            assert e.metrics().decode_steps < 30
        with Engine(d, config) as e:
            assert _arriving_together(e, PROMPTS[:4], max_tokens=12) == alone
            assert e.metrics().prefill_passes == 1


@pytest.mark.parametrize("family", ["jamba", "gpt_oss", "qwen3_next"])
def test_models_with_state_or_window_caches_run_their_generations_in_turn(tiny_model_factory, family):
    """State-space, linear-attention and sliding-window layers keep caches a batch cannot
    merge: concurrent generations run one after the other, each as it would alone."""
    d = tiny_model_factory(family)
    config = EngineConfig(prerouter="off")
    alone = _alone(d, config, PROMPTS[:3], max_tokens=8)
    with Engine(d, config) as e:
        assert asyncio.run(_together(e, PROMPTS[:3], max_tokens=8)) == alone
        m = e.metrics()
    assert m.decode_steps == m.decode_tokens == sum(len(t) for t in alone)


def test_slot_growth_never_passes_the_memory_budget(tiny_model_factory):
    from edge0.exec.budget import slot_ceiling

    d = tiny_model_factory("qwen3_moe")
    with Engine(d, EngineConfig(decode_path="staged", prerouter="off"), oracle=None) as e:
        index, staged = e.streaming.index, sorted(e.streaming.index.layers)
    per = max(index.layers[l].expert_bytes for l in staged)
    others = 4 * per
    budget_mb = -(-(len(staged) * 6 * per + others) // 2**20)  # room for about 6 slots a layer
    ceiling = slot_ceiling(EngineConfig(memory_budget_mb=budget_mb, slot_budget_mb=1024), index, staged, 4, others)
    assert ceiling * len(staged) * per + others <= budget_mb * 2**20
    assert slot_ceiling(EngineConfig(slot_budget_mb=1024), index, staged, 4, others) > ceiling


@pytest.mark.parametrize("share, least_gap", [(50, 9), (100, 1)])
def test_prefill_takes_at_most_its_share_of_time_while_rows_decode(monkeypatch, share, least_gap):
    """prefill_share: with the clock made of work done (a prefill pass 10 units, a decode step
    1), a long prompt's chunks at 50% come only after about ten decode steps of the running
    stream each (at 100%, one: a chunk every step); the chunks are delayed, never cut, so
    both generations' tokens are their tokens alone."""
    from edge0 import prefill

    config = EngineConfig(prefill_step_size=32, prefill_share=share)
    long_prompt = "def long_function(a, b, c):\n" + "    a = a + b * c - 1\n" * 16
    with Engine(DEMO, config) as e:
        eos = {t: -100.0 for t in e.tokenizer.eos_token_ids}
        clock = lambda: 10 * e.metrics().prefill_passes + e.metrics().decode_steps  # noqa: E731
        monkeypatch.setattr(prefill, "time", type("Clock", (), {"perf_counter": staticmethod(clock)}))
        seen, a_tokens, b_tokens = [], [], []

        def run_b():
            b_tokens.extend(ev.token for ev in e.stream(long_prompt, max_tokens=1, temp=0.0))

        late = threading.Thread(target=run_b)
        for ev in e.stream(PROMPTS[0], max_tokens=120, temp=0.0, logit_bias=eos):
            a_tokens.append(ev.token)
            m = e.metrics()
            seen.append((m.decode_steps, m.prefill_passes))
            if len(a_tokens) == 5:
                late.start()
        late.join(60)
        chunks = -(-(len(e.encode(long_prompt)) - 1) // 32)
    at = [steps for (steps, passes), (_, before) in zip(seen[1:], seen) if passes > before]
    assert len(at) >= chunks - 1 and b_tokens, (at, chunks)  # every chunk ran while A decoded
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert gaps and min(gaps) >= least_gap, gaps
    if share == 100:
        assert max(gaps) <= 2, gaps
    alone = EngineConfig(max_batch=1)
    with Engine(DEMO, alone) as e:
        assert [ev.token for ev in e.stream(long_prompt, max_tokens=1, temp=0.0)] == b_tokens
        assert [ev.token for ev in e.stream(PROMPTS[0], max_tokens=120, temp=0.0, logit_bias=eos)] == a_tokens


def test_rows_that_end_while_prefilling_give_their_cache_back_at_once():
    """A generation cancelled while its prompt prefills gives its KV cache back when it
    ends, not when a garbage collection finds the cycles its row sits in (abandoned long
    prompts held tens of MiB of MLX memory on the server until then)."""
    import gc

    import mlx.core as mx

    long_prompt = "def long_function(a, b, c):\n" + "    a = a + b * c - 1\n" * 60
    with Engine(DEMO, EngineConfig(prefill_step_size=16)) as e:
        e.generate_text("x", max_tokens=2)
        base = mx.get_active_memory()

        async def leave_early():
            async def one():
                async for _ in e.generate(long_prompt, max_tokens=4):
                    pass
            for _ in range(4):
                task = asyncio.ensure_future(one())
                deadline = time.monotonic() + 60
                while e.metrics().prefill_passes == passes[0] and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                passes[0] = e.metrics().prefill_passes
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

        passes = [e.metrics().prefill_passes]
        gc.disable()
        try:
            asyncio.run(leave_early())
            deadline = time.monotonic() + 30
            while e.metrics().in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
            e.resources()  # the compute thread is done with them
            held = mx.get_active_memory() - base
        finally:
            gc.enable()
        assert e.metrics().in_flight == 0
    assert held < 256 * 1024, held  # each one's cache would be about 1 MiB


@pytest.mark.parametrize("starve", [2, 10_000])
def test_a_long_prompt_still_prefills_under_a_stream_of_shorter_ones(monkeypatch, tiny_model_factory, starve):
    """The prompt with the fewest tokens left prefills first, but one passed over
    STARVE_PASSES times goes first: a seven-chunk prompt submitted with twenty two-chunk
    prompts gets its first token before the last of them (last, if it waited for them all)."""
    from edge0 import prefill

    monkeypatch.setattr(prefill, "STARVE_PASSES", starve)
    d = tiny_model_factory("qwen3_moe")
    with Engine(d, EngineConfig(prefill_step_size=8, max_batch=32, prompt_cache_mb=0)) as e:
        long_prompt = "def long_function(a, b, c):\n" + "    a = a + b * c - 1\n" * 3  # 7 chunks
        mediums = [f"def {c}(x):\n    return x * 1 + 1" for c in "abcdefghijklmnopqrst"]  # 2 each
        assert 40 < len(e.encode(long_prompt)) <= 57 and all(10 < len(e.encode(m)) <= 17 for m in mediums)
        order = []

        async def one(name, prompt):
            async for ev in e.generate(prompt, max_tokens=1, temp=0.0):
                if ev is not None and name not in order:
                    order.append(name)

        async def main():
            await asyncio.gather(one("long", long_prompt), *(one(i, m) for i, m in enumerate(mediums)))

        asyncio.run(main())
    assert len(order) == 21
    if starve == 2:
        assert order.index("long") < 20, order  # before the last two-chunk prompt
    else:
        assert order[-1] == "long", order  # without the bound: after them all


def test_an_iteration_forwards_at_most_its_budget_of_prompt_tokens_but_one_chunk(monkeypatch, tiny_model_factory):
    """A long prompt's whole chunk used to run after a short prompt's in the same iteration,
    holding the short one's first token for it: an iteration's prompt tokens stay within
    prefill_step_size, except a single chunk (which always runs), and every generation's
    tokens are still its own."""
    from edge0 import prefill

    d = tiny_model_factory("qwen3_moe")
    step = 16
    long_prompt = "def long_function(a, b, c):\n" + "    a = a + b * c - 1\n" * 30
    shorts = ["x = 1 + 2"]  # one (two arriving together would prefill together)
    with Engine(d, EngineConfig(prefill_step_size=step, prompt_cache_mb=0)) as e:
        iterations: list[list[int]] = []  # each iteration's chunks (prompt tokens forwarded)
        real_run, real_chunk = prefill.run, prefill.chunk

        def run(*args):
            iterations.append([])
            return real_run(*args)

        def chunk(host, row):
            n, passes = real_chunk(host, row)
            iterations[-1].append(n)
            return n, passes

        monkeypatch.setattr(prefill, "run", run)
        monkeypatch.setattr(prefill, "chunk", chunk)
        got = {}

        async def one(name, prompt, delay):
            await asyncio.sleep(delay)
            got[name] = [ev.token async for ev in e.generate(prompt, max_tokens=3, temp=0.0) if ev is not None]

        async def main():
            await asyncio.gather(one("long", long_prompt, 0), *(one(s, s, 0.01) for s in shorts))

        asyncio.run(main())
        assert len(e.encode(long_prompt)) > 4 * step
        assert all(sum(ns) <= step for ns in iterations if len(ns) > 1), iterations
        assert any(ns == [step] for ns in iterations), iterations
        short = len(e.encode(shorts[0])) - 1
        at = next(i for i, ns in enumerate(iterations) if short in ns)
        assert [step] in iterations[at + 1:], iterations  # it ran while the long one still had full chunks
    with Engine(d, EngineConfig(max_batch=1, prompt_cache_mb=0)) as e:
        for name, prompt in [("long", long_prompt)] + [(s, s) for s in shorts]:
            assert [ev.token for ev in e.stream(prompt, max_tokens=3, temp=0.0)] == got[name]
