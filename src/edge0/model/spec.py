"""MoESpec: what Edge0 knows about a MoE checkpoint's routed experts. Plain data.

It is derived from mlx-lm's own model for the checkpoint's config.json (``edge0.model.arch``):
which decoder layers have a stack of routed experts, where the stack, its block and its
router live, the expert count, k, and the checkpoint keys of the stacked tensors. One
streaming layer serves every architecture from this data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edge0.errors import ConfigError


@dataclass(frozen=True)
class ExpertQuant:
    bits: int
    group_size: int
    mode: str = "affine"


@dataclass(frozen=True)
class MoELayer:
    """One decoder layer's routed experts."""

    layer: int
    block_path: str  # the module that routes and calls the switch stack
    switch_path: str  # the stack; its stacked tensors are checkpoint keys "{switch_path}.{name}"
    router_path: str | None  # the router module (None: not found, no prerouter on this layer)
    router_kind: str | None  # "linear" (x -> logits) or "inline" (a gate that multiplies by its weight)
    num_experts: int
    router_outputs: int  # logits per token (E, or more for zero/identity experts)


@dataclass(frozen=True)
class MoESpec:
    model_type: str
    num_layers: int  # decoder layers
    layer_prefix: str  # module path of the decoder layers, e.g. "model.layers."
    hidden_size: int  # width of the routers' input (what a prerouter head sees)
    block_input: int  # width of the MoE blocks' input
    num_experts: int
    k: int
    moe_layers: tuple[int, ...]
    layers: dict[int, MoELayer] = field(compare=False)
    quant: ExpertQuant | None = None  # the checkpoint's default quantization (None: unquantized)
    quant_overrides: dict = field(default_factory=dict, compare=False)
    prerouter_problem: str | None = None  # why the prerouter cannot drive this model (None: it can)

    def block_path(self, layer: int) -> str:
        return self.layers[layer].block_path

    def switch_path(self, layer: int) -> str:
        return self.layers[layer].switch_path

    def is_expert_key(self, key: str) -> bool:
        return any(key.startswith(m.switch_path + ".") for m in self.layers.values())

    def expert_quant(self, layer: int, name: str) -> ExpertQuant | None:
        """Quantization of the stacked tensor ``name`` (e.g. ``gate_proj.weight``) of a layer."""
        module = f"{self.switch_path(layer)}.{name.rpartition('.')[0]}"
        override = self.quant_overrides.get(module)
        if override is False:
            return None
        if isinstance(override, dict):
            base = self.quant or ExpertQuant(4, 64)
            return ExpertQuant(int(override.get("bits", base.bits)), int(override.get("group_size", base.group_size)),
                               str(override.get("mode", base.mode)))
        return self.quant



def with_experts_per_token(config: dict, k: int | None) -> dict:
    """``config`` with its routing width replaced (the nested text config too): serving a
    narrower width is a file swap of heads and adapter, never a change of the base."""
    if k is None:
        return config
    cfg = dict(config)
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"] = dict(cfg["text_config"], num_experts_per_tok=k)
    else:
        cfg["num_experts_per_tok"] = k
    return cfg


def load_config(model_dir: str | Path) -> dict:
    """config.json of ``model_dir``, read through the model-directory gate (regular file
    inside the directory, size limit, UTF-8, bounded nesting)."""
    from edge0.model.files import read_json

    try:
        config = read_json(Path(model_dir), "config.json")
    except FileNotFoundError:
        raise ConfigError(f"{model_dir} is not a model directory: {Path(model_dir) / 'config.json'} does not "
                          "exist") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{Path(model_dir) / 'config.json'} must hold a JSON object")
    _check_key_counts(config, Path(model_dir) / "config.json")
    return config


MAX_CONFIG_KEYS = 10_000  # per JSON object; real configs hold a few hundred (mlx-lm checks each key's name
# against its argument class one signature at a time: 200,000 keys took 37 s)


def _check_key_counts(value, where: Path, path: str = "") -> None:
    if isinstance(value, dict):
        if len(value) > MAX_CONFIG_KEYS and path.rsplit(".", 1)[-1] not in ("quantization", "quantization_config"):
            raise ConfigError(f"{where}: {path or 'the top-level object'} has {len(value)} keys, more than the "
                              f"{MAX_CONFIG_KEYS} a model configuration may hold")
        for k, v in value.items():
            _check_key_counts(v, where, f"{path}.{k}" if path else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_key_counts(v, where, f"{path}[{i}]")
