"""A float64 NumPy reference for routed experts, read straight from the checkpoint bytes.

Independent of MLX and of Edge0's reader: it slices the file with plain reads at the
offsets the safetensors header gives, unpacks the int4 words and dequantizes in float64.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np


def _tensors(model_dir: Path) -> dict[str, tuple[Path, int, dict]]:
    out = {}
    for f in sorted(Path(model_dir).glob("model*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        for k, v in header.items():
            out[k] = (f, 8 + n, v)
    return out


def _read(path: Path, start: int, nbytes: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(start)
        return fh.read(nbytes)


def _as_float64(raw: bytes, dtype: str, shape) -> np.ndarray:
    if dtype == "BF16":
        u16 = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
        return u16.view(np.float32).astype(np.float64).reshape(shape)
    np_dtype = {"F16": np.float16, "F32": np.float32}[dtype]
    return np.frombuffer(raw, dtype=np_dtype).astype(np.float64).reshape(shape)


def expert_matrix(model_dir: Path, prefix: str, expert: int, bits: int, group_size: int) -> np.ndarray:
    """Dequantized [out, in] float64 weight of ``expert`` in the stacked tensor ``prefix``."""
    tensors = _tensors(model_dir)
    parts = {}
    for part in ("weight", "scales", "biases"):
        path, data_start, meta = tensors[f"{prefix}.{part}"]
        e, *row_shape = meta["shape"]
        begin, end = meta["data_offsets"]
        row_bytes = (end - begin) // e
        raw = _read(path, data_start + begin + expert * row_bytes, row_bytes)
        parts[part] = (raw, meta["dtype"], row_shape)
    raw, _, (out_dim, packed) = parts["weight"]
    words = np.frombuffer(raw, dtype=np.uint32).reshape(out_dim, packed)
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, None, :]
    q = ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(out_dim, packed * per_word)
    scales = _as_float64(*parts["scales"])
    biases = _as_float64(*parts["biases"])
    q = q.astype(np.float64).reshape(out_dim, -1, group_size)
    return (q * scales[..., None] + biases[..., None]).reshape(out_dim, -1)


def swiglu_expert(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    g = x @ gate.T
    return ((g / (1.0 + np.exp(-g))) * (x @ up.T)) @ down.T


def rel_l2(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def record_staging(engine, prompt, max_tokens: int):
    """Run a greedy generation on ``engine``; returns (plans, used, events): per decode step
    and staged layer, the experts the step's plan staged and the experts the layer's block
    routed to (steps that were planned only), whether the experts come from slots or from
    the checkpoint's mapping."""
    s = engine.streaming
    stager = s.stager
    plans, used = {}, {}
    switches = s.switches()

    def observe(layer, inds, previous):
        plan = stager.plan
        if inds.size == inds.shape[-1] and layer in stager.layers and plan is not None and plan.step == stager.step:
            plans[plan.step] = {l: set(plan.experts[l]) for l in stager.layers}  # (a later generation: its own)
            used.setdefault(stager.step, {})[layer] = set(np.array(inds).reshape(-1).tolist())
        if previous is not None:
            previous(layer, inds)

    for l in s.spec.moe_layers:
        switches[l].observer = lambda layer, inds, _p=switches[l].observer: observe(layer, inds, _p)
    return plans, used, list(engine.stream(prompt, max_tokens=max_tokens, temp=0.0))
