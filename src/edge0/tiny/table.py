"""The table of supported architectures (docs/MODELS.md), derived from the code."""

from __future__ import annotations

from edge0.backend import nn as bnn
from edge0.model.arch import NOT_STREAMABLE, derive_spec
from edge0.model.families import PIPELINE_MODEL_TYPES, SUPPORTED_MODEL_TYPES
from edge0.tiny.configs import MIN_LAYERS, tiny_config


def architecture_table() -> str:
    """The table of supported architectures (docs/MODELS.md), derived from each model type's tiny
    config through ``edge0.model.arch.derive_spec`` (``tests/test_readme.py`` keeps docs/MODELS.md in sync)."""
    rows = ["| model_type | mlx-lm model file | routed experts | router | prerouter heads | pipeline |",
            "|---|---|---|---|---|---|"]
    for model_type in SUPPORTED_MODEL_TYPES:
        config = tiny_config(model_type, layers=max(4, MIN_LAYERS.get(model_type, 1)))
        model = bnn.build_model(config)
        spec = derive_spec(model, config)
        first = spec.layers[spec.moe_layers[0]]
        base = f"{spec.layer_prefix}{first.layer}."
        switch = bnn.module_at(model, first.switch_path)
        router = f"`{first.router_path[len(base):]}` ({first.router_kind})" if first.router_path else "none found"
        heads = "yes" if not spec.prerouter_problem else "no: " + spec.prerouter_problem
        rows.append(f"| `{model_type}` | `{type(model).__module__.rsplit('.', 1)[-1]}.py` | "
                    f"`{first.switch_path[len(base):]}` ({type(switch).__name__}) | {router} | {heads} | "
                    f"{'yes' if model_type in PIPELINE_MODEL_TYPES else 'no'} |")
    for model_type, why in NOT_STREAMABLE.items():
        rows.append(f"| `{model_type}` | | not streamed: {why} | | | |")
    return "\n".join(rows)
