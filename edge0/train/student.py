"""The student path: the served computation, in parallel over whole sequences, with a
trainable recovery LoRA.

At serving time a prompt is prefilled with every layer routing by its own gate; each
generated token then runs the consumer layers on the routing the prerouter predicted at
the previous token (prediction as routing). Training has to see exactly that, so the
student path, for a batch of sequences whose first ``P`` tokens are the prompt:

- routes every MoE layer by its own gate at prompt positions (t < P);
- at every later position t, routes each consumer layer l+1 by
  ``route(head_l(x_l[t-1], experts_l[t-1], experts_l[t-2]))``, the prediction its owner
  made one token earlier, through the consumer's own routing function (and bias);
- computes with the int4 checkpoint's own numbers: by default their dequantized float32
  reconstruction (the paper's "we train on what is served"; fast float matmuls), or the
  int4 kernels the engine runs (``dequantize=False``: bit-identical to serving), and adds
  the adapter's delta to the attention and shared-expert projections.

The base and the heads are frozen; gradients reach only the adapter (through the experts,
the heads' predicted combine weights and the attention). ``served_logits_agree`` in the
tests checks this path against the engine token by token.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from edge0.adapters import AdaptedLinear, save_adapter, target_modules
from edge0.backend import nn as bnn
from edge0.exec.moe_layer import StreamingMoE
from edge0.prerouter.files import HEADS_FILENAME, load_heads
from edge0.routing import combine, make_route_fn
from edge0.spec import load_config, spec_from_config, with_experts_per_token


class _Context:
    """What the layers of one student forward share: the prompt mask and the predictions
    owners hand to their consumers."""

    def __init__(self, heads, route, bias_of):
        self.heads, self.route, self.bias_of = heads, route, bias_of
        self.owners = set(heads.owners) if heads is not None else set()
        self.mask = None  # [B, T, 1] bool: position routes by prediction
        self.predicted: dict[int, tuple] = {}

    def start(self, mask) -> None:
        self.mask, self.predicted = mask, {}

    def predict_next(self, owner: int, x, inds) -> None:
        heads = self.heads
        on_t = (mx.expand_dims(inds, -1) == mx.arange(heads.experts)).any(axis=-2).astype(x.dtype)
        on_prev = mx.concatenate([mx.zeros_like(on_t[:, :1]), on_t[:, :-1]], axis=1)
        logits = heads.head(owner)(x, on_t, on_prev)  # predicts layer owner+1 at t+1
        logits = mx.concatenate([logits[:, :1], logits[:, :-1]], axis=1).astype(mx.float32)
        self.predicted[owner + 1] = self.route(logits, self.bias_of(owner + 1))


class StudentMoE(StreamingMoE):
    """A MoE block on the student path: own routing at prompt positions, the owner's
    prediction afterwards; experts from the resident int4 stack."""

    def __init__(self, spec, layer: int, original, route, ctx: _Context):
        super().__init__(spec, layer, original, route, executors={})
        self.switch_mlp = original.switch_mlp
        self._ctx = ctx

    def __call__(self, x):
        ctx = self._ctx
        inds, scores = self.routing(x)
        pred = ctx.predicted.get(self.layer_id)
        if pred is not None and ctx.mask is not None:
            inds = mx.where(ctx.mask, pred[0], inds)
            scores = mx.where(ctx.mask, pred[1].astype(scores.dtype), scores)
        if self.layer_id in ctx.owners:
            ctx.predict_next(self.layer_id, x, inds)
        y = combine(self.switch_mlp(x, inds), scores)
        if self.shared_kind == "plain":
            y = y + self.shared_experts(x)
        elif self.shared_kind == "gated":
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


class StudentModel:
    """The int4 base (resident, float32 activations) on the student path, with a LoRA on
    every attention and shared-expert projection. Only the LoRA trains."""

    def __init__(self, model_dir: str | Path, *, heads_file: str | Path | None = None, rank: int = 8,
                 scale: float = 10.0, seed: int = 0, use_heads: bool = True, experts_per_token: int | None = None,
                 dequantize: bool = True):
        """``dequantize``: run on the dequantized reconstruction of the int4 weights (the same
        numbers through float32 matmuls, 5x faster to train here than the quantized kernels'
        backward pass) rather than on the int4 kernels themselves (bit-identical to serving)."""
        self.model_dir = Path(model_dir)
        raw = with_experts_per_token(load_config(self.model_dir), experts_per_token)
        self.spec = spec_from_config(raw)
        self.model = bnn.load_full_model(self.model_dir, experts_per_token=experts_per_token)
        bnn.cast_model(self.model, mx.float32)
        if dequantize:
            bnn.dequantize_model(self.model)
        route = make_route_fn(self.spec)
        heads = None
        self.heads_path = None
        if use_heads:
            self.heads_path = Path(heads_file) if heads_file else self.model_dir / HEADS_FILENAME
            heads, _ = load_heads(self.heads_path, self.model_dir, spec=self.spec)
            bnn.load_parameters_flat(heads, {k: v.astype(mx.float32) for k, v in bnn.parameters_flat(heads).items()})
            heads.freeze()
        blocks = {l: bnn.module_at(self.model, self.spec.block_path(l)) for l in self.spec.moe_layers}
        bias_attr = self.spec.router_bias_attr
        self.ctx = _Context(heads, route, (lambda l: getattr(blocks[l].gate, bias_attr)) if bias_attr
                            else (lambda l: None))
        for l, block in blocks.items():
            bnn.set_module_at(self.model, self.spec.block_path(l), StudentMoE(self.spec, l, block, route, self.ctx))
        self.model.freeze()
        self.rank, self.scale = rank, scale
        self.adapted = self._attach_lora(rank, scale, seed)

    def _attach_lora(self, rank: int, scale: float, seed: int) -> dict[str, AdaptedLinear]:
        mx.random.seed(seed)
        adapted = {}
        for path, module in target_modules(self.model, self.spec).items():
            out_dim, in_dim = bnn.linear_dims(module)
            wrapper = AdaptedLinear(module)
            bound = 1 / np.sqrt(in_dim)  # mlx-lm's LoRALinear initialisation
            wrapper.set_delta(mx.random.uniform(-bound, bound, (in_dim, rank)), mx.zeros((rank, out_dim)), scale)
            wrapper.freeze()
            wrapper.unfreeze(keys=["lora_a", "lora_b"], recurse=False)
            bnn.set_module_at(self.model, path, wrapper)
            adapted[path] = wrapper
        return adapted

    def load_lora(self, adapter_dir: str | Path) -> None:
        """Continue from a saved adapter (phase 3 starts from phase 2's)."""
        weights = mx.load(str(Path(adapter_dir) / "adapters.safetensors"))
        for path, wrapper in self.adapted.items():
            if f"{path}.lora_a" in weights:
                wrapper.lora_a, wrapper.lora_b = weights[f"{path}.lora_a"], weights[f"{path}.lora_b"]

    def trainable(self) -> dict:
        return dict(tree_flatten(self.model.trainable_parameters()))

    def logits(self, tokens, prompt_lengths):
        """tokens [B, T] int32; prompt_lengths [B]: positions >= P route by prediction."""
        T = tokens.shape[1]
        mask = (mx.arange(T)[None, :] >= mx.array(prompt_lengths)[:, None])[..., None]
        self.ctx.start(mask if self.ctx.heads is not None else None)
        return self.model(tokens)

    def save(self, out_dir: str | Path, provenance: dict) -> Path:
        tensors = {p: (w.lora_a, w.lora_b) for p, w in self.adapted.items()}
        keys = sorted({p.split(".layers.")[1].split(".", 1)[1] for p in tensors})
        return save_adapter(tensors, out_dir, rank=self.rank, scale=self.scale, keys=keys,
                            num_layers=self.spec.num_layers, provenance=provenance)


def continuation_ce(logits, tokens, mask):
    """Mean cross-entropy of next-token predictions where ``mask`` [B, T-1] is 1 (the
    continuation: ``edge0.train.data.continuation_mask``)."""
    ce = nn.losses.cross_entropy(logits[:, :-1].astype(mx.float32), tokens[:, 1:], reduction="none")
    return (ce * mask).sum() / mx.maximum(mask.sum(), 1.0)
