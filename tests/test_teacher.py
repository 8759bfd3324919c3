"""Teacher training and evaluation at tiny scale: a few steps on a small corpus subset."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from edge0.train import evaluate as ev
from edge0.train import corpus as co
from edge0.train import teacher as te

TINY = dict(layers=2, experts=4, k=2, hidden=64, moe_intermediate=64, vocab_size=320, seq_len=32,
            batch_size=8, steps=40, warmup_steps=3, lr=3e-3, heldout_fraction=0.2, log_every=5,
            eval_every=20, eval_tokens=256, final_eval_tokens=1024, compile=False)
N_FILES = 60


@pytest.fixture(scope="module")
def files():
    return co.list_corpus_files()[:N_FILES]


@pytest.fixture(scope="module")
def run(tmp_path_factory, files):
    out = tmp_path_factory.mktemp("teacher")
    summary = te.train_teacher(te.TeacherConfig(**TINY), out, files=files, progress=False)
    return out, summary


def test_corpus_listing_excludes_tests_and_site_packages():
    all_files = co.list_corpus_files()
    assert all_files == sorted(all_files) and len(all_files) > 100
    for rel in all_files:
        parts = rel.split("/")
        assert rel.endswith(".py")
        assert not set(parts[:-1]) & {"test", "tests", "idle_test", "site-packages", "__pycache__"}, rel


def test_split_is_deterministic_and_by_file():
    all_files = co.list_corpus_files()
    train, heldout = co.split_files(all_files, 0.05)
    assert (train, heldout) == co.split_files(list(reversed(all_files)), 0.05)
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == all_files
    assert 0 < len(heldout) < 0.15 * len(all_files)
    assert all(co.is_heldout(f, 0.05) for f in heldout)
    # a pure function of the path: a subset splits the same way
    sub_train, sub_heldout = co.split_files(all_files[:50], 0.05)
    assert set(sub_train) <= set(train) and set(sub_heldout) <= set(heldout)


def test_outputs_and_provenance(run):
    out, summary = run
    files = json.loads((out / te.FILES_FILE).read_text())
    assert files["train"] and files["heldout"]
    assert not set(files["train"]) & set(files["heldout"])
    for name in ("teacher", "int4"):
        prov = json.loads((out / name / "provenance.json").read_text())
        for key in ("corpus", "train_config", "model_config", "seed", "steps", "tokens_seen",
                    "final_train_loss", "heldout_loss", "wall_time_s", "edge0_version", "weights_sha256"):
            assert key in prov, (name, key)
        assert prov["steps"] == TINY["steps"]
        assert prov["tokens_seen"] == TINY["steps"] * TINY["batch_size"] * TINY["seq_len"]
        corpus = prov["corpus"]
        for key in ("train_file_list_sha256", "heldout_file_list_sha256", "train_token_stream_sha256",
                    "heldout_token_stream_sha256", "train_tokens", "heldout_tokens"):
            assert key in corpus, key
        assert math.isfinite(prov["final_train_loss"]) and math.isfinite(prov["heldout_loss"])
        # what ships names no machine path: the corpus root by Python version, not by directory
        assert corpus["stdlib_root"].startswith("<python ") and str(co.stdlib_root()) not in json.dumps(prov)
    int4 = json.loads((out / "int4" / "provenance.json").read_text())
    assert int4["quantization"]["bits"] == 4 and int4["quantization"]["group_size"] == 64
    heldout = np.load(out / te.HELDOUT_FILE)
    assert heldout.dtype == np.uint16 and heldout.size == int4["corpus"]["heldout_tokens"]


def test_loss_decreases(run):
    out, _ = run
    log = [json.loads(line) for line in (out / te.LOG_FILE).read_text().splitlines()]
    steps = [r for r in log if "step" in r]
    assert steps[-1]["step"] == TINY["steps"]
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, (steps[0], steps[-1])
    assert all(math.isfinite(r["balance"]) for r in steps)
    assert any("heldout_loss" in r for r in steps)  # periodic evaluation ran


def test_checkpoints_load_with_mlx_lm(run):
    from mlx_lm import generate, load

    out, _ = run
    cfg = json.loads((out / "int4" / "config.json").read_text())
    q = cfg["quantization"]
    assert q["bits"] == 4 and q["group_size"] == 64
    assert q["model.layers.0.mlp.gate"]["bits"] == 8  # routers stay 8-bit (quant_predicate)
    teacher_cfg = json.loads((out / "teacher" / "config.json").read_text())
    assert "quantization" not in teacher_cfg
    for name in ("teacher", "int4"):
        model, tok = load(str(out / name))
        text = generate(model, tok, prompt="def f(x):", max_tokens=5, verbose=False)
        assert isinstance(text, str)


def test_evaluation(run):
    out, _ = run
    model, tok = ev.load_model(out / "int4")
    tokens = ev.load_tokens(out / te.HELDOUT_FILE)
    res = ev.evaluate_tokens(model, tokens, teacher=model, seq_len=32, max_tokens=256)
    assert res.n_tokens == 256
    assert math.isfinite(res.perplexity) and 1.0 < res.perplexity < 320
    assert res.top1_agreement == 1.0
    assert abs(res.kl) < 1e-5
    assert res.teacher_nll == pytest.approx(res.nll)

    teacher, _ = ev.load_model(out / "teacher")
    vs = ev.evaluate_tokens(model, tokens, teacher=teacher, seq_len=32, max_tokens=256)
    assert 0.0 <= vs.top1_agreement <= 1.0 and vs.kl >= 0.0

    # text data is encoded with the model's tokenizer
    txt = out / "sample.txt"
    txt.write_text("def add(a, b):\n    return a + b\n" * 20)
    assert math.isfinite(ev.evaluate_tokens(model, ev.load_tokens(txt, tok), seq_len=32).perplexity)


def test_routing_load(run):
    out, _ = run
    model, _ = ev.load_model(out / "teacher")
    tokens = ev.load_tokens(out / te.HELDOUT_FILE)
    loads = ev.routing_load(model, tokens, seq_len=32, max_tokens=512)
    assert [ld.layer for ld in loads] == [f"model.layers.{i}.mlp.switch_mlp" for i in range(TINY["layers"])]
    for ld in loads:
        assert ld.n_experts == TINY["experts"]
        assert ld.assignments == 512 * TINY["k"]
        assert 0.0 < ld.entropy <= 1.0 + 1e-9
        assert 1 / TINY["experts"] <= ld.max_share <= 1.0


def test_unigram_baseline(run):
    counts = np.array([3, 1, 0, 0])
    toks = np.array([0, 0, 1, 2])
    res = ev.unigram_perplexity(counts, toks)
    p = np.array([4, 2, 1, 1]) / 8
    assert res.n_tokens == 3
    assert res.nll == pytest.approx(-np.mean(np.log(p[[0, 1, 2]])))
    # uniform counts: perplexity = vocabulary size
    assert ev.unigram_perplexity(np.zeros(10), np.arange(10)).perplexity == pytest.approx(10.0)

    out, _ = run
    counts = np.load(out / te.UNIGRAM_FILE)
    heldout = np.load(out / te.HELDOUT_FILE)
    uni = ev.unigram_perplexity(counts, heldout, seq_len=32, max_tokens=256)
    assert uni.n_tokens == 256 and 1.0 < uni.perplexity < TINY["vocab_size"]


def test_balance_capture_keeps_outputs(run):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.qwen3_moe import Qwen3MoeSparseMoeBlock

    out, _ = run
    model, _ = load(str(out / "teacher"))
    x = mx.array(np.load(out / te.HELDOUT_FILE)[:32].astype(np.int32))[None]
    ref = model(x)
    with te.balance_loss_capture(model) as n_blocks:
        got = model(x)
        aux = list(te._AUX)
    assert n_blocks == TINY["layers"] and len(aux) == TINY["layers"]
    assert mx.array_equal(ref, got)
    assert all(math.isfinite(a.item()) and a.item() > 0 for a in aux)
    assert all(type(layer.mlp) is Qwen3MoeSparseMoeBlock for layer in model.model.layers)
    assert te._AUX == []


def test_eval_cli(run, tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    out, _ = run
    path = Path(__file__).resolve().parents[1] / "tools" / "eval_model.py"
    spec = importlib.util.spec_from_file_location("eval_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    js = tmp_path / "r.json"
    rc = mod.main(["--model", str(out / "int4"), "--teacher", str(out / "teacher"),
                   "--data", str(out / te.HELDOUT_FILE), "--max-tokens", "128", "--routing", "--json", str(js)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "top-1 agreement" in text and "unigram baseline" in text and "entropy" in text
    res = json.loads(js.read_text())
    assert res["seq_len"] == TINY["seq_len"] and res["eval"]["n_tokens"] == 128
    assert mod.main(["--model", str(tmp_path / "nope"), "--data", str(out / te.HELDOUT_FILE)]) == 2


def test_config_errors():
    with pytest.raises(ValueError, match="k=9"):
        te.TeacherConfig(experts=4, k=9).validate()
    with pytest.raises(ValueError, match="multiple of 64"):
        te.TeacherConfig(hidden=100).validate()
    with pytest.raises(ValueError, match="empty side"):
        co.build_corpus(TINY["heldout_fraction"], TINY["vocab_size"], files=co.list_corpus_files()[:1])


def test_resumed_training_is_bit_identical(tmp_path, files):
    """A run interrupted at a checkpoint and resumed ends with the same weights as an
    uninterrupted one (weights, optimizer moments, sampler state all restored)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    cfg = dict(TINY, steps=6, checkpoint_every=3, eval_every=0, final_eval_tokens=64)
    corpus = co.build_corpus(cfg["heldout_fraction"], cfg["vocab_size"], files=files)
    straight = te.train(te.TeacherConfig(**cfg), corpus, progress=False)
    resume = tmp_path / "resume"
    with pytest.raises(KeyboardInterrupt):
        def stop_after_checkpoint(record):
            if record.get("step") == 5:  # after the step-3 checkpoint was written
                raise KeyboardInterrupt
        te.train(te.TeacherConfig(**dict(cfg, log_every=1)), corpus, progress=False, resume_dir=resume,
                 on_log=stop_after_checkpoint)
    assert (resume / "state.json").exists()
    resumed = te.train(te.TeacherConfig(**cfg), corpus, progress=False, resume_dir=resume, resume=True)
    a, b = dict(tree_flatten(straight.model.parameters())), dict(tree_flatten(resumed.model.parameters()))
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert resumed.steps_done == 6
    with pytest.raises(ValueError, match="other settings"):
        te.train(te.TeacherConfig(**dict(cfg, lr=1e-4)), corpus, progress=False, resume_dir=resume, resume=True)


def test_a_run_stopped_by_its_budget_keeps_its_state_and_resumes_bit_identical(tmp_path, files):
    """--time-budget with --no-fit-schedule stops early: the state at the stop is kept, and
    --resume ends where an uninterrupted run ends, bit for bit."""
    import hashlib

    cfg = dict(TINY, steps=6, checkpoint_every=4, eval_every=0, final_eval_tokens=64)
    te.train_teacher(te.TeacherConfig(**cfg), tmp_path / "straight", files=files, progress=False)
    out = tmp_path / "stopped"
    said = []
    first = te.train_teacher(te.TeacherConfig(**cfg, time_budget_s=1e-9, fit_schedule_to_budget=False), out,
                             files=files, progress=False, say=said.append)
    assert first["steps"] == 1 and first["stopped_by_budget"]
    assert (out / te.RESUME_DIR / "state.json").exists() and any("--resume" in s for s in said)
    done = te.train_teacher(te.TeacherConfig(**cfg, fit_schedule_to_budget=False), out, files=files, progress=False,
                            resume=True)
    assert done["steps"] == 6 and not (out / te.RESUME_DIR).exists()
    digest = lambda d: hashlib.sha256((d / "teacher" / "model.safetensors").read_bytes()).hexdigest()
    assert digest(out) == digest(tmp_path / "straight")


def test_a_bfloat16_copy_of_the_teacher_is_read_as_the_teacher(run, tmp_path, capsys):
    """tools/teacher_copy.py keeps the teacher in bfloat16 with both files' sha256; the
    evaluation and the training loaders read it in float32, within bf16 rounding of the
    original's perplexity."""
    import importlib.util
    from pathlib import Path

    import mlx.core as mx

    from edge0.backend import nn as bnn
    from edge0.train.quality import teacher_logprobs

    out, _ = run
    tool = Path(__file__).resolve().parents[1] / "tools" / "teacher_copy.py"
    spec = importlib.util.spec_from_file_location("teacher_copy", tool)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    original = mod.sha256(out / "teacher" / "model.safetensors")
    assert mod.main([str(out / "teacher"), str(tmp_path / "bf16"), "--expect-sha256", original]) == 0
    prov = json.loads((tmp_path / "bf16" / "provenance.json").read_text())
    assert prov["float32_original"] == {"model.safetensors_sha256": original, "expected_sha256": original,
                                        "matches_the_demo_teacher": True}
    assert prov["weights_sha256"]["model.safetensors"] == mod.sha256(tmp_path / "bf16" / "model.safetensors")
    stored = mx.load(str(tmp_path / "bf16" / "model.safetensors"))
    assert all(v.dtype == mx.bfloat16 for v in stored.values() if mx.issubdtype(v.dtype, mx.floating))
    teacher = bnn.load_teacher(tmp_path / "bf16")
    assert all(v.dtype == mx.float32 for _, v in bnn.parameters_flat(teacher).items()
               if mx.issubdtype(v.dtype, mx.floating))
    tokens = [int(t) for t in np.load(out / te.HELDOUT_FILE)[:256]]
    ours, theirs = teacher_logprobs(tmp_path / "bf16", tokens, 64), teacher_logprobs(out / "teacher", tokens, 64)
    nll = lambda lp: -float(np.mean(lp["logp"][np.arange(len(lp["targets"])), lp["targets"]]))  # noqa: E731
    assert abs(nll(ours) - nll(theirs)) < 0.02 * nll(theirs)
    assert mod.main([str(tmp_path / "nope"), str(tmp_path / "x")]) == 2


def test_the_kept_teacher_is_the_demos():
    """teachers/demo-v2 is the bfloat16 copy of the float32 teacher the demo was quantized
    from: its recorded original is the demo's teacher, its own bytes are what it records, and
    it loads as a float32 teacher whose greedy choice matches the int4 demo's on most tokens."""
    import hashlib
    from pathlib import Path

    import mlx.core as mx

    from edge0.backend import nn as bnn

    root = Path(__file__).resolve().parents[1]
    kept, demo = root / "teachers" / "demo-v2", root / "src" / "edge0" / "data" / "demo_model"
    prov = json.loads((kept / "provenance.json").read_text())
    want = json.loads((demo / "provenance.json").read_text())["teacher_weights_sha256"]["model.safetensors"]
    assert prov["float32_original"]["model.safetensors_sha256"] == want
    digest = hashlib.sha256((kept / "model.safetensors").read_bytes()).hexdigest()
    assert prov["weights_sha256"]["model.safetensors"] == digest
    assert prov["dtype"].startswith("bfloat16") and prov["trained_dtype"] == "float32"
    teacher = bnn.load_teacher(kept)
    student = bnn.load_teacher(demo)
    from tokenizers import Tokenizer

    text = "import os\nimport sys\n\n\ndef read_config(path):\n    with open(path) as f:\n        return f.read()\n"
    ids = mx.array([Tokenizer.from_file(str(kept / "tokenizer.json")).encode(text).ids])
    a = mx.argmax(teacher(ids), axis=-1)
    b = mx.argmax(student(ids), axis=-1)
    assert ids.shape[1] > 16 and float(mx.mean(a == b)) > 0.85
