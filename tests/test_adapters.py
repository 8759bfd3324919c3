"""Recovery LoRA adapters at serving time: unmerged deltas on every path, mlx-lm's layout
both ways, foreign and malformed adapters refused, several adapters on one base."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from edge0 import CheckpointError, ConfigError, Engine, EngineConfig, HeaderError
from edge0.adapters import WEIGHTS_FILE, adapter_key, save_adapter, target_modules
from edge0.backend import nn as bnn
from edge0.errors import ForeignArtifactError
from edge0.loader import load_streaming_model
from edge0.prerouter.files import checkpoint_identity

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"


def random_adapter(model_dir: Path, out: Path, *, rank: int = 4, scale: float = 2.0, seed: int = 0,
                   only: tuple[str, ...] | None = None, provenance: dict | None = None) -> Path:
    """An adapter on every target projection (or those whose path ends with ``only``),
    with B random (not zero) so that it changes the output."""
    s = load_streaming_model(model_dir, EngineConfig(adapter="off", prerouter="off"))
    try:
        targets = target_modules(s.model, s.spec)
        rng = np.random.default_rng(seed)
        tensors, keys = {}, set()
        for path, module in targets.items():
            if only and not path.endswith(only):
                continue
            out_dim, in_dim = bnn.linear_dims(module)
            a = rng.normal(0, 1 / np.sqrt(in_dim), (in_dim, rank)).astype(np.float32)
            b = rng.normal(0, 0.05, (rank, out_dim)).astype(np.float32)
            tensors[path] = (mx.array(a), mx.array(b))
            keys.add(adapter_key(s.spec, path))
        prov = {"base_identity": checkpoint_identity(model_dir), "phase": "test"}
        prov.update(provenance or {})
        return save_adapter(tensors, out, rank=rank, scale=scale, keys=sorted(keys), num_layers=s.spec.num_layers,
                            provenance=prov)
    finally:
        s.close()


@pytest.fixture(scope="module")
def qwen(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


@pytest.fixture(scope="module")
def adapter(qwen, tmp_path_factory):
    return random_adapter(qwen, tmp_path_factory.mktemp("adapter") / "recovery")


def first_logits(model_dir, config, ids):
    s = load_streaming_model(model_dir, config)
    try:
        if s.adapters is not None:
            s.adapters.activate(next(iter(s.adapters.adapters)))
        out = s.model(mx.array([ids]))
        mx.eval(out)
        return out
    finally:
        s.close()


def reference_logits(model_dir, adapter_dir, ids):
    """mlx-lm's resident model (float32) with every adapted projection replaced by a float
    Linear of the dequantized weight plus the explicit delta scale * (A @ B)^T."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    model = bnn.load_full_model(model_dir)
    bnn.cast_model(model, mx.float32)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = cfg["lora_parameters"]["scale"]
    weights = mx.load(str(adapter_dir / WEIGHTS_FILE))
    for path in {k.rsplit(".", 1)[0] for k in weights}:
        q = bnn.module_at(model, path)
        w = mx.dequantize(q.weight, q.scales, q.biases, group_size=q.group_size, bits=q.bits).astype(mx.float32)
        delta = scale * (weights[f"{path}.lora_a"] @ weights[f"{path}.lora_b"]).T
        lin = nn.Linear(w.shape[1], w.shape[0], bias="bias" in q)
        lin.weight = w + delta
        if "bias" in q:
            lin.bias = q.bias
        bnn.set_module_at(model, path, lin)
    assert tree_flatten(model.parameters())
    out = model(mx.array([ids]))
    mx.eval(out)
    return out


def rel_l2(a, b) -> float:
    a, b = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "qwen3_5_moe"])
def test_adapter_equals_dequantized_weights_plus_explicit_delta(tiny_model_factory, tmp_path, family):
    d = tiny_model_factory(family)
    a = random_adapter(d, tmp_path / "a")
    with Engine(d) as e:
        ids = e.encode(PROMPT)
    base = first_logits(d, EngineConfig(adapter="off"), ids)
    ours = first_logits(d, EngineConfig(adapter=str(a)), ids)
    ref = reference_logits(d, a, ids)
    moved = rel_l2(ours, base)
    assert moved > 0.01, "the adapter must change the logits for this test to mean anything"
    # dequantized float matmuls against the quantized kernel: close, and far closer than the delta
    assert rel_l2(ours, ref) < 1e-3 and rel_l2(ours, ref) < moved / 20


@pytest.mark.parametrize("config", [
    dict(decode_path="staged"), dict(decode_path="hot", hot_experts=6), dict(decode_path="whole_layer"),
    dict(prefill_path="whole_layer"),
])
def test_every_path_serves_the_adapter_bit_identically(qwen, adapter, config):
    with Engine(qwen, EngineConfig(adapter=str(adapter))) as e:
        oracle = e.record_routing(PROMPT, max_tokens=8)
        expected = [ev.token for ev in e.stream(PROMPT, max_tokens=8)]
        bare = [ev.token for ev in e.stream(PROMPT, max_tokens=8, adapter=None)]
    assert expected != bare
    with Engine(qwen, EngineConfig(adapter=str(adapter), **config), oracle=oracle) as e:
        assert [ev.token for ev in e.stream(PROMPT, max_tokens=8)] == expected


def test_edge0_adapter_loads_in_mlx_lm_with_equal_logits(qwen, adapter):
    from mlx_lm.utils import load

    with Engine(qwen) as e:
        ids = e.encode(PROMPT)
    ours = first_logits(qwen, EngineConfig(adapter=str(adapter), kernels="mlx"), ids)  # mlx-lm's kernels
    model, _ = load(str(qwen), adapter_path=str(adapter))
    bnn.cast_model(model, mx.float32)
    theirs = model(mx.array([ids]))
    assert mx.array_equal(ours, theirs).item(), f"max diff {mx.abs(ours - theirs).max().item()}"


def test_adapter_trained_by_mlx_lm_lora_loads_in_edge0(qwen, tmp_path):
    """A few iterations of ``mlx_lm lora`` on attention keys; Edge0 serves the result with
    the logits mlx-lm gives it."""
    from mlx_lm.utils import load

    data = tmp_path / "data"
    data.mkdir()
    rows = [{"text": f"def f{i}(x):\n    return x * {i}\n"} for i in range(24)]
    for split in ("train", "valid"):
        (data / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = tmp_path / "lora.yaml"
    cfg.write_text("lora_parameters:\n  keys: [self_attn.q_proj, self_attn.v_proj, self_attn.o_proj]\n"
                   "  rank: 4\n  scale: 10.0\n  dropout: 0.0\n")
    out = tmp_path / "adapters"
    run = subprocess.run([sys.executable, "-m", "mlx_lm", "lora", "--model", str(qwen), "--train", "--data",
                          str(data), "--iters", "3", "--batch-size", "2", "--num-layers", "-1", "--adapter-path",
                          str(out), "-c", str(cfg), "--max-seq-length", "64", "--learning-rate", "1e-2"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    with Engine(qwen, EngineConfig(adapter=str(out))) as e:
        ids = e.encode(PROMPT)
        assert e.adapters == ["adapters"]
    ours = first_logits(qwen, EngineConfig(adapter=str(out), kernels="mlx"), ids)  # mlx-lm's kernels
    model, _ = load(str(qwen), adapter_path=str(out))
    bnn.cast_model(model, mx.float32)
    theirs = model(mx.array([ids]))
    assert mx.array_equal(ours, theirs).item()
    base = first_logits(qwen, EngineConfig(adapter="off", kernels="mlx"), ids)
    assert not mx.array_equal(ours, base).item()


def test_adapter_beside_the_checkpoint_is_found(qwen, tmp_path):
    from tests.ckpt_tools import copy_model

    d = copy_model(qwen, tmp_path / "m")
    random_adapter(d, d / "adapter")
    with Engine(d) as e:
        assert e.adapters == ["adapter"]
        events = list(e.stream(PROMPT, max_tokens=4))
        assert "adapter adapter (rank 4" in events[-1].stats.line()
    with Engine(d, EngineConfig(adapter="off")) as e:
        assert e.adapters == []
        assert "adapter none" in list(e.stream(PROMPT, max_tokens=2))[-1].stats.line()


def test_several_adapters_on_one_base(qwen, adapter, tmp_path):
    other = random_adapter(qwen, tmp_path / "other", seed=1, scale=10.0, only=("q_proj", "o_proj"))
    with Engine(qwen, EngineConfig(adapter=str(adapter), extra_adapters=(str(other),))) as e:
        assert e.adapters == ["recovery", "other"]
        a = [ev.token for ev in e.stream(PROMPT, max_tokens=8)]
        b = [ev.token for ev in e.stream(PROMPT, max_tokens=8, adapter="other")]
        none = [ev.token for ev in e.stream(PROMPT, max_tokens=8, adapter=None)]
        again = [ev.token for ev in e.stream(PROMPT, max_tokens=8, adapter="recovery")]
        with pytest.raises(ConfigError, match="no adapter named 'missing'"):
            list(e.stream(PROMPT, max_tokens=2, adapter="missing"))
    for name, tokens in (("recovery", a), ("other", b)):
        with Engine(qwen, EngineConfig(adapter=str(adapter if name == "recovery" else other))) as e:
            assert [ev.token for ev in e.stream(PROMPT, max_tokens=8)] == tokens
    with Engine(qwen, EngineConfig(adapter="off")) as e:
        assert [ev.token for ev in e.stream(PROMPT, max_tokens=8)] == none
    assert again == a and len({tuple(a), tuple(b), tuple(none)}) == 3


def test_foreign_adapters_are_refused_naming_both_identities(qwen, tiny_model_factory, tmp_path):
    other = tiny_model_factory("qwen3_moe", layers=3)
    a = random_adapter(other, tmp_path / "foreign")
    with pytest.raises((ForeignArtifactError, CheckpointError)) as err:
        Engine(qwen, EngineConfig(adapter=str(a)))
    msg = str(err.value)
    # a 3-layer adapter names modules a 4-layer model has, but its provenance is another base
    assert "another base checkpoint" in msg and checkpoint_identity(qwen) in msg and checkpoint_identity(other) in msg


def test_adapter_trained_under_other_heads_is_refused(qwen, tmp_path):
    from edge0.adapters import artifact_identity
    from edge0.prerouter.files import heads_identity
    from edge0.train.heads import make_warm_heads
    from tests.ckpt_tools import copy_model

    d = copy_model(qwen, tmp_path / "m")
    make_warm_heads(d, d / "prerouter.safetensors", width=32)
    a = random_adapter(d, tmp_path / "a", provenance={"heads_identity": "0" * 32, "heads_k": 4})
    with pytest.raises(ForeignArtifactError, match="trained under other prerouter heads") as err:
        Engine(d, EngineConfig(adapter=str(a)))
    assert "0" * 32 in str(err.value) and heads_identity(d / "prerouter.safetensors") in str(err.value)
    for name, ident in (("ok", heads_identity), ("made-before", artifact_identity)):  # what adapters record, recorded
        ok = random_adapter(d, tmp_path / name, provenance={
            "heads_identity": ident(d / "prerouter.safetensors"), "heads_k": 4})
        with Engine(d, EngineConfig(adapter=str(ok))) as e:
            assert "heads prerouter.safetensors" in list(e.stream(PROMPT, max_tokens=2))[-1].stats.line()


def _rewrite(adapter_dir: Path, out: Path, mutate) -> Path:
    import shutil

    from tests.ckpt_tools import read_tensors, write_tensors

    shutil.copytree(adapter_dir, out)
    tensors, meta = read_tensors(adapter_dir / WEIGHTS_FILE)
    (out / WEIGHTS_FILE).unlink()
    tensors, meta = mutate(tensors, meta) or (tensors, meta)
    write_tensors(out / WEIGHTS_FILE, tensors, meta)
    return out


@pytest.mark.parametrize("case,error,match", [
    ("routed expert", CheckpointError, "a routed expert streams from disk and never carries an adapter"),
    ("router", CheckpointError, "not an attention or shared-expert projection"),
    ("shape", CheckpointError, r"shape \[128, 5\], expected \[128, 4\]"),
    ("dtype", CheckpointError, "dtype I32, expected a float type"),
    ("one half", CheckpointError, "needs both lora_a and lora_b"),
    ("not lora", CheckpointError, "not a LoRA tensor"),
])
def test_malformed_adapters_are_refused(qwen, adapter, tmp_path, case, error, match):
    def mutate(tensors, meta):
        t = tensors[0]
        if case == "routed expert":
            t["name"] = "model.layers.1.mlp.switch_mlp.gate_proj.lora_a"
        elif case == "router":
            t["name"] = "model.layers.1.mlp.gate.lora_a"
        elif case == "shape":
            t["shape"] = [128, 5]
            t["data"] = bytes(128 * 5 * 4)
        elif case == "dtype":
            t["dtype"] = "I32"
        elif case == "one half":
            tensors.pop(1 if tensors[1]["name"].endswith("lora_b") else 0)
        elif case == "not lora":
            t["name"] = t["name"].replace("lora_a", "weight")
        return tensors, meta

    bad = _rewrite(adapter, tmp_path / "bad", mutate)
    with pytest.raises(error, match=match):
        Engine(qwen, EngineConfig(adapter=str(bad)))


def test_adapter_files_that_are_not_adapters(qwen, adapter, tmp_path):
    import shutil

    d = tmp_path / "x"
    shutil.copytree(adapter, d)
    (d / WEIGHTS_FILE).write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(HeaderError):
        Engine(qwen, EngineConfig(adapter=str(d)))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    for change, match in ((dict(fine_tune_type="dora"), "fine_tune_type 'dora' is not supported"),
                          (dict(lora_parameters={"rank": 0, "scale": 1.0}), "rank must be an integer")):
        shutil.rmtree(d)
        shutil.copytree(adapter, d)
        (d / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ConfigError, match=match):
            Engine(qwen, EngineConfig(adapter=str(d)))
    with pytest.raises(ConfigError, match="is not a directory"):
        Engine(qwen, EngineConfig(adapter=str(tmp_path / "missing")))


def test_adapter_init_serves_the_base_and_loads_in_mlx_lm(qwen, tmp_path):
    """``edge0 adapter init``: an untrained adapter (B = 0) on every target projection;
    served, it gives the base's logits; it loads in mlx-lm, and a bad --out is refused."""
    from edge0.cli import main

    out = tmp_path / "init"
    assert main(["adapter", "init", "--model", str(qwen), "--out", str(out), "--rank", "4"]) == 0
    weights = mx.load(str(out / "adapters.safetensors"))
    s = load_streaming_model(qwen, EngineConfig(adapter="off", prerouter="off"))
    try:
        targets = set(target_modules(s.model, s.spec))
    finally:
        s.close()
    assert {k.rpartition(".")[0] for k in weights} == targets
    assert all(w.shape[-1] == 4 for k, w in weights.items() if k.endswith("lora_a"))
    assert all(not mx.any(w).item() for k, w in weights.items() if k.endswith("lora_b"))
    assert any(mx.any(w).item() for k, w in weights.items() if k.endswith("lora_a"))
    ids = [[3, 7, 11, 5]]
    logits = {}
    for label, adapter in (("base", "off"), ("init", str(out))):
        s = load_streaming_model(qwen, EngineConfig(adapter=adapter, prerouter="off"))
        try:
            logits[label] = s.model(mx.array(ids))
            assert (s.adapters is not None and s.adapters.active is not None) == (label == "init")
        finally:
            s.close()
    assert mx.array_equal(logits["base"], logits["init"]).item()
    from mlx_lm import load as mlx_load

    mlx_load(str(qwen), adapter_path=str(out))
    assert main(["adapter", "init", "--model", str(qwen), "--out", str(out)]) == 2  # not empty: refused


def test_the_demo_serves_its_shipped_adapter():
    """The packaged demo, opened with every default (sync and async, and `edge0 demo`),
    applies the recovery adapter that ships beside it, on top of its shipped heads, with
    the routing both were trained for (select, k+2): the stats line names both, and the
    adapter changes the output (bare base: adapter=None)."""
    import anyio

    from edge0.adapters import ADAPTER_DIRNAME
    from edge0.cli import PACKAGED_DEMO
    from edge0.prerouter.files import HEADS_FILENAME

    adapter_dir = PACKAGED_DEMO / ADAPTER_DIRNAME
    assert (adapter_dir / "adapters.safetensors").is_file() and (adapter_dir / "adapter_config.json").is_file()
    rank = json.loads((adapter_dir / "adapter_config.json").read_text())["lora_parameters"]["rank"]
    with Engine(PACKAGED_DEMO) as engine:
        s = engine.streaming
        assert s.adapters is not None and s.adapters.active == ADAPTER_DIRNAME
        assert s.stager.layers == s.prerouter.heads.consumers() and s.heads_path == PACKAGED_DEMO / HEADS_FILENAME
        _, meta = mx.load(str(adapter_dir / "adapters.safetensors"), return_metadata=True)
        assert json.loads(meta["routing"]) == {"routing": s.routing[0], "stage_extra": s.routing[1]} \
            == {"routing": "select", "stage_extra": 2}
        with_adapter = list(engine.stream("def f(x):", max_tokens=12, logprobs=True))
        bare = list(engine.stream("def f(x):", max_tokens=12, logprobs=True, adapter=None))
    stats = with_adapter[-1].stats
    assert stats.adapter.startswith(f"{ADAPTER_DIRNAME} (rank {rank},") and "phase 2" in stats.adapter
    assert stats.heads.startswith(HEADS_FILENAME)
    assert bare[-1].stats.adapter is None
    assert [e.logprob for e in with_adapter] != [e.logprob for e in bare]

    async def main():
        async with Engine.open(PACKAGED_DEMO) as engine:
            return [e async for e in engine.generate("def f(x):", max_tokens=12, logprobs=True) if e is not None]

    events = anyio.run(main)
    assert events[-1].stats.adapter == stats.adapter and [e.token for e in events] == [e.token for e in with_adapter]
    out = subprocess.run([sys.executable, "-m", "edge0", "demo", "--max-tokens", "4"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"adapter {stats.adapter}" in out.stdout


_LOAD_DEMO = ("import sys\nfrom edge0 import EngineConfig\nfrom edge0.errors import CheckpointError\n"
              "from edge0.cli import PACKAGED_DEMO\nfrom edge0.loader import load_streaming_model\n"
              "try:\n    load_streaming_model(PACKAGED_DEMO, EngineConfig(adapter=sys.argv[1])).close()\n"
              "except CheckpointError as e:\n    print(e)\nelse:\n    print('loaded')")


def test_crafted_adapter_files_are_refused_in_one_short_line(tmp_path):
    """The demo's shipped adapter, its header rewritten: a tensor name with a huge layer
    index, and provenance values a megabyte long. Each is one short line naming the file,
    and the crafted file costs the valid one's memory."""
    import shutil

    from edge0.cli import PACKAGED_DEMO
    from tests.ckpt_tools import peak_rss, rewrite_header

    src = PACKAGED_DEMO / "adapter"

    def crafted(name, mutate) -> Path:
        d = tmp_path / name
        shutil.copytree(src, d)
        rewrite_header(src / WEIGHTS_FILE, d / WEIGHTS_FILE, mutate)
        return d

    def rename(tensors, meta):
        t = next(t for t in tensors if t["name"] == "model.layers.0.self_attn.q_proj.lora_a")
        t["name"] = "model.layers.50000000.self_attn.q_proj.lora_a"
    huge = crafted("huge", rename)
    with pytest.raises(CheckpointError) as e:
        load_streaming_model(PACKAGED_DEMO, EngineConfig(adapter=str(huge)))
    assert str(e.value) == (f"file {huge / WEIGHTS_FILE}, tensor 'model.layers.50000000.self_attn.q_proj.lora_a': "
                            "module 'model.layers.50000000.self_attn.q_proj': not an attention or shared-expert "
                            "projection of this model")
    long = "'" + "x" * 39 + "... (1000002 characters)"
    for key, message in (("base_identity", "the adapter was made for another base checkpoint: its base_identity is "
                                           f"{long}, this model is "),
                         ("heads_identity", f"the adapter was trained under other prerouter heads: its heads_identity "
                                            f"is {long}, this engine serves with heads ")):
        d = crafted(key, lambda tensors, meta: meta.update({key: "x" * 10**6}))
        with pytest.raises(ForeignArtifactError) as e:
            load_streaming_model(PACKAGED_DEMO, EngineConfig(adapter=str(d)))
        assert str(e.value).startswith(f"file {d / WEIGHTS_FILE}: {message}") and len(str(e.value)) < 400

    said, valid_kib = peak_rss(_LOAD_DEMO, src)
    assert said == "loaded"
    said, crafted_kib = peak_rss(_LOAD_DEMO, huge)
    assert said.startswith(f"file {huge / WEIGHTS_FILE}, tensor 'model.layers.50000000") and "\n" not in said
    assert crafted_kib < 2 * valid_kib, (crafted_kib, valid_kib)
