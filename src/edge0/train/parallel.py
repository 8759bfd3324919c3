"""Data-parallel training on ``mx.distributed``: ``mlx.launch -n N edge0 train heads|sft|distill``.

Every rank runs the same command on the same data. What costs the most is split over the
ranks and put back together, so that each rank holds what one process would hold:

- the data a phase makes before it trains (the heads' traces, the teacher's or the
  student's continuations, the teacher's top-K): rank r computes items r, r+N, r+2N, ...,
  and :meth:`DataParallel.assemble` sums the zero-filled full arrays over the group, which
  puts each item where one process would have put it (a sum with zeros is exact);
- each optimizer step: every rank draws the same global batch from the same generator
  and computes the loss and gradient on its own contiguous part of it
  (:meth:`DataParallel.shard`); :meth:`DataParallel.reduce` weighs each rank's gradient
  and loss by its share of the batch's weight (its rows, or its masked tokens for a
  masked mean) and sums them over the group in one ``all_sum``. The result is the global
  batch's mean gradient, so the clipped update is the one a single process would take,
  within float rounding (the sum's order differs).

Rank 0 alone writes files (checkpoints, caches, the trained artifact) and prints; the
others compute. Outside ``mlx.launch`` the group has one rank and nothing here does
anything.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from edge0.errors import ConfigError

_MAX_DIMS = 4  # trailing dimensions of an item's rows that ranks agree on


class DataParallel:
    """The group a training command runs in (``None``: one process)."""

    def __init__(self, group=None):
        self.group = group if group is not None and group.size() > 1 else None

    @classmethod
    def current(cls) -> "DataParallel":
        """The group ``mlx.launch`` started this process in, or one process."""
        from edge0.backend import dist

        return cls(dist.group())

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size()

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mine(self, i: int) -> bool:
        """Whether this rank computes item ``i`` of the data a phase makes."""
        return i % self.size == self.rank

    def describe(self) -> str:
        return "one process" if self.group is None else f"data parallel over {self.size} ranks"

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (every rank gets the same answer)."""
        if self.group is None:
            return bool(flag)
        return mx.distributed.all_sum(mx.array([1.0 if flag else 0.0]), group=self.group).item() > 0

    # -- the data a phase makes ---------------------------------------------------------

    def assemble(self, lengths: Sequence[int], parts: dict[int, np.ndarray]) -> np.ndarray:
        """The concatenation, in item order, of every item's rows: ``parts`` holds this
        rank's items (``parts[i]`` has ``lengths[i]`` rows), the other ranks hold the rest."""
        if self.group is None:
            return np.concatenate([parts[i] for i in range(len(lengths))])
        inner, floating = self._layout(parts)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        full = np.zeros((int(offsets[-1]), *inner), dtype=np.float32 if floating else np.int32)
        for i, part in parts.items():
            full[offsets[i]:offsets[i + 1]] = part
        return np.array(mx.distributed.all_sum(mx.array(full), group=self.group))

    def _layout(self, parts: dict[int, np.ndarray]) -> tuple[tuple[int, ...], bool]:
        """The items' trailing shape and whether they are floating, agreed by every rank
        (a rank with no item of its own learns them from the others)."""
        some = next(iter(parts.values()), None)
        mine = np.zeros(_MAX_DIMS + 2, dtype=np.float32)
        if some is not None:
            if some.ndim - 1 > _MAX_DIMS:
                raise ValueError(f"items of {some.ndim} dimensions: at most {_MAX_DIMS + 1}")
            mine[0], mine[1], mine[2:2 + some.ndim - 1] = 1, np.issubdtype(some.dtype, np.floating), some.shape[1:]
        total = np.array(mx.distributed.all_sum(mx.array(mine), group=self.group))
        have = max(total[0], 1)
        if some is not None and not np.array_equal(total[2:] / have, mine[2:]):
            raise ValueError("the ranks' items differ in shape")
        dims = tuple(int(d) for d in total[2:] / have if d > 0)
        return dims, bool(total[1] / have > 0.5)

    def assemble_dict(self, lengths: Sequence[int], parts: dict[int, dict], keys: Sequence[str]) -> dict:
        """:meth:`assemble` for items that are dicts of arrays, one result per key."""
        return {k: self.assemble(lengths, {i: p[k] for i, p in parts.items()}) for k in keys}

    # -- one optimizer step -------------------------------------------------------------

    def shard(self, batch: Sequence[mx.array]) -> tuple:
        """This rank's contiguous part of every array of a global batch (its first axis)."""
        if self.group is None:
            return tuple(batch)
        rows = batch[0].shape[0]
        if rows % self.size:
            raise ConfigError(f"a batch of {rows} rows does not split over {self.size} ranks: "
                              f"choose a batch that is a multiple of {self.size}")
        n = rows // self.size
        return tuple(a[self.rank * n:(self.rank + 1) * n] for a in batch)

    def reduce(self, grads, outputs: Sequence[mx.array], weight: mx.array):
        """The global batch's mean gradient and loss outputs from this rank's, weighed by
        ``weight`` (this rank's rows or masked tokens), in one ``all_sum``."""
        if self.group is None:
            return grads, tuple(outputs)
        flat = tree_flatten(grads)
        w = weight.astype(mx.float32).reshape(1)
        pieces = [g.astype(mx.float32).reshape(-1) * w for _, g in flat]
        pieces += [o.astype(mx.float32).reshape(1) * w for o in outputs] + [w]
        total = mx.distributed.all_sum(mx.concatenate(pieces), group=self.group)
        denom = mx.maximum(total[-1], 1e-12)
        out, start = [], 0
        for name, g in flat:
            out.append((name, (total[start:start + g.size] / denom).reshape(g.shape).astype(g.dtype)))
            start += g.size
        values = tuple((total[start + j] / denom).astype(o.dtype) for j, o in enumerate(outputs))
        return tree_unflatten(out), values


def rows_weight(*batch) -> mx.array:
    """The weight of a loss that is a mean over rows: the rows."""
    return mx.array(float(batch[0].shape[0]))


def mask_weight(index: int) -> Callable[..., mx.array]:
    """The weight of a loss that is a mean over the tokens ``batch[index]`` masks in."""
    return lambda *batch: batch[index].astype(mx.float32).sum()
