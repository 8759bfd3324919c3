"""Building blocks for Edge0's own small trainable modules, the prerouter heads (MLX).

MLX's float linear layer, activations and autodiff under backend-neutral names
(``Linear``, ``silu``, ``log_sigmoid``, ``value_and_grad``), the AdamW optimizer
(``adamw``), a module's parameters as a flat {path: array} dict and back
(``parameters_flat``, ``load_parameters_flat``), and a router's weight as float32,
dequantized if need be (``router_weight``), to initialise a head from.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

Linear = nn.Linear
silu = nn.silu
log_sigmoid = nn.log_sigmoid
value_and_grad = nn.value_and_grad


def adamw(learning_rate: float, weight_decay: float = 0.0):
    import mlx.optimizers as optim

    return optim.AdamW(learning_rate=learning_rate, weight_decay=weight_decay)


def parameters_flat(module: nn.Module) -> dict:
    return dict(tree_flatten(module.parameters()))


def load_parameters_flat(module: nn.Module, flat: dict) -> None:
    module.update(tree_unflatten(list(flat.items())))


def router_weight(router: nn.Module):
    """The router's [E, D] weight as a float32 array, dequantized if it is quantized
    (``router``: a RouterTap, or the router module itself)."""
    lin = router.original if hasattr(router, "original") else router
    if isinstance(lin, nn.QuantizedLinear):
        w = mx.dequantize(lin.weight, lin.scales, lin.biases, group_size=lin.group_size, bits=lin.bits)
    else:
        w = lin.weight
    return w.astype(mx.float32)
