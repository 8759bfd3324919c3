"""An untrained adapter: mlx-lm's LoRA initialisation on every target projection of a
checkpoint (``edge0 adapter init``).

A is uniform in +-1/sqrt(in), B is zero, so the adapter serves exactly the base's output
while computing everything a trained adapter of the same rank computes: a starting point
for ``mlx_lm.lora``, and what a cost measurement needs on a checkpoint no adapter was
trained for.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from edge0.adapters import adapter_key, save_adapter, target_modules
from edge0.backend import nn as bnn
from edge0.config import EngineConfig
from edge0.prerouter.files import checkpoint_identity


def lora_init(in_dim: int, out_dim: int, rank: int) -> tuple[mx.array, mx.array]:
    """mlx-lm's LoRALinear initialisation: A uniform in +-1/sqrt(in_dim), B zero."""
    bound = 1 / np.sqrt(in_dim)
    return mx.random.uniform(-bound, bound, (in_dim, rank)), mx.zeros((rank, out_dim))


def init_adapter(model_dir: str | Path, out: str | Path, *, rank: int = 8, scale: float = 10.0,
                 seed: int = 0) -> Path:
    from edge0.loader import load_streaming_model

    model_dir = Path(model_dir)
    s = load_streaming_model(model_dir, EngineConfig(adapter="off", prerouter="off", kernels="mlx"))  # training
    try:
        mx.random.seed(seed)
        tensors = {}
        for path, module in target_modules(s.model, s.spec).items():
            out_dim, in_dim = bnn.linear_dims(module)
            tensors[path] = lora_init(in_dim, out_dim, rank)
        keys = sorted({adapter_key(s.spec, p) for p in tensors})
        return save_adapter(tensors, out, rank=rank, scale=scale, keys=keys, num_layers=s.spec.num_layers,
                            provenance={"base_identity": checkpoint_identity(model_dir), "phase": "untrained",
                                        "recipe": {"init": "mlx-lm LoRA (A uniform +-1/sqrt(in), B zero)",
                                                   "rank": rank, "scale": scale, "seed": seed}})
    finally:
        s.close()
