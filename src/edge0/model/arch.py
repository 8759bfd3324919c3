"""What Edge0 needs to know about an architecture, derived from mlx-lm's own model.

No table of model types: Edge0 builds mlx-lm's model for ``config.json`` (a skeleton whose
weights are never evaluated) and looks at it:

- the decoder layers: the model's ``layers``, and their module path;
- in each layer, the routed experts: the one ``SwitchGLU`` / ``SwitchMLP`` stack (its path,
  its stacked tensors, which give the expert count and the checkpoint key of every row);
- the MoE block: the module that calls the stack (its parent, or the parent of a wrapper);
- the router: inside the block, the linear map producing one logit per expert, or a gate
  module that multiplies by an ``[E, D]`` weight itself; found by shape, not by name;
- ``k`` and the block's input width: from one forward of a single dummy token through the
  block (graph only, nothing evaluated).

An architecture Edge0 cannot stream raises ``UnsupportedModelError`` with the reason.
"""

from __future__ import annotations

from edge0.backend import core as B
from edge0.backend import nn as bnn
from edge0.errors import ConfigError, UnsupportedModelError
from edge0.model.spec import ExpertQuant, MoELayer, MoESpec

# Model types beyond edge0.model.families.SUPPORTED_MODEL_TYPES load when derive_spec finds
# their experts and router, untested.

# mlx-lm model types whose experts are a stack but that Edge0 cannot stream, and why.
NOT_STREAMABLE = {
    "muse_spark": "its MoE block routes and combines with Metal-only kernels, which Edge0's tests cannot run",
    "dbrx": "its experts are a Python list of modules, not a stacked tensor Edge0 can read rows of",
}


def check_streamable(config: dict) -> None:
    """Refuse, before any model is built, a model type Edge0 knows it cannot stream."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"config.json: field 'model_type' must be a model type name (a string), got "
                          f"{model_type!r:.80}")
    if model_type in NOT_STREAMABLE:
        raise UnsupportedModelError(f"{model_type} cannot be streamed: {NOT_STREAMABLE[model_type]}")


def decoder_layers(model) -> tuple[list, str]:
    """The model's decoder layers and the module path they live at."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list) or not layers:
        raise UnsupportedModelError(f"{type(model).__module__}: the model exposes no list of decoder layers")
    first = next((l for l in layers if l is not None), None)
    for path, module in model.named_modules():
        if module is first and path:
            prefix = path.rsplit(".", 1)[0] + "."
            return layers, prefix
    raise UnsupportedModelError(f"{type(model).__module__}: cannot find where the decoder layers live")


def _router(block, switch_rel: str, experts: int) -> tuple[str | None, str | None, int]:
    """(path inside the block, kind, outputs) of the block's router, found by shape."""
    linears = []
    inline = []
    for path, module in block.named_modules():
        if not path or path == switch_rel or path.startswith(switch_rel + ".") or switch_rel.startswith(path + "."):
            continue
        if "shared" in path or "share_" in path:
            continue
        if bnn.is_linear(module):
            out_dim, _ = bnn.linear_dims(module)
            if experts <= out_dim <= 2 * experts:
                linears.append((path.count("."), path, out_dim))
        elif "weight" in module and getattr(module["weight"], "ndim", 0) == 2 \
                and experts <= module["weight"].shape[0] <= 2 * experts and not bnn.children(module):
            inline.append((path.count("."), path, module["weight"].shape[0]))
    if linears:
        _, path, out = min(linears)
        return path, "linear", out
    if inline:
        _, path, out = min(inline)
        return path, "inline", out
    return None, None, experts


def derive_spec(model, config: dict) -> MoESpec:
    """The MoESpec of an mlx-lm model skeleton (its arrays are never evaluated)."""
    model_type = config.get("model_type")
    check_streamable(config)
    layers, prefix = decoder_layers(model)
    found: dict[int, MoELayer] = {}
    for i, layer in enumerate(layers):
        if layer is None:
            continue
        switches = [(p, m) for p, m in layer.named_modules() if bnn.is_switch(m)]
        if not switches:
            continue
        if len(switches) > 1:
            raise UnsupportedModelError(f"{model_type}: layer {i} has {len(switches)} expert stacks "
                                        f"({[p for p, _ in switches]}); Edge0 streams one per layer")
        rel, switch = switches[0]
        experts = bnn.switch_experts(switch)
        parts = rel.split(".")
        block_rel = ".".join(parts[:-1])
        block = bnn.module_at(layer, block_rel) if block_rel else layer
        router_rel, kind, outputs = _router(block, parts[-1], experts)
        if router_rel is None and len(parts) >= 2:  # the stack sits in a wrapper (Experts(x, i, w))
            block_rel = ".".join(parts[:-2])
            block = bnn.module_at(layer, block_rel) if block_rel else layer
            router_rel, kind, outputs = _router(block, ".".join(parts[-2:]), experts)
        base = f"{prefix}{i}"
        found[i] = MoELayer(
            layer=i, block_path=f"{base}.{block_rel}" if block_rel else base, switch_path=f"{base}.{rel}",
            router_path=(f"{base}.{block_rel}.{router_rel}" if block_rel else f"{base}.{router_rel}")
            if router_rel else None, router_kind=kind, num_experts=experts, router_outputs=outputs)
    if not found:
        raise UnsupportedModelError(f"{model_type}: no decoder layer has a stack of routed experts (SwitchGLU or "
                                    "SwitchMLP): there is nothing to stream")
    counts = {m.num_experts for m in found.values()}
    if len(counts) > 1:
        raise UnsupportedModelError(f"{model_type}: MoE layers have different expert counts {sorted(counts)}")
    quant, overrides = _quantization(config)
    spec = MoESpec(model_type=model_type, num_layers=len(layers), layer_prefix=prefix, hidden_size=0, block_input=0,
                   num_experts=counts.pop(), k=0, moe_layers=tuple(sorted(found)), layers=found, quant=quant,
                   quant_overrides=overrides)
    return _probe_shapes(model, spec, config)


def _quantization(config: dict) -> tuple[ExpertQuant | None, dict]:
    q = config.get("quantization")
    if q is None and isinstance(config.get("text_config"), dict):
        q = config["text_config"].get("quantization")
    if not isinstance(q, dict):
        return None, {}
    return ExpertQuant(q.get("bits", 4), q.get("group_size", 64), q.get("mode", "affine")), \
        {k: v for k, v in q.items() if isinstance(v, (dict, bool))}


K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "top_k_experts", "moe_topk", "moe_k", "top_k")


def _config_k(config: dict) -> int | None:
    for cfg in (config, config.get("text_config") if isinstance(config.get("text_config"), dict) else {}):
        for key in K_FIELDS:
            if isinstance(cfg.get(key), int) and not isinstance(cfg.get(key), bool):
                return cfg[key]
    return None


def _probe_shapes(model, spec: MoESpec, config: dict) -> MoESpec:
    """k and the router's input width, from one dummy token through the first MoE block
    (the graph is built, nothing is evaluated). A block that cannot run on its own (a whole
    decoder layer that owns its experts) gets k from config.json and no prerouter."""
    first = spec.layers[spec.moe_layers[0]]
    block = bnn.module_at(model, first.block_path)
    switch = bnn.module_at(model, first.switch_path)
    router = bnn.module_at(model, first.router_path) if first.router_path else None
    seen: dict = {}
    width = bnn.hidden_width(model)
    with bnn.intercept(switch, lambda x, inds: seen.setdefault("switch", (x, inds))):
        with bnn.intercept(router, lambda x: seen.setdefault("router", x)):
            if not _is_layer(first):
                try:
                    block(B.zeros((1, 1, width)))
                    if "switch" in seen:  # the routing alone: the router's weight, never the experts'
                        B.eval(seen["switch"][1])
                except Exception as e:  # noqa: BLE001 - mlx-lm's own routing code rejects the config
                    raise ConfigError(f"config.json: mlx-lm's {spec.model_type} MoE block cannot route a token "
                                      f"with these values: {type(e).__name__}: {e}") from None
    problem = None
    if "switch" in seen:
        k = int(seen["switch"][1].shape[-1])
    else:
        k = _config_k(config)
        if k is None:
            raise UnsupportedModelError(f"{spec.model_type}: cannot tell how many experts a token routes to (its MoE "
                                        f"block does not run on its own{': ' + seen['error'] if 'error' in seen else ''}"
                                        f"; config.json names none of {K_FIELDS})")
        problem = "the MoE block is not a module that runs on its own input (its decoder layer owns the experts)"
    if not 1 <= k <= first.router_outputs:
        raise ConfigError(f"config.json: {spec.model_type} routes each token to {k} experts, but its MoE layers have "
                          f"{spec.num_experts}")
    if router is None:
        problem = problem or "no router (a linear map to one logit per expert) was found in the MoE block"
    elif "router" not in seen and problem is None:
        problem = "the MoE block does not call its router on its input"
    hidden = int(seen["router"].shape[-1]) if "router" in seen else width
    return MoESpec(**{**spec.__dict__, "k": k, "block_input": width, "hidden_size": hidden,
                      "prerouter_problem": problem})


def _is_layer(layer: MoELayer) -> bool:
    """Whether the 'block' is the decoder layer itself."""
    return layer.block_path.rsplit(".", 1)[-1].isdigit()
