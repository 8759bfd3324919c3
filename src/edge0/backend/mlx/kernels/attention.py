"""The prompt's attention on Edge0's CPU kernel (``csrc/attn.cpp``), where MLX's fused
attention on the CPU backend runs its products at a few GFLOP/s.

mlx-lm's model modules compute attention through ``mlx_lm.models.base.
scaled_dot_product_attention``, imported by name into each module. ``install()`` puts
``sdpa`` in its place in every loaded model module; ``sdpa`` computes on Edge0's kernel only
while ``active(True)`` holds in the calling context (Edge0's forward pass with kernels
edge0: ``edge0.streaming.StepModel``), for a prompt's queries (more than one) in float32 with
a causal mask or none, no attention sinks and an unquantized cache; everywhere else it is
mlx-lm's own function, so ``kernels=mlx`` keeps mlx-lm's numbers bit for bit in the same
process.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys

import mlx.core as mx

from edge0.backend.mlx.kernels._loader import available, ext
from edge0.errors import KernelError

_ON = contextvars.ContextVar("edge0_attention", default=False)
MIN_QUERIES = 2  # a decode step's one query stays on MLX's kernel


@contextlib.contextmanager
def active(on: bool = True):
    """``with active(True):`` attention built inside runs on Edge0's kernel where it can."""
    token = _ON.set(bool(on))
    try:
        yield
    finally:
        _ON.reset(token)


def attention(q, k, v, *, scale: float, causal: bool = True):
    """softmax(q k^T * scale) v: q [B, Hq, L, D], k and v [B, Hkv, S, D] float32 (Hq a multiple
    of Hkv); ``causal``: query i sees keys j <= S - L + i. Inputs it cannot compute: a
    ``KernelError`` naming what was wrong."""
    try:
        return ext().attention(q, k, v, float(scale), bool(causal))
    except ValueError as e:
        raise KernelError(str(e)) from None


def _usable(queries, keys, values, cache, mask, sinks) -> bool:
    """Whether the kernel computes this call (else mlx-lm's function does): switched on, a
    prompt's queries, float32, the keys and values of one shape (not MLA's narrower values),
    grouped-query heads, a causal mask with as many keys as queries or more, or none."""
    if not (_ON.get() and sinks is None and not hasattr(cache, "bits") and available()):
        return False
    if not (mask is None or (isinstance(mask, str) and mask == "causal")):
        return False
    return (queries.ndim == 4 and keys.ndim == 4 and queries.shape[2] >= MIN_QUERIES
            and queries.dtype == mx.float32 and keys.dtype == mx.float32 and values.dtype == mx.float32
            and keys.shape == values.shape and queries.shape[-1] == keys.shape[-1]
            and queries.shape[0] == keys.shape[0] and queries.shape[1] % keys.shape[1] == 0
            and (mask is None or keys.shape[2] >= queries.shape[2]))


def _make(base):
    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        if _usable(queries, keys, values, cache, mask, sinks):
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
