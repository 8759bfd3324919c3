"""The reader's fast path (the extension's ``read_rows``: an expert's ranges in one call, the
interpreter's lock released) puts the bytes the Python path puts, buffered and direct, in place
and bounced, in runs of adjacent experts; what it does not read whole (a truncated file, a row
outside its buffer) goes to the Python path, which raises the typed error."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest

from edge0 import Engine
from edge0.backend import io as bio
from edge0.errors import ExpertReadError
from edge0.exec.rows import row_phase
from edge0.io_sched import direct as dio
from edge0.io_sched import reader as reader_mod
from edge0.io_sched.reader import ExpertReader
from tests.test_direct_io import _with_header_padded

pytestmark = pytest.mark.skipif(bio.read_rows() is None, reason="the extension is not built")


@pytest.fixture(scope="module")
def checkpoint(tiny_model_factory, tmp_path_factory):
    # tensors at multiples of 8 bytes: the rows of whole pages can land in place
    d = _with_header_padded(tiny_model_factory("qwen3_moe", hidden=256), tmp_path_factory.mktemp("native"))
    with Engine(d) as e:
        index = e.streaming.index
    return d, index


class Spy:
    """Wraps ``read_rows``: how often it ran and what it left to the Python path."""

    def __init__(self, real):
        self.real, self.calls, self.left = real, 0, 0

    def __call__(self, spec, experts, rows):
        self.calls += 1
        out = self.real(spec, experts, rows)
        self.left += len(out[2])
        return out


def _buffers(index, layer, rows, phased):
    return [bio.RowBuffer(rows, t.row_bytes, phase=row_phase(t) if phased else None)
            for t in index.layers[layer].tensors]


def _expected(index, layer, expert):
    out = []
    for t in index.layers[layer].tensors:
        with open(t.file, "rb") as f:
            f.seek(t.offset + expert * t.row_bytes)
            out.append(f.read(t.row_bytes))
    return out


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("phased", [False, True])
def test_the_fast_path_puts_the_bytes_of_the_file_into_the_rows(checkpoint, direct, phased, monkeypatch):
    d, index = checkpoint
    if direct and dio.open_direct(index.files[0]) is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    rng = random.Random(0)
    n_exp = index.spec.num_experts
    spy = Spy(bio.read_rows())
    monkeypatch.setattr(reader_mod, "_native_read_rows", lambda: spy)
    with ExpertReader(index, threads=2, direct=direct) as reader:
        for layer in index.layers:
            bufs = _buffers(index, layer, 6, phased)
            runs = [0, 1, 2] if rng.random() < 0.5 else []  # adjacent experts into adjacent rows: one range
            experts = runs + rng.sample(range(3, n_exp), 3)
            rows = list(range(len(experts)))
            rows[len(runs):] = rng.sample(range(len(runs), 6), 3)
            for parallel in (False, True):
                for buf in bufs:
                    buf.host[:] = 0
                assert reader.read_experts(layer, experts, rows, bufs, parallel=parallel) == \
                    len(experts) * sum(t.row_bytes for t in index.layers[layer].tensors)
                for e, r in zip(experts, rows):
                    assert [buf.host[r].tobytes() for buf in bufs] == _expected(index, layer, e), (layer, e, r)
        assert spy.calls > 0 and spy.left == 0
        if direct:  # whole pages land in place exactly where the rows have the file's phase
            assert (reader.stats.in_place_reads > 0) == phased


def test_a_truncated_file_is_the_python_paths_typed_error(checkpoint, tmp_path, monkeypatch):
    d, _ = checkpoint
    copy = tmp_path / "cut"
    shutil.copytree(d, copy)
    with Engine(copy) as e:
        index = e.streaming.index
    layer, last = max(((layer, t) for layer, le in index.layers.items() for t in le.tensors),
                      key=lambda lt: lt[1].offset)  # the file's last tensor
    spy = Spy(bio.read_rows())
    monkeypatch.setattr(reader_mod, "_native_read_rows", lambda: spy)
    with ExpertReader(index, threads=1) as reader:
        with open(last.file, "r+b") as f:
            f.truncate(last.offset + last.row_bytes * (index.spec.num_experts - 1) + 10)
        bufs = _buffers(index, layer, 2, False)
        reader.read_experts(layer, [0], [0], bufs)  # whole: read by the fast path
        assert spy.left == 0
        with pytest.raises(ExpertReadError, match="short read") as err:
            reader.read_experts(layer, [index.spec.num_experts - 1], [1], bufs)
        assert spy.left == 1 and err.value.layer == layer


def test_a_row_outside_the_buffers_is_never_written(checkpoint):
    _, index = checkpoint
    layer = min(index.layers)
    with ExpertReader(index, threads=1) as reader:
        bufs = _buffers(index, layer, 2, False)
        guard = [np.array(buf.host) for buf in bufs]
        spec = [(reader._fds[t.file], 0, t.offset, t.row_bytes, buf.address, buf.host.strides[0], buf.host.shape[0])
                for t, buf in zip(index.layers[layer].tensors, bufs)]
        total, _, left = bio.read_rows()(spec, [4, 7, 6], [1, 2, -1])
        assert left == [1, 2] and total == sum(t.row_bytes for t in index.layers[layer].tensors)
        assert [buf.host[0].tobytes() for buf in bufs] == [g[0].tobytes() for g in guard]
        with pytest.raises(ExpertReadError, match=r"rows \[2\] are outside the buffers' \[0, 2\)"):
            reader.read_experts(layer, [5], [2], bufs)


@pytest.mark.parametrize("native", [True, False])
def test_rows_narrower_than_the_tensors_are_refused_typed(checkpoint, native):
    _, index = checkpoint
    layer = min(index.layers)
    tensors = index.layers[layer].tensors
    with ExpertReader(index, threads=1, native=native) as reader:
        bufs = [bio.RowBuffer(2, t.row_bytes - 8 * (i == 1)) for i, t in enumerate(tensors)]
        with pytest.raises(ExpertReadError, match=f"fewer than the {tensors[1].row_bytes} bytes") as err:
            reader.read_experts(layer, [1], [0], bufs)
        assert err.value.tensor == tensors[1].key and reader.stats.reads == 0


@pytest.mark.parametrize("how", ["not built", "native=False"])
def test_without_the_extension_the_python_path_reads(checkpoint, monkeypatch, how):
    _, index = checkpoint
    spy = Spy(bio.read_rows())
    monkeypatch.setattr(reader_mod, "_native_read_rows", lambda: None if how == "not built" else spy)
    layer = min(index.layers)
    with ExpertReader(index, threads=1, native=how != "native=False") as reader:
        bufs = _buffers(index, layer, 1, False)
        reader.read_experts(layer, [3], [0], bufs)
        assert [buf.host[0].tobytes() for buf in bufs] == _expected(index, layer, 3)
        assert reader.stats.reads == len(index.layers[layer].tensors) and spy.calls == 0  # one pread a range
