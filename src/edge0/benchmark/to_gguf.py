"""An MLX int4 qwen3_moe checkpoint as a GGUF file for llama.cpp (the ``llama.cpp`` bench arm).

The same weights, bit for bit where a GGUF type can hold them: MLX's 4-bit affine groups of
64 (w = scale * q + bias) become Q4_1 blocks of 32 (w = d * q + m), each group's scale and
bias written into both of its blocks, the nibbles reordered into Q4_1's layout; floats
(norms) become F32; 8-bit groups (the routers) are dequantized to F32, which Q8_0 (no
offset) could not hold exactly. Q4_1 costs 5 bits per weight against MLX's 4.5 (two
16-bit numbers per 32 weights instead of per 64): the GGUF file is about 11% larger, and
so are the bytes llama.cpp reads per expert. llama.cpp's CPU backend keeps Q4_1 weights in
the mapped file (it repacks only Q4_0, Q4_K, IQ4_NL and Q8_0 into memory of its own), so a
file larger than memory streams from the page cache as it would for any user.

Written tensor by tensor (each converted in memory, written, dropped): the file's size,
not the machine's memory, bounds what can be converted. Uses the ``gguf`` package.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edge0.errors import ConfigError
from edge0.model.safetensors_header import read_header

ARCH = "qwen3moe"
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp", "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps", "mlp.switch_mlp.down_proj": "ffn_down_exps",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(module: str) -> str:
    """mlx-lm's module name -> llama.cpp's tensor name (``.weight`` appended)."""
    if module in _TOP_NAMES:
        return _TOP_NAMES[module] + ".weight"
    parts = module.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"]:
        rest = ".".join(parts[3:])
        if rest in _LAYER_NAMES:
            return f"blk.{int(parts[2])}.{_LAYER_NAMES[rest]}.weight"
    raise ConfigError(f"no GGUF name for the tensor {module!r} of a qwen3_moe checkpoint")


class _Tensors:
    """Raw tensors of a checkpoint's safetensors files, read on demand."""

    def __init__(self, model_dir: Path):
        self.where = {}
        for f in sorted(model_dir.glob("model*.safetensors")):
            h = read_header(f)
            for name, e in h.tensors.items():
                self.where[name] = (f, h.data_start + e.begin, e)

    def get(self, name: str) -> np.ndarray:
        f, offset, e = self.where[name]
        with open(f, "rb") as fh:
            fh.seek(offset)
            raw = np.frombuffer(fh.read(e.nbytes), dtype=np.uint8)
        if e.dtype == "BF16":
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(e.shape)
        kinds = {"F16": np.float16, "F32": np.float32, "U32": np.uint32}
        if e.dtype not in kinds:
            raise ConfigError(f"{name}: dtype {e.dtype} is not one the GGUF conversion reads")
        return raw.view(kinds[e.dtype]).reshape(e.shape)

    def modules(self) -> list[str]:
        return sorted({n.rsplit(".", 1)[0] for n in self.where})


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packing (``bits``-bit values, low bits first, in little-endian uint32 words)
    -> one uint8 per value."""
    per = 32 // bits
    words = packed.view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    vals = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * per).astype(np.uint8)


def q4_1_blocks(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, group: int) -> np.ndarray:
    """MLX 4-bit affine rows (``packed`` [..., n/8] uint32, scales and biases [..., n/group])
    -> Q4_1 bytes [..., n/32 * 20]: per 32 weights d and m (float16), then 16 bytes whose low
    nibbles hold weights 0-15 and high nibbles 16-31."""
    if group % 32:
        raise ConfigError(f"group size {group} is not a multiple of Q4_1's 32")
    q = _unpack(packed, 4)  # [..., n]
    n = q.shape[-1]
    blocks = q.reshape(*q.shape[:-1], n // 32, 32)
    qs = blocks[..., :16] | (blocks[..., 16:] << 4)
    rep = group // 32
    d = np.repeat(scales.astype(np.float16), rep, axis=-1)[..., None].view(np.uint8)
    m = np.repeat(biases.astype(np.float16), rep, axis=-1)[..., None].view(np.uint8)
    out = np.concatenate([d, m, qs], axis=-1)  # [..., n/32, 20]
    return np.ascontiguousarray(out.reshape(*q.shape[:-1], n // 32 * 20))


def dequantize(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int) -> np.ndarray:
    q = _unpack(packed, bits).astype(np.float32)
    g = q.reshape(*q.shape[:-1], -1, group)
    return (g * scales[..., None] + biases[..., None]).reshape(q.shape)


def _quant_of(config: dict, module: str) -> dict | None:
    q = config.get("quantization") or {}
    own = q.get(module)
    if isinstance(own, dict):
        return own
    return {"bits": q["bits"], "group_size": q["group_size"]} if "bits" in q else None


def _converted(tensors: _Tensors, config: dict, module: str):
    """(numpy array, GGML type or None) of one module's weight in its GGUF form."""
    from gguf import GGMLQuantizationType

    w = tensors.get(module + ".weight")
    if module + ".scales" not in tensors.where:
        return np.ascontiguousarray(w.astype(np.float32)), None
    q = _quant_of(config, module)
    s, b = tensors.get(module + ".scales"), tensors.get(module + ".biases")
    if q["bits"] == 4:
        return q4_1_blocks(w, s, b, q["group_size"]), GGMLQuantizationType.Q4_1
    return np.ascontiguousarray(dequantize(w, s, b, q["bits"], q["group_size"])), None


def _metadata(writer, config: dict, model_dir: Path) -> None:
    c = config
    writer.add_name(model_dir.name)
    writer.add_context_length(int(c.get("max_position_embeddings", 4096)))
    writer.add_embedding_length(c["hidden_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    writer.add_expert_count(c["num_experts"])
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(float(c["rms_norm_eps"]))
    writer.add_rope_freq_base(float(c.get("rope_theta", 10000.0)))
    writer.add_file_type(3)  # LLAMA_FTYPE_MOSTLY_Q4_1
    _tokenizer(writer, model_dir, c)


def _tokenizer(writer, model_dir: Path, config: dict) -> None:
    """The checkpoint's byte-level BPE tokenizer (tokenizer.json) as a gpt2-type vocab."""
    t = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = t.get("model") or {}
    if model.get("type") != "BPE":
        raise ConfigError(f"{model_dir}/tokenizer.json: the GGUF conversion writes BPE tokenizers only, "
                          f"not {model.get('type')!r}")
    vocab = dict(model["vocab"])
    for added in t.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    size = config["vocab_size"]
    tokens = [f"[PAD{i}]" for i in range(size)]
    for text, i in vocab.items():
        if i < size:
            tokens[i] = text
    special = {a["id"] for a in t.get("added_tokens", []) if a.get("special")}
    pads = {i for i in range(size) if tokens[i] == f"[PAD{i}]"}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 5 if i in pads else 1 for i in range(size)])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])])
    eos = config.get("eos_token_id")
    if isinstance(eos, int):
        writer.add_eos_token_id(eos)


def convert(model_dir: str | Path, out: str | Path, progress=lambda s: None) -> Path:
    """Write ``out`` (a GGUF file) from the MLX checkpoint in ``model_dir``; returns its path."""
    import gguf

    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") != "qwen3_moe":
        raise ConfigError(f"the GGUF conversion handles qwen3_moe checkpoints (the bench's), not "
                          f"{config.get('model_type')!r}")
    tensors = _Tensors(model_dir)
    modules = tensors.modules()
    writer = gguf.GGUFWriter(str(out) + ".part", ARCH)
    _metadata(writer, config, model_dir)
    plan = []
    for module in modules:  # the shapes and types first (the header), then the data in the same order
        e = tensors.where[module + ".weight"][2]
        quant = _quant_of(config, module) if module + ".scales" in tensors.where else None
        rows, cols = e.shape[:-1], e.shape[-1] * (32 // quant["bits"] if quant else 1)
        if quant and quant["bits"] == 4:
            nbytes = int(np.prod(rows)) * cols // 32 * 20
            writer.add_tensor_info(gguf_name(module), (*rows, cols // 32 * 20), np.dtype(np.uint8), nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            writer.add_tensor_info(gguf_name(module), (*rows, cols), np.dtype(np.float32),
                                   int(np.prod(rows)) * cols * 4)
        plan.append(module)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, module in enumerate(plan):
        array, _ = _converted(tensors, config, module)
        writer.write_tensor_data(array)
        if i % 50 == 0:
            progress(f"GGUF: {i + 1}/{len(plan)} tensors")
    writer.close()
    Path(str(out) + ".part").replace(out)
    return out
