"""Routing functions: router logits -> (expert indices, combine weights).

Standalone versions of each family's gate math, op for op as in mlx-lm's model files so
that the results are bit-identical (tests compare them on random logits). The same
function objects route the real router's logits and, later, the prerouter's predicted
logits: prediction-as-routing goes through exactly the math the model was trained with.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from edge0.backend import core as B
from edge0.spec import MoESpec, SigmoidGroup, SoftmaxTopK

RouteFn = Callable[..., tuple]  # (logits, bias=None) -> (inds [..., k], scores [..., k])


def softmax_topk(logits, *, k: int, norm_topk_prob: bool):
    """Qwen3 / Qwen3.5: softmax over all experts, top-k, optional renormalisation."""
    gates = B.softmax(logits, axis=-1, precise=True)
    inds = B.stop_gradient(B.argpartition(gates, kth=-k, axis=-1)[..., -k:])
    scores = B.take_along_axis(gates, inds, axis=-1)
    if norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores


def topk_softmax(logits, *, k: int):
    """Mixtral: top-k on the logits, then softmax over the k selected."""
    inds = B.stop_gradient(B.argpartition(-logits, kth=k - 1, axis=-1)[..., :k])
    scores = B.take_along_axis(logits, inds, axis=-1)
    return inds, B.softmax(scores, axis=-1, precise=True)


def sigmoid_group(logits, bias, *, k: int, n_group: int, topk_group: int, routed_scaling_factor: float,
                  norm_topk_prob: bool, score_function: str = "sigmoid", denominator_eps: float = 0.0,
                  select: str = "neg_first_k", cast_to_input: bool = False):
    """DeepSeek-V3 / GLM / Ling: scores, keep the best groups (by their top-2 sum), top-k
    among survivors, weights are the uncorrected scores, renormalised and scaled."""
    in_type = logits.dtype
    if score_function == "sigmoid":
        scores = B.sigmoid(logits.astype(B.float32))
    else:
        scores = B.softmax(logits.astype(B.float32), axis=-1)
    orig_scores = scores
    if bias is not None:
        scores = scores + bias
    if n_group > 1:
        scores = B.unflatten(scores, axis=-1, shape=(n_group, -1))
        group_scores = B.topk(scores, 2, axis=-1).sum(axis=-1, keepdims=True)
        drop = n_group - topk_group
        group_idx = B.argpartition(group_scores, kth=drop - 1, axis=-2)[..., :drop, :]
        zero = B.array(0.0, scores.dtype) if cast_to_input else B.array(0.0)
        scores = B.put_along_axis(scores, B.stop_gradient(group_idx), zero, axis=-2)
        scores = B.flatten(scores, -2, -1)
    if select == "last_k":
        inds = B.argpartition(scores, kth=-k, axis=-1)[..., -k:]
    else:
        inds = B.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
    inds = B.stop_gradient(inds)
    scores = B.take_along_axis(orig_scores, inds, axis=-1)
    if k > 1 and norm_topk_prob:
        if denominator_eps:
            scores = scores / (scores.sum(axis=-1, keepdims=True) + denominator_eps)
        else:
            scores = scores / scores.sum(axis=-1, keepdims=True)
    scores = scores * routed_scaling_factor
    if cast_to_input:
        scores = scores.astype(in_type)
    return inds, scores


def make_route_fn(spec: MoESpec) -> RouteFn:
    """The routing function of ``spec``'s family, with its parameters bound.

    Returns ``route(logits, bias=None) -> (inds, scores)``.
    """
    r = spec.routing
    if isinstance(r, SoftmaxTopK):
        if r.order == "topk_softmax":
            fn = partial(topk_softmax, k=r.k)
        else:
            fn = partial(softmax_topk, k=r.k, norm_topk_prob=r.norm_topk_prob)
        return lambda logits, bias=None: fn(logits)
    assert isinstance(r, SigmoidGroup)
    params = dict(k=r.k, n_group=r.n_group, topk_group=r.topk_group,
                  routed_scaling_factor=r.routed_scaling_factor, norm_topk_prob=r.norm_topk_prob,
                  score_function=r.score_function, denominator_eps=r.denominator_eps,
                  select=r.select, cast_to_input=r.cast_to_input)
    if r.compiled:
        # bailing compiles its routing; compiling ours the same way keeps fused kernels equal.
        with_bias = B.compile(lambda logits, bias: sigmoid_group(logits, bias, **params))
        without = B.compile(lambda logits: sigmoid_group(logits, None, **params))
        return lambda logits, bias=None: without(logits) if bias is None else with_bias(logits, bias)
    return lambda logits, bias=None: sigmoid_group(logits, bias, **params)


def combine(expert_out, scores):
    """Weighted sum over the k experts: (y * scores).sum(-2) in y's dtype."""
    return (expert_out * scores[..., None]).sum(axis=-2).astype(expert_out.dtype)
