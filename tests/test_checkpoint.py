"""The checkpoint index: byte ranges, sharding, and every layout error (RELIABILITY 2-4)."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from edge0 import EngineConfig
from edge0.loader import load_streaming_model
from edge0.model.open import load_spec, open_checkpoint
from edge0.errors import ConfigError, HeaderError, LayoutError, UnsafeModelError, UnsupportedModelError
from tests.ckpt_tools import copy_model, find


@pytest.fixture
def qwen(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


def open_index(d):
    return open_checkpoint(d)[1]


def test_every_expert_range_holds_that_experts_bytes(tiny_model):
    index = open_index(tiny_model)
    spec = index.spec
    layer = spec.moe_layers[-1]
    le = index.layers[layer]
    assert le.expert_bytes * spec.num_experts * len(spec.moe_layers) == index.expert_bytes_total
    assert len(le.names) == 9  # gate/up/down x weight/scales/biases
    for name in le.names:
        loc = le.location(name)
        assert loc.key == f"{spec.switch_path(layer)}.{name}"
        whole = mx.load(loc.file)[loc.key]
        raw = np.array(whole.view(mx.uint8)).reshape(spec.num_experts, -1)
        with open(loc.file, "rb") as f:
            for e in (0, spec.num_experts // 2, spec.num_experts - 1):
                start, end = loc.expert_range(e)
                f.seek(start)
                assert f.read(end - start) == raw[e].tobytes()


def test_sharded_checkpoint_streams_identically(qwen, tmp_path):
    sharded = copy_model(qwen, tmp_path / "sharded", shards=3)
    assert len(list(sharded.glob("model-*.safetensors"))) == 3
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    outs = []
    for d in (qwen, sharded):
        s = load_streaming_model(d, EngineConfig())
        outs.append(s.model(tokens))
        s.close()
    assert mx.array_equal(outs[0], outs[1]).item()


def _expert_key(d, proj="up_proj", part="weight"):
    spec = load_spec(d)
    return f"{spec.switch_path(spec.moe_layers[0])}.{proj}.{part}"


def test_expert_count_differs_from_config(qwen, tmp_path):
    bad = copy_model(qwen, tmp_path / "m", config=lambda c: c.update(num_experts=8))
    with pytest.raises(LayoutError, match="expert count 16 differs from config.json's 8") as e:
        open_index(bad)
    assert e.value.tensor.endswith(".switch_mlp.gate_proj.weight")


def test_packed_int4_shape_inconsistent(qwen, tmp_path):
    key = _expert_key(qwen)

    def mutate(ts):
        t = find(ts, key)
        e, out, packed = t["shape"]
        t["shape"] = [e, out * 2, packed // 2]  # same bytes, wrong packing

    bad = copy_model(qwen, tmp_path / "m", mutate)
    with pytest.raises(LayoutError, match=r"int4 packed shape \[16, 128, 8\] is inconsistent with scales "
                                          r"\[16, 64, 2\] at group size 64") as e:
        open_index(bad)
    assert e.value.tensor == key and e.value.file.endswith("model.safetensors")


def test_expert_shapes_disagree_with_config(qwen, tmp_path):
    bad = copy_model(qwen, tmp_path / "m", config=lambda c: c.update(moe_intermediate_size=128))
    with pytest.raises(LayoutError, match=r"shape \[16, 64, 16\] is inconsistent with config.json \(int4 group 64 "
                                          r"packing\): expected \[16, 128, 16\]"):
        open_index(bad)


def test_scales_shape_mismatch(qwen, tmp_path):
    key = _expert_key(qwen, "down_proj", "biases")

    def mutate(ts):
        t = find(ts, key)
        e, out, groups = t["shape"]
        t["shape"] = [e, out // 2, groups * 2]

    bad = copy_model(qwen, tmp_path / "m", mutate)
    with pytest.raises(LayoutError, match="biases shape .* differs from scales shape") as e:
        open_index(bad)
    assert e.value.tensor == key


def test_resident_quantized_triple_inconsistent(qwen, tmp_path):
    def mutate(ts):
        t = find(ts, "layers.0.self_attn.q_proj.weight")
        a, b = t["shape"]
        t["shape"] = [a * 2, b // 2]  # same bytes, rows no longer match the scales

    bad = copy_model(qwen, tmp_path / "m", mutate)
    with pytest.raises(LayoutError, match="is inconsistent with scales") as e:
        open_index(bad)
    assert e.value.tensor == "model.layers.0.self_attn.q_proj.weight"


def test_missing_expert_tensor(qwen, tmp_path):
    key = _expert_key(qwen, "gate_proj", "biases")
    bad = copy_model(qwen, tmp_path / "m", lambda ts: [t for t in ts if t["name"] != key])
    with pytest.raises(LayoutError, match=re.escape(f"missing tensor: expected {key!r}")) as e:
        open_index(bad)
    assert e.value.tensor == key


def test_missing_resident_tensor(qwen, tmp_path):
    bad = copy_model(qwen, tmp_path / "m", lambda ts: [t for t in ts if t["name"] != "model.norm.weight"])
    with pytest.raises(LayoutError, match=r"resident tensors missing from the checkpoint: \['model.norm.weight'\]"):
        load_streaming_model(bad, EngineConfig())


def test_unexpected_resident_tensor(qwen, tmp_path):
    def mutate(ts):
        extra = dict(find(ts, "model.norm.weight"))
        extra["name"] = "model.extra.weight"
        return ts + [extra]

    bad = copy_model(qwen, tmp_path / "m", mutate)
    with pytest.raises(LayoutError, match=r"checkpoint tensors the model does not have: \['model.extra.weight'\]"):
        load_streaming_model(bad, EngineConfig())


def test_duplicate_key_across_shards(qwen, tmp_path):
    def mutate(ts):
        ts = [t for t in ts if t["name"] != "model.norm.weight"] + [find(ts, "model.norm.weight")]
        return [dict(ts[-1])] + ts  # one copy in the first shard, one in the last

    bad = copy_model(qwen, tmp_path / "m", mutate, shards=2)
    with pytest.raises(LayoutError, match="duplicate key: also stored in") as e:
        open_index(bad)
    assert e.value.tensor == "model.norm.weight"


def test_wrong_and_unknown_dtypes(qwen, tmp_path):
    key = _expert_key(qwen)

    def to_i32(ts):
        find(ts, key)["dtype"] = "I32"

    with pytest.raises(LayoutError, match=r"dtype I32, expected U32 \(packed quantized words\)"):
        open_index(copy_model(qwen, tmp_path / "a", to_i32))

    def to_unknown(ts):
        find(ts, key)["dtype"] = "Q4"

    with pytest.raises(HeaderError, match="unknown dtype") as e:
        open_index(copy_model(qwen, tmp_path / "b", to_unknown))
    assert e.value.tensor == key


def test_truncated_shard_is_refused_before_reading(qwen, tmp_path):
    bad = copy_model(qwen, tmp_path / "m")
    f = bad / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 100)
    with pytest.raises(HeaderError, match="missing bytes"):
        open_index(bad)


@pytest.mark.parametrize("what", ["model_file", "py", "pickle"])
def test_code_or_pickles_are_refused(qwen, tmp_path, what):
    if what == "model_file":
        bad = copy_model(qwen, tmp_path / "m", config=lambda c: c.update(model_file="evil.py"))
        match = "asks to import custom code"
    else:
        bad = copy_model(qwen, tmp_path / "m")
        name = "modeling.py" if what == "py" else "pytorch_model.bin"
        (bad / name).write_text("raise SystemExit('executed')")
        match = f"holds '{name}'"
    with pytest.raises(UnsafeModelError, match=match):
        load_streaming_model(bad, EngineConfig())


def test_dense_model_type_has_nothing_to_stream(qwen, tmp_path):
    bad = copy_model(qwen, tmp_path / "m", config=lambda c: c.update(model_type="llama"))
    with pytest.raises(UnsupportedModelError, match="llama: no decoder layer has a stack of routed experts"):
        load_spec(bad)


def test_model_type_unknown_to_mlx_lm(qwen, tmp_path):
    bad = copy_model(qwen, tmp_path / "m", config=lambda c: c.update(model_type="not_a_model"))
    with pytest.raises(UnsupportedModelError, match="not_a_model"):
        load_spec(bad)


@pytest.mark.parametrize("model_type", ["dbrx"])
def test_stacks_edge0_cannot_read_are_refused_with_the_reason(qwen, tmp_path, model_type):
    bad = copy_model(qwen, tmp_path / "m", config=lambda c: c.update(model_type=model_type))
    with pytest.raises(UnsupportedModelError, match=f"{model_type} cannot be streamed: its experts are a Python list"):
        load_spec(bad)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ConfigError, match="is not a model directory"):
        load_spec(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        load_spec(tmp_path)
