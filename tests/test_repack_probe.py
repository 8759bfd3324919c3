"""tools/repack_probe.py: the ranges it reads as stored are the engine's expert rows, the
repacked ones the same bytes per expert as one range each, inside the file."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import repack_probe as rp  # noqa: E402

from edge0.model.open import open_checkpoint  # noqa: E402


def test_stored_ranges_are_the_expert_rows_and_repacked_ones_one_range_per_expert(tiny_model_factory):
    spec, index, _ = open_checkpoint(tiny_model_factory("qwen3_moe"))
    layer = index.layers[spec.moe_layers[-1]]
    expert_bytes = sum(loc.row_bytes for loc in layer.tensors)
    experts = [5, 1, 2]  # 1 and 2 adjacent: one range per tensor for both
    stored = rp.stored_ranges(layer, experts)
    want = {(loc.file, loc.offset + e * loc.row_bytes, loc.row_bytes * n)
            for e, n in ((1, 2), (5, 1)) for loc in layer.tensors}
    assert sorted(stored) == sorted(want) and len(stored) == 2 * len(layer.tensors)
    packed = rp.repacked_ranges(layer, experts, expert_bytes, spec.num_experts)
    assert [n for _, _, n in packed] == [2 * expert_bytes, expert_bytes]
    assert sum(n for _, _, n in stored) == sum(n for _, _, n in packed) == 3 * expert_bytes
    assert all(0 <= off and off + n <= os.path.getsize(f) for f, off, n in packed)


@pytest.mark.parametrize("refused", [False, True])
def test_the_probe_reads_both_layouts_and_reports_them(tiny_model_factory, tmp_path, monkeypatch, refused):
    model = tiny_model_factory("qwen3_moe")
    if refused:  # a filesystem that refuses O_DIRECT: buffered reads, said so
        real_open = os.open

        def refusing(path, flags, *args):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "O_DIRECT refused")
            return real_open(path, flags, *args)

        monkeypatch.setattr(rp.os, "open", refusing)
    out = tmp_path / "probe.json"
    monkeypatch.setattr(sys, "argv", ["repack_probe", "--model", str(model), "--draws", "6", "--k", "2",
                                      "--json", str(out)])
    rp.main()
    got = json.loads(out.read_text())
    spec, index, _ = open_checkpoint(model)
    tensors = len(index.layers[spec.moe_layers[0]].tensors)
    assert got["stored"]["draws"] == got["repacked"]["draws"] == 6
    if refused:
        assert got["direct"] is False
    assert got["repacked"]["reads_per_draw"] <= 2 < got["stored"]["reads_per_draw"] <= 2 * tensors
    assert got["repacked_vs_stored_median"] > 0
