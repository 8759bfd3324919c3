"""What merging destroys: ``edge0 adapter merge-report``.

Merging folds an adapter into the int4 base: dequantize W, add dW = scale * (A @ B)^T,
re-quantize with the checkpoint's bits and group size. LoRA deltas sit far below the int4
group step, so rounding erases most of them. Per adapted projection the weight-level
retention is

    r_w = <Q(W + dW) - W, dW> / ||dW||^2       (W: the int4 weight as stored, dequantized)

and on the first-token logits of fixed prompts

    r_z = <z_merged - z_base, z_unmerged - z_base> / ||z_unmerged - z_base||^2

1.0 means the adapter's whole effect survives; the unmerged adapter (served as a parallel
delta) keeps all of it by construction.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from edge0.adapters import WEIGHTS_FILE
from edge0.backend import nn as bnn

PROMPTS = ("def read_config(path):\n", "class Cache:\n    def __init__(self):\n", "import os\nimport sys\n\n",
           "    for i in range(len(items)):\n", '"""Return the list of files."""\n')


def _adapter(adapter_dir: Path) -> tuple[dict, float]:
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    weights = mx.load(str(adapter_dir / WEIGHTS_FILE))
    pairs = {k.rsplit(".", 1)[0]: (weights[k], weights[k.rsplit(".", 1)[0] + ".lora_b"])
             for k in weights if k.endswith(".lora_a")}
    return pairs, float(cfg["lora_parameters"]["scale"])


def merged_weights(model, pairs: dict, scale: float) -> dict[str, dict]:
    """module path -> {"weight", "scales", "biases"} of the merged, re-quantized projection,
    and the weight-level retention of each."""
    out = {}
    for path, (a, b) in pairs.items():
        q = bnn.module_at(model, path)
        w = mx.dequantize(q.weight, q.scales, q.biases, group_size=q.group_size, bits=q.bits).astype(mx.float32)
        dw = scale * (a @ b).T.astype(mx.float32)
        wq, s, bi = mx.quantize(w + dw, group_size=q.group_size, bits=q.bits)
        back = mx.dequantize(wq, s, bi, group_size=q.group_size, bits=q.bits).astype(mx.float32)
        retention = ((back - w) * dw).sum() / (dw * dw).sum()
        mx.eval(wq, s, bi, retention)
        out[path] = {"weight": wq, "scales": s.astype(q.scales.dtype), "biases": bi.astype(q.biases.dtype),
                     "retention": retention.item(), "delta_rms": mx.sqrt((dw * dw).mean()).item(),
                     "group_step_rms": mx.sqrt((q.scales.astype(mx.float32) ** 2).mean()).item()}
    return out


def _first_token_logits(model, tokenizer, prompts) -> mx.array:
    rows = []
    for p in prompts:
        ids = tokenizer.encode(p)
        rows.append(model(mx.array([ids]))[0, -1].astype(mx.float32))
    out = mx.stack(rows)
    mx.eval(out)
    return out


def merge_report(model_dir: str | Path, adapter_dir: str | Path, prompts=PROMPTS) -> dict:
    """Weight- and logit-level retention of ``adapter_dir`` merged into ``model_dir``."""
    from mlx_lm.utils import load

    model_dir, adapter_dir = Path(model_dir), Path(adapter_dir)
    pairs, scale = _adapter(adapter_dir)
    base, tokenizer = load(str(model_dir))
    bnn.cast_model(base, mx.float32)
    z_base = _first_token_logits(base, tokenizer, prompts)
    merged = merged_weights(base, pairs, scale)
    unmerged, _ = load(str(model_dir), adapter_path=str(adapter_dir))
    bnn.cast_model(unmerged, mx.float32)
    z_unmerged = _first_token_logits(unmerged, tokenizer, prompts)
    for path, parts in merged.items():  # the base model becomes the merged one
        q = bnn.module_at(base, path)
        q.weight, q.scales, q.biases = parts["weight"], parts["scales"].astype(mx.float32), \
            parts["biases"].astype(mx.float32)
    z_merged = _first_token_logits(base, tokenizer, prompts)

    def retention(z):
        d = (z_unmerged - z_base).reshape(-1)
        return ((z - z_base).reshape(-1) * d).sum().item() / (d * d).sum().item()

    by_kind: dict[str, list[float]] = {}
    for path, parts in merged.items():
        by_kind.setdefault(path.rsplit(".", 1)[-1], []).append(parts["retention"])
    return {
        "adapter": str(adapter_dir), "model": str(model_dir), "scale": scale,
        "targets": {p: {k: v for k, v in parts.items() if k in ("retention", "delta_rms", "group_step_rms")}
                    for p, parts in merged.items()},
        "weight_retention_by_projection": {k: float(np.mean(v)) for k, v in sorted(by_kind.items())},
        "weight_retention_mean": float(np.mean([p["retention"] for p in merged.values()])),
        "logit_retention": {"unmerged": retention(z_unmerged), "merged": retention(z_merged)},
        "prompts": list(prompts),
    }


def write_merged(model_dir: str | Path, adapter_dir: str | Path, out: str | Path) -> Path:
    """A copy of the checkpoint with the adapter merged into its int4 weights (tensor order,
    shapes and dtypes kept): what a merge-and-requantize deployment would serve."""
    from mlx_lm.utils import load_model

    model_dir, out = Path(model_dir), Path(out)
    pairs, scale = _adapter(Path(adapter_dir))
    model, _ = load_model(model_dir)
    merged = merged_weights(model, pairs, scale)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("adapter", "prerouter.safetensors"))
    for f in sorted(out.glob("model*.safetensors")):
        tensors, meta = mx.load(str(f), return_metadata=True)
        for path, parts in merged.items():
            for part in ("weight", "scales", "biases"):
                if f"{path}.{part}" in tensors:
                    tensors[f"{path}.{part}"] = parts[part]
        f.unlink()
        mx.save_safetensors(str(f), tensors, metadata=meta)
    return out
