"""The llama.cpp bench arm: the bench checkpoint as GGUF, and llama.cpp running it.

The conversion is checked with the ``gguf`` package alone (a test dependency); the runs of
llama.cpp itself need ``llama-cpp-python`` (``pip install 'edge0[llamacpp]'``, built from
source) and are skipped where it is not installed.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from edge0.benchmark import harness
from edge0.benchmark.checkpoint import BenchShape, make_bench_checkpoint
from edge0.benchmark.report import markdown
from edge0.benchmark.to_gguf import convert, gguf_name
from edge0.errors import ConfigError

gguf = pytest.importorskip("gguf")
SMALL = BenchShape(layers=2, experts=16, k=4, hidden=256, moe_intermediate=128, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def bench_gguf(tmp_path_factory):
    d = make_bench_checkpoint(tmp_path_factory.mktemp("gguf") / "m", SMALL, seed=3)
    return d, convert(d, d.parent / "m.gguf")


def _expected(d):
    """Every weight of the checkpoint as MLX computes it (float32), by module name."""
    config = json.loads((d / "config.json").read_text())
    raw = {}
    for f in sorted(d.glob("model*.safetensors")):
        raw.update(mx.load(str(f)))
    out = {}
    for name in {n.rsplit(".", 1)[0] for n in raw}:
        w = raw[name + ".weight"]
        if name + ".scales" in raw:
            q = config["quantization"].get(name) or config["quantization"]
            w = mx.dequantize(w, raw[name + ".scales"].astype(mx.float32), raw[name + ".biases"].astype(mx.float32),
                              group_size=q["group_size"], bits=q["bits"])
        out[name] = np.array(w.astype(mx.float32))
    return out


def test_the_gguf_copy_holds_the_checkpoints_weights(bench_gguf):
    """Every tensor, dequantized by the gguf package's own Q4_1 code, equals MLX's
    dequantization of the checkpoint's (4-bit experts, attention and embeddings; the 8-bit
    routers and the norms as F32); the metadata llama.cpp reads names the same shapes."""
    d, path = bench_gguf
    reader = gguf.GGUFReader(str(path))
    got = {t.name: t for t in reader.tensors}
    expected = _expected(d)
    assert len(got) == len(expected)
    q4 = 0
    for module, want in expected.items():
        t = got[gguf_name(module)]
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(want.shape)
        assert np.array_equal(values, want), (module, np.abs(values - want).max())
        q4 += t.tensor_type == gguf.GGMLQuantizationType.Q4_1
    assert q4 == 3 * SMALL.layers + 4 * SMALL.layers + 2  # experts, attention, embeddings and head
    field = lambda key: reader.fields[key].contents()
    assert field("general.architecture") == "qwen3moe"
    assert field("qwen3moe.expert_count") == SMALL.experts and field("qwen3moe.expert_used_count") == SMALL.k
    assert field("qwen3moe.block_count") == SMALL.layers and field("qwen3moe.embedding_length") == SMALL.hidden
    assert len(field("tokenizer.ggml.tokens")) == json.loads((d / "config.json").read_text())["vocab_size"]


def test_other_families_are_refused(tiny_model_factory, tmp_path):
    with pytest.raises(ConfigError, match="handles qwen3_moe checkpoints .* not 'mixtral'"):
        convert(tiny_model_factory("mixtral"), tmp_path / "x.gguf")
    with pytest.raises(ConfigError, match="no GGUF name for the tensor 'model.layers.0.mlp.shared_expert'"):
        gguf_name("model.layers.0.mlp.shared_expert")


def test_the_arm_is_refused_clearly_without_llama_cpp(monkeypatch):
    from edge0.benchmark import llama_cpp

    monkeypatch.setattr(llama_cpp, "available", lambda: llama_cpp.INSTALL)
    with pytest.raises(ConfigError, match=r"pip install 'edge0\[llamacpp\]'"):
        harness.BenchSettings(arms=("exact", "llama.cpp")).validate()


def test_llama_cpp_computes_what_mlx_computes_on_the_copy(bench_gguf):
    """llama.cpp's logits on the GGUF copy track the resident MLX model's at every position
    (it rounds activations to 8 bits in its dot products, so not bit for bit)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from edge0.backend import nn as bnn

    d, path = bench_gguf
    tokens = [5, 17, 33, 2, 99, 41, 7, 250, 13, 77]
    model = bnn.load_full_model(str(d))
    bnn.cast_model(model, mx.float32)  # as the resident arm runs it (the checkpoint's floats are bf16)
    ref = np.array(model(mx.array([tokens]))[0].astype(mx.float32))
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    try:
        llm.eval(tokens)
        ours = np.array(llm.scores[:len(tokens)])
    finally:
        llm.close()
    corr = [np.corrcoef(ours[i], ref[i])[0, 1] for i in range(len(tokens))]
    assert min(corr) > 0.999, corr
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.8


def test_the_llama_cpp_arm_replays_the_benchs_sequence(bench_gguf, tmp_path):
    """Through the harness, cold: llama.cpp consumes the same tokens as the other arms, its
    figures come back and the table says what its columns mean for it."""
    pytest.importorskip("llama_cpp")
    d, path = bench_gguf
    settings = harness.BenchSettings(arms=("resident", "llama.cpp"), rounds=1, cache="cold", prompt_tokens=12,
                                     decode_tokens=4, extra={"gguf_file": str(path), "llama_threads": 2})
    doc = harness.run_bench(d, settings)
    ll, res = doc["arms"]["llama.cpp"], doc["arms"]["resident"]
    assert ll["consumed_digest"] == res["consumed_digest"]
    assert ll["decode_tps"]["median"] > 0 and len(ll["runs"]) == 1 and "peak_active_memory" not in ll
    assert ll["runs"][0]["info"]["threads"] == 2 and ll["runs"][0]["settings"]["gguf_file"] == "m.gguf"
    assert doc["gguf_bytes"] == path.stat().st_size
    table = markdown(doc)
    assert "| llama.cpp |" in table and "n/a" in table and "the same weights in Q4_1" in table
    build = ll["runs"][0]["info"]["build"]  # the CPU features its build uses, in the results and the report
    assert build and all(f == f.strip().upper() and ":" not in f for f in build)
    assert f"Its build uses: {', '.join(build)}." in table


def test_the_bench_command_passes_the_gguf_file_and_threads(tmp_path):
    import argparse

    from edge0.benchmark.command import _extra

    args = argparse.Namespace(heads=None, gguf=str(tmp_path / "m.gguf"), llama_threads=2, kernels="auto")
    assert _extra(args) == {"gguf_file": str((tmp_path / "m.gguf").resolve()), "llama_threads": 2, "kernels": "auto"}
    with pytest.raises(ConfigError, match="--llama-threads must be at least 1, got 0"):
        _extra(argparse.Namespace(heads=None, gguf=None, llama_threads=0, kernels="mlx"))


def test_the_default_gguf_copy_is_named_by_the_checkpoint(bench_gguf, tmp_path, monkeypatch):
    """Converted once into the cache, under a name that changes when the checkpoint does."""
    monkeypatch.setenv("EDGE0_CACHE", str(tmp_path))
    d, _ = bench_gguf
    first = harness.default_gguf(d)
    assert first.parent == tmp_path / "gguf" and first.name.startswith("m-") and first.suffix == ".gguf"
    made = harness._gguf_for(d, {}, lambda s: None)
    assert made == first and made.exists()
    mtime = made.stat().st_mtime_ns
    assert harness._gguf_for(d, {}, lambda s: None).stat().st_mtime_ns == mtime  # not converted again
    cfg = d / "config.json"
    cfg.write_text(cfg.read_text() + " ")
    try:
        assert harness.default_gguf(d) != first
    finally:
        cfg.write_text(cfg.read_text()[:-1])


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_the_page_cache_protocol_covers_the_gguf_copy(bench_gguf, monkeypatch, cache):
    """Cold: before every run the GGUF copy is evicted with the checkpoint (a llama.cpp run
    finds neither cached); warm: each arm's own file is read through first."""
    from tests.test_bench import fake_runner

    d, path = bench_gguf
    monkeypatch.setattr(harness, "make_replay", lambda *a: {"prompt": [1, 2], "continuation": [3]})
    monkeypatch.setattr("edge0.benchmark.llama_cpp.available", lambda: None)
    evicted, warmed = [], []
    monkeypatch.setattr(harness, "evict", lambda files: evicted.append(list(files)))
    monkeypatch.setattr(harness, "warm", lambda files: warmed.append(list(files)))
    settings = harness.BenchSettings(arms=("resident", "llama.cpp"), rounds=1, cache=cache,
                                     extra={"gguf_file": str(path)})
    harness.run_bench(d, settings, runner=fake_runner([]))
    files = harness.checkpoint_files(d)
    if cache == "cold":
        assert evicted == [files + [path]] * 2 and not warmed
    else:
        assert warmed == [files, [path]] and not evicted
