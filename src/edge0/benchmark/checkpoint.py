"""A synthetic int4 checkpoint with the expert shapes of the paper's 35B tier.

Qwen3.6-35B-A3B class: hidden 2048, 256 experts of width 512, k=8, int4 group 64, so
1,769,472 bytes per expert per layer. The architecture is mlx-lm's ``qwen3_moe``; the
number of layers is a parameter (12 layers = 5.4 GB of experts, 40 = 18 GB).

The routed experts are written straight to disk, one expert at a time, from a seeded
NumPy generator: the model is never materialised in memory. Only the resident part
(attention, norms, routers, embeddings: tens of MB) is built with mlx-lm's own class and
quantized with its own rules. Routers are random with a spread that makes routing vary
from token to token. The directory loads with ``mlx_lm.load``.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge0.errors import ConfigError

BYTES_PER_EXPERT_35B = 1_769_472
SHARD_BYTES = 5 * 10**9  # as mlx-lm's save_model


@dataclass(frozen=True)
class BenchShape:
    layers: int = 12
    hidden: int = 2048
    experts: int = 256
    k: int = 8
    moe_intermediate: int = 512
    heads: int = 16
    kv_heads: int = 2
    head_dim: int = 128
    vocab_size: int = 512
    group_size: int = 64
    bits: int = 4

    def config(self) -> dict:
        return dict(
            model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=self.hidden,
            num_hidden_layers=self.layers, intermediate_size=4 * self.moe_intermediate,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
            num_experts=self.experts, num_experts_per_tok=self.k, decoder_sparse_step=1, mlp_only_layers=[],
            moe_intermediate_size=self.moe_intermediate, norm_topk_prob=True, rms_norm_eps=1e-6,
            vocab_size=self.vocab_size, rope_theta=1_000_000.0, tie_word_embeddings=False,
            max_position_embeddings=32768, eos_token_id=0, torch_dtype="bfloat16",
        )

    def expert_tensors(self, layer: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """(key, safetensors dtype, shape) of the nine stacked expert tensors of ``layer``."""
        out = []
        for proj in ("gate_proj", "up_proj", "down_proj"):
            o, i = (self.hidden, self.moe_intermediate) if proj == "down_proj" else (self.moe_intermediate, self.hidden)
            base = f"model.layers.{layer}.mlp.switch_mlp.{proj}"
            out.append((f"{base}.weight", "U32", (self.experts, o, i * self.bits // 32)))
            out.append((f"{base}.scales", "BF16", (self.experts, o, i // self.group_size)))
            out.append((f"{base}.biases", "BF16", (self.experts, o, i // self.group_size)))
        return out

    @property
    def bytes_per_expert(self) -> int:
        return sum(int(np.prod(s[1:])) * (4 if d == "U32" else 2) for _, d, s in self.expert_tensors(0))

    @property
    def expert_bytes(self) -> int:
        return self.bytes_per_expert * self.experts * self.layers


def _bf16_bytes(x: np.ndarray) -> bytes:
    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _resident_tensors(shape: BenchShape, seed: int) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Everything but the routed experts, built with mlx-lm's class and quantization rules."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    from edge0.backend import nn as bnn

    config = shape.config()
    mx.random.seed(seed)
    model_class, args_class = bnn.model_classes(config)
    model = model_class(args_class.from_dict(config))
    for layer in model.model.layers:
        del layer.mlp["switch_mlp"]  # never evaluated: its lazy random init is dropped
        layer.mlp.gate.weight = mx.random.normal(layer.mlp.gate.weight.shape) * (2.0 / shape.hidden**0.5)
    model.model.embed_tokens.weight = mx.random.normal(model.model.embed_tokens.weight.shape)
    model.set_dtype(mx.bfloat16)
    model, config = quantize_model(model, config, shape.group_size, shape.bits,
                                   quant_predicate=getattr(model, "quant_predicate", None))
    out = {}
    names = {mx.uint32: "U32", mx.bfloat16: "BF16", mx.float32: "F32", mx.float16: "F16"}
    for key, value in tree_flatten(model.parameters()):
        mx.eval(value)
        raw = np.array(value.view(mx.uint16)) if value.dtype == mx.bfloat16 else np.array(value)
        out[key] = (names[value.dtype], tuple(value.shape), raw.tobytes())
    return out, config




def _write_expert_tensor(f, shape: BenchShape, key: str, dtype: str, tshape, rng: np.random.Generator,
                         scales_cache: dict) -> None:
    experts, out_dim, last = tshape
    in_dim = last * shape.group_size if dtype == "BF16" else last * 32 // shape.bits
    for _ in range(experts):
        if dtype == "U32":
            f.write(rng.integers(0, 2**32, size=(out_dim, last), dtype=np.uint32).tobytes())
        elif key.endswith(".scales"):
            # (q - 8) for uniform q in 0..15 has std ~4.6: scale so that w has std 1/sqrt(in)
            s = np.abs(rng.normal(1.0, 0.1, size=(out_dim, last))) / (4.6 * in_dim**0.5)
            scales_cache.setdefault(key, []).append(s)
            f.write(_bf16_bytes(s))
        else:  # biases follow their scales: zero-mean weights
            s = scales_cache[key.replace(".biases", ".scales")].pop(0)
            f.write(_bf16_bytes(-8.0 * s))


def make_bench_checkpoint(out_dir: str | Path, shape: BenchShape = BenchShape(), *, seed: int = 0,
                          overwrite: bool = False, progress=None) -> Path:
    """Write the checkpoint into ``out_dir``; refuses when the disk lacks room."""
    from edge0.tiny import build_tokenizer

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty; pass --overwrite to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    resident, config = _resident_tensors(shape, seed)
    need = shape.expert_bytes + sum(len(r[2]) for r in resident.values())
    free = shutil.disk_usage(out).free
    if free < need + 512 * 2**20:
        raise ConfigError(f"not enough disk space in {out}: the checkpoint needs {need / 1e9:.2f} GB "
                          f"(+0.5 GiB margin), {free / 1e9:.2f} GB free")
    # Header entries, in write order: layer by layer, resident tensors then experts.
    entries: list[tuple[str, str, tuple[int, ...], int]] = []
    by_layer: dict[int, list[str]] = {}
    for key in resident:
        layer = int(key.split(".")[2]) if key.startswith("model.layers.") else -1
        by_layer.setdefault(layer, []).append(key)
    for layer in sorted(by_layer):
        for key in by_layer[layer]:
            dtype, tshape, raw = resident[key]
            entries.append((key, dtype, tshape, len(raw)))
        if layer >= 0:
            for key, dtype, tshape in shape.expert_tensors(layer):
                entries.append((key, dtype, tshape, int(np.prod(tshape)) * (4 if dtype == "U32" else 2)))
    shards: list[list] = [[]]
    size = 0
    for entry in entries:
        if size + entry[3] > SHARD_BYTES and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[3]
    rng = np.random.default_rng(seed)
    weight_map = {}
    t0, written = time.perf_counter(), 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        header, offset = {"__metadata__": {"format": "mlx"}}, 0
        for key, dtype, tshape, nbytes in shard:
            header[key] = {"dtype": dtype, "shape": list(tshape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[key] = name
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        tmp = out / (name + ".partial")
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            scales_cache: dict = {}
            for key, dtype, tshape, nbytes in shard:
                if key in resident:
                    f.write(resident[key][2])
                else:
                    _write_expert_tensor(f, shape, key, dtype, tshape, rng, scales_cache)
                written += nbytes
                if progress is not None:
                    progress(written, need, time.perf_counter() - t0)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(out / name)
    if len(shards) > 1:
        total = sum(e[3] for e in entries)
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    config = {**config, "edge0_bench": {"seed": seed, "layers": shape.layers, "bytes_per_expert": shape.bytes_per_expert}}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    build_tokenizer(out)
    return out
