"""The recovery recipe: the student path is the served path, each phase's loss falls, the
adapter changes the served logits, and merging it into int4 loses part of its effect."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from edge0 import Engine, EngineConfig


@pytest.fixture(scope="module")
def model_with_heads(tiny_model_factory, tmp_path_factory):
    from edge0.train.heads import make_warm_heads
    from tests.ckpt_tools import copy_model

    d = copy_model(tiny_model_factory("qwen3_moe"), tmp_path_factory.mktemp("student") / "m")
    make_warm_heads(d, d / "prerouter.safetensors", width=32)
    return d


def served_logits(model_dir, config, prompt: list[int], continuation: list[int]):
    """Prefill the prompt, then feed the continuation one token per step (as served)."""
    from edge0.backend import nn as bnn
    from edge0.loader import load_streaming_model
    from edge0.streaming import StepModel

    s = load_streaming_model(model_dir, config)
    try:
        if s.stager is not None:
            s.stager.reset()
        model = StepModel(s)
        cache = bnn.make_cache(model)
        out = [model(mx.array([prompt]), cache=cache)[0, -1]]
        for t in continuation[:-1]:
            out.append(model(mx.array([[t]]), cache=cache)[0, -1])
        return mx.stack(out).astype(mx.float32)
    finally:
        s.close()


def test_student_path_is_the_served_path(model_with_heads, tmp_path):
    """Logits of the student path (parallel over the sequence, prompt on own gates, the rest
    on the heads' prediction) equal the engine's token-by-token logits, adapter included,
    fed without evaluating each step (teacher forcing)."""
    from edge0.prerouter.files import checkpoint_identity
    from edge0.train.student import StudentModel

    student = StudentModel(model_with_heads, rank=4, scale=10.0, seed=3, dequantize=False)
    rng = np.random.default_rng(0)
    for w in student.adapted.values():  # a non-zero adapter, so that the delta is exercised too
        w.lora_b = mx.array(rng.normal(0, 0.05, w.lora_b.shape).astype(np.float32))
    student.save(tmp_path / "a", {"base_identity": checkpoint_identity(model_with_heads)})
    prompt, continuation = [5, 17, 33, 2, 99, 41], [7, 250, 13, 77, 101, 3, 64, 9]
    tokens = mx.array([prompt + continuation])
    ours = student.logits(tokens, np.array([len(prompt)]))[0, len(prompt) - 1:-1].astype(mx.float32)
    adapter = str(tmp_path / "a")  # served on MLX's kernels: the student differentiates through mlx-lm's modules
    served = served_logits(model_with_heads, EngineConfig(adapter=adapter, prerouter_flush="mlx", kernels="mlx"),
                           prompt, continuation)
    own = served_logits(model_with_heads, EngineConfig(adapter=adapter, prerouter="off", kernels="mlx"), prompt,
                        continuation)
    # bit for bit with the heads flushed in MLX, as training computes them: same routing, same
    # kernel, same delta (this also holds the staged path to evaluating a step's slots before
    # reusing them when the next input is teacher-forced)
    assert mx.array_equal(ours, served).item(), mx.abs(ours - served).max().item()
    # the flush in NumPy (prerouter_flush numpy) sums in another order: float rounding apart
    on_host = served_logits(model_with_heads, EngineConfig(adapter=adapter, prerouter_flush="numpy", kernels="mlx"),
                            prompt, continuation)
    assert mx.abs(ours - on_host).max().item() < 1e-5 * mx.abs(ours).max().item()
    # and the routing replacement matters here: own-gate routing gives other logits
    assert mx.abs(own - served).max().item() > 1e-2


def test_dequantized_student_path_is_close_to_the_served_path(model_with_heads):
    """Training runs on the dequantized reconstruction: float rounding apart, the served logits."""
    from edge0.train.student import StudentModel

    student = StudentModel(model_with_heads, rank=4, scale=10.0, seed=3)
    prompt, continuation = [5, 17, 33, 2, 99, 41], [7, 250, 13, 77, 101, 3, 64, 9]
    ours = student.logits(mx.array([prompt + continuation]), np.array([len(prompt)]))[0, len(prompt) - 1:-1]
    served = served_logits(model_with_heads, EngineConfig(adapter="off"), prompt, continuation)
    rel = (mx.abs(ours.astype(mx.float32) - served).max() / mx.abs(served).max()).item()
    assert rel < 1e-3, rel
    assert mx.array_equal(mx.argmax(ours, -1), mx.argmax(served, -1)).item()


def _bucketed(seed: int):
    """Random student and teacher logits [2, 3, 10], the teacher's top 4 (ids, log-probs),
    and both distributions bucketed to those 4 plus the tail: (s, t, idx, top_lp, pb, qb)."""
    rng = np.random.default_rng(seed)
    s = rng.normal(0, 2, (2, 3, 10)).astype(np.float32)
    t = rng.normal(0, 2, (2, 3, 10)).astype(np.float32)
    tlogp = t - np.log(np.exp(t).sum(-1, keepdims=True))
    idx = np.argsort(-tlogp, -1)[..., :4]
    p = np.exp(s - np.log(np.exp(s).sum(-1, keepdims=True)))
    pk, qk = np.take_along_axis(p, idx, -1), np.take_along_axis(np.exp(tlogp), idx, -1)
    pb = np.concatenate([pk, 1 - pk.sum(-1, keepdims=True)], -1)
    qb = np.concatenate([qk, 1 - qk.sum(-1, keepdims=True)], -1)
    return s, t, mx.array(idx), mx.array(np.take_along_axis(tlogp, idx, -1)), pb, qb


def test_reverse_kl_topk_is_kl_of_the_bucketed_distributions():
    from edge0.train.distill import reverse_kl_topk

    s, t, idx, top_lp, pb, qb = _bucketed(0)
    got = reverse_kl_topk(mx.array(s), idx, top_lp, mx.ones((2, 3))).item()
    want = float(np.mean((pb * (np.log(pb) - np.log(qb))).sum(-1)))
    assert abs(got - want) < 1e-5
    same = reverse_kl_topk(mx.array(t), idx, top_lp, mx.ones((2, 3))).item()
    assert abs(same) < 1e-6  # zero when the student is the teacher


def test_forward_kl_topk_is_kl_of_the_bucketed_distributions():
    from edge0.train.distill import forward_kl_topk

    s, t, idx, top_lp, pb, qb = _bucketed(1)
    mask = np.array([[1, 1, 0], [1, 0, 1]], dtype=np.float32)
    got = forward_kl_topk(mx.array(s), idx, top_lp, mx.array(mask)).item()
    per = (qb * (np.log(qb) - np.log(pb))).sum(-1)  # the teacher weights: KL(teacher || student)
    want = float((per * mask).sum() / mask.sum())
    assert abs(got - want) < 1e-5
    same = forward_kl_topk(mx.array(t), idx, top_lp, mx.ones((2, 3))).item()
    assert abs(same) < 1e-6


def test_sft_on_the_corpus_learns_the_teachers_distribution(model_with_heads, tmp_path, monkeypatch):
    """`edge0 train sft --text corpus`: windows of the training split, the teacher's top-K at
    every position as the target, forward KL falling on a fixed batch; the adapter's recipe
    says so, a second run reuses the scored windows, and a run on more windows (same seed)
    scores only the new ones."""
    import json

    from edge0.backend import nn as bnn
    from edge0.cli import main
    from edge0.model.safetensors_header import read_header
    from edge0.train import sft

    monkeypatch.setattr(sft, "SCORE_BLOCK", 4)
    d, w, out = model_with_heads, tmp_path / "w", tmp_path / "a"
    argv = ["train", "sft", "--model", str(d), "--teacher", str(d), "--work", str(w), "--rows", "8",
            "--steps", "6", "--batch", "4", "--rank", "4", "--lr", "3e-3", "--text", "corpus", "--top-k", "5",
            "--routing", "replace", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    teacher = bnn.load_teacher(d)
    bnn.cast_model(teacher, mx.float32)

    def check_scored(n):
        rows, ids, lp, _ = sft.corpus_targets(d, d, sft.SFTConfig(text="corpus", rows=n, top_k=5), w, say=lambda m: None)
        assert rows.shape == (n, 128) and ids.shape == lp.shape == (n, 127, 5)
        for at in (slice(0, 2), slice(n - 2, n)):  # the first block's windows and the last's
            logits = np.array(teacher(mx.array(rows[at]))[:, :-1].astype(mx.float32))
            want = np.sort(np.argsort(-logits, -1)[..., :5], -1)
            assert (np.sort(ids[at], -1) == want).mean() > 0.99  # the teacher's own top-5 (ties apart)
        return rows, {f: f.stat().st_mtime_ns for f in w.glob("corpus_block-*.npz")}

    rows8, blocks = check_scored(8)
    assert len(blocks) == 2
    recipe = json.loads(read_header(out / "adapters.safetensors").metadata["recipe"])
    assert recipe["text"] == "corpus" and recipe["top_k"] == 5
    assert recipe["loss_after"] < recipe["loss_before"], recipe
    assert main(argv[:-3] + ["--out", str(tmp_path / "b"), "--no-progress"]) == 0
    assert check_scored(8)[1] == blocks  # scored once
    argv[argv.index("--rows") + 1] = "12"
    assert main(argv[:-3] + ["--out", str(tmp_path / "c"), "--no-progress"]) == 0
    rows12, blocks12 = check_scored(12)
    assert (rows12[:8] == rows8).all()
    assert len(blocks12) == 3 and {f: blocks12[f] for f in blocks} == blocks  # only the new block scored


def test_sft_refuses_an_unknown_text(model_with_heads, tmp_path):
    from edge0.errors import ConfigError
    from edge0.train.sft import SFTConfig, run_sft

    with pytest.raises(ConfigError, match="SFT text 'web'"):
        run_sft(model_with_heads, model_with_heads, tmp_path / "a", SFTConfig(text="web"), work=tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_quick_recipe_end_to_end(tiny_model_factory, tmp_path):
    """``edge0 train recipe --quick``: heads -> SFT -> distill -> report on a tiny model
    (its own float32 reading as the teacher)."""
    from edge0.train.recipe import QUICK, run_recipe
    from tests.ckpt_tools import copy_model

    d = copy_model(tiny_model_factory("qwen3_moe"), tmp_path / "m")
    report = run_recipe(d, d, copy.deepcopy(QUICK), work=tmp_path / "work", say=lambda s: None)
    ph = report["phases"]
    assert ph["heads"]["losses"]["last"] < ph["heads"]["losses"]["first"]
    assert ph["heads"]["recall_after"] > ph["heads"]["recall_before"]
    for name in ("sft", "distill"):
        assert ph[name]["loss_after"] < ph[name]["loss_before"], (name, ph[name])
    assert report["adapter_effect"]["relative_l2"] > 1e-3
    m = report["merge"]
    assert abs(m["logit_retention"]["unmerged"] - 1.0) < 1e-6
    assert m["logit_retention"]["merged"] != m["logit_retention"]["unmerged"]
    assert (d / "prerouter.safetensors").exists() and (d / "adapter" / "adapters.safetensors").exists()

    # the quality table: every row over the same positions, the merged row served as well
    q = report["quality"]
    rows = {r["label"]: r for r in q["rows"]}
    assert list(rows) == ["float32 teacher", "int4, own gates", "int4 + prerouter", "+ phase-2 adapter (SFT)",
                          "+ phase-3 adapter (on-policy)", "phase-3 adapter merged, re-quantized"]
    assert q["tokens"] == 47 and all(r["tokens"] == 47 for r in q["rows"])
    teacher = rows["float32 teacher"]
    assert teacher["ratio_to_teacher"] == 1.0 and teacher["top1_agreement"] == 1.0 and teacher["kl_teacher_row"] == 0
    # the tiny model is its own teacher: its own gates serve the teacher's distribution
    assert rows["int4, own gates"]["kl_teacher_row"] < 1e-6
    for r in q["rows"][1:]:
        assert np.isfinite(r["perplexity"]) and r["sample"], r
        assert r["label"] == "int4, own gates" or r["kl_teacher_row"] > 1e-4, r
        assert r["ratio_to_teacher"] == r["perplexity"] / teacher["perplexity"]
    # each adapter changes what is served, and the merged checkpoint is not the unmerged adapter
    assert len({rows[k]["nll"] for k in list(rows)[2:]}) == 4
    with Engine(d) as e:  # heads and adapter beside the checkpoint: found, and named in the stats
        line = list(e.stream("def f(x):", max_tokens=3))[-1].stats.line()
    assert "heads prerouter.safetensors" in line and "adapter adapter (rank 4" in line and "phase 3" in line

    # --resume after the heads were written: phase 1 is not run again, its figures are kept
    heads_written = (d / "prerouter.safetensors").stat().st_mtime_ns
    said: list[str] = []
    again = run_recipe(d, d, copy.deepcopy(QUICK), work=tmp_path / "work", resume=True, say=said.append)
    assert (d / "prerouter.safetensors").stat().st_mtime_ns == heads_written
    assert again["phases"]["heads"]["recall_after"] == ph["heads"]["recall_after"]
    assert any("--resume" in s for s in said) and (d / "adapter" / "adapters.safetensors").exists()


def test_merge_report_retention(tiny_model_factory, tmp_path):
    """An adapter whose deltas sit below the int4 group step (the paper's regime): merged
    and re-quantized, most of its effect is gone; unmerged, all of it is there."""
    from edge0.train.merge import merge_report
    from tests.test_adapters import random_adapter

    d = tiny_model_factory("qwen3_moe")
    a = random_adapter(d, tmp_path / "a", scale=0.1, seed=2)
    m = merge_report(d, a)
    assert abs(m["logit_retention"]["unmerged"] - 1.0) < 1e-6
    assert m["logit_retention"]["merged"] < 0.8
    assert m["weight_retention_mean"] < 0.8
    assert all(t["delta_rms"] < t["group_step_rms"] for t in m["targets"].values())
    assert set(m["weight_retention_by_projection"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_quality_command_serves_each_adapter_row(model_with_heads, tmp_path, capsys):
    """``edge0 train quality``: teacher, own gates, prerouter, then one row per --adapter,
    every row over the same held-out positions; the adapter row is what the adapter serves."""
    import json

    from edge0.cli import main
    from tests.test_adapters import random_adapter

    d = model_with_heads
    a = random_adapter(d, tmp_path / "a", scale=2.0, seed=5)
    out = tmp_path / "q.json"
    assert main(["train", "quality", "--model", str(d), "--teacher", str(d), "--adapter", f"my row={a}",
                 "--tokens", "40", "--json", str(out)]) == 0
    table = json.loads(out.read_text())
    labels = [r["label"] for r in table["rows"]]
    assert labels == ["float32 teacher", "int4, own gates", "int4 + prerouter", "my row"]
    assert table["tokens"] == 39 and all(r["tokens"] == 39 for r in table["rows"])
    by = {r["label"]: r for r in table["rows"]}
    assert by["my row"]["nll"] != by["int4 + prerouter"]["nll"]
    assert "| my row |" in capsys.readouterr().out
    assert main(["train", "quality", "--model", str(d), "--teacher", str(d), "--heads", str(tmp_path / "none")]) == 2


def test_quality_command_measures_on_a_text_given(model_with_heads, tmp_path, capsys):
    """``edge0 train quality --text``: the rows are measured on that text (a file, or a
    directory's .py files in order) instead of the held-out split; a missing path or a text
    shorter than --tokens is a ConfigError naming it (exit 2)."""
    import json

    from edge0.backend import nn as bnn
    from edge0.cli import main

    d = model_with_heads
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "b.py").write_text("def second(y):\n    return y * 2\n" * 8)
    (src / "pkg" / "a.py").write_text("import os\n\ndef first(x):\n    return os.path.join(x, x)\n" * 8)
    (src / "notes.txt").write_text("not python")
    args = ["train", "quality", "--model", str(d), "--tokens", "30"]
    assert main(args + ["--text", str(src), "--json", str(tmp_path / "t.json")]) == 0
    on_text = json.loads((tmp_path / "t.json").read_text())
    assert main(args + ["--json", str(tmp_path / "h.json")]) == 0
    held = json.loads((tmp_path / "h.json").read_text())
    assert on_text["text"] == str(src) and on_text["tokens"] == held["tokens"] == 29
    assert on_text["rows"][0]["nll"] != held["rows"][0]["nll"]
    tok = bnn.load_tokenizer(d)
    from edge0.train.data import text_tokens
    want = list(tok.encode((src / "b.py").read_text())) + [0] + list(tok.encode((src / "pkg" / "a.py").read_text()))
    assert text_tokens(d, src, 30) == want[:30]  # b.py sorts before pkg/a.py; notes.txt is not read
    assert main(args + ["--text", str(tmp_path / "none")]) == 2
    assert main(args + ["--text", str(src), "--tokens", "100000"]) == 2
    assert "fewer than the 100000 asked for" in capsys.readouterr().err


def test_cached_rows_without_their_metadata_are_written_again_and_bad_ones_named(tmp_path):
    """Rows copied without their .json are not taken as a cache; metadata that cannot be read
    is a CheckpointError naming the file, not a traceback."""
    from edge0.errors import CheckpointError
    from edge0.train import data as D

    path = tmp_path / "rows.npy"
    D.save_rows(path, np.arange(12, dtype=np.int32).reshape(3, 4), 2, {"x": 1})
    assert D.rows_cached(path)
    rows, prompt_len, meta = D.load_rows(path)
    assert rows.shape == (3, 4) and prompt_len == 2 and meta["x"] == 1
    (tmp_path / "rows.npy.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="rows.npy"):
        D.load_rows(path)
    (tmp_path / "rows.npy.json").unlink()
    assert not D.rows_cached(path)


@pytest.mark.parametrize("lr, warmup, steps", [(5e-4, 30, 600), (3e-3, 3, 24), (2e-4, 10, 150), (1e-3, 1, 10),
                                               (1e-3, 0, 10)])
def test_the_adapter_schedule_is_warm_up_then_cosine_to_a_tenth(lr, warmup, steps):
    """The warm-up + cosine of the adapter and head trainings, now mlx.optimizers' schedules:
    the same curve as written by hand before (lr/warmup at step 0, lr at warmup - 1, then
    cosine to lr/10 at the last step, and flat after)."""
    import math

    from edge0.train.loop import LoopConfig, lr_at

    cfg = LoopConfig(steps=steps, batch=1, lr=lr, warmup=warmup)
    for step in range(steps + 5):
        if step < warmup:
            want = lr * (step + 1) / warmup
        else:
            p = min((step - warmup) / max(steps - warmup, 1), 1.0)
            want = lr * (0.1 + 0.45 * (1 + math.cos(math.pi * p)))
        assert abs(lr_at(cfg, step) - want) <= 1e-6 * want, (step, lr_at(cfg, step), want)
