"""The memory plan: ``edge0 plan`` (headers only) and ``Engine.open`` make it in one place, so
they agree; the KV budget is what mlx-lm's caches take; a plan that cannot fit is refused by
both alike; the forecast of the disk's bytes per token replays the engine's own tiers."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from edge0 import Engine, EngineConfig
from edge0.cli import main
from edge0.errors import CheckpointError, ConfigError
from edge0.exec.oracle import OracleRouting
from tests.test_async_misuse import N, PROMPT, setups  # noqa: F401

GIB = 2**30
SAME = ("limit", "resident", "heads", "per_expert", "staged", "slots", "ceiling", "others", "held", "kv_per_token", "context",
        "batch", "margin", "policy", "direct")


def _plan_cli(*args: str) -> tuple[int, dict | None, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *args])
    return code, json.loads(out.getvalue()) if code == 0 and "--json" in args else None, out.getvalue() + err.getvalue()


def _limit(monkeypatch, limit: int, runtime: int) -> None:
    """The memory the process may use, and what it holds itself (measured by each, so
    fixed here: the two measure at other moments)."""
    import edge0.exec.budget as budget
    import edge0.io_sched.direct as dio

    monkeypatch.setattr(budget, "memory_limit", lambda: limit)
    monkeypatch.setattr(dio, "memory_limit", lambda: limit)
    monkeypatch.setattr(budget, "process_rss", lambda: runtime)


@pytest.mark.parametrize("config", ["staged+heads", "staged+select", "exact"])
def test_the_plan_command_and_engine_open_make_the_same_plan_and_the_engine_allocates_by_it(setups, config,
                                                                                          monkeypatch):
    d, cfg, _, _ = setups[config]
    flags = ["--direct-io", "on"] + (["--routing", "select", "--stage-extra", "2"] if config == "staged+select" else [])
    kwargs = {**cfg.__dict__, "direct_io": "on"}
    with Engine(d, EngineConfig(**kwargs)) as engine:
        held = engine.streaming.plan.held
        planned = engine.streaming.plan.planned - engine.streaming.plan.cache
    # a limit where the automatic cache is a part of the experts (not all, not none)
    _limit(monkeypatch, planned + held // 2 + GIB, runtime=engine.streaming.plan.runtime)  # (margin: 1 GiB under 8)
    code, doc, _ = _plan_cli("--model", str(d), "--json", *flags)
    assert code == 0
    with Engine(d, EngineConfig(**kwargs)) as engine:
        plan, reader, stager = engine.plan, engine.streaming.reader, engine.streaming.stager
        for name in (*SAME, "runtime", "cache"):
            assert doc["plan"][name] == getattr(plan, name), name
        if plan.direct:
            assert 0 < plan.cache < plan.held and reader.cache.budget == plan.cache
        if stager is not None:
            assert stager.pool.slots == plan.slots and stager.pool.max_slots == plan.ceiling
    assert doc["staged_layers"] == plan.staged and (plan.staged == 0) == (config == "exact")


def test_an_automatic_budget_goes_to_the_staged_slots_in_their_share(setups, monkeypatch):
    """cache_mb auto with direct reads: sticky slots are a cache whose hits cost no copy, so the
    staged layers' share (their experts' of those held) of what the automatic cache would get
    goes to their slots, each an equal part, the room to grow for a batch included; the rest is
    the cache. The memory planned is the same; slots_per_layer set keeps the slots as set. The
    engine allocates the slots planned and decodes the same text on them."""
    d, cfg, oracle, expected = setups["staged+heads"]
    auto = {**cfg.__dict__, "direct_io": "on", "slot_budget_mb": 0}  # no room to grow: the share shows whole
    with Engine(d, EngineConfig(**auto)) as engine:
        spec, index, staged = engine.spec, engine.streaming.index, engine.streaming.stager.layers
    set_slots = {**auto, "slots_per_layer": 2 * spec.k}
    with Engine(d, EngineConfig(**set_slots)) as engine:
        first = engine.plan
    if not first.direct:
        pytest.skip("this filesystem refuses O_DIRECT: an automatic cache is none with buffered reads")
    share = sum(index.layers[l].expert_bytes for l in staged) / sum(le.expert_bytes for le in index.layers.values())
    _limit(monkeypatch, first.planned - first.cache + first.held * 9 // 20 + GIB, runtime=first.runtime)
    with Engine(d, EngineConfig(**set_slots)) as engine:
        fixed = engine.plan  # 2k slots, their room to grow, and a cache of the rest
    with Engine(d, EngineConfig(**auto), oracle=oracle) as engine:
        plan, stager = engine.plan, engine.streaming.stager
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
        assert stager.pool.slots == plan.slots == plan.ceiling and stager.pool.max_slots == plan.ceiling
    assert 0 < fixed.cache and fixed.slots == 2 * spec.k < plan.slots <= spec.num_experts
    gained = (plan.ceiling - fixed.ceiling) * plan.staged * plan.per_expert  # into the slots ...
    assert fixed.cache - plan.cache == gained  # ... out of the cache, the same memory planned
    assert plan.slots < spec.num_experts  # the staged share of the spare, to one expert a layer
    assert abs(gained - (fixed.cache * share)) <= plan.staged * plan.per_expert
    assert plan.planned == fixed.planned


def test_a_layer_no_head_predicts_held_whole_is_planned_as_the_engine_holds_it(setups):
    """``unpredicted_layers`` resident over slots: the plan counts the first MoE layer's
    every expert among the buffers and says so, the engine holds exactly those bytes once it
    decodes, and the text is the same as exact's; over the mapping nothing is held."""
    d, cfg, _, _ = setups["staged+heads"]
    flags = ("--model", str(d), "--direct-io", "on")
    base = {**cfg.__dict__, "direct_io": "on"}
    _, exact, _ = _plan_cli(*flags, "--json")
    _, held, _ = _plan_cli(*flags, "--json", "--unpredicted-layers", "resident")
    _, _, text = _plan_cli(*flags, "--unpredicted-layers", "resident")
    texts = {}
    for mode in ("exact", "resident"):
        with Engine(d, EngineConfig(**{**base, "unpredicted_layers": mode})) as engine:
            texts[mode] = engine.generate_text(PROMPT, max_tokens=N)[0]
            hot, spec, plan = engine.streaming.hot, engine.spec, engine.plan
            if mode == "resident":
                first = spec.moe_layers[0]
                assert hot.resident == {first} and plan.whole_layers == 1
                assert hot.rows[first].nbytes == spec.num_experts * engine.streaming.index.layers[first].expert_bytes
                assert held["plan"]["others"] - exact["plan"]["others"] == spec.num_experts * plan.per_expert
                assert held["plan"]["others"] == plan.others
            else:
                assert hot is None and plan.whole_layers == 0
    assert texts["exact"] == texts["resident"]
    assert "1 unpredicted layer held whole" in text
    _, mapped, _ = _plan_cli("--model", str(d), "--json", "--unpredicted-layers", "resident", "--direct-io", "off")
    assert mapped["plan"]["source"] == "mapping" and mapped["plan"]["whole_layers"] == 0


@pytest.mark.parametrize("config", ["staged+heads", "exact"])
def test_the_plan_says_the_prefetch_depth_the_scheduler_runs_with(setups, config):
    d, cfg, _, _ = setups[config]
    code, doc, _ = _plan_cli("--model", str(d), "--json", "--prefetch-depth", "3", "--expert-source", "slots")
    _, _, text = _plan_cli("--model", str(d), "--prefetch-depth", "3", "--expert-source", "slots")
    assert code == 0
    with Engine(d, EngineConfig(**{**cfg.__dict__, "prefetch_depth": 3, "expert_source": "slots"})) as engine:
        stager = engine.streaming.stager
        depth = stager.pool.scheduler.prefetch_depth if stager is not None else None
    assert doc["prefetch_depth"] == depth and (depth == 3) == (config != "exact")
    assert ("prefetch depth 3: reads run up to 3 staged layers ahead" in text) == (config != "exact")


def test_the_plan_names_every_part_in_its_text(setups):
    d, _, _, _ = setups["staged+heads"]
    code, _, text = _plan_cli("--model", str(d), "--memory", "6G", "--plan-context", "8192", "--plan-batch", "2",
                              "--expert-source", "slots")
    assert code == 0
    for part in ("memory the process may use", "6.00 GiB  (--memory)", "the process itself", "resident weights",
                 "expert buffers at open", "slots grown for a batch", "KV caches", "(2 x 8192 tokens", "expert cache",
                 "margin", "planned in all", "forecast:"):
        assert part in text, part


def test_the_kv_budget_is_what_mlx_lms_caches_take(setups):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from edge0.plan import make

    d, _, _, _ = setups["exact"]
    model, _ = load(str(d))
    model.set_dtype(mx.float32)  # the plan's compute dtype on the CPU
    cache = make_prompt_cache(model)
    tokens = 256  # one step of mlx-lm's KV allocation
    mx.eval(model(mx.array([[1] * tokens]), cache=cache))
    taken = sum(c.nbytes for c in cache)
    plan = make(d, EngineConfig(compute_dtype="float32"))["plan"]
    assert plan["kv_per_token"] * tokens == taken
    quantized = [c.to_quantized(group_size=32, bits=4) for c in cache]
    mx.eval([q.state for q in quantized])
    plan4 = make(d, EngineConfig(compute_dtype="float32", kv_bits=4, kv_group_size=32))["plan"]
    assert plan4["kv_per_token"] * tokens == sum(q.nbytes for q in quantized)
    assert plan4["kv_bytes"] == plan4["kv_per_token"] * 4096


def test_a_plan_that_cannot_fit_is_refused_by_the_command_and_by_engine_open_alike(setups):
    d, _, _, _ = setups["exact"]
    code, _, text = _plan_cli("--model", str(d), "--plan-context", "100000000", "--plan-batch", "64")
    assert code == 2
    with pytest.raises(CheckpointError) as refused:
        Engine(d, EngineConfig(plan_context=100_000_000, plan_batch=64))
    cut = "and the process holds"
    said = str(refused.value)
    assert "the KV caches of 64 x 100000000 tokens" in said and said.split(cut)[0] in text
    code, _, text = _plan_cli("--model", str(d), "--memory", "10X")
    assert code == 2 and "--memory must look like 8G" in text


def test_a_recorded_routing_keeps_the_prompts_reads_and_older_files_load(setups, tmp_path):
    d, _, _, _ = setups["exact"]
    with Engine(d) as engine:
        routing = engine.record_routing(PROMPT, max_tokens=N)
    assert routing.prefill and set(routing.prefill[0]) == set(routing.steps[0])
    assert len(routing.prefill[0][next(iter(routing.prefill[0]))]) > len(routing.steps[0][next(iter(routing.steps[0]))])
    routing.save(tmp_path / "t.json")
    again = OracleRouting.load(tmp_path / "t.json")
    assert again.steps == routing.steps and again.prefill == routing.prefill
    doc = json.loads((tmp_path / "t.json").read_text())
    del doc["prefill"]  # a file written before prompts were recorded
    (tmp_path / "old.json").write_text(json.dumps(doc))
    old = OracleRouting.load(tmp_path / "old.json")
    assert old.steps == routing.steps and old.prefill == []


@pytest.mark.parametrize("cache_mb", [1, 0])
def test_the_forecast_of_a_recorded_run_is_what_the_engine_reads_from_the_disk(setups, tmp_path, cache_mb):
    """The exact path: every routed expert goes to the cache or the disk; the replay of the
    recorded routing through the engine's cache class reads what the engine read."""
    from edge0.plan import make

    d, _, _, _ = setups["exact"]
    config = EngineConfig(cache_mb=cache_mb, cache_policy="lfu", expert_source="slots")
    with Engine(d, config) as engine:
        routing = engine.record_routing(PROMPT, max_tokens=N)
    with Engine(d, config) as engine:
        stats = list(engine.stream(PROMPT, max_tokens=N))[-1].stats
    routing.steps = routing.steps[:stats.generated_tokens - 1]  # the steps the stats count (the first token: prefill)
    routing.save(tmp_path / "trace.json")
    measured = stats.decode_expert_bytes / len(routing.steps)
    forecast = make(d, config, trace=tmp_path / "trace.json")["forecast"]
    assert forecast["steps"] == len(routing.steps) and forecast["prompt_chunks"] == len(routing.prefill)
    assert forecast["disk_bytes_per_token"] == pytest.approx(measured, rel=1e-9)
    if cache_mb:
        assert stats.decode_cache_hits > 0 and forecast["disk_bytes_per_token"] < forecast["expert_bytes_per_token"]


def test_the_forecast_reads_a_trace_beside_the_checkpoint_else_says_what_it_assumes(setups, tmp_path):
    from edge0.plan import TRACE_FILENAME, make
    from tests.ckpt_tools import copy_model

    d, _, _, _ = setups["exact"]
    assumed = make(d, EngineConfig())["forecast"]
    assert assumed["source"].startswith("assumed: each step's") and assumed["disk_bytes_per_token"] > 0
    m = copy_model(d, tmp_path / "m")
    with Engine(m) as engine:
        engine.record_routing(PROMPT, max_tokens=N).save(m / TRACE_FILENAME)
    beside = make(m, EngineConfig())["forecast"]
    assert beside["source"].startswith(f"trace {m / TRACE_FILENAME}") and beside["steps"] == N
    with pytest.raises(ConfigError, match="does not exist"):
        make(m, EngineConfig(), trace=tmp_path / "absent.json")


@pytest.mark.parametrize("config,flush", [("staged+heads", "auto"), ("staged+heads", "mlx"), ("exact", "auto")])
def test_the_plan_counts_the_resident_weights_and_the_heads_as_the_loaded_engine_holds_them(setups, config, flush):
    from mlx.utils import tree_flatten

    d, cfg, oracle, _ = setups[config]
    with Engine(d, EngineConfig(**{**cfg.__dict__, "prerouter_flush": flush}), oracle=oracle) as engine:
        plan, s = engine.streaming.plan, engine.streaming
        assert plan.resident == sum(v.nbytes for _, v in tree_flatten(s.model.parameters()))  # float32 on the CPU
        if s.prerouter is None:
            assert plan.heads == 0
        else:
            assert tree_flatten(s.prerouter.heads.parameters()) == []  # the loaded copy: freed once the flush has its own
            if s.prerouter.host is not None:  # the host flush's float32 copy
                held = s.prerouter.host.nbytes
            elif s.prerouter.quantized is not None:  # the 8-bit copy on Edge0's kernels (auto there)
                held = s.prerouter.quantized.nbytes
            else:  # the MLX flush's stacked copy
                held = sum(v.nbytes for v in s.prerouter.heads._stacked.values())
            assert plan.heads == held > 0


def test_under_a_cgroup_limit_the_process_itself_is_what_its_cgroup_holds(tmp_path, monkeypatch):
    import edge0.exec.budget as budget
    import edge0.io_sched.direct as dio

    root = tmp_path / "fs"
    (root / "a" / "b").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("memory\n")
    (root / "a" / "memory.max").write_text(f"{8 * GIB}\n")
    (root / "a" / "memory.current").write_text(f"{3 * GIB}\n")  # the level whose limit binds
    (root / "a" / "b" / "memory.max").write_text("max\n")
    (root / "a" / "b" / "memory.current").write_text(f"{GIB}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert dio.cgroup_limit(str(proc), root) == 8 * GIB and dio.cgroup_current(str(proc), root) == 3 * GIB
    monkeypatch.setattr(budget, "cgroup_limit", lambda: 8 * GIB)
    monkeypatch.setattr(budget, "cgroup_current", lambda: 3 * GIB)
    monkeypatch.setattr(budget, "process_rss", lambda: GIB)
    assert budget.held_now(8 * GIB) == 3 * GIB  # the cgroup's limit: what it holds (page cache charged to it too)
    assert budget.held_now(16 * GIB) == GIB  # another limit: the process's own resident bytes


def test_without_a_model_the_plan_is_the_demos():
    from edge0.cli import demo_model_dir

    code, doc, _ = _plan_cli("--json")
    assert code == 0 and doc["model"] == str(demo_model_dir()) and doc["plan"]["resident"] > 0


def test_the_margin_is_an_eighth_of_the_memory_and_at_least_a_gib(setups):
    from edge0.plan import make

    d, _, _, _ = setups["exact"]
    assert make(d, EngineConfig(), memory=16 * GIB)["plan"]["margin"] == 2 * GIB  # an eighth
    assert make(d, EngineConfig(), memory=4 * GIB)["plan"]["margin"] == GIB  # at least 1 GiB
