"""Quantized projections split over the compute streams (MLX).

``SplitQuantizedLinear`` computes a quantized projection's output rows in groups, one
group per stream (so per core), and puts them back in order: bit-identical to one call.
``split_projections`` turns every large enough quantized projection of a model into one
(``SPLIT_MIN_WEIGHTS``: the size below which cutting costs more than it gives back).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from edge0.backend.mlx.core import compute_streams
from edge0.backend.mlx.tree import linear_dims

# Below this many weights (out x in) a projection stays one op: cutting it costs more in
# cross-stream hand-offs than the second core gives back.
SPLIT_MIN_WEIGHTS = 1 << 20


class SplitQuantizedLinear(nn.QuantizedLinear):
    """An int4 (any quantized) projection whose output rows are cut into groups, each
    computed on its own stream (so on its own core), then put back in order.

    Each output element is the same quantized dot product over the same row of the weight
    as in one call, so the result is bit-identical; only which thread computes it changes.
    The instance keeps its parameters and stays a ``QuantizedLinear`` (adapters, training
    and merging see the module they expect)."""

    split_threads = 1

    def __call__(self, x):
        n = self.split_threads
        rows = self["weight"].shape[0]
        if n <= 1 or rows < 2 * n:
            return super().__call__(x)
        streams = compute_streams(n)
        bounds = [rows * i // n for i in range(n + 1)]
        biases = self.get("biases")
        outs = []
        for i in range(n):
            a, b = bounds[i], bounds[i + 1]
            with mx.stream(streams[i]):
                outs.append(mx.quantized_matmul(
                    x, self["weight"][a:b], scales=self["scales"][a:b],
                    biases=None if biases is None else biases[a:b], transpose=True,
                    group_size=self.group_size, bits=self.bits, mode=getattr(self, "mode", "affine")))
        y = mx.concatenate(outs, axis=-1)
        if "bias" in self:
            y = y + self["bias"]
        return y


def split_projections(model: nn.Module, threads: int, min_weights: int | None = None) -> int:
    """Let every quantized projection of ``model`` with at least ``min_weights`` weights
    run its output rows over ``threads`` streams (``SplitQuantizedLinear``); returns how
    many do. Expert stacks are not ``QuantizedLinear`` modules and are untouched."""
    if threads <= 1:
        return 0
    limit = SPLIT_MIN_WEIGHTS if min_weights is None else min_weights
    n = 0
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear and "scales" in m:
            out_dim, in_dim = linear_dims(m)
            if out_dim * in_dim >= limit and out_dim >= 2 * threads:
                m.__class__ = SplitQuantizedLinear
                m.split_threads = threads
                n += 1
    return n
