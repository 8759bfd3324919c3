"""incr_stack: a step rewrites only the slots whose expert changed, in place, in slot memory."""

from __future__ import annotations

import numpy as np
import pytest

from edge0.exec.rows import ExpertRows
from edge0.io_sched.scheduler import PrefetchScheduler
from edge0.io_sched.slots import LayerPlan, StepPlan
from edge0.io_sched.reader import ExpertReader, SlotStore
from edge0.model.open import open_checkpoint

pytestmark = pytest.mark.asyncio


def file_bytes(loc, expert):
    start, end = loc.expert_range(expert)
    with open(loc.file, "rb") as f:
        f.seek(start)
        return f.read(end - start)


async def test_changed_experts_only_are_written(tiny_model_factory):
    d = tiny_model_factory("qwen3_moe")
    _, index, _ = open_checkpoint(d)
    layers = list(index.spec.moe_layers[:2])
    per_expert = index.layers[layers[0]].expert_bytes
    with ExpertReader(index, threads=2) as reader:
        rows = {l: ExpertRows(index.layers[l], 8) for l in layers}
        addresses = {l: [b.host.ctypes.data for b in r.buffers] for l, r in rows.items()}
        store = SlotStore(reader, {l: r.buffers for l, r in rows.items()})
        sets = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 5, 6], [7, 2, 5, 9]]  # m = 4, 2, 0, 2
        async with PrefetchScheduler(store, {l: 8 for l in layers}, readers=2) as sched:
            previous, prev_maps = None, {}
            for step, experts in enumerate(sets):
                before_bytes, before_reads = reader.stats.bytes, reader.stats.reads
                sched.submit(StepPlan(step, tuple(LayerPlan(l, tuple(experts)) for l in layers)))
                maps = [await sched.ready(step, l) for l in layers]
                m = len(set(experts) - set(previous or []))
                assert reader.stats.bytes - before_bytes == m * per_expert * len(layers)
                ranges = reader.stats.reads - before_reads  # nine an expert; adjacent experts into adjacent
                assert ranges % 9 == 0 and 9 * len(layers) * (m > 0) <= ranges <= m * 9 * len(layers)  # slots: one
                for sm in maps:
                    assert sm.misses == m and sm.hits == len(experts) - m
                    if previous is not None:  # kept experts stay in their slots
                        for e in set(experts) & set(previous):
                            assert sm.slot_of[e] == prev_maps[sm.layer].slot_of[e]
                    # every slot holds exactly its expert's bytes, seen through the MLX array
                    for e, slot in sm.slot_of.items():
                        for loc, buf in zip(index.layers[sm.layer].tensors, rows[sm.layer].buffers):
                            assert np.array(buf.device[slot]).tobytes() == file_bytes(loc, e)
                sched.release(step)
                previous, prev_maps = experts, {sm.layer: sm for sm in maps}
    # slot memory was written in place: the buffers never moved
    assert {l: [b.host.ctypes.data for b in r.buffers] for l, r in rows.items()} == addresses
