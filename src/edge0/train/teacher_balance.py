"""The teacher's Switch-style load-balancing loss ``E * sum_i f_i * P_i``, computed from
each qwen3_moe MoE block's router during training (mlx-lm's block does not compute it):
:func:`balance_loss_capture` swaps the blocks' class for the duration of training only, so
the saved model is plain mlx-lm."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import mlx.nn as nn

_AUX: list = []  # per-block balance losses of the forward pass being traced


def _balanced_block_class(base: type) -> type:
    """A subclass of mlx-lm's qwen3_moe block whose forward is op for op the block's,
    and which also appends the Switch load-balancing loss ``E * sum_i f_i * P_i`` to
    ``_AUX``: ``f_i`` is the share of the token->expert assignments that went to expert
    ``i`` (no gradient), ``P_i`` the mean router probability of expert ``i``.  Equal to 1
    when routing is uniform, up to E when collapsed."""

    class BalancedMoeBlock(base):
        def __call__(self, x):
            gates = mx.softmax(self.gate(x), axis=-1, precise=True)
            k = self.top_k
            inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
            scores = mx.take_along_axis(gates, inds, axis=-1)
            if self.norm_topk_prob:
                scores = scores / mx.sum(scores, axis=-1, keepdims=True)
            y = self.switch_mlp(x, inds)
            y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)

            n_exp = self.num_experts
            probs = gates.reshape(-1, n_exp)
            onehot = (inds.reshape(-1, k)[..., None] == mx.arange(n_exp)).astype(probs.dtype)
            f = mx.stop_gradient(onehot.sum(axis=(0, 1)) / (probs.shape[0] * k))
            _AUX.append(n_exp * mx.sum(f * probs.mean(axis=0)))
            return y

    BalancedMoeBlock.__name__ = f"Balanced{base.__name__}"
    return BalancedMoeBlock


@contextlib.contextmanager
def balance_loss_capture(model: nn.Module):
    """Within the block, every qwen3_moe MoE block of ``model`` appends its balance loss
    to the module-level list ``_AUX`` on each forward (same outputs, same parameter
    names).  The blocks' class is restored on exit."""
    from mlx_lm.models.qwen3_moe import Qwen3MoeSparseMoeBlock

    balanced = _balanced_block_class(Qwen3MoeSparseMoeBlock)
    blocks = [m for _, m in model.named_modules() if type(m) is Qwen3MoeSparseMoeBlock]
    if not blocks:
        raise ValueError("balance_loss_capture: the model has no qwen3_moe MoE block")
    for m in blocks:
        m.__class__ = balanced
    try:
        yield len(blocks)
    finally:
        for m in blocks:
            m.__class__ = Qwen3MoeSparseMoeBlock
        _AUX.clear()


def loss_with_balance(balance_weight: float):
    """``loss(model, x, y) -> (ce + balance_weight * balance, ce, balance)``: next-token
    cross-entropy (mean, float32 logits) and the mean of the blocks' balance losses, for a
    model inside :func:`balance_loss_capture`."""

    def loss(model, x, y):
        _AUX.clear()
        logits = model(x)
        ce = nn.losses.cross_entropy(logits.astype(mx.float32), y, reduction="mean")
        bal = sum(_AUX) / len(_AUX)
        _AUX.clear()
        return ce + balance_weight * bal, ce, bal

    return loss
