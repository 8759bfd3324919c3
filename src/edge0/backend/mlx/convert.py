"""Changing the numeric form of a model's weights (MLX).

Quantizing a routed-expert stack's template the way the checkpoint stores it
(``quantize_switch``) and describing the tensors such a stack holds (``switch_layout``,
the names, shapes and safetensors dtypes the checkpoint index checks against), replacing
every quantized module by its float equivalent (``dequantize_model``), and casting a
model's floating parameters to another dtype as ``mlx_lm.convert`` does (``cast_model``).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from edge0.backend.mlx.tree import linear_dims, set_module_at
from edge0.errors import LayoutError

_ST_NAMES = {mx.uint32: "U32", mx.uint8: "U8", mx.int8: "I8", mx.int32: "I32", mx.uint16: "U16", mx.int16: "I16"}


def switch_layout(template) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, safetensors dtype) of a switch module's stacked tensors; "float" for
    any floating type (F16, BF16 or F32 are all accepted for scales, biases and float
    weights)."""
    return [(name, tuple(v.shape), "float" if mx.issubdtype(v.dtype, mx.floating) else _ST_NAMES.get(v.dtype, str(v.dtype)))
            for name, v in tree_flatten(template.parameters())]


def quantize_switch(template, header_shapes: dict, prefix: str, quantization: dict) -> None:
    """Quantize the switch module ``template`` (at module path ``prefix``) the way the
    checkpoint stores it: each projection whose ``scales`` the files hold, with config.json's
    bits, group size and mode for it (a per-module override first), else what its packed
    shape implies."""
    for name, child in list(template.children().items()):
        if not hasattr(child, "to_quantized"):
            continue
        key = f"{prefix}.{name}"
        if f"{key}.scales" not in header_shapes:
            continue
        override = quantization.get(key)
        spec = dict(override) if isinstance(override, dict) else {}
        in_dim = child.weight.shape[-1]
        packed, groups = header_shapes[f"{key}.weight"][-1], header_shapes[f"{key}.scales"][-1]
        bits = spec.get("bits", quantization.get("bits") or packed * 32 // max(in_dim, 1))
        group = spec.get("group_size", quantization.get("group_size") or in_dim // max(groups, 1))
        mode = spec.get("mode", quantization.get("mode", "affine"))
        if group not in (32, 64, 128) or bits not in (2, 3, 4, 5, 6, 8) or in_dim % group:
            raise LayoutError(f"the expert projection is {in_dim} wide: int{bits} quantization with group size "
                              f"{group} cannot hold it", tensor=f"{key}.weight")
        setattr(template, name, child.to_quantized(group_size=group, bits=bits, mode=mode))


def dequantize_model(model: nn.Module, dtype=mx.float32) -> None:
    """Replace every quantized linear, switch linear and embedding by its float equivalent
    holding the dequantized weights (the "dequantized reconstruction" training runs on:
    the same numbers as the int4 kernels, through fast float matmuls)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    def deq(m):
        return mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits).astype(dtype)

    swaps = []
    for path, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            out_dim, in_dim = linear_dims(m)
            new = nn.Linear(in_dim, out_dim, bias="bias" in m)
        elif isinstance(m, QuantizedSwitchLinear):
            new = SwitchLinear(m.input_dims, m.output_dims, m.num_experts, bias="bias" in m)
        elif isinstance(m, nn.QuantizedEmbedding):
            new = nn.Embedding(m.num_embeddings, m.dims)
        else:
            continue
        new.weight = deq(m)
        if "bias" in m:
            new.bias = m.bias.astype(dtype)
        swaps.append((path, new))
    for path, new in swaps:
        set_module_at(model, path, new)


def cast_model(model: nn.Module, dtype, skip: Callable[[str], bool] = lambda _: False) -> None:
    """Cast floating parameters to ``dtype``, honouring the model's ``cast_predicate``
    (e.g. DeepSeek's e_score_correction_bias stays float32), as mlx_lm.convert does.
    Parameters whose path ``skip`` accepts keep their dtype."""
    keep = getattr(model, "cast_predicate", lambda _: True)
    params = tree_flatten(model.parameters())
    cast = [(k, v.astype(dtype)) for k, v in params
            if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype and keep(k) and not skip(k)]
    if cast:
        model.update(tree_unflatten(cast))
