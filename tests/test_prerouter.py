"""The prerouter: heads files, training, and prediction as routing at decode."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from edge0 import ConfigError, Engine, EngineConfig, HeaderError
from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.engine import StepModel, load_streaming_model
from edge0.prerouter.files import ForeignArtifactError, checkpoint_identity, load_heads, save_heads
from edge0.train.heads import train_heads

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


@pytest.fixture(scope="module")
def trained(tiny_model_factory, tmp_path_factory):
    """family -> (model dir, training report); heads trained once per family."""
    out = {}

    def get(family):
        if family not in out:
            from tests.ckpt_tools import copy_model

            d = copy_model(tiny_model_factory(family), tmp_path_factory.mktemp(f"pr-{family}") / "m")
            report = train_heads(d, tokens=4000, heldout_tokens=1500, steps=150, width=64, seq_len=96)
            out[family] = (d, report)
        return out[family]

    return get


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_staged_set_equals_routed_set_for_64_steps(trained, family):
    d, _ = trained(family)
    with Engine(d) as engine:
        s = engine.streaming
        stager = s.stager
        assert stager is not None and stager.prerouter is not None
        assert stager.layers == s.prerouter.heads.consumers()
        plans, used = {}, {}
        submit = stager.scheduler.submit

        def record_plan(plan):
            plans[plan.step] = {lp.layer: set(lp.experts) for lp in plan.layers}
            submit(plan)

        stager.scheduler.submit = record_plan
        blocks = s.blocks()
        owners_observer = s.prerouter.observe

        def observe(layer, x, inds):
            if x.shape[-2] == 1 and layer in stager.layers:
                used.setdefault(stager.step, {})[layer] = set(np.array(inds).reshape(-1).tolist())
            if layer in s.prerouter.owners:
                owners_observer(layer, x, inds)

        for l in s.spec.moe_layers:
            blocks[l].observer = observe
        events = list(engine.stream(PROMPT, max_tokens=64))
    assert len(events) == 64
    planned_steps = sorted(plans)
    assert len(planned_steps) >= 64  # every decode step was staged from a prediction
    for step in planned_steps:
        if step in used:
            assert used[step] == plans[step], f"step {step}"
    assert len([st for st in planned_steps if st in used]) >= 64


def test_trained_heads_beat_the_warm_start(trained):
    _, report = trained("qwen3_moe")
    mean = lambda d: np.mean([v["recall_at_k"] for v in d.values()])
    assert mean(report["after"]) > mean(report["before"]) + 0.01
    assert report["losses"][-1] < report["losses"][0]


def test_heads_save_reload_is_bit_identical(trained, tmp_path):
    d, _ = trained("qwen3_moe")
    heads, meta = load_heads(d / "prerouter.safetensors", d)
    path = save_heads(heads, tmp_path / "again.safetensors", base_identity=meta["base_identity"],
                      recipe={"copy": True}, training_data="test")
    again, meta2 = load_heads(path, d)
    a, b = bnn.parameters_flat(heads), bnn.parameters_flat(again)
    assert set(a) == set(b) and all(mx.array_equal(a[k], b[k]).item() and a[k].dtype == b[k].dtype for k in a)
    for key in ("format", "base_identity", "owners", "shape", "recipe", "training_data", "created", "edge0_version"):
        assert key in meta, key
    assert meta2["base_identity"] == checkpoint_identity(d)


def test_foreign_or_malformed_heads_are_refused(trained, tiny_model_factory, tmp_path):
    d, _ = trained("qwen3_moe")
    other = tiny_model_factory("qwen3_moe", layers=3)
    with pytest.raises(ForeignArtifactError, match="heads were made for another base checkpoint"):
        load_heads(d / "prerouter.safetensors", other)
    with pytest.raises(ForeignArtifactError):
        load_streaming_model(other, EngineConfig(prerouter_file=str(d / "prerouter.safetensors")))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(HeaderError):
        load_heads(bad, d)


def test_prerouter_off_and_required(trained, tiny_model_factory):
    d, _ = trained("qwen3_moe")
    with Engine(d, EngineConfig(prerouter="off")) as e:
        assert e.streaming.stager is None
    with pytest.raises(ConfigError, match="do not exist"):
        load_streaming_model(tiny_model_factory("mixtral"), EngineConfig(prerouter="on"))


def test_host_syncs_per_step_do_not_grow_with_layers(tiny_model_factory, tmp_path):
    from tests.ckpt_tools import copy_model

    counts = {}
    for layers in (3, 6):
        d = copy_model(tiny_model_factory("qwen3_moe", layers=layers), tmp_path / f"m{layers}")
        train_heads(d, tokens=600, heldout_tokens=300, steps=2, width=32, seq_len=64)
        s = load_streaming_model(d, EngineConfig())
        try:
            assert len(s.stager.layers) == layers - 1
            s.stager.reset()
            model = StepModel(s)
            cache = bnn.make_cache(model)
            mx.eval(model(mx.array([[5, 6, 7, 8]]), cache=cache))
            per_step = []
            for t in (9, 10, 11, 12):
                before = dict(B.SYNCS)
                logits = model(mx.array([[t]]), cache=cache)
                per_step.append(sum(B.SYNCS[k] - before[k] for k in B.SYNCS))
                mx.eval(logits)
            counts[layers] = per_step
        finally:
            s.close()
    # 2 for the step (await the previous one; one read of every predicted set) + 2 for layer 0,
    # which no head predicts and so routes itself on the exact path; nothing per staged layer
    assert counts[3] == counts[6] == [4, 4, 4, 4]


def test_quality_guard_reports_recall(trained):
    d, _ = trained("deepseek_v3")
    with Engine(d, EngineConfig(guard_every=2)) as e:
        events = list(e.stream(PROMPT, max_tokens=12))
        recall = e.streaming.stager.guard_recall
    assert set(recall) == set(e.streaming.stager.layers)
    assert all(0.0 <= v <= 1.0 for values in recall.values() for v in values)
    assert all(len(values) >= 5 for values in recall.values())
    stats = events[-1].stats
    assert stats.guard_recall and set(stats.guard_recall) == set(recall)


def test_served_perplexity_matches_a_full_forward(trained):
    """Own-gates served perplexity (token by token) equals a whole-sequence forward's."""
    import math

    from edge0.prerouter.quality import served_perplexity

    d, _ = trained("qwen3_moe")
    tokens = list(range(3, 60))
    own = served_perplexity(d, tokens, EngineConfig(prerouter="off"), window=64)
    s = load_streaming_model(d, EngineConfig(prerouter="off"))
    try:
        logits = s.model(mx.array([tokens[:-1]]))[0].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll = -float(mx.take_along_axis(logp, mx.array(tokens[1:])[:, None], axis=-1).mean().item())
    finally:
        s.close()
    assert own["tokens"] == len(tokens) - 1
    assert abs(own["perplexity"] - math.exp(nll)) / math.exp(nll) < 1e-4
    pre = served_perplexity(d, tokens, EngineConfig(prerouter="on"), window=64)
    assert pre["staged_layers"] == [1, 2, 3] and math.isfinite(pre["perplexity"])
