"""Paths into a model's module tree and edits of it (MLX).

The model is mlx-lm's own module tree; these helpers find a submodule by its dotted path
and swap one in, tell linear projections and routed-expert stacks (mlx-lm's switch
modules) apart from the rest, read the widths the engine needs (hidden width, a
projection's unquantized shape, a switch stack's expert count and output width), find the
token embedding, and let a caller observe a module's inputs (``intercept``) without
changing what it computes.
"""

from __future__ import annotations

import mlx.nn as nn
from mlx.utils import tree_flatten

from edge0.errors import LayoutError

Module = nn.Module


def module_at(root: nn.Module, path: str):
    """The submodule at dotted ``path`` (list indices as numbers), or None."""
    node = root
    for part in path.split("."):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                return None
            node = node[int(part)]
        elif isinstance(node, nn.Module) and part in node:
            node = node[part]
        else:
            return None
    return node


def set_module_at(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = module_at(root, parent_path) if parent_path else root
    if parent is None:
        raise LayoutError(f"module path {parent_path!r} does not exist in the model")
    setattr(parent, name, module)


def children(module) -> dict:
    return module.children() if isinstance(module, nn.Module) else {}


def is_linear(module) -> bool:
    return isinstance(module, (nn.Linear, nn.QuantizedLinear))


def is_switch(module) -> bool:
    """A stack of routed experts: mlx-lm's SwitchGLU or SwitchMLP (not a bare SwitchLinear:
    some attention projections are one)."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    return isinstance(module, (SwitchGLU, SwitchMLP))


def switch_experts(switch) -> int:
    """The number of experts stacked in a switch module (axis 0 of its weights)."""
    shapes = {v.shape[0] for k, v in tree_flatten(switch.parameters()) if k.endswith("weight")}
    if len(shapes) != 1:
        raise LayoutError(f"a switch stack whose weights stack different expert counts: {sorted(shapes)}")
    return shapes.pop()


def switch_output_width(switch) -> int:
    """Width of a switch module's output rows (its last projection's outputs)."""
    last = switch["down_proj"] if "down_proj" in switch else switch["fc2"] if "fc2" in switch else None
    if last is None:
        raise LayoutError(f"an expert stack of type {type(switch).__name__} without down_proj or fc2")
    return last["weight"].shape[1]


def hidden_width(model) -> int:
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None)):
        for name in ("hidden_size", "model_dim", "d_model"):
            value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
            if isinstance(value, int):
                return value
    raise LayoutError("the model's config names no hidden_size")


def token_embedding(model: nn.Module):
    """The model's input token embedding (an ``Embedding`` or ``QuantizedEmbedding``; the one
    named ``embed_tokens`` when there are several): ids [..] -> rows [.., D]. None when the
    model has none."""
    found = [(("embed_tokens" not in path), path.count("."), path, m) for path, m in model.named_modules()
             if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))]
    return min(found, key=lambda f: f[:3])[3] if found else None


def linear_modules(root: nn.Module):
    """(path, module) of every linear projection (float or quantized) under ``root``."""
    return [(p, m) for p, m in root.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """(out, in) of a linear projection, unquantized."""
    out_dim, in_dim = module.weight.shape
    if isinstance(module, nn.QuantizedLinear):
        in_dim = in_dim * 32 // module.bits
    return out_dim, in_dim


class intercept:
    """``with intercept(module, fn):`` calls ``fn(*args)`` before each call of ``module``
    (by swapping the instance's class for the duration; ``module`` None does nothing)."""

    def __init__(self, module, fn):
        self.module, self.fn = module, fn

    def __enter__(self):
        if self.module is None:
            return self
        cls, fn = type(self.module), self.fn

        def call(inner, *args, **kwargs):
            fn(*args, **kwargs)
            return cls.__call__(inner, *args, **kwargs)

        self._cls = cls
        self.module.__class__ = type(f"Intercepted{cls.__name__}", (cls,), {"__call__": call})
        return self

    def __exit__(self, *exc):
        if self.module is not None:
            self.module.__class__ = self._cls
