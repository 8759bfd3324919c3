"""The student path: the served computation, in parallel over whole sequences, with a
trainable recovery LoRA.

At serving time a prompt is prefilled with every layer routing by its own gate; each
generated token then runs the consumer layers on the routing the prerouter predicted at
the previous token (prediction as routing). Training has to see exactly that, so the
student path, for a batch of sequences whose first ``P`` tokens are the prompt:

- routes every MoE layer by its own gate at prompt positions (t < P);
- at every later position t, routes each consumer layer l+1 by
  ``route(head_l(x_l[t-1], experts_l[t-1], experts_l[t-2]))``, the prediction its owner
  made one token earlier, through the consumer's own routing function (and bias); under
  select routing, by the consumer's own router restricted to the top k+m experts of that
  prediction (the candidates the engine stages);
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

from edge0.adapters import adapter_key, save_adapter, target_modules
from edge0.model.arch import derive_spec
from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.exec.plan import LayerRoute
from edge0.exec.taps import AdaptedLinear, RouterTap, Step, StepContext
from edge0.config import EngineConfig
from edge0.loader import resolve_routing
from edge0.streaming import routing_probe
from edge0.prerouter.files import HEADS_FILENAME, load_heads
from edge0.model.spec import load_config, with_experts_per_token
from edge0.train.adapter_init import lora_init


class ObservedSwitch(nn.Module):
    """The resident expert stack of an owner layer, reporting the experts its block routed
    to before computing them (the original stack, unchanged, does the work)."""

    def __init__(self, layer: int, original, observer=None):
        super().__init__()
        self.layer_id = layer
        self.original = original
        object.__setattr__(self, "_observer", observer)

    def __call__(self, x, indices, *args, **kwargs):
        if self._observer is not None:
            self._observer(self.layer_id, indices)
        return self.original(x, indices, *args, **kwargs)


class _Context:
    """What the layers of one student forward share: the prompt mask, and for each owner
    its router input, which the experts it routed to turn into the consumer's predicted
    logits (the consumer's route in ``routes``, which the forward pass's ``Step`` holds,
    filled before the consumer's block runs)."""

    def __init__(self, heads, routers: dict[int, RouterTap], embed=None, widen=None):
        """``widen``: (consumer, logits [N, E]) -> the consumer's k+m candidates [N, k+m]
        (select routing), or None (replace routing)."""
        self.heads, self.routers, self.embed, self.widen = heads, routers, embed, widen
        self.mask = None  # [B, T, 1] bool: position routes by prediction
        self.routes: dict = {}  # consumer -> its LayerRoute for the pass being built
        self.next_tokens = None  # [B, T, D]: at t, the embedding of token t+1 (heads that see it)
        self._x: dict[int, object] = {}

    def start(self, mask, tokens=None) -> None:
        self.mask, self._x = mask, {}
        self.next_tokens = None
        if mask is not None and self.heads.sees_token:
            e = self.embed(tokens).astype(mx.float32)
            self.next_tokens = mx.concatenate([e[:, 1:], mx.zeros_like(e[:, :1])], axis=1)
        self.routes = {}

    def watch(self, owner: int, x, tap=None) -> None:
        """An owner's router input (the RouterTap's watcher)."""
        self._x[owner] = x

    def on_experts(self, owner: int, inds) -> None:
        x = self._x.pop(owner, None)
        if x is None or self.mask is None:
            return
        heads = self.heads
        batch, steps = self.mask.shape[:2]
        x = x.reshape(batch, steps, x.shape[-1])
        inds = inds.reshape(batch, steps, inds.shape[-1])
        on_t = B.one_hot_k(inds, heads.experts, x.dtype)
        on_prev = mx.concatenate([mx.zeros_like(on_t[:, :1]), on_t[:, :-1]], axis=1)
        logits = heads.head(owner)(x, on_t, on_prev, self.next_tokens)  # at t: the consumer's logits for t+1
        logits = mx.concatenate([logits[:, :1], logits[:, :-1]], axis=1).astype(mx.float32)
        consumer = heads.consumer[owner]
        staged = None
        if self.widen is not None:
            wide = self.widen(consumer, logits.reshape(-1, logits.shape[-1]))
            staged = B.one_hot_k(wide, logits.shape[-1], mx.int32).reshape(logits.shape) > 0
        mode = "select" if staged is not None else "replace"
        self.routes[consumer] = LayerRoute(mode, logits, staged, where=self.mask, scope="all")


class StudentModel:
    """The int4 base (resident, float32 activations) on the student path, with a LoRA on
    every attention and shared-expert projection. Only the LoRA trains.

    Any architecture Edge0 streams: the blocks run mlx-lm's own code; each consumer's
    router is a RouterTap whose ``route`` substitutes the predicted logits at continuation
    positions, so the block's own routing turns them into experts and combine weights,
    as the engine does at a staged decode step."""

    def __init__(self, model_dir: str | Path, *, heads_file: str | Path | None = None, rank: int = 8,
                 scale: float = 10.0, seed: int = 0, use_heads: bool = True, experts_per_token: int | None = None,
                 dequantize: bool = True, routing: str = "auto", stage_extra: int | None = None):
        """``dequantize``: run on the dequantized reconstruction of the int4 weights (the same
        numbers through float32 matmuls, 5x faster to train here than the quantized kernels'
        backward pass) rather than on the int4 kernels themselves (bit-identical to serving).
        ``routing``, ``stage_extra``: as the engine's settings (auto: what the heads file
        records), so that training sees the routing that will be served."""
        self.model_dir = Path(model_dir)
        raw = with_experts_per_token(load_config(self.model_dir), experts_per_token)
        self.model = bnn.load_full_model(self.model_dir, experts_per_token=experts_per_token)
        self.spec = derive_spec(self.model, raw)
        bnn.cast_model(self.model, mx.float32)
        if dequantize:
            bnn.dequantize_model(self.model)
        heads = None
        self.heads_path = None
        self.routing = None  # (mode, stage_extra) with heads
        if use_heads:
            self.heads_path = Path(heads_file) if heads_file else self.model_dir / HEADS_FILENAME
            heads, meta = load_heads(self.heads_path, self.model_dir, spec=self.spec)
            self.routing = resolve_routing(EngineConfig(routing=routing, stage_extra=stage_extra), meta, self.spec,
                                    self.heads_path)
            bnn.load_parameters_flat(heads, {k: v.astype(mx.float32) for k, v in bnn.parameters_flat(heads).items()})
            heads.freeze()
        routers = {}
        self.context = StepContext()  # the routes each forward pass follows (``logits``)
        for l, m in self.spec.layers.items():
            if m.router_path:
                tap = RouterTap(l, bnn.module_at(self.model, m.router_path), m.router_kind, m.router_outputs,
                                self.context)
                bnn.set_module_at(self.model, m.router_path, tap)
                routers[l] = tap
        widen = None
        if heads is not None and self.routing[0] == "select":
            width = self.spec.k + self.routing[1]
            probes = {c: routing_probe(self, c, width) for c in heads.consumers()}
            widen = lambda consumer, logits: probes[consumer](logits)
        self.ctx = _Context(heads, routers, bnn.token_embedding(self.model), widen)
        if heads is not None:
            for owner in heads.owners:
                routers[owner].watch = self.ctx.watch
            for layer in heads.owners:
                path = self.spec.switch_path(layer)
                bnn.set_module_at(self.model, path, ObservedSwitch(
                    layer, bnn.module_at(self.model, path), self.ctx.on_experts if layer in heads.owners else None))
        self.model.freeze()
        self.rank, self.scale = rank, scale
        self.adapted = self._attach_lora(rank, scale, seed)

    def _attach_lora(self, rank: int, scale: float, seed: int) -> dict[str, AdaptedLinear]:
        mx.random.seed(seed)
        adapted = {}
        for path, module in target_modules(self.model, self.spec).items():
            out_dim, in_dim = bnn.linear_dims(module)
            wrapper = AdaptedLinear(module)
            wrapper.set_delta(*lora_init(in_dim, out_dim, rank), scale)
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

    def logits(self, tokens, prompt_lengths):
        """tokens [B, T] int32; prompt_lengths [B]: positions >= P route by prediction."""
        T = tokens.shape[1]
        mask = (mx.arange(T)[None, :] >= mx.array(prompt_lengths)[:, None])[..., None]
        self.ctx.start(mask if self.ctx.heads is not None else None, tokens)
        with self.context.installed(Step(routes=self.ctx.routes)):
            return self.model(tokens)

    def save(self, out_dir: str | Path, provenance: dict) -> Path:
        tensors = {p: (w.lora_a, w.lora_b) for p, w in self.adapted.items()}
        keys = sorted({adapter_key(self.spec, p) for p in tensors})
        return save_adapter(tensors, out_dir, rank=self.rank, scale=self.scale, keys=keys,
                            num_layers=self.spec.num_layers, provenance=provenance)


def continuation_ce(logits, tokens, mask):
    """Mean cross-entropy of next-token predictions where ``mask`` [B, T-1] is 1 (the
    continuation: ``edge0.train.data.continuation_mask``)."""
    ce = nn.losses.cross_entropy(logits[:, :-1].astype(mx.float32), tokens[:, 1:], reduction="none")
    return (ce * mask).sum() / mx.maximum(mask.sum(), 1.0)
