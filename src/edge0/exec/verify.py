"""A verify pass of speculative decoding on the staged path, over slots.

A verify pass (``edge0.decoding.Decoder.verify``) forwards a sequence's step token and its
drafted ones together; with prerouter heads each drafted position is routed inside the
pass (``edge0.exec.plan.DraftedRouting``), so no plan can read its experts ahead. The
Stager (``edge0.exec.staged``) runs such a pass as a step of its own (``begin_verify``),
and each staged layer, when it runs, stages the distinct experts its positions route to in
its slots (``_union``: one host read of its routing; what its slots hold is not read again;
its slots grow where a batch's would). Where they do not fit, the experts its slots hold and
as many more as fit are staged and the rest are read by the exact path, each pair computed
from where its expert is. The step before a verify pass plans nothing ahead for it, so
nothing it would read is thrown away.
"""

from __future__ import annotations

import numpy as np

from edge0.backend import core as B
from edge0.exec.plan import SlotRoute
from edge0.io_sched.slots import LayerPlan, StepPlan


class VerifyStaging:
    """The ``Stager``'s verify passes (its base class): it reads the Stager's slots
    (``pool``), scheduler, step state (``now``) and fallback path."""

    def begin_verify(self) -> None:
        """Before a verify pass (one sequence, its drafted positions routed inside the pass):
        the step before closed and unpinned, or a plan made ahead for this one cancelled;
        each staged layer then stages its positions' union when it runs (``_union``)."""
        self._settle()
        planned, self.now.planned_for = self.now.planned_for, None
        if planned is not None:
            self._replan()
        self._stage(self._next_step() if planned is None else None, [])
        self.now.verifying = True

    def _union(self, layer: int, x, inds):
        """A verify pass's staged layer: the distinct experts of ``inds`` (one host read)
        staged in its slots (grown where they may; what they miss read now). Where they do
        not fit, those the slots hold and as many more as fit are staged, the rest read by
        the fallback (exact) path; each pair is computed from where its expert is."""
        experts = np.unique(B.to_host(inds)).tolist()
        self.pool.fits(layer, len(experts))
        room = self.pool.rows[layer].capacity
        staged = experts
        if len(experts) > room:
            table = self.scheduler.tables[layer]
            held = self.portal.call(lambda: [e for e in experts if table.lookup(e) is not None])[:room]
            staged = sorted(held + [e for e in experts if e not in held][:room - len(held)])
            self.over_slot_layers += 1
        step = self.now.step
        self.pool.ticket(step)
        claimed = self.portal.call(self.scheduler.stage, None, [StepPlan(step, (LayerPlan(layer, tuple(staged)),))])
        self.now.submitted.add(step)
        for (s, l), slot_of in claimed.items():
            self.now.maps.setdefault(s, {})[l] = slot_of
        self._tables()
        route = SlotRoute(self.now.tables[layer], *self.pool.flag(layer, step))
        raw = B.take(route.lookup, inds)
        out = self._run(layer, route, x, raw)
        rest = [e for e in experts if e not in set(staged)]
        if not rest:
            return out
        in_slots = raw >= 0  # the others' pairs: the exact path, which reads only theirs
        exact = self.fallback(layer, x, B.where(in_slots, B.array(rest[0], dtype=inds.dtype), inds))
        return B.where(in_slots[..., None], out, exact)
