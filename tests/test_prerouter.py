"""The prerouter: heads files, training, and prediction as routing at decode."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from edge0 import ConfigError, Engine, EngineConfig, HeaderError
from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.loader import load_streaming_model
from edge0.streaming import StepModel
from edge0.exec.plan import PrerouterPlanner
from edge0.prerouter.files import ForeignArtifactError, checkpoint_identity, load_heads, save_heads
from edge0.train.heads import train_heads
from tests.reference import record_staging

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
        assert stager is not None and isinstance(stager.planner, PrerouterPlanner)
        assert stager.layers == s.prerouter.heads.consumers()
        plans, used, events = record_staging(engine, PROMPT, 64)
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


def _staged_step_syncs(d, monkeypatch, config=None):
    """Per decode step: MLX-level syncs of the whole forward, and of the staged blocks alone."""
    from tests.syncs import count_syncs

    s = load_streaming_model(d, config or EngineConfig())
    try:
        staged = set(s.stager.layers)
        blocks = s.blocks()
        routers = s.routers()
        staged_ids = {id(blocks[l]): routers[l] for l in staged}
        cls = type(blocks[min(staged)])
        s.stager.reset()
        model = StepModel(s)
        cache = bnn.make_cache(model)
        mx.eval(model(mx.array([[5, 6, 7, 8]]), cache=cache))
        inside: list = []
        call = cls.__call__

        def counted_call(self, x):
            # (a probe routing predicted logits runs on a clone of the block: not a step)
            if id(self) not in staged_ids or x.shape[-2] != 1:
                return call(self, x)
            before = counter.snapshot()
            y = call(self, x)
            after = counter.snapshot()
            inside.append({k: after[k] - before[k] for k in after if after[k] != before[k]})
            return y

        monkeypatch.setattr(cls, "__call__", counted_call)
        per_step = []
        with count_syncs() as counter:
            for t in (9, 10, 11, 12):
                before = counter.snapshot()
                logits = model(mx.array([[t]]), cache=cache)
                after = counter.snapshot()
                per_step.append({k: after[k] - before[k] for k in after if after[k] != before[k]})
                mx.eval(logits)
        monkeypatch.setattr(cls, "__call__", call)
        return per_step, inside, len(staged)
    finally:
        s.close()


def test_host_syncs_per_step_do_not_grow_with_layers(tiny_model_factory, tmp_path, monkeypatch):
    """Counted at MLX's own level (tests/syncs.py), not through the facade: every mx.eval,
    .item(), .tolist(), scalar conversion and NumPy conversion, whoever makes it; with the
    heads flushed in MLX (the default) and in NumPy."""
    from tests.ckpt_tools import copy_model

    results = {}
    for layers in (3, 6):
        d = copy_model(tiny_model_factory("qwen3_moe", layers=layers), tmp_path / f"m{layers}")
        train_heads(d, tokens=600, heldout_tokens=300, steps=2, width=32, seq_len=64)
        for flush in ("mlx", "numpy"):
            for source in ("slots", "mapping"):
                results[layers, flush, source] = _staged_step_syncs(d, monkeypatch, EngineConfig(
                    prerouter_flush=flush, expert_source=source))
    for (layers, flush, source), (per_step, inside, n_staged) in results.items():
        assert n_staged == layers - 1
        # a staged layer calls nothing of MLX's evaluator: its wait for its slots is an op
        # of the step's graph
        assert len(inside) == 4 * n_staged
        assert all(c == {} for c in inside), inside
        # per step: the step hook reads every predicted set at once (numpy); the previous
        # step, evaluated when its logits were, is not evaluated again; layer 0, which no
        # head predicts, routes itself on the exact path: its routing comes to the host
        # (numpy) and its bundle's last reader is settled (eval). A flush in NumPy reads the
        # heads' inputs (computed already) to the host once more. Nothing grows with the
        # number of staged layers. Over the checkpoint's mapping layer 0 reads nothing to the
        # host either: the step's one read is the predicted sets.
        for counts in per_step:
            if source == "slots":
                assert counts == {"eval": 1, "numpy": 2 + (flush == "numpy")}, counts
            else:
                assert counts == {"numpy": 1 + (flush == "numpy")}, counts


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

    from edge0.train.quality import served_perplexity

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


def _strong_bias_deepseek(tiny_model_factory, path):
    """A deepseek_v3 copy whose score-correction bias moves the selection (+0.5 on every
    third expert), with warm-start heads beside it."""
    from tests.ckpt_tools import copy_model
    from edge0.train.heads import make_warm_heads

    def mutate(tensors):
        for t in tensors:
            if t["name"].endswith("e_score_correction_bias"):
                n = t["shape"][0]
                bias = np.where(np.arange(n) % 3 == 0, 0.5, -0.1).astype(np.float32)
                t["data"] = bias.tobytes()
                assert t["dtype"] == "F32"

    d = copy_model(tiny_model_factory("deepseek_v3"), path, mutate=mutate)
    make_warm_heads(d, d / "prerouter.safetensors", width=32)
    return d


class _Returns:
    """A router stand-in for the reference block: returns what it was given."""

    def __init__(self, value):
        self.value = value

    def __call__(self, x):
        return self.value


def _reference_block(model_dir, spec, layer):
    """Layer ``layer``'s block of mlx-lm's own resident model (float32, every expert loaded)."""
    from mlx_lm.utils import load_model

    ref, _ = load_model(model_dir)
    bnn.cast_model(ref, mx.float32)
    return bnn.module_at(ref, spec.block_path(layer))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_prediction_is_the_routing_weights_included(trained, tiny_model_factory, tmp_path, family):
    """Every staged decode layer computes what mlx-lm's own block computes when its router
    returns the predicted logits: experts and combine weights both from the prediction.
    Checked bit for bit against mlx-lm's resident block (for deepseek_v3, whose gate
    multiplies inline, the reference gate is mlx-lm's group_expert_select on the predicted
    logits, with the layer's score-correction bias); and the check is sensitive: the block on
    its own router gives another output at most steps."""
    from mlx_lm.models.deepseek_v3 import group_expert_select

    from edge0.model.spec import load_config

    d = _strong_bias_deepseek(tiny_model_factory, tmp_path / "m") if family == "deepseek_v3" else trained(family)[0]
    seen = []
    with Engine(d, EngineConfig(kernels="mlx")) as engine:  # the reference block runs mlx-lm's kernels
        s = engine.streaming
        stager, blocks = s.stager, s.blocks()
        for l in stager.layers:
            blk = blocks[l]
            cls = type(blk)

            def call(inner, x, _cls=cls, _l=l):
                y = _cls.__call__(inner, x)
                z = stager.planned_logits(_l)
                if x.shape[-2] == 1 and z is not None:
                    mx.eval(x, z, y)  # on the engine's compute thread, whose stream made them
                    seen.append((_l, x, z, y))
                return y

            blk.__class__ = type(f"Recorded{cls.__name__}", (cls,), {"__call__": call})
        list(engine.stream(PROMPT, max_tokens=12))
        spec = s.spec
    cfg = load_config(d)
    assert len(seen) >= 10 * len(stager.layers)
    differs = 0
    refs = {l: _reference_block(d, spec, l) for l in stager.layers}
    for layer, x, z, y in seen:
        ref = refs[layer]
        gate = ref.gate
        if family == "deepseek_v3":
            routed = group_expert_select(z.astype(mx.float32), gate.e_score_correction_bias, cfg["num_experts_per_tok"],
                                         cfg["n_group"], cfg["topk_group"], cfg["routed_scaling_factor"],
                                         cfg["norm_topk_prob"])
            ref.gate = _Returns(routed)
        else:
            ref.gate = _Returns(z.reshape(*x.shape[:-1], -1).astype(x.dtype))
        try:
            expected = ref(x)
        finally:
            ref.gate = gate
        assert mx.array_equal(y, expected).item(), f"layer {layer}: {mx.abs(y - expected).max().item()}"
        differs += not mx.array_equal(y, ref(x)).item()
    assert differs > len(seen) // 2


def test_predicted_routing_applies_the_score_correction_bias(tiny_model_factory, tmp_path):
    """Sigmoid-group families: the prediction goes through the consumer's routing function
    with the consumer's e_score_correction_bias, as mlx-lm's own gate does (its
    ``group_expert_select`` is the reference here)."""
    from mlx_lm.models.deepseek_v3 import group_expert_select

    d = _strong_bias_deepseek(tiny_model_factory, tmp_path / "m")
    with Engine(d) as engine:
        s = engine.streaming
        blocks = s.blocks()
        heads = s.prerouter.heads
        predict_all = s.prerouter.logits
        logits_seen, planned_seen = [], []

        def capture_logits(*a):
            out = predict_all(*a)
            logits_seen.append(out)
            return out

        s.prerouter.logits = capture_logits
        flush = s.stager.planner.flush

        def capture_flush(*a):
            out = flush(*a)
            if out is not None:
                planned_seen.append(out)
            return out

        s.stager.planner.flush = capture_flush
        list(engine.stream(PROMPT, max_tokens=12))
    from edge0.model.spec import load_config

    cfg = load_config(d)
    args = (cfg["num_experts_per_tok"], cfg["n_group"], cfg["topk_group"], cfg["routed_scaling_factor"],
            cfg["norm_topk_prob"])
    moved = 0
    assert len(logits_seen) == len(planned_seen) >= 10
    for logits, planned in zip(logits_seen, planned_seen):
        for i, owner in enumerate(heads.owners):
            consumer = heads.consumer[owner]
            bias = blocks[consumer].gate.original.e_score_correction_bias
            z = logits[i].astype(mx.float32)
            ref = group_expert_select(z, bias, *args)
            inds, predicted = planned[consumer]
            assert mx.array_equal(predicted, z).item()
            assert mx.array_equal(inds, ref[0].reshape(inds.shape)).item()
            unbiased = group_expert_select(z, mx.zeros_like(bias), *args)
            moved += not mx.array_equal(mx.sort(unbiased[0]), mx.sort(ref[0])).item()
    assert moved > 0  # the bias changes the selection here, so dropping it would be seen


_LOAD_HEADS = ("import sys\nfrom edge0.errors import CheckpointError\nfrom edge0.prerouter.files import load_heads\n"
               "try:\n    heads, _ = load_heads(sys.argv[1], sys.argv[2])\nexcept CheckpointError as e:\n    print(e)\n"
               "else:\n    print(len(heads.owners), 'heads')")


def test_crafted_heads_files_are_refused_in_one_line_before_their_heads_are_built(tmp_path):
    """The demo's heads file, its header rewritten: metadata naming 20,000 owners (whose heads
    would cost gigabytes to build, whatever the file holds), a tensor name with a huge index,
    a huge format value. Each is one short line naming the file, at the valid file's memory
    (measured without a spec: the path that builds heads from the metadata alone)."""
    import json

    from edge0.cli import PACKAGED_DEMO
    from edge0.model.safetensors_header import read_header
    from edge0.prerouter.files import HEADS_FILENAME
    from edge0.errors import CheckpointError
    from tests.ckpt_tools import peak_rss, rewrite_header

    src = PACKAGED_DEMO / HEADS_FILENAME
    held = len(read_header(src).tensors)
    owners = rewrite_header(src, tmp_path / "owners.safetensors", lambda tensors, meta: meta.update(
        owners=json.dumps(list(range(20000))), consumers=json.dumps(list(range(1, 20001)))))
    with pytest.raises(CheckpointError) as e:
        load_heads(owners, PACKAGED_DEMO)
    assert str(e.value) == (f"file {owners}: heads tensors differ from the metadata's shape: its 20000 owners' heads "
                            f"have 120000 tensors, the file holds {held}")

    def rename(tensors, meta):
        next(t for t in tensors if t["name"] == "heads.layer0.fc1.bias")["name"] = "heads.layer50000000.fc1.bias"
    name = rewrite_header(src, tmp_path / "name.safetensors", rename)
    with pytest.raises(CheckpointError) as e:
        load_heads(name, PACKAGED_DEMO)
    assert str(e.value) == (f"file {name}: heads tensors differ from the metadata's shape: missing "
                            "['heads.layer0.fc1.bias'], unexpected ['heads.layer50000000.fc1.bias']")
    fmt = rewrite_header(src, tmp_path / "format.safetensors", lambda tensors, meta: meta.update(format="x" * 10**6))
    with pytest.raises(CheckpointError) as e:
        load_heads(fmt, PACKAGED_DEMO)
    assert str(e.value) == (f"file {fmt}: not an Edge0 prerouter heads file (format '{'x' * 59}... (1000002 "
                            "characters), expected 'edge0-prerouter/1')")

    said, valid_kib = peak_rss(_LOAD_HEADS, src, PACKAGED_DEMO)
    assert said == f"{held // 6} heads"
    said, crafted_kib = peak_rss(_LOAD_HEADS, owners, PACKAGED_DEMO)
    assert said.startswith(f"file {owners}: heads tensors differ") and "\n" not in said
    assert crafted_kib < 2 * valid_kib, (crafted_kib, valid_kib)
