"""The prompt's attention on Edge0's CPU kernel (``csrc/attn.cpp``), where MLX's fused
attention on the CPU backend runs its products at a few GFLOP/s; and the layers' RMS norms
and rotary embeddings on Edge0's row kernels (``csrc/layer_ops.cpp``), where MLX's CPU
backend composes each of several elementwise ops.

mlx-lm's model modules compute attention through ``mlx_lm.models.base.
scaled_dot_product_attention``, imported by name into each module. ``install()`` puts
``sdpa`` in its place in every loaded model module; ``sdpa`` computes on Edge0's kernel only
while ``active(True)`` holds in the calling context (Edge0's forward pass with kernels
edge0: ``edge0.streaming.StepModel``), for a prompt's queries or a decode step's in float32
with a causal mask, a boolean one (a batch's left padding) or none, no attention sinks and
an unquantized cache; everywhere else it is
mlx-lm's own function, so ``kernels=mlx`` keeps mlx-lm's numbers bit for bit in the same
process.

``Edge0RMSNorm`` and ``Edge0RoPE`` (the twins ``use_edge0`` gives mlx-lm's ``nn.RMSNorm``
and ``nn.RoPE``) compute on the row kernels under the same switch, for every pass (a decode
step's one row too), float32 in and out, an integer offset or one per batch entry; elsewhere
they are mlx-lm's modules unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys

import mlx.core as mx
import mlx.nn as nn

from edge0.backend.mlx.kernels._loader import ext
from edge0.errors import KernelError

_ON = contextvars.ContextVar("edge0_attention", default=False)
MIN_QUERIES = 1  # a decode step's one query too
_attention = None  # the extension's attention, once looked up


@contextlib.contextmanager
def active(on: bool = True):
    """``with active(True):`` attention built inside runs on Edge0's kernel where it can."""
    token = _ON.set(bool(on))
    try:
        yield
    finally:
        _ON.reset(token)


def attention(q, k, v, *, scale: float, causal: bool = True, mask=None):
    """softmax(q k^T * scale) v: q [B, Hq, L, D], k and v [B, Hkv, S, D] float32 (Hq a multiple
    of Hkv); ``causal``: query i sees keys j <= S - L + i; ``mask``: a boolean [B or 1, Hq or
    1, L or 1, S] of the keys each query sees (a batch's left padding: a padded sequence
    computes what it computes alone). Inputs it cannot compute: a ``KernelError`` naming what
    was wrong."""
    global _attention
    if _attention is None:  # (looked up once: a decode step does not enter the loader)
        _attention = ext().attention
    try:
        return _attention(q, k, v, float(scale), bool(causal), mask)
    except ValueError as e:
        raise KernelError(str(e)) from None


def _usable(queries, keys, values, cache, mask, sinks) -> bool:
    """Whether the kernel computes this call (else mlx-lm's function does): switched on, a
    prompt's queries or a decode step's, float32, the keys and values of one shape (not MLA's
    narrower values), grouped-query heads, a causal mask with as many keys as queries or more,
    a boolean mask over the keys (a batch's), or none."""
    # (switched on only where the kernels resolved, so they are built)
    if not (_ON.get() and queries.ndim == 4 and queries.shape[2] >= MIN_QUERIES and sinks is None
            and not hasattr(cache, "bits")):
        return False
    if not (mask is None or (isinstance(mask, str) and mask == "causal") or _boolean(mask, queries, keys)):
        return False
    return (keys.ndim == 4
            and queries.dtype == mx.float32 and keys.dtype == mx.float32 and values.dtype == mx.float32
            and keys.shape == values.shape and queries.shape[-1] == keys.shape[-1]
            and queries.shape[0] == keys.shape[0] and queries.shape[1] % keys.shape[1] == 0
            and (not isinstance(mask, str) or keys.shape[2] >= queries.shape[2]))


def _boolean(mask, queries, keys) -> bool:
    """A boolean mask of the kernel's shapes: [B or 1, Hq or 1, L or 1, S]."""
    if not (isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.ndim == 4 and keys.ndim == 4):
        return False
    want = (queries.shape[0], queries.shape[1], queries.shape[2], keys.shape[2])
    return mask.shape[3] == want[3] and all(m in (1, w) for m, w in zip(mask.shape[:3], want[:3]))


def _make(base):
    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        if _usable(queries, keys, values, cache, mask, sinks):
            if isinstance(mask, mx.array):
                return attention(queries, keys, values, scale=scale, causal=False, mask=mask)
            return attention(queries, keys, values, scale=scale, causal=mask is not None)
        return base(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    return sdpa


def install() -> int:
    """Put ``sdpa`` in place of mlx-lm's attention function in every loaded mlx-lm model
    module (again after more are loaded: idempotent); returns how many it replaced now."""
    from mlx_lm.models import base

    n = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("mlx_lm.models.") or module is None:
            continue
        fn = getattr(module, "scaled_dot_product_attention", None)
        if fn is base.scaled_dot_product_attention and module is not base:
            module.scaled_dot_product_attention = _make(fn)
            n += 1
    return n


_row_ops = None  # the extension's row kernels, looked up once


def _row_kernels():
    global _row_ops
    if _row_ops is None:
        _row_ops = (ext().rms_norm, ext().rope)
    return _row_ops


def rms_norm(x, weight, eps: float):
    """``mx.fast.rms_norm(x, weight, eps)`` on Edge0's row kernel (float32 x [..., D] of 1 to 4
    dimensions, weight [D])."""
    try:
        return _row_kernels()[0](x, weight, float(eps))
    except ValueError as e:
        raise KernelError(str(e)) from None


def rope(x, dims: int, *, traditional: bool, base, scale: float, offset, freqs=None):
    """``mx.fast.rope`` on Edge0's row kernel: float32 x [..., L, D] (2 to 4 dimensions),
    positions ``offset`` + l along axis -2; ``offset`` an int, or an int array of one value or
    one per batch entry (axis 0); ``base`` or ``freqs`` (float32 [dims / 2]), one of the two."""
    offsets = mx.array([offset], dtype=mx.int32) if isinstance(offset, int) else \
        offset.astype(mx.int32).reshape(-1)
    try:
        return _row_kernels()[1](x, int(dims), bool(traditional), None if base is None else float(base),
                                 float(scale), offsets, freqs)
    except ValueError as e:
        raise KernelError(str(e)) from None


def _rows(x) -> bool:
    """Whether the row kernels take ``x`` in this context: switched on, float32, 1 to 4 dims."""
    return _ON.get() and x.dtype == mx.float32 and 1 <= x.ndim <= 4


class Edge0RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computing on Edge0's row kernel inside Edge0's forward pass (same weight)."""

    def __call__(self, x):
        if _rows(x) and self.weight.dtype == mx.float32:
            return rms_norm(x, self.weight, self.eps)
        return super().__call__(x)


class Edge0RoPE(nn.RoPE):
    """``nn.RoPE`` computing on Edge0's row kernel inside Edge0's forward pass."""

    def __call__(self, x, offset=0):
        if _rows(x) and x.ndim >= 2 and self.dims % 2 == 0 and (
                isinstance(offset, int) or (isinstance(offset, mx.array) and offset.ndim <= 1
                                            and (offset.size == 1 or (x.ndim >= 3 and offset.size == x.shape[0])))):
            return rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=offset)
        return super().__call__(x, offset)
