"""The hostile model directories that once crashed, hung, read outside the directory or
served garbage: each now gets one typed error naming the file and the field or tensor.

Opened in a worker process (tests/fuzzing.py), so a regression shows as a failed test
with the crash, hang or memory blow-up it caused, not as a dead test run."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.fuzzing import Worker


@pytest.fixture(scope="module")
def worker():
    w = Worker(memory_limit=4 * 2**30)
    yield w
    w.close()


def _copy(tiny_model_factory, family, tmp_path, name="m") -> Path:
    from tests.ckpt_tools import copy_model

    return copy_model(tiny_model_factory(family), tmp_path / name)


def _set_config(d: Path, **values) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(values)
    (d / "config.json").write_text(json.dumps(cfg))


def _set_dtype(d: Path, suffix: str, dtype: str) -> str:
    f = d / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k.endswith(suffix))
    header[name]["dtype"] = dtype
    blob = json.dumps(header).encode()
    blob += b" " * (n - len(blob))
    assert len(blob) == n
    f.write_bytes(raw[:8] + blob + raw[8 + n:])
    return name


def _check(worker, d, error: str, match: str):
    outcome, detail = worker.run(d, time_limit=60)
    assert outcome == "typed", f"{outcome}: {detail}"
    assert detail.startswith(error + ":"), detail
    assert match in detail, detail


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite", "bailing_moe"])
@pytest.mark.parametrize("value", [1, True])
def test_intermediate_size_that_crashed_the_quantizer(worker, tiny_model_factory, tmp_path, family, value):
    d = _copy(tiny_model_factory, family, tmp_path)
    _set_config(d, intermediate_size=value)
    _check(worker, d, "ConfigError" if value is True else "LayoutError",
           "intermediate_size" if value is True else "group size")


@pytest.mark.parametrize("values,match", [
    (dict(num_hidden_layers=1_000_000_000), "'num_hidden_layers' is 1000000000, but the checkpoint has tensors for 4"),
    (dict(hidden_size=10**12), "'hidden_size' is 1000000000000, larger than any tensor"),
    (dict(rope_theta=""), "'rope_theta' must be a number, got ''"),
    (dict(num_attention_heads="8"), "'num_attention_heads' must be an integer"),
    (dict(num_attention_heads=0), "'num_attention_heads' must be at least 1, got 0"),
    (dict(num_experts_per_tok=-3), "'num_experts_per_tok' must not be negative"),
    (dict(max_position_embeddings=2**40), "'max_position_embeddings' is 1099511627776, over the limit"),
    (dict(quantization={"group_size": 64, "bits": "abc"}), "quantization.bits must be one of"),
    # found by the 10,000-variant fuzzing campaign
    (dict(model_type={}), "'model_type' must be a model type name (a string), got {}"),
    (dict(model_type=[1, 2]), "'model_type' must be a model type name (a string), got [1, 2]"),
    (dict(partial_rotary_factor=-2.5), "'partial_rotary_factor' must be a fraction in (0, 1], got -2.5"),
    (dict(partial_rotary_factor=1_000_000_000), "'partial_rotary_factor' must be a fraction in (0, 1]"),
])
def test_config_values(worker, tiny_model_factory, tmp_path, values, match):
    d = _copy(tiny_model_factory, "qwen3_moe", tmp_path)
    _set_config(d, **values)
    _check(worker, d, "ConfigError", match)


@pytest.mark.parametrize("family,value", [("bailing_moe", -2.5), ("bailing_moe", 10**9), ("qwen3_5_moe", 10**9)])
def test_rotary_fraction_out_of_range_at_any_depth(worker, tiny_model_factory, tmp_path, family, value):
    """The fuzzer's cases: a rotary fraction that gave MLX's rope kernel an impossible
    dimension at the first token (bailing_moe at the top level, qwen3_5_moe inside
    text_config.rope_parameters)."""
    d = _copy(tiny_model_factory, family, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    if family == "qwen3_5_moe":
        cfg["text_config"].setdefault("rope_parameters", {})["partial_rotary_factor"] = value
        where = "text_config.rope_parameters.partial_rotary_factor"
    else:
        cfg["partial_rotary_factor"] = value
        where = "partial_rotary_factor"
    (d / "config.json").write_text(json.dumps(cfg))
    _check(worker, d, "ConfigError", f"'{where}' must be a fraction in (0, 1]")


def test_deeply_nested_and_non_utf8_config(worker, tiny_model_factory, tmp_path):
    d = _copy(tiny_model_factory, "qwen3_moe", tmp_path)
    (d / "config.json").write_text('{"model_type": ' + "[" * 100000 + "]" * 100000 + "}")
    _check(worker, d, "ConfigError", "nested too deeply")
    (d / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')
    _check(worker, d, "ConfigError", "is not UTF-8")


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors.index.json",
                                  "model.safetensors"])
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/urandom", "outside"])
def test_files_that_are_not_regular_files_inside_the_directory(worker, tiny_model_factory, tmp_path, name, kind):
    d = _copy(tiny_model_factory, "qwen3_moe", tmp_path)
    if name == "model.safetensors.index.json":
        (d / name).write_text(json.dumps({"weight_map": {}}))
    (d / name).unlink()
    if kind == "fifo":
        os.mkfifo(d / name)
        match = "is a FIFO, not a regular file"
    elif kind == "outside":
        (tmp_path / "elsewhere.json").write_text("{}")
        os.symlink(tmp_path / "elsewhere.json", d / name)
        match = "symbolic link leaves the model directory"
    else:
        os.symlink(kind, d / name)
        match = "symbolic link leaves the model directory"
    _check(worker, d, "UnsafeModelError", match)


def test_index_naming_files_outside_the_directory(worker, tiny_model_factory, tmp_path):
    d = _copy(tiny_model_factory, "qwen3_moe", tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    _check(worker, d, "LayoutError", "names files that are not model*.safetensors")


def test_broken_tokenizer(worker, tiny_model_factory, tmp_path):
    d = _copy(tiny_model_factory, "qwen3_moe", tmp_path)
    (d / "tokenizer.json").write_text('{"model": 5}')
    _check(worker, d, "TokenizerError", "the tokenizer does not load")


@pytest.mark.parametrize("suffix,dtype,match", [
    ("layers.0.self_attn.q_proj.scales", "F16", "dtype F16 among"),  # bf16 bytes declared F16
    ("layers.0.input_layernorm.weight", "I16", "dtype mlx.core.int16 where the model holds a floating-point"),
    ("model.norm.weight", "I16", "floating-point"),
])
def test_resident_dtype_of_the_same_width_is_refused(worker, tiny_model_factory, tmp_path, suffix, dtype, match):
    d = _copy(tiny_model_factory, "qwen3_moe", tmp_path)
    _set_dtype(d, suffix, dtype)
    _check(worker, d, "LayoutError", match)


def test_heads_for_another_shape_are_refused(worker, tiny_model_factory, tmp_path):
    """Heads predicting 32 experts beside a 16-expert model once read other tensors' bytes."""
    from edge0.prerouter.files import checkpoint_identity, save_heads
    from edge0.prerouter.heads import PrerouterHeads

    d = _copy(tiny_model_factory, "qwen3_moe", tmp_path)
    heads = PrerouterHeads([0, 1, 2], hidden=128, experts=32, k=4, width=16)
    save_heads(heads, d / "prerouter.safetensors", base_identity=checkpoint_identity(d), recipe={},
               training_data="test")
    _check(worker, d, "CheckpointError", "heads predict for experts = 32, the model has 16")


def test_oracle_with_experts_outside_the_model_is_refused(tiny_model_factory, tmp_path):
    from edge0 import ConfigError, Engine, EngineConfig
    from edge0.exec.oracle import OracleRouting

    d = tiny_model_factory("qwen3_moe")
    OracleRouting([{0: (1, 99)}]).save(tmp_path / "o.json")
    with pytest.raises(ConfigError, match=r"expert ids outside \[0, 16\)"):
        Engine(d, EngineConfig(decode_path="staged", oracle_file=str(tmp_path / "o.json")))


def test_data_bytes_flipped_give_output_or_typed_error(worker, tiny_model_factory, tmp_path):
    d = _copy(tiny_model_factory, "qwen3_moe", tmp_path)
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    rng = np.random.default_rng(0)
    for i in rng.integers(8 + n, len(raw), 5000):
        raw[i] = 0xFF  # NaN-ish bf16 scales, garbage weights: never a crash
    f.write_bytes(bytes(raw))
    outcome, detail = worker.run(d, time_limit=60)
    assert outcome in ("typed", "opened"), detail
