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


# --- value kinds at every depth of config.json (tools/fuzz_checkpoints.py --mode values) ---

def _with_value(tiny_model_factory, family, tmp_path, path: str, value, inject: dict | None = None) -> Path:
    """A hard-linked copy of the tiny ``family`` checkpoint whose config.json holds
    ``value`` at the dotted ``path`` (``inject``: an object placed at the path's parent
    first, for objects the base has as null)."""
    from tests.fuzz_values import _dumps, _replace, _set
    from tests.fuzzing import _copy

    d = tmp_path / "m"
    _copy(tiny_model_factory(family), d)
    cfg = json.loads((d / "config.json").read_text())
    where = tuple(int(k) if k.isdigit() else k for k in path.split("."))
    if inject is not None:
        _set(cfg, where[:-1], dict(inject))
    _set(cfg, where, value)
    _replace(d / "config.json", _dumps(cfg))
    return d


YARN = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048, "beta_fast": 32, "beta_slow": 1}
DYNAMIC = {"type": "dynamic", "factor": 2.0}
LONGROPE = {"type": "longrope", "original_max_position_embeddings": 2048, "short_factor": [1.0] * 16,
            "long_factor": [1.0] * 16}
INJECT = {("deepseek_v3", "rope_scaling.factor"): DYNAMIC, ("deepseek_v3", "rope_scaling.beta_fast"): YARN,
          ("deepseek_v3", "rope_scaling.rope_type"): YARN,
          ("kimi_k25", "text_config.rope_scaling.long_factor"): LONGROPE}


def _id(value) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 24 else f"{text[:16]}...{len(text)}"


@pytest.mark.parametrize("family,path,value,match", [
    # the three reported cases: a TypeError inside MLX's rope at the first token, the same
    # for a list nested two objects deep, and a hang building 2**64 layers
    ("qwen3_moe", "rope_theta", 10**400, "'rope_theta' must be a number, got an integer of 401 digits"),
    ("qwen3_5_moe", "text_config.rope_parameters.rope_theta", [1, 2],
     "'text_config.rope_parameters.rope_theta' must be a finite number, got [1, 2]"),
    ("kimi_k25", "text_config.num_hidden_layers", 2**64,
     "'text_config.num_hidden_layers' must be an integer, got 18446744073709551616 (beyond the range of a 64-bit"),
    # one case of each value kind, at every depth
    ("qwen3_5_moe", "text_config.num_experts", 2**64, "'text_config.num_experts' must be an integer"),  # huge_int
    ("mellum", "rope_parameters.sliding_attention.rope_theta", -(10**400),
     "'rope_parameters.sliding_attention.rope_theta' must be a finite number"),
    ("qwen3_5_moe", "text_config.hidden_size", 1e300, "'text_config.hidden_size' must be an integer, got 1e+300"),
    ("qwen3_5_moe", "text_config.rope_parameters.rope_theta", float("nan"),  # nonfinite
     "'text_config.rope_parameters.rope_theta' must be a finite number, got nan"),
    ("deepseek_v3", "rope_scaling.factor", float("inf"), "'rope_scaling.factor' must be a finite number, got inf"),
    ("mellum", "sliding_window", -2**31, "'sliding_window' must not be negative"),  # negative
    ("qwen3_5_moe", "text_config.linear_num_key_heads", -1, "'text_config.linear_num_key_heads' must not be negative"),
    ("kimi_k25", "text_config.rms_norm_eps", 0.0, "'text_config.rms_norm_eps' must be a positive number"),  # zero
    ("deepseek_v3", "rope_scaling.beta_fast", 0, "'rope_scaling.beta_fast' must be a positive number"),
    ("qwen3_vl_moe", "text_config.num_attention_heads", 1.5,  # fraction
     "'text_config.num_attention_heads' must be an integer, got 1.5"),
    ("qwen3_5_moe", "text_config.rope_parameters.partial_rotary_factor", 0.001,
     "text_config.rope_parameters.partial_rotary_factor = 0.001, text_config.head_dim = 32 give the rotary"),
    ("qwen3_5_moe", "text_config.head_dim", 5e-324, "'text_config.head_dim' must be an integer"),  # tiny
    ("deepseek_v3", "rope_scaling.factor", True, "'rope_scaling.factor' must be a finite number, got True"),  # bool
    ("mistral4", "rope_parameters.llama_4_scaling_beta", [0.1],  # list
     "'rope_parameters.llama_4_scaling_beta' must be a finite number, got [0.1]"),
    ("qwen3_vl_moe", "text_config.rope_theta", {"type": "yarn"},  # object
     "'text_config.rope_theta' must be a number, got {'type': 'yarn'}"),
    ("qwen3_5_moe", "text_config.rope_parameters.rope_theta", "1e4",  # string
     "'text_config.rope_parameters.rope_theta' must be a finite number, got '1e4'"),
    ("deepseek_v3", "rope_scaling.rope_type", 5, "'rope_scaling.rope_type' must be a rope type name"),
    ("deepseek_v3", "rope_scaling.factor", None, "'rope_scaling.factor' must be a finite number, got None"),  # null
    ("mistral3", "text_config.rope_parameters", None,
     "'text_config.rope_parameters' must be an object holding llama_4_scaling_beta"),
    ("qwen3_moe", "torch_dtype", "x" * 100_000, "'torch_dtype' must be a dtype name"),  # long_string
    ("mellum", "rope_parameters.sliding_attention.rope_theta", "9" * 5000,
     "'rope_parameters.sliding_attention.rope_theta' must be a finite number, got '99999"),
    ("qwen3_moe", "quantization.group_size", 2**64, "quantization.group_size must be one of 32, 64, 128"),
    ("qwen3_5_moe", "text_config.rope_parameters.mrope_section.0", 2**64,  # inside a list
     "'text_config.rope_parameters.mrope_section[0]' is 18446744073709551616, beyond the range of a 64-bit integer"),
    ("kimi_linear", "linear_attn_config.head_dim", 10**12,  # a size in an object no annotation covers
     "'linear_attn_config.head_dim' is 1000000000000, larger than any tensor of the checkpoint could hold"),
    ("kimi_k25", "text_config.rope_scaling.long_factor", [[1]],  # a ValueError in MLX's rope at the first token
     "'text_config.rope_scaling.long_factor' must be a list of finite numbers, got [[1]]"),
], ids=_id)
def test_value_kinds_at_every_depth(worker, tiny_model_factory, tmp_path, family, path, value, match):
    d = _with_value(tiny_model_factory, family, tmp_path, path, value, inject=INJECT.get((family, path)))
    _check(worker, d, "ConfigError", match)


# --- hostile adapter/ directories beside the checkpoint (--mode adapter) ---

@pytest.fixture(scope="module")
def adapter_base(tiny_model_factory, tmp_path_factory):
    """A tiny qwen3_moe checkpoint with a valid adapter in ``adapter/``."""
    from tests.fuzz_values import make_adapter
    from tests.fuzzing import _copy

    d = tmp_path_factory.mktemp("adapter-base") / "m"
    _copy(tiny_model_factory("qwen3_moe"), d)
    make_adapter(d, d / "adapter")
    return d


def _adapter_copy(adapter_base, tmp_path) -> Path:
    from tests.fuzz_values import copy_with_adapter

    d = tmp_path / "m"
    copy_with_adapter(adapter_base, d)
    return d


def test_valid_adapter_beside_the_checkpoint_opens(worker, adapter_base, tmp_path):
    outcome, detail = worker.run(_adapter_copy(adapter_base, tmp_path), time_limit=60)
    assert outcome == "opened", detail


def _loop(p: Path) -> None:
    os.symlink(p.name, p)


@pytest.mark.parametrize("name,kind,error,match", [
    ("adapter_config.json", "fifo", "UnsafeModelError", "adapter/adapter_config.json: is a FIFO"),
    ("adapter_config.json", "dir", "UnsafeModelError", "adapter/adapter_config.json: is a directory"),
    ("adapter_config.json", "loop", "UnsafeModelError", "adapter/adapter_config.json: broken symbolic link"),
    ("adapter_config.json", "missing", "ConfigError", "adapter_config.json does not exist"),
    ("adapters.safetensors", "fifo", "UnsafeModelError", "adapter/adapters.safetensors: is a FIFO"),
    ("adapters.safetensors", "loop", "UnsafeModelError", "adapter/adapters.safetensors: broken symbolic link"),
    ("adapters.safetensors", "missing", "CheckpointError", "adapter/adapters.safetensors: does not exist"),  # untyped
    ("adapters.safetensors", "/dev/zero", "UnsafeModelError", "symbolic link leaves the model directory"),
])
def test_adapter_files_of_the_wrong_kind(worker, adapter_base, tmp_path, name, kind, error, match):
    d = _adapter_copy(adapter_base, tmp_path)
    p = d / "adapter" / name
    p.unlink()
    {"fifo": os.mkfifo, "dir": Path.mkdir, "loop": _loop, "missing": lambda p: None,
     "/dev/zero": lambda p: os.symlink("/dev/zero", p)}[kind](p)
    _check(worker, d, error, match)


@pytest.mark.parametrize("length", [2**63, 2**64 - 1, 100 * 2**20 + 1, 100_000_000])
def test_adapter_header_length_past_anything(worker, adapter_base, tmp_path, length):
    d = _adapter_copy(adapter_base, tmp_path)
    p = d / "adapter" / "adapters.safetensors"
    raw = bytearray(p.read_bytes())
    raw[:8] = struct.pack("<Q", length)
    p.unlink()
    p.write_bytes(bytes(raw))
    _check(worker, d, "HeaderError", "adapters.safetensors")


def test_adapter_header_garbled(worker, adapter_base, tmp_path):
    d = _adapter_copy(adapter_base, tmp_path)
    p = d / "adapter" / "adapters.safetensors"
    raw = bytearray(p.read_bytes())
    raw[9] = 0xFF  # not UTF-8
    p.unlink()
    p.write_bytes(bytes(raw))
    _check(worker, d, "HeaderError", "adapters.safetensors")


@pytest.mark.parametrize("path,value,match", [
    ("lora_parameters.scale", 10**400, "lora_parameters.scale must be a finite number"),  # was an OverflowError
    ("lora_parameters.scale", float("nan"), "lora_parameters.scale must be a finite number, got nan"),
    ("lora_parameters.scale", "2.0", "lora_parameters.scale must be a finite number, got '2.0'"),
    ("lora_parameters.rank", [4], "lora_parameters.rank must be an integer in 1..4096, got [4]"),
    ("lora_parameters.rank", 2**64, "lora_parameters.rank must be an integer in 1..4096"),
    ("lora_parameters", None, "'lora_parameters' must be an object"),
    ("fine_tune_type", "x" * 100_000, "fine_tune_type 'xxxxxxxx"),
], ids=_id)
def test_adapter_config_values(worker, adapter_base, tmp_path, path, value, match):
    from tests.fuzz_values import _dumps, _replace, _set

    d = _adapter_copy(adapter_base, tmp_path)
    p = d / "adapter" / "adapter_config.json"
    cfg = json.loads(p.read_text())
    _set(cfg, tuple(path.split(".")), value)
    _replace(p, _dumps(cfg))
    _check(worker, d, "ConfigError", f"adapter_config.json: {match}")


def test_a_per_layer_list_where_the_model_reads_one_is_served_as_the_single_value(tiny_model_factory, tmp_path):
    """Hunyuan reads ``moe_topk`` (annotated int) through its ``_int_or_list``: a list with
    one value per layer is a valid config, and gives what the single value gives; an entry
    out of range is a typed error naming it."""
    from edge0 import ConfigError, Engine

    d = _copy(tiny_model_factory, "hunyuan", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    with Engine(d) as e:
        expected = [ev.token for ev in e.stream("def f(x):", max_tokens=6)]
    _set_config(d, moe_topk=[cfg["moe_topk"]] * cfg["num_hidden_layers"])
    with Engine(d) as e:
        assert [ev.token for ev in e.stream("def f(x):", max_tokens=6)] == expected
    _set_config(d, moe_topk=[2**40] * cfg["num_hidden_layers"])
    with pytest.raises(ConfigError, match=r"moe_topk\[0\]"):
        Engine(d)


def _rename_tensor(d: Path, name: str, new: str) -> None:
    """Rename one tensor in the header, keeping the header's length."""
    f = next(p for p in sorted(d.glob("*.safetensors")) if name.encode() in p.read_bytes()[:2**20])
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert len(new) == len(name)
    blob = raw[8:8 + n].replace(f'"{name}"'.encode(), f'"{new}"'.encode(), 1)
    assert blob != raw[8:8 + n]
    f.write_bytes(raw[:8] + blob + raw[8 + n:])


@pytest.mark.parametrize("family,suffix", [
    ("qwen3_moe", "mlp.switch_mlp.gate_proj.weight"),
    ("qwen3_moe", "mlp.switch_mlp.down_proj.weight"),
    ("qwen3_moe", "self_attn.q_proj.weight"),
    ("deepseek_v3", "mlp.switch_mlp.up_proj.weight"),
])
def test_quantized_tensor_whose_weight_is_gone(worker, tiny_model_factory, tmp_path, family, suffix):
    """A switch expert's .weight renamed away while its .scales stay (it once raised KeyError
    in the quantizer): a LayoutError naming the file and the missing key."""
    d = _copy(tiny_model_factory, family, tmp_path)
    header = json.loads((d / "model.safetensors").read_bytes()[8:8 + struct.unpack(
        "<Q", (d / "model.safetensors").read_bytes()[:8])[0]])
    name = next(k for k in header if k.endswith(suffix))
    _rename_tensor(d, name, name[:-len("weight")] + "weighz")
    _check(worker, d, "LayoutError", f"tensor '{name}'")


def _pad_header(p: Path, length: int) -> None:
    """The same safetensors file with its (valid) header padded with spaces to ``length``."""
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    blob = raw[8:8 + n] + b" " * (length - n)
    p.unlink()
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", length))
        f.write(blob)
        f.write(raw[8 + n:])


def test_adapter_with_a_header_mlx_would_refuse(worker, adapter_base, tmp_path):
    """A 100,000,000-byte header is valid JSON but past MLX's loader (an untyped RuntimeError
    there): Edge0's own reader refuses it first, naming the file."""
    d = _adapter_copy(adapter_base, tmp_path)
    _pad_header(d / "adapter" / "adapters.safetensors", 100_000_000)
    _check(worker, d, "HeaderError", "adapters.safetensors")


def test_heads_with_a_header_mlx_would_refuse(worker, tiny_model_factory, tmp_path):
    from edge0.prerouter.files import checkpoint_identity, save_heads
    from edge0.prerouter.heads import PrerouterHeads

    d = _copy(tiny_model_factory, "qwen3_moe", tmp_path)
    heads = PrerouterHeads([0, 1, 2], hidden=128, experts=16, k=4, width=16)
    save_heads(heads, d / "prerouter.safetensors", base_identity=checkpoint_identity(d), recipe={},
               training_data="test")
    assert worker.run(d, time_limit=60)[0] == "opened"
    _pad_header(d / "prerouter.safetensors", 100_000_000)
    _check(worker, d, "HeaderError", "prerouter.safetensors")


@pytest.mark.parametrize("dtype", ["I16", "BF16", "U16"])
def test_heads_tensor_relabelled_to_another_type_of_the_same_width(worker, tiny_model_factory, tmp_path, dtype):
    """Once accepted, serving other numbers: every heads tensor is float16 as written."""
    from edge0.prerouter.files import checkpoint_identity, save_heads
    from edge0.prerouter.heads import PrerouterHeads

    d = _copy(tiny_model_factory, "qwen3_moe", tmp_path)
    p = d / "prerouter.safetensors"
    save_heads(PrerouterHeads([0, 1, 2], hidden=128, experts=16, k=4, width=16), p,
               base_identity=checkpoint_identity(d), recipe={}, training_data="test")
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = sorted(k for k in header if k != "__metadata__")[-1]
    header[name]["dtype"] = dtype
    blob = json.dumps(header).encode()
    p.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])
    _check(worker, d, "CheckpointError", f"tensor '{name}': dtype {dtype}: heads files store every tensor as F16")


def test_more_weight_files_than_edge0_opens(worker, tiny_model_factory, tmp_path):
    """An index of 10,000 shards once ran 69 s into an OSError (too many open files)."""
    from edge0.model.checkpoint import MAX_WEIGHT_FILES
    from tests.ckpt_tools import write_tensors

    d = _copy(tiny_model_factory, "qwen3_moe", tmp_path)
    for i in range(MAX_WEIGHT_FILES):
        write_tensors(d / f"model-extra-{i:05d}.safetensors", [])
    _check(worker, d, "LayoutError", f"{MAX_WEIGHT_FILES + 1} weight files (model*.safetensors): more than the "
                                     f"{MAX_WEIGHT_FILES}")


_NOFILE_SCRIPT = """
import os, resource, sys
from edge0 import Engine, EngineConfig
from edge0.errors import CheckpointError
d, soft_extra, hard_extra = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
open_now = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + soft_extra, open_now + hard_extra))
try:
    with Engine(d, EngineConfig(direct_io="off")) as e:
        print("opened", e.generate_text("def f(x):", max_tokens=2)[0] is not None)
except CheckpointError as exc:
    print("refused", exc)
"""


@pytest.mark.parametrize("soft_extra,hard_extra,expect", [
    (20, 200, "opened"),      # the soft limit is raised toward the hard one
    (20, 60, "refused"),      # 40 shards + the margin do not fit under the hard limit
    (1000, 1000, "opened"),
])
def test_shards_against_the_open_file_limit(tiny_model_factory, tmp_path, soft_extra, hard_extra, expect):
    import subprocess
    import sys

    from tests.ckpt_tools import copy_model

    d = copy_model(tiny_model_factory("qwen3_moe"), tmp_path / "m", shards=40)
    out = subprocess.run([sys.executable, "-c", _NOFILE_SCRIPT, str(d), str(soft_extra), str(hard_extra)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(expect), out.stdout + out.stderr[-2000:]
    if expect == "refused":
        assert "weight files need 40 open files" in out.stdout and "raise `ulimit -n`" in out.stdout


def test_resident_weights_declared_past_the_memory_the_process_may_use(worker, tiny_model_factory, tmp_path):
    """A 15 MB sparse directory whose config and header declared a 13.4 GiB embedding once
    passed 4 GiB of RSS: the declared resident bytes are checked against the memory the
    process may use (here the worker's 4 GiB address-space limit) before any is read."""
    from tests.ckpt_tools import read_tensors

    d = _copy(tiny_model_factory, "qwen3_moe", tmp_path)
    vocab = 2**25  # embedding and lm_head: 2 x (2 GiB of int4 + 256 MiB of bf16 scales and biases, 512 in float32)
    _set_config(d, vocab_size=vocab)
    f = d / "model.safetensors"
    tensors, meta = read_tensors(f)
    header, offset, big = {"__metadata__": meta} if meta else {}, 0, []
    for t in tensors:
        shape = list(t["shape"])
        if t["name"].startswith(("model.embed_tokens.", "lm_head.")):
            shape[0] = vocab
            big.append(t["name"])
        size = len(t["data"]) // t["shape"][0] * shape[0]
        header[t["name"]] = {"dtype": t["dtype"], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    f.unlink()
    with open(f, "wb") as out:
        out.write(struct.pack("<Q", len(blob)) + blob)
        for t in tensors:
            if t["name"] in big:  # a hole: the file declares the bytes without holding them
                out.seek(len(t["data"]) // t["shape"][0] * vocab, os.SEEK_CUR)
            else:
                out.write(t["data"])
        out.truncate()
    assert f.stat().st_blocks * 512 < 64 * 2**20  # sparse
    # as the model will hold them: the scales and biases in the float32 it computes in
    _check(worker, d, "CheckpointError", "the resident weights (every tensor but the routed experts) declare 5.00 GiB")


def test_config_with_a_flood_of_unused_keys(worker, tiny_model_factory, tmp_path):
    """200,000 unused keys once took 37 s to open (mlx-lm asks for a signature per key):
    up to the bound they are dropped before mlx-lm sees them, past it refused."""
    from edge0.model.spec import MAX_CONFIG_KEYS

    d = _copy(tiny_model_factory, "qwen3_moe", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    _set_config(d, **{f"unused_{i}": i for i in range(MAX_CONFIG_KEYS - len(cfg))})
    outcome, detail = worker.run(d, time_limit=60)
    assert outcome == "opened", detail
    _set_config(d, unused_last=0)
    _check(worker, d, "ConfigError", f"the top-level object has {MAX_CONFIG_KEYS + 1} keys, more than the "
                                     f"{MAX_CONFIG_KEYS}")
    d = _copy(tiny_model_factory, "qwen3_moe", tmp_path, name="n")
    _set_config(d, rope_scaling={f"k{i}": i for i in range(MAX_CONFIG_KEYS + 1)})
    _check(worker, d, "ConfigError", f"rope_scaling has {MAX_CONFIG_KEYS + 1} keys")
