"""staged, hot and whole-layer paths against exact: same kernel, same outputs."""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import pytest

from edge0 import ConfigError, Engine, EngineConfig
from edge0.backend import core as B
from edge0.loader import load_streaming_model
from edge0.streaming import StepModel
from edge0.exec.oracle import OracleRouting
from edge0.errors import RoutingMismatchError

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def record(model_dir, prompt=PROMPT, n=10):
    with Engine(model_dir) as e:
        oracle = e.record_routing(prompt, max_tokens=n)
        tokens = [ev.token for ev in e.stream(prompt, max_tokens=n)]
        ids = e.encode(prompt)
    return oracle, tokens, ids


@contextmanager
def step_model(model_dir, config, oracle=None):
    """(model behind the step hook, its KV cache), as mlx-lm's generation loop drives it."""
    from edge0.backend import nn as bnn

    s = load_streaming_model(model_dir, config, oracle=oracle)
    try:
        if s.stager is not None:
            s.stager.reset()
        model = StepModel(s)
        yield model, bnn.make_cache(model)
    finally:
        s.close()


def replay_logits(model_dir, config, ids, continuation, oracle=None):
    """Prefill ``ids`` then feed ``continuation``; every step's logits (through the step hook)."""
    with step_model(model_dir, config, oracle) as (model, cache):
        out = [model(mx.array([ids[:-1]]), cache=cache)] if len(ids) > 1 else []
        for t in [ids[-1]] + continuation[:-1]:
            logits = model(mx.array([[t]]), cache=cache)
            mx.eval(logits)
            out.append(logits)
        return out


@pytest.fixture(scope="module")
def qwen(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


@pytest.mark.parametrize("slots", ["k", "2k", "3k"])
def test_staged_oracle_generation_equals_exact(tiny_model, tiny_model_factory, slots):
    oracle, expected, _ = record(tiny_model)
    k = {"k": 1, "2k": 2, "3k": 3}[slots]
    from edge0.model.open import load_spec

    cfg = EngineConfig(decode_path="staged", slots_per_layer=k * load_spec(tiny_model).k, expert_source="slots")
    with Engine(tiny_model, cfg, oracle=oracle) as e:
        got = [ev.token for ev in e.stream(PROMPT, max_tokens=10)]
        again = [ev.token for ev in e.stream(PROMPT, max_tokens=10)]  # reset + sticky slots across runs
        assert e.streaming.stager.scheduler.stats.hits > 0
    assert got == expected and again == expected


@pytest.mark.parametrize("path,extra,source", [
    ("whole_layer", {}, "slots"),  # every expert of the layer read, routing used as it is
    ("staged", {"slots_per_layer": 4}, "slots"),  # S = k
    ("hot", {"hot_experts": 4}, "slots"),  # H = k: misses every step
    ("hot", {"hot_experts": 16}, "slots"),  # H = E: hits after warm-up
    ("hot", {"hot_experts": 4096}, "slots"),  # every expert of each layer resident: the routing never read
    ("exact", {}, "mapping"),  # computed where the checkpoint's mapping holds the experts
    ("staged", {}, "mapping"),
    ("hot", {}, "mapping"),
    ("whole_layer", {}, "mapping"),
])
def test_decode_paths_are_bit_identical_to_exact(tiny_model, path, extra, source):
    """Against the exact path over its bundle; each path with its experts read into its
    buffers (slots) and computed where the checkpoint's mapping holds them."""
    oracle, tokens, ids = record(tiny_model, n=8)
    base = replay_logits(tiny_model, EngineConfig(expert_source="slots"), ids, tokens)
    other = replay_logits(tiny_model, EngineConfig(decode_path=path, expert_source=source, **extra), ids, tokens,
                          oracle=oracle)
    assert len(base) == len(other) == len(tokens) + 1
    for step, (a, b) in enumerate(zip(base, other)):
        assert mx.array_equal(a, b).item(), f"step {step}: max diff {mx.abs(a - b).max().item()}"


@pytest.mark.parametrize("path,extra,source", [
    ("whole_layer", {}, "slots"),
    ("hot", {"hot_experts": 4}, "slots"),  # more distinct experts than the hot set: falls to exact
    ("hot", {"hot_experts": 16}, "slots"),
    ("exact", {"bundle_capacity": 4}, "slots"),  # more distinct experts than the bundle: chunks
    ("exact", {}, "mapping"),  # every row's experts where the mapping holds them
])
def test_prefill_paths_are_bit_identical_to_exact(tiny_model, path, extra, source):
    _, tokens, ids = record(tiny_model, n=2)
    base = replay_logits(tiny_model, EngineConfig(expert_source="slots"), ids, tokens)
    other = replay_logits(tiny_model, EngineConfig(prefill_path=path, expert_source=source, **extra), ids, tokens)
    assert all(mx.array_equal(a, b).item() for a, b in zip(base, other))


def test_mixed_paths_per_layer_and_phase(qwen):
    oracle, expected, _ = record(qwen)
    cfg = EngineConfig(decode_path="staged", prefill_path="whole_layer", oracle_file=None, expert_source="slots",
                       layer_paths=((0, "decode", "hot"), (1, "decode", "exact"), (3, "prefill", "exact")))
    with Engine(qwen, cfg, oracle=oracle) as e:
        assert [ev.token for ev in e.stream(PROMPT, max_tokens=10)] == expected
        assert e.streaming.stager.layers == [2, 3] and e.streaming.whole.layers == [0, 1, 2]


def test_staged_decode_needs_no_host_sync_per_layer(qwen):
    """Counted at MLX's own level (tests/syncs.py): every mx.eval, .item(), .tolist(),
    scalar and NumPy conversion, not only the facade's calls."""
    from tests.syncs import count_syncs

    oracle, tokens, ids = record(qwen, n=6)

    def syncs_per_step(config):
        with step_model(qwen, config, oracle) as (model, cache):
            mx.eval(model(mx.array([ids[:-1]]), cache=cache))
            counts = []
            with count_syncs() as counter:
                for t in [ids[-1]] + tokens[:3]:
                    before = counter.snapshot()
                    logits = model(mx.array([[t]]), cache=cache)
                    after = counter.snapshot()
                    counts.append({k: after[k] - before[k] for k in after if after[k] != before[k]})
                    mx.eval(logits)
            return counts

    n_layers = 4
    # exact: per layer, the routing comes to the host (and the bundle's last reader is settled)
    assert all(c["numpy"] == n_layers for c in syncs_per_step(EngineConfig(expert_source="slots")))
    # staged: no layer evaluates or waits in the building thread (each waits for its slots
    # inside the graph); once per step the routing-mismatch counter is read: O(1) per step
    # (the previous step, evaluated by whoever read its logits, is not evaluated again)
    assert syncs_per_step(EngineConfig(decode_path="staged", expert_source="slots")) == [{"numpy": 1}] * 4
    # over the checkpoint's mapping neither path reads anything to the host during the step
    assert syncs_per_step(EngineConfig(expert_source="mapping")) == [{}] * 4


def test_wrong_oracle_is_detected_not_silent(qwen, tiny_model_factory):
    other, _, _ = record(qwen, prompt="x = [1, 2, 3]\nprint(x)\n", n=6)
    with Engine(qwen, EngineConfig(decode_path="staged", expert_source="slots"), oracle=other) as e:
        with pytest.raises(RoutingMismatchError, match="routed to an expert its plan did not stage"):
            list(e.stream(PROMPT, max_tokens=6))


def test_oracle_shorter_than_the_run(qwen):
    oracle, _, _ = record(qwen, n=3)
    # 3 tokens take 3 one-token forwards (the last prompt token's, then one per token but the last)
    with Engine(qwen, EngineConfig(decode_path="staged"), oracle=oracle) as e:
        with pytest.raises(ConfigError, match="covers 3 decode steps; step 3 was requested"):
            list(e.stream(PROMPT, max_tokens=8))


def test_oracle_file_roundtrip_and_errors(qwen, tmp_path):
    oracle, expected, _ = record(qwen, n=5)
    path = tmp_path / "routing.json"
    oracle.save(path)
    again = OracleRouting.load(path)
    assert again.steps == oracle.steps and len(again) == 5
    with Engine(qwen, EngineConfig(decode_path="staged", oracle_file=str(path))) as e:
        assert [ev.token for ev in e.stream(PROMPT, max_tokens=5)] == expected
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(ConfigError, match="is not an oracle routing file"):
        OracleRouting.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="does not exist"):
        OracleRouting.load(tmp_path / "missing.json")
    with Engine(qwen, EngineConfig(decode_path="staged")) as e:
        with pytest.raises(ConfigError, match="needs a routing source"):
            list(e.stream(PROMPT, max_tokens=2))


def test_memory_budget_and_bad_paths(qwen):
    with pytest.raises(ConfigError, match=r"expert buffers need .* whole-layer buffers .* over memory_budget_mb=1"):
        load_streaming_model(qwen, EngineConfig(prefill_path="whole_layer", bundle_capacity=64, memory_budget_mb=1))
    with pytest.raises(ConfigError, match=r"layer_paths names layer 9, which is not a MoE layer"):
        load_streaming_model(qwen, EngineConfig(layer_paths=((9, "decode", "hot"),)))
    with pytest.raises(ConfigError, match="prefill_path 'staged' is not supported"):
        EngineConfig(prefill_path="staged")
    with pytest.raises(ConfigError, match="slots_per_layer must be >= k = 4, got 2"):
        load_streaming_model(qwen, EngineConfig(decode_path="staged", slots_per_layer=2))
