"""Select routing (candidate staging) and heads that see the token being decoded.

Select: the prerouter stages the top k+m predicted experts of each staged layer and the
layer's own router chooses its k among them. Checked through the engine on every family
the prerouter tests cover: every routed expert was staged; the weights are the router's
own; with every expert staged the output is own-gate routing bit for bit; replace is what
it was. Token heads: the flush hands each head the embedding of the token the step decodes.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from edge0 import CheckpointError, ConfigError, Engine, EngineConfig
from edge0.backend import nn as bnn
from edge0.loader import load_streaming_model
from edge0.prerouter.files import load_heads
from edge0.train.heads import train_heads
from edge0.train.quality import served_logprobs
from tests.reference import record_staging

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
FAMILIES = ["qwen3_moe", "deepseek_v3"]


@pytest.fixture(scope="module")
def heads(tiny_model_factory, tmp_path_factory):
    """(family, token input) -> model directory with heads beside it (trained once)."""
    from tests.ckpt_tools import copy_model

    out = {}

    def get(family, token=True, serving=None):
        key = (family, token, json.dumps(serving, sort_keys=True))
        if key not in out:
            d = copy_model(tiny_model_factory(family), tmp_path_factory.mktemp(f"sel-{family}") / "m")
            train_heads(d, tokens=3000, heldout_tokens=600, steps=60, width=32, seq_len=64, token_input=token,
                        serving=serving)
            out[key] = d
        return out[key]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_select_stages_every_routed_expert(heads, family):
    d = heads(family)
    with Engine(d, EngineConfig(routing="select", stage_extra=2, kernels="mlx")) as engine:  # the reference: mlx-lm's
        k = engine.streaming.spec.k
        plans, used, _ = record_staging(engine, PROMPT, 24)
    steps = [st for st in used if st in plans]
    assert len(steps) >= 20
    for st in steps:
        for layer, experts in used[st].items():
            assert len(plans[st][layer]) == k + 2, (st, layer)
            assert len(experts) == k and experts <= plans[st][layer], (st, layer, experts, plans[st][layer])


@pytest.mark.parametrize("extra", [2, 0])
@pytest.mark.parametrize("family", FAMILIES)
def test_select_routes_by_the_layers_own_router_among_the_staged(heads, family, extra):
    """Each staged layer's block computes what mlx-lm's block computes on its own router
    with the unstaged experts masked (softmax: -inf logits; sigmoid-group: the ranking bias
    lowered), weights included; and the choice differs from the prediction's at some steps.
    With m = 0 the routed experts are the predicted k (what replace reads), weighted by the
    layer's own router."""
    from mlx_lm.models.deepseek_v3 import group_expert_select

    from edge0.model.spec import load_config

    d = heads(family)
    cfg = load_config(d)
    seen = []
    with Engine(d, EngineConfig(routing="select", stage_extra=extra, kernels="mlx")) as engine:
        s = engine.streaming
        stager, blocks = s.stager, s.blocks()
        for l in stager.layers:
            cls = type(blocks[l])

            def call(inner, x, _cls=cls, _l=l):
                y = _cls.__call__(inner, x)
                route = stager.layer_route(_l)
                if x.shape[-2] == 1 and route is not None:
                    mx.eval(x, y, route.staged, stager.predicted[_l][0])
                    seen.append((_l, x, route.staged, stager.predicted[_l][0], y))
                return y

            blocks[l].__class__ = type(f"Recorded{cls.__name__}", (cls,), {"__call__": call})
        list(engine.stream(PROMPT, max_tokens=12))
        spec = s.spec
    from tests.test_prerouter import _reference_block, _Returns

    refs = {l: _reference_block(d, spec, l) for l in stager.layers}
    assert len(seen) >= 10 * len(stager.layers)
    chose_other = 0
    for layer, x, staged, candidates, y in seen:
        ref = refs[layer]
        gate = ref.gate
        mask = staged.reshape(-1)
        if family == "deepseek_v3":
            own = x @ gate.weight.T
            bias = mx.where(mask, gate.e_score_correction_bias, gate.e_score_correction_bias - 1e4)
            routed = group_expert_select(own, bias, cfg["num_experts_per_tok"], cfg["n_group"], cfg["topk_group"],
                                         cfg["routed_scaling_factor"], cfg["norm_topk_prob"])
            inds = routed[0]
            # the combine weights are the unbiased sigmoid scores of the chosen experts
            raw = mx.take_along_axis(mx.sigmoid(own.astype(mx.float32)), inds, axis=-1)
            want = raw / raw.sum(-1, keepdims=True) if cfg["norm_topk_prob"] else raw
            assert mx.allclose(routed[1], want * cfg["routed_scaling_factor"], rtol=1e-6).item()
            ref.gate = _Returns(routed)
        else:
            own = gate(x)
            masked = mx.where(mask, own, mx.array(float("-inf"), dtype=own.dtype))
            inds = mx.argpartition(mx.softmax(masked, axis=-1, precise=True), kth=-spec.k, axis=-1)[..., -spec.k:]
            ref.gate = _Returns(masked)
        try:
            expected = ref(x)
        finally:
            ref.gate = gate
        assert mx.array_equal(y, expected).item(), f"layer {layer}: {mx.abs(y - expected).max().item()}"
        chosen, offered = set(np.array(inds).reshape(-1).tolist()), set(np.array(candidates).reshape(-1).tolist())
        assert chosen <= offered and (extra or chosen == offered) and len(offered) == spec.k + extra
        chose_other += not mx.array_equal(y, ref(x)).item()  # own gate, unmasked: differs sometimes
    assert 0 < chose_other and (chose_other < len(seen) or not extra)


@pytest.mark.parametrize("family", FAMILIES)
def test_select_with_every_expert_staged_is_own_gate_routing(heads, family):
    d = heads(family)
    tokens = list(range(5, 70))
    with Engine(d) as engine:
        experts = engine.streaming.spec.num_experts
        k = engine.streaming.spec.k
    own = served_logprobs(d, tokens, EngineConfig(prerouter="off"), window=64)
    full = served_logprobs(d, tokens, EngineConfig(routing="select", stage_extra=experts - k), window=64)
    part = served_logprobs(d, tokens, EngineConfig(routing="select", stage_extra=2), window=64)
    assert full["staged_layers"] and full["routing"] == ("select", experts - k)
    assert np.array_equal(own["logp"], full["logp"])
    assert not np.array_equal(own["logp"], part["logp"])  # staging fewer experts is a real restriction


@pytest.mark.parametrize("family", FAMILIES)
def test_replace_is_prediction_as_routing_whatever_the_file_records(heads, family):
    """A heads file recording select serves select under routing auto; routing replace
    serves what a file without a record serves (the prediction is the routing)."""
    plain = heads(family)
    recorded = heads(family, serving={"routing": "select", "stage_extra": 2})
    tokens = list(range(5, 60))
    a = served_logprobs(plain, tokens, EngineConfig(), window=64)
    b = served_logprobs(recorded, tokens, EngineConfig(routing="replace"), window=64)
    c = served_logprobs(recorded, tokens, EngineConfig(), window=64)
    assert a["routing"] == b["routing"] == ("replace", 0) and c["routing"] == ("select", 2)
    assert np.array_equal(a["logp"], b["logp"])
    assert not np.array_equal(a["logp"], c["logp"])
    with Engine(recorded) as engine:
        events = list(engine.stream(PROMPT, max_tokens=4))
    assert "select k+2" in events[-1].stats.heads and "token" in events[-1].stats.heads


def test_select_adds_no_host_sync(heads, monkeypatch):
    from tests.test_prerouter import _staged_step_syncs

    per_step, inside, n_staged = _staged_step_syncs(heads("qwen3_moe"), monkeypatch,
                                                    EngineConfig(routing="select", stage_extra=2,
                                                                 prerouter_flush="numpy", expert_source="slots"))
    assert len(inside) == 4 * n_staged and all(c == {} for c in inside), inside
    for counts in per_step:  # as replace: tests/test_prerouter.py::test_host_syncs_per_step_do_not_grow_with_layers
        assert counts == {"eval": 1, "numpy": 3}, counts


def test_token_heads_are_handed_the_token_being_decoded(heads):
    """At every planned step the flush computes each head on the embedding row of the token
    the step decodes; with a different token the prediction differs."""
    d = heads("qwen3_moe")
    with Engine(d) as engine:
        s = engine.streaming
        pr = s.prerouter
        assert pr.heads.sees_token and pr.heads.token_dim == s.embed_dim
        calls = []
        predict_all = pr.logits

        def capture(h, inds_t, inds_prev, tok=None):
            out = predict_all(h, inds_t, inds_prev, tok)
            calls.append((h, inds_t, inds_prev, tok, out))
            return out

        pr.logits = capture
        planner = s.stager.planner
        flush = planner.flush
        fed = []

        def planned(inputs, observed):
            out = flush(inputs, observed)
            if out is not None:
                fed.append(inputs)
            return out

        planner.flush = planned
        list(engine.stream(PROMPT, max_tokens=10))
        assert len(calls) == len(fed) >= 8
        differs = 0
        for (h, it, ip, tok, out), ids in zip(calls, fed):
            want = s.embed(ids.reshape(1, 1))
            assert mx.array_equal(tok, want).item()
            other = predict_all(h, it, ip, s.embed((ids.reshape(1, 1) + 1) % 100))
            differs += not mx.array_equal(other, out).item()
    assert differs == len(calls)


def test_heads_files_record_their_inputs_and_serving(heads, tmp_path):
    d = heads("qwen3_moe", serving={"routing": "select", "stage_extra": 3})
    h, meta = load_heads(d / "prerouter.safetensors", d)
    assert json.loads(meta["inputs"]) == ["hidden", "experts_t", "experts_prev", "token"]
    assert json.loads(meta["serving"]) == {"routing": "select", "stage_extra": 3}
    assert h.sees_token and "heads.layer1.token.weight" in bnn.parameters_flat(h)
    base = heads("qwen3_moe", token=False)
    hb, mb = load_heads(base / "prerouter.safetensors", base)
    assert json.loads(mb["inputs"]) == ["hidden", "experts_t", "experts_prev"] and not hb.sees_token
    # a file written before heads recorded inputs or serving loads as base heads, replace
    legacy = dict(mb)
    for key in ("inputs", "serving"):
        legacy.pop(key, None)
    legacy["shape"] = json.dumps({k: v for k, v in json.loads(mb["shape"]).items() if k != "token_dim"})
    arrays = {k: v for k, v in bnn.parameters_flat(hb).items()}
    mx.save_safetensors(str(tmp_path / "old.safetensors"), arrays, legacy)
    old, old_meta = load_heads(tmp_path / "old.safetensors", base)
    assert not old.sees_token and "serving" not in old_meta
    s = load_streaming_model(base, EngineConfig(prerouter_file=str(tmp_path / "old.safetensors")))
    try:
        assert s.routing == ("replace", 0)
    finally:
        s.close()
    for key, value, match in (("inputs", json.dumps(["hidden"]), "known input sets"),
                              ("serving", json.dumps({"routing": "both"}), "serving"),
                              ("serving", json.dumps({"routing": "select", "stage_extra": -1}), "stage_extra"),
                              ("shape", json.dumps(dict(json.loads(mb["shape"]), token_dim=8)), "token_dim")):
        bad = dict(mb, **{key: value})
        mx.save_safetensors(str(tmp_path / "bad.safetensors"), arrays, bad)
        with pytest.raises(CheckpointError, match=match):
            load_heads(tmp_path / "bad.safetensors", base)


def test_select_settings_are_checked(heads):
    d = heads("qwen3_moe")
    with pytest.raises(ConfigError, match="applies to routing 'select'"):
        EngineConfig(routing="replace", stage_extra=2)
    with pytest.raises(ConfigError, match="routing must be auto, replace or select, got .guess."):
        EngineConfig(routing="guess")
    with pytest.raises(ConfigError, match="more than the 16 experts"):
        load_streaming_model(d, EngineConfig(routing="select", stage_extra=13))
    with pytest.raises(ConfigError, match="cannot hold"):
        load_streaming_model(d, EngineConfig(routing="select", stage_extra=4, slots_per_layer=6, expert_source="slots"))
    ds = heads("deepseek_v3")
    with pytest.raises(ConfigError, match="expert groups"):
        load_streaming_model(ds, EngineConfig(routing="select", stage_extra=6))
    s = load_streaming_model(d, EngineConfig(routing="select", expert_source="slots"))  # no count given: 2k staged
    try:
        assert s.routing == ("select", s.spec.k) and s.stager.slots == min(4 * s.spec.k, s.spec.num_experts)
    finally:
        s.close()


@pytest.mark.parametrize("family,routing,flush", [(f, r, "mlx") for f in FAMILIES for r in ("replace", "select")]
                         + [("qwen3_moe", r, "numpy") for r in ("replace", "select")])
def test_student_path_is_the_served_path_with_token_heads(heads, family, routing, flush, tmp_path):
    """The training path (parallel over the sequence) computes the served logits with heads
    that see the token, under either routing, adapter included: bit for bit on qwen3_moe
    with the heads flushed in MLX, as training computes them; to float rounding with the
    flush in NumPy (other summation order), and on deepseek_v3, since its attention over a
    whole sequence already differs from token-by-token decode in the last bits on its own
    gates."""
    from edge0.prerouter.files import checkpoint_identity
    from edge0.train.student import StudentModel
    from tests.test_recipe import served_logits

    d = heads(family)
    extra = 2 if routing == "select" else None
    student = StudentModel(d, rank=4, scale=10.0, seed=3, dequantize=False, routing=routing, stage_extra=extra)
    assert student.routing == ((routing, 2) if routing == "select" else ("replace", 0))
    rng = np.random.default_rng(0)
    for w in student.adapted.values():
        w.lora_b = mx.array(rng.normal(0, 0.05, w.lora_b.shape).astype(np.float32))
    student.save(tmp_path / "a", {"base_identity": checkpoint_identity(d)})
    prompt, continuation = [5, 17, 33, 2, 99, 41], [7, 250, 13, 77, 101, 3, 64, 9, 11, 200]
    ours = student.logits(mx.array([prompt + continuation]), np.array([len(prompt)]))[0, len(prompt) - 1:-1]
    config = EngineConfig(adapter=str(tmp_path / "a"), routing=routing, stage_extra=extra, prerouter_flush=flush,
                          kernels="mlx")  # the student path runs mlx-lm's kernels
    served = served_logits(d, config, prompt, continuation)
    diff = mx.abs(ours.astype(mx.float32) - served).max().item()
    exact = family == "qwen3_moe" and flush == "mlx"
    assert diff == 0 if exact else diff < 1e-5 * mx.abs(served).max().item(), diff
    other = EngineConfig(adapter=str(tmp_path / "a"), routing="select" if routing == "replace" else "replace")
    assert mx.abs(served_logits(d, other, prompt, continuation) - served).max().item() > 1e-3


def test_the_demo_decodes_staged_on_its_shipped_heads():
    """The packaged demo model, opened with every default (sync and async), decodes its
    staged layers on the heads that ship beside it, with the routing their file records,
    and the stats line names them."""
    import anyio

    from edge0.cli import PACKAGED_DEMO
    from edge0.prerouter.files import HEADS_FILENAME, serving_of

    assert (PACKAGED_DEMO / HEADS_FILENAME).is_file()
    _, meta = load_heads(PACKAGED_DEMO / HEADS_FILENAME, PACKAGED_DEMO)
    recorded = serving_of(meta)
    with Engine(PACKAGED_DEMO) as engine:
        s = engine.streaming
        assert s.heads_path == PACKAGED_DEMO / HEADS_FILENAME and s.prerouter.heads.sees_token
        assert s.stager.layers == s.prerouter.heads.consumers() == list(s.spec.moe_layers[1:])
        assert s.routing == (recorded["routing"], recorded["stage_extra"])
        width = s.spec.k + recorded["stage_extra"]
        plans, used, events = record_staging(engine, PROMPT, 16)
        text = "".join(e.text for e in events)
        line = engine.generate_text("def f(x):", max_tokens=4)[1].heads
    assert len(plans) >= 15 and text
    for st, layers in used.items():
        for layer, experts in layers.items():
            assert len(plans[st][layer]) == width and experts <= plans[st][layer]
    assert f"{HEADS_FILENAME} (7 heads, k=4, token, select k+{recorded['stage_extra']})" == line

    async def main():
        async with Engine.open(PACKAGED_DEMO) as engine:
            assert engine.streaming.routing == (recorded["routing"], recorded["stage_extra"])
            return [event async for event in engine.generate("def f(x):", max_tokens=4)]

    events = anyio.run(main)
    assert events[-1].stats.heads == line


def test_quality_rows_without_a_teacher_serve_their_settings(heads, tmp_path, capsys, monkeypatch):
    """`edge0 train quality --row LABEL:SETTINGS` without --teacher: the own-gates row is the
    reference, and each row is served with its settings (routing, staged layers)."""
    from edge0.cli import main
    from edge0.train import data as D

    d = heads("qwen3_moe")
    held = np.arange(3, 200, dtype=np.int64)
    monkeypatch.setattr(D, "token_streams", lambda model: (held, held, "test"))
    out = tmp_path / "q.json"
    assert main(["train", "quality", "--model", str(d), "--tokens", "60", "--json", str(out),
                 "--row", "sel:routing=select,stage_extra=2",
                 "--row", "rep 2-3:routing=replace,layer_paths=1:decode=exact"]) == 0
    rows = {r["label"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["int4, own gates", "sel", "rep 2-3"]
    own = rows["int4, own gates"]
    assert own["top1_agreement"] == 1.0 and own["kl_teacher_row"] == 0 and own["ratio_to_own_gates"] == 1.0
    assert rows["sel"]["routing"] == ["select", 2] and rows["sel"]["staged_layers"] == [1, 2, 3]
    assert rows["rep 2-3"]["routing"] == ["replace", 0] and rows["rep 2-3"]["staged_layers"] == [2, 3]
    assert all("ratio_to_teacher" not in r for r in rows.values())
    assert "ratio to own gates" in capsys.readouterr().out


@pytest.mark.parametrize("family,token", [("qwen3_moe", True), ("deepseek_v3", True), ("qwen3_moe", False)],
                         ids=["token-heads-qwen3_moe", "token-heads-deepseek_v3", "base-heads-qwen3_moe"])
def test_the_numpy_flush_plans_what_the_mlx_flush_plans(heads, family, token):
    """prerouter_flush numpy (the CPU backend's default) against mlx, replace and select:
    the heads' logits equal within float32 rounding, hence the same staged sets, the same
    routing and the same greedy text."""
    d = heads(family, token=token)
    for routing, extra in (("replace", None), ("select", 2)):
        runs = {}
        for flush in ("mlx", "numpy"):
            with Engine(d, EngineConfig(prerouter_flush=flush, routing=routing, stage_extra=extra)) as engine:
                pr = engine.streaming.prerouter
                assert (pr.host is not None) == (flush == "numpy")
                seen, logits = [], pr.logits
                pr.logits = lambda *a, _f=logits: (lambda out: (seen.append(np.array(out)), out)[1])(_f(*a))
                plans, used, events = record_staging(engine, PROMPT, 12)
            runs[flush] = (seen, plans, used, [e.text for e in events])
        (m_logits, *m_rest), (n_logits, *n_rest) = runs["mlx"], runs["numpy"]
        assert len(m_logits) == len(n_logits) >= 8
        for a, b in zip(m_logits, n_logits):
            assert a.shape == b.shape and np.allclose(a, b, rtol=1e-5, atol=1e-5), np.abs(a - b).max()
        assert m_rest == n_rest, routing


def test_a_numpy_flush_in_float16_is_refused(heads):
    with pytest.raises(ConfigError, match="prerouter_flush numpy computes in float32; prerouter_dtype float16"):
        Engine(heads("qwen3_moe"), EngineConfig(prerouter_flush="numpy", prerouter_dtype="float16"))
    with Engine(heads("qwen3_moe"), EngineConfig(prerouter_dtype="float16")) as engine:  # auto: then mlx
        assert engine.streaming.prerouter.host is None


def test_on_the_cpu_backend_on_mlxs_kernels_the_default_flush_is_numpys_on_one_blas_thread(heads):
    """prerouter_flush auto: on the CPU backend with MLX's kernels (Edge0's take the heads in
    8 bits: tests/test_quantized_flush.py) the heads flush in float32 NumPy, and every
    flush holds NumPy's BLAS to the calling thread (its threads would compete with MLX's
    compute threads and the readers for the cores), the count before put back after."""
    from edge0.prerouter import runtime as host

    if not host.blas_threads_controllable():
        pytest.skip("NumPy's OpenBLAS thread count cannot be set here")
    get, set_ = host._blas_threads()
    set_(2)
    with Engine(heads("qwen3_moe"), EngineConfig(kernels="mlx")) as engine:
        pr = engine.streaming.prerouter
        assert pr.host is not None  # auto = numpy here
        counts, inner = [], pr.host._logits
        pr.host._logits = lambda *a: (counts.append(get()), inner(*a))[1]
        engine.generate_text(PROMPT, max_tokens=6, temp=0.0)
    assert len(counts) >= 4 and set(counts) == {1}, counts
    assert get() == 2


@pytest.mark.parametrize("asked, want", [(None, {"routing": "select", "stage_extra": 2}),
                                         (["--routing", "replace"], {"routing": "replace", "stage_extra": 0})])
def test_sft_trains_on_the_routing_asked_for_and_records_it(heads, tmp_path, asked, want):
    """`edge0 train sft --routing`: the student trains on that routing (default: the heads
    file's record), and the adapter's provenance says which."""
    from edge0.cli import main

    d = heads("qwen3_moe", True, {"routing": "select", "stage_extra": 2})
    out = tmp_path / "a"
    argv = ["train", "sft", "--model", str(d), "--teacher", str(d), "--work", str(tmp_path / "w"), "--rows", "4",
            "--steps", "2", "--batch", "2", "--rank", "2", "--out", str(out), "--no-progress"] + (asked or [])
    assert main(argv) == 0
    _, meta = mx.load(str(out / "adapters.safetensors"), return_metadata=True)
    assert json.loads(meta["routing"]) == want
    # phase 3 likewise: its student generates and trains on the routing asked for
    out3 = tmp_path / "a3"
    assert main(["train", "distill", "--model", str(d), "--teacher", str(d), "--work", str(tmp_path / "w"),
                 "--rows", "2", "--steps", "1", "--batch", "1", "--adapter", str(out), "--out", str(out3),
                 "--no-progress"] + (asked or [])) == 0
    _, meta = mx.load(str(out3 / "adapters.safetensors"), return_metadata=True)
    assert json.loads(meta["routing"]) == want


def test_sft_refuses_stage_extra_with_replace(heads, tmp_path, capsys):
    from edge0.cli import main

    d = heads("qwen3_moe", True, {"routing": "select", "stage_extra": 2})
    assert main(["train", "sft", "--model", str(d), "--teacher", str(d), "--work", str(tmp_path / "w"),
                 "--routing", "replace", "--stage-extra", "2", "--no-progress"]) == 2
    assert "--stage-extra applies to --routing select" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # refused before any work


def test_sft_and_distill_take_the_sampling_temperature(heads, tmp_path):
    """--temp sets the temperature of the continuations a phase trains on (the teacher's for
    SFT, the student's for distillation); the rows' metadata and the adapter's recipe say so."""
    import json

    from edge0.cli import main
    from edge0.model.safetensors_header import read_header

    d = heads("qwen3_moe", True, {"routing": "replace", "stage_extra": 0})
    w = tmp_path / "w"
    assert main(["train", "sft", "--model", str(d), "--teacher", str(d), "--work", str(w), "--rows", "4",
                 "--steps", "1", "--batch", "2", "--temp", "1.0", "--no-progress"]) == 0
    (rows_meta,) = w.glob("sft_rows-*.npy.json")
    assert json.loads(rows_meta.read_text())["temp"] == 1.0
    recipe = json.loads(read_header(w / "adapter-sft" / "adapters.safetensors").metadata["recipe"])
    assert recipe["temp"] == 1.0
