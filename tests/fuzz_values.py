"""Hostile VALUE KINDS at every depth of config.json, and hostile ``adapter/`` directories
beside the checkpoint, for tools/fuzz_checkpoints.py and the fuzz tests.

``mutate_value(d, rng, kind)`` (``apply_value`` for one given slot of ``config_slots``)
replaces one value of ``d/config.json`` (top level,
``text_config.*``, ``text_config.rope_parameters.*``, ``rope_scaling.*``,
``quantization.*``, any nested dict, the first element of any list; and fields of a
``rope_scaling`` injected where the base has none) by a value of one kind:

- ``huge_int``: integers too large for int64, for a float, for anything (10**400);
- ``huge_float``: finite floats near the end of the double range;
- ``nonfinite``: NaN and +-Infinity (Python's json writes and reads them);
- ``negative``, ``zero``, ``fraction`` (a float where an integer is expected), ``tiny``
  (denormals), ``bool``, ``list``, ``object``, ``string``, ``null``, ``long_string``.

``mutate_adapter(d, rng, outside)`` breaks the adapter directory ``d/adapter`` (a valid
one is built beside each base): config values of every kind, ``adapter_config.json`` or
``adapters.safetensors`` that is a FIFO, a directory, a symlink loop, a link outside or
missing, huge or garbled safetensors headers, and ``adapter`` itself not a directory.

Both are seeded by the caller's generator: the same (seed, variant) gives the same case.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np

from tests.fuzzing import _join, _split

VALUE_KINDS: dict[str, list] = {
    "huge_int": [10**400, -(10**400), 2**64, 2**63, 10**30],
    "huge_float": [1e308, -1e308, 1.7976931348623157e308, 1e300, 3.4e38],
    "nonfinite": [float("nan"), float("inf"), float("-inf")],
    "negative": [-1, -2, -2**31, -(2**63), -0.5, -1e-9],
    "zero": [0, 0.0, -0.0],
    "fraction": [0.5, 1.5, 4.0001, 1e-3],
    "tiny": [5e-324, 1e-310, 1e-300],
    "bool": [True, False],
    "list": [[], [1], [1, 2], [[1]], ["a"], [None], [2**64], [1.5, "x"]],
    "object": [{}, {"a": 1}, {"rope_theta": 1}, {"type": "yarn"}, {"": None}],
    "string": ["", "abc", "1e4", "NaN", "4", "yarn", "\x00", "../../etc/passwd"],
    "null": [None],
    "long_string": ["x" * 100_000, "9" * 5000, "a" * (1 << 20)],
}
KINDS = tuple(VALUE_KINDS)
# valid nested objects the bases do not hold, injected so that their fields are reached too
ROPE_SCALING = [
    {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048, "beta_fast": 32, "beta_slow": 1,
     "mscale": 1.0, "mscale_all_dim": 1.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 2048},
    {"type": "linear", "factor": 2.0},
    {"type": "dynamic", "factor": 2.0, "alpha": 1.0},
    {"type": "longrope", "original_max_position_embeddings": 2048, "short_factor": [1.0] * 16,
     "long_factor": [1.0] * 16},
]


def _replace(path: Path, data: bytes) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    path.write_bytes(data)


def value_slots(cfg, prefix=()) -> list[tuple]:
    """Every place a value sits: each key of each dict at every depth, and the first
    element of each list. Of a quantization block's per-module overrides, one stands for
    all (they are alike and there can be thousands)."""
    out = []
    if isinstance(cfg, dict):
        modules = 0
        for k, v in cfg.items():
            if prefix and str(prefix[-1]).startswith("quantization") and isinstance(v, dict):
                modules += 1
                if modules > 1:
                    continue
            out.append(prefix + (k,))
            out += value_slots(v, prefix + (k,))
    elif isinstance(cfg, list) and cfg:
        out.append(prefix + (0,))
        out += value_slots(cfg[0], prefix + (0,))
    return out


def _set(cfg, where: tuple, value) -> None:
    parent = cfg
    for k in where[:-1]:
        parent = parent[k]
    parent[where[-1]] = value


def _dumps(cfg) -> bytes:
    return json.dumps(cfg).encode()  # NaN and Infinity as Python's json writes them


def pick_value(rng: np.random.Generator, kind: str):
    values = VALUE_KINDS[kind]
    return values[int(rng.integers(len(values)))]


def config_slots(cfg: dict) -> list[tuple]:
    """Every slot ``mutate_value`` may change in ``cfg``: (None, path) for a value the
    config holds; (template, path) for a field of an injected ``rope_scaling`` (inside
    ``text_config`` where there is one, else at the top level)."""
    out = [(None, where) for where in value_slots(cfg)]
    scope = ("text_config",) if isinstance(cfg.get("text_config"), dict) else ()  # where mlx-lm reads it
    for t, template in enumerate(ROPE_SCALING):
        out += [(t, scope + ("rope_scaling",) + s) for s in value_slots(template)]
    return out


def apply_value(d: Path, slot: tuple, kind: str, rng: np.random.Generator) -> str:
    """Write ``d/config.json`` with the value at ``slot`` (from ``config_slots``) replaced
    by a value of ``kind`` (picked by ``rng``); return what was done."""
    path = d / "config.json"
    cfg = json.loads(path.read_text())
    template, where = slot
    if template is not None:
        scope = cfg["text_config"] if where[0] == "text_config" else cfg
        scope["rope_scaling"] = copy.deepcopy(ROPE_SCALING[template])
    value = pick_value(rng, kind)
    _set(cfg, where, value)
    _replace(path, _dumps(cfg))
    return f"value:{kind} {'.'.join(map(str, where))} = {_short(value)}"


def mutate_value(d: Path, rng: np.random.Generator, kind: str | None = None) -> str:
    """One value of config.json, at any depth (a slot drawn by ``rng``), replaced by a
    value of ``kind``."""
    kind = kind or KINDS[int(rng.integers(len(KINDS)))]
    slots = config_slots(json.loads((d / "config.json").read_text()))
    return apply_value(d, slots[int(rng.integers(len(slots)))], kind, rng)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}...({len(text)} chars)"


# --- adapter/ beside the checkpoint ---------------------------------------------------

def make_adapter(model_dir: Path, out: Path, *, rank: int = 4, seed: int = 0) -> Path:
    """A valid adapter on every target projection of ``model_dir`` (random, nonzero)."""
    import mlx.core as mx

    from edge0 import EngineConfig
    from edge0.adapters import adapter_key, save_adapter, target_modules
    from edge0.backend import nn as bnn
    from edge0.loader import load_streaming_model
    from edge0.prerouter.files import checkpoint_identity

    s = load_streaming_model(model_dir, EngineConfig(adapter="off", prerouter="off"))
    try:
        rng = np.random.default_rng(seed)
        tensors, keys = {}, set()
        for path, module in target_modules(s.model, s.spec).items():
            out_dim, in_dim = bnn.linear_dims(module)
            tensors[path] = (mx.array(rng.normal(0, 0.1, (in_dim, rank)).astype(np.float32)),
                             mx.array(rng.normal(0, 0.01, (rank, out_dim)).astype(np.float32)))
            keys.add(adapter_key(s.spec, path))
        return save_adapter(tensors, out, rank=rank, scale=2.0, keys=sorted(keys), num_layers=s.spec.num_layers,
                            provenance={"base_identity": checkpoint_identity(model_dir), "phase": "fuzz"})
    finally:
        s.close()


ADAPTER_CASES = ("config_value", "config_kind", "config_bytes", "weights_kind", "header_length",
                 "header_bytes", "header_entry", "metadata", "dir_kind")


def mutate_adapter(d: Path, rng: np.random.Generator, outside: Path, case: str | None = None) -> str:
    """One hostile change to ``d/adapter`` (copied from the base's valid adapter)."""
    a = d / "adapter"
    case = case or ADAPTER_CASES[int(rng.integers(len(ADAPTER_CASES)))]
    return f"adapter:{case} " + _ADAPTER_MUTATORS[case](a, rng, outside)


def _config_value(a: Path, rng, outside) -> str:
    path = a / "adapter_config.json"
    cfg = json.loads(path.read_text())
    kind = KINDS[int(rng.integers(len(KINDS)))]
    slots = value_slots(cfg)
    where = slots[int(rng.integers(len(slots)))]
    value = pick_value(rng, kind)
    _set(cfg, where, value)
    _replace(path, _dumps(cfg))
    return f"{kind} {'.'.join(map(str, where))} = {_short(value)}"


def _file_kind(path: Path, rng, outside: Path) -> str:
    """``path`` replaced by something that is not a regular file of the adapter."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    kind = int(rng.integers(8))
    if kind == 0:
        os.mkfifo(path)
    elif kind == 1:
        path.mkdir()
    elif kind == 2:
        os.symlink(path.name, path)  # a link to itself
    elif kind == 3:
        os.symlink(path.name + ".b", path)
        os.symlink(path.name, path.with_name(path.name + ".b"))  # two links to each other
    elif kind == 4:
        os.symlink("/dev/zero", path)
    elif kind == 5:
        (outside / path.name).write_bytes(b"{}")
        os.symlink(outside / path.name, path)
    elif kind == 6:
        os.symlink("missing-target", path)
    # kind 7: missing
    return f"{path.name} kind {kind}"


def _config_kind(a: Path, rng, outside) -> str:
    return _file_kind(a / "adapter_config.json", rng, outside)


def _weights_kind(a: Path, rng, outside) -> str:
    return _file_kind(a / "adapters.safetensors", rng, outside)


def _config_bytes(a: Path, rng, outside) -> str:
    path = a / "adapter_config.json"
    raw = path.read_bytes()
    kind = int(rng.integers(7))
    data = [raw[: int(rng.integers(len(raw)))], b"\xff\xfe{}", b"[1, 2]", b'"lora"',
            b'{"lora_parameters": ' + b"[" * 5000 + b"]" * 5000 + b"}",
            b'{"fine_tune_type": "lora", "pad": "' + b"x" * (2 << 20) + b'"}', b""][kind]
    _replace(path, data)
    return f"kind {kind}"


def _header_length(a: Path, rng, outside) -> str:
    path = a / "adapters.safetensors"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    values = [0, 1, n - 1, n + 1, len(raw), 2**40, 2**63, 2**64 - 1, 100 * 2**20 + 1]
    value = values[int(rng.integers(len(values)))]
    raw[:8] = struct.pack("<Q", value)
    _replace(path, bytes(raw))
    return f"length {value}"


def _header_bytes(a: Path, rng, outside) -> str:
    path = a / "adapters.safetensors"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    kind = int(rng.integers(6))
    if kind == 0:
        for _ in range(int(rng.integers(1, 16))):
            raw[8 + int(rng.integers(n))] = int(rng.integers(256))
    elif kind == 1:
        raw[8 + int(rng.integers(n))] = 0xFF
    elif kind == 2:
        raw = raw[: int(rng.integers(0, len(raw)))]
    elif kind == 3:
        raw = bytearray(_join_raw(b"[1, 2, 3]", bytes(raw[8 + n:])))
    elif kind == 4:  # a header of megabytes of nested arrays
        raw = bytearray(_join_raw(b'{"x": ' + b"[" * 100000 + b"]" * 100000 + b"}", bytes(raw[8 + n:])))
    else:  # a huge header (a long key) over a real tensor table
        header, data = _split(bytes(raw))
        header["k" * (8 << 20)] = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
        raw = bytearray(_join(header, data))
    _replace(path, bytes(raw))
    return f"kind {kind}"


def _join_raw(blob: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(blob)) + blob + data


def _header_entry(a: Path, rng, outside) -> str:
    path = a / "adapters.safetensors"
    header, data = _split(path.read_bytes())
    names = [k for k in header if k != "__metadata__"]
    name = names[int(rng.integers(len(names)))]
    kind = int(rng.integers(8))
    entry = header[name]
    if kind == 0:
        entry["dtype"] = ["F64", "I32", "U8", "BOOL", "XX", "F16", "BF16"][int(rng.integers(7))]
    elif kind == 1:
        entry["shape"] = [[2**40, 2**40], [2**64], [-1, 4], [0, 4], ["x"], [1.5], []][int(rng.integers(7))]
    elif kind == 2:
        a_, b_ = entry["data_offsets"]
        entry["data_offsets"] = [a_, b_ + [-4, 4, 2**40][int(rng.integers(3))]]
    elif kind == 3:
        header[name.replace("lora_", "lora_x")] = header.pop(name)
    elif kind == 4:
        header[name.replace("model.layers.0", "model.layers.99999")] = header.pop(name)
    elif kind == 5:
        header[name] = [1, 2]
    elif kind == 6:
        del header[name]
    else:
        header[name.replace(".lora_", ".switch_mlp.lora_")] = header.pop(name)
    _replace(path, _join(header, data))
    return f"{name} kind {kind}"


def _metadata(a: Path, rng, outside) -> str:
    path = a / "adapters.safetensors"
    header, data = _split(path.read_bytes())
    meta = header.setdefault("__metadata__", {})
    kind = int(rng.integers(6))
    if kind == 0:
        meta["base_identity"] = "0" * 32
    elif kind == 1:
        meta["heads_identity"] = "f" * 32
    elif kind == 2:
        meta["format"] = "edge0-adapter/999"
    elif kind == 3:
        header["__metadata__"] = {"format": 5}
    elif kind == 4:
        header["__metadata__"] = ["x"]
    else:
        meta["base_identity"] = "x" * 100_000
    _replace(path, _join(header, data))
    return f"kind {kind}"


def _dir_kind(a: Path, rng, outside) -> str:
    kind = int(rng.integers(6))
    if kind == 5:
        for f in a.iterdir():
            f.unlink()  # an empty adapter directory
        return "empty"
    shutil.rmtree(a)
    if kind == 0:
        os.mkfifo(a)
    elif kind == 1:
        os.symlink("adapter", a)
    elif kind == 2:
        os.symlink(outside, a)
    elif kind == 3:
        a.write_bytes(b"not a directory")
    else:
        os.symlink("/dev/zero", a)
    return f"kind {kind}"


_ADAPTER_MUTATORS = {
    "config_value": _config_value, "config_kind": _config_kind, "config_bytes": _config_bytes,
    "weights_kind": _weights_kind, "header_length": _header_length, "header_bytes": _header_bytes,
    "header_entry": _header_entry, "metadata": _metadata, "dir_kind": _dir_kind,
}


def copy_with_adapter(src: Path, dst: Path, adapter: bool = True) -> None:
    """``src`` copied to ``dst``: files hard-linked, and (``adapter``) its ``adapter/``
    directory copied (the mutators replace files, never write into them, but may remove
    the directory)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copyfile(f, dst / f.name)
    if adapter and (src / "adapter").is_dir():
        shutil.copytree(src / "adapter", dst / "adapter")
