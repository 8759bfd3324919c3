"""The quantized gather matmul every executor path shares (MLX)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.activations import swiglu


def gather_qmm(x, weight, scales, biases, indices, *, bits: int, group_size: int, sorted_indices: bool):
    return mx.gather_qmm(
        x, weight, scales, biases, rhs_indices=indices, transpose=True,
        group_size=group_size, bits=bits, mode="affine", sorted_indices=sorted_indices,
    )


def glu(x_up, x_gate):
    """SwitchGLU's activation: silu(gate) * up, mlx-lm's own fused swiglu."""
    return swiglu(x_gate, x_up)


def dequantize(weight, scales, biases, *, bits: int, group_size: int):
    return mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits)


def sort_rows(x, indices):
    """Group (token, slot) rows by expert, as SwitchGLU does for larger batches."""
    *_, m = indices.shape
    flat = indices.flatten()
    order = mx.argsort(flat)
    inv_order = mx.argsort(order)
    return x.flatten(0, -3)[order // m], flat[order], inv_order


def unsort_rows(x, inv_order, shape):
    return mx.unflatten(x[inv_order], 0, shape)

