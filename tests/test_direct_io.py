"""Direct reads (``direct_io``): O_DIRECT through aligned bounce buffers gives the bytes and
the tokens buffered reads give, on every path, through injected faults; ``auto`` turns on
when the checkpoint is larger than the memory the process may use; a filesystem that
refuses O_DIRECT is read buffered, with one log line."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from edge0 import Engine, EngineConfig
from edge0.errors import ConfigError
from edge0.io_sched import direct as dio
from edge0.io_sched.reader import ExpertReader
from tests.test_async_misuse import CONFIGS, N, PROMPT, setups  # noqa: F401
from tests.test_read_faults import Faults


def _direct_or_skip(model_dir) -> None:
    fd = dio.open_direct(str(next(model_dir.glob("model*.safetensors"))))
    if fd is None:
        pytest.skip("this filesystem refuses O_DIRECT (the fallback is tested below)")
    os.close(fd)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_direct_reads_give_the_same_tokens_on_every_path(setups, config):
    d, cfg, oracle, expected = setups[config]
    _direct_or_skip(d)
    with Engine(d, EngineConfig(**{**cfg.__dict__, "direct_io": "on"}), oracle=oracle) as engine:
        assert engine.reader.direct
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
        assert engine.reader.stats.bytes > 0


@pytest.mark.parametrize("config", ["exact", "staged+heads"])
@pytest.mark.parametrize("kind", ["eio", "eintr", "short"])
def test_transient_faults_under_direct_reads_are_retried(setups, config, kind):
    d, cfg, oracle, expected = setups[config]
    _direct_or_skip(d)
    with Engine(d, EngineConfig(**{**cfg.__dict__, "direct_io": "on"}), oracle=oracle) as engine:
        faults = Faults(kind)
        engine.reader.pread = faults
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
        assert faults.injected > 0 and engine.reader.direct  # still direct: no fallback on these


def test_direct_bytes_equal_buffered_bytes_at_any_offset(tiny_model_factory, monkeypatch):
    d = tiny_model_factory("qwen3_moe")
    _direct_or_skip(d)
    monkeypatch.setattr(dio, "CHUNK", 3 * dio.ALIGN)  # reads longer than a chunk take several
    with Engine(d) as e:
        index = e.streaming.index
    path = index.files[0]
    data = open(path, "rb").read()
    rng = random.Random(0)
    with ExpertReader(index, threads=1, direct=True) as reader:
        fd = reader._direct[path]
        bounce = reader._bounce.get()
        for _ in range(200):
            offset = rng.randrange(len(data))
            length = rng.randrange(1, min(5 * dio.ALIGN, len(data) - offset) + 1)
            dest = bytearray(length)
            done = 0
            while done < length:
                n = dio.read_direct(os.preadv, fd, bounce, memoryview(dest)[done:], offset + done)
                assert n > 0
                done += n
            assert bytes(dest) == data[offset:offset + length]
        end = bytearray(16)  # past the end of the file: nothing, not an error
        assert dio.read_direct(os.preadv, fd, bounce, memoryview(end), len(data)) == 0


def test_auto_is_on_when_the_checkpoint_is_larger_than_the_memory_limit(tiny_model_factory, monkeypatch):
    d = tiny_model_factory("qwen3_moe")
    files = [str(p) for p in d.glob("model*.safetensors")]
    size = sum(os.path.getsize(f) for f in files)
    monkeypatch.setattr(dio, "memory_limit", lambda: size - 1)
    assert dio.wants_direct("auto", files) and not dio.wants_direct("off", files)
    monkeypatch.setattr(dio, "memory_limit", lambda: size)
    assert not dio.wants_direct("auto", files) and dio.wants_direct("on", files)
    with pytest.raises(ConfigError, match="direct_io must be auto, on or off, got 'yes'"):
        EngineConfig(direct_io="yes")


def test_the_cgroup_limit_is_the_smallest_on_the_path(tmp_path):
    root = tmp_path / "cg"
    (root / "a" / "b").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("memory\n")
    (root / "memory.max").write_text("max\n")
    (root / "a" / "memory.max").write_text(f"{8 * 2**30}\n")
    (root / "a" / "b" / "memory.max").write_text("max\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert dio.cgroup_limit(str(proc), root) == 8 * 2**30
    (root / "memory" / "x").mkdir(parents=True)  # v1: the memory controller's own hierarchy
    (root / "memory" / "x" / "memory.limit_in_bytes").write_text(f"{2**30}\n")
    proc.write_text("4:memory:/x\n1:cpu:/y\n")
    assert dio.cgroup_limit(str(proc), root) == 2**30
    proc.write_text("0::/\n")
    assert dio.cgroup_limit(str(proc), root) is None
    assert dio.cgroup_limit(str(tmp_path / "absent"), root) is None


def test_a_filesystem_that_refuses_o_direct_is_read_buffered(setups, monkeypatch, capsys):
    d, cfg, oracle, expected = setups["exact"]
    monkeypatch.setattr(dio, "open_direct", lambda path: None)  # as tmpfs answers
    with Engine(d, EngineConfig(direct_io="on", log_format="json")) as engine:
        assert not engine.reader.direct
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    refused = [e for e in events if e.get("event") == "io.direct_unavailable"]
    assert len(refused) == len(engine.streaming.index.files) and refused[0]["action"] == "buffered reads"


def test_reads_refused_after_the_open_go_buffered(setups, capsys):
    """A filesystem that takes the O_DIRECT open but fails its reads with EINVAL."""
    import errno

    d, cfg, oracle, expected = setups["exact"]
    _direct_or_skip(d)
    with Engine(d, EngineConfig(direct_io="on", log_format="json")) as engine:
        direct_fds = set(engine.reader._direct.values())

        def refuse(fd, buffers, offset):
            if fd in direct_fds:
                raise OSError(errno.EINVAL, "Invalid argument")
            return os.preadv(fd, buffers, offset)

        engine.reader.pread = refuse
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
        assert not engine.reader.direct
        for fd in direct_fds:  # given up, not closed: another reader thread may still hold it
            os.fstat(fd)
    assert '"io.direct_unavailable"' in capsys.readouterr().err
    for fd in direct_fds:  # closed with the engine
        with pytest.raises(OSError):
            os.fstat(fd)


def test_in_place_reads_refused_go_through_the_bounce_buffer_still_direct(setups):
    """A device that refuses the in-place layout (EINVAL on a read of several iovecs) keeps
    direct reads, through the bounce buffer."""
    import errno

    d, cfg, oracle, expected = setups["exact"]
    _direct_or_skip(d)
    with Engine(d, EngineConfig(direct_io="on")) as engine:
        direct_fds = set(engine.reader._direct.values())

        def refuse_in_place(fd, buffers, offset):
            if fd in direct_fds and len(buffers) > 1:
                raise OSError(errno.EINVAL, "Invalid argument")
            return os.preadv(fd, buffers, offset)

        engine.reader.pread = refuse_in_place
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
        assert engine.reader.direct and engine.reader._bounce_only


def test_bounce_buffers_are_page_aligned():
    view = dio.Bounce().get()
    assert len(view) == dio.CHUNK
    assert np.frombuffer(view, dtype=np.uint8).ctypes.data % dio.ALIGN == 0


def test_a_direct_read_lands_in_place_when_the_buffer_has_the_files_phase(tmp_path):
    """Rows laid out with the file offset's phase (``RowBuffer(phase=...)``) take a direct
    read straight into their memory: only the partial first and last pages go through the
    bounce buffer. Any other buffer is refused (None) and read through the bounce buffer."""
    from edge0.backend import io as bio

    path = tmp_path / "blob"
    data = np.random.default_rng(0).integers(0, 256, 64 * 4096 + 123, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    fd = dio.open_direct(str(path))
    if fd is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    bounce = dio.Bounce().get()
    seen = []

    def spy(fd_, iov, off):
        seen.append([np.frombuffer(v, dtype=np.uint8).ctypes.data for v in iov])
        return os.preadv(fd_, iov, off)

    try:
        for offset, row_bytes in [(232, 8192), (0, 4096 * 3), (4000, 4096 * 5), (4096 * 7 + 8, 4096 * 2)]:
            buf = bio.RowBuffer(3, row_bytes, phase=offset % dio.ALIGN)
            dest = memoryview(buf.host[1:3].reshape(-1))  # two adjacent rows: one run
            seen.clear()
            assert dio.read_in_place(spy, fd, bounce, dest, offset) == len(dest)
            assert bytes(dest) == data[offset:offset + len(dest)]
            middle = np.frombuffer(dest, dtype=np.uint8).ctypes.data + (-offset % dio.ALIGN)
            assert len(seen) == 1 and middle in seen[0]  # one read, its middle straight into the rows
            other = bio.RowBuffer(3, row_bytes, phase=(offset + 8) % dio.ALIGN)
            assert dio.read_in_place(spy, fd, bounce, memoryview(other.host[1:3].reshape(-1)), offset) is None
    finally:
        os.close(fd)


def _with_header_padded(model_dir, tmp_path):
    """A copy of ``model_dir`` whose safetensors header is padded with spaces (as the format
    allows) so the data section, and every tensor, starts at a multiple of 8 bytes."""
    import shutil

    out = tmp_path / "padded"
    shutil.copytree(model_dir, out)
    for path in out.glob("model*.safetensors"):
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = raw[8:8 + n].rstrip(b" ")
        header += b" " * (-(8 + len(header)) % 8)
        path.write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + n:])
    return out


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("prefill_path", ["exact", "whole_layer"])
def test_every_layer_reads_in_place_through_buffers_the_layers_share(tiny_model_factory, monkeypatch, tmp_path,
                                                                     prefill_path, native):
    """The exact path's bundle and the whole-layer buffers serve every layer of a layout,
    and each layer's tensors sit at another offset, modulo a page, in the file: the buffers
    are laid out again for each layer, so no read of a tensor whose rows allow it (whole
    pages, an 8-byte offset) goes through the bounce buffer, in any layer, on the Python path
    or the extension's (its rows' addresses have the file's phase); tokens as buffered. Red
    when a shared buffer keeps the first layer's layout."""
    from edge0.backend import io as bio
    from edge0.exec.rows import row_phase
    from edge0.io_sched import reader as reader_mod

    if native and bio.read_rows() is None:
        pytest.skip("the extension is not built")
    d = _with_header_padded(tiny_model_factory("qwen3_moe", hidden=256), tmp_path)  # weight rows: two pages
    _direct_or_skip(d)
    with Engine(d, EngineConfig(direct_io="off", prefill_path=prefill_path)) as e:
        expected = [ev.token for ev in e.stream(PROMPT, max_tokens=N)]
        index = e.streaming.index
        assert len(index.files) == 1  # offsets alone name a tensor
        placeable = [(t.offset, t.offset + t.row_bytes * index.spec.num_experts, t.key)
                     for le in index.layers.values() for t in le.tensors if row_phase(t) is not None]
    assert len({start % dio.ALIGN for start, _, _ in placeable}) > 1  # the layers' phases differ
    bounced, calls = [], []
    real = dio.read_direct

    def spy(pread, fd, bounce, dest, offset):
        bounced.extend(key for lo, hi, key in placeable if lo <= offset < hi)
        return real(pread, fd, bounce, dest, offset)

    def native_spy(spec, experts, rows):  # a placeable tensor's rows without the file's phase would bounce
        calls.append(len(experts))
        for fd, mode, offset, row_bytes, address, stride, _ in spec:
            bounced.extend(key for lo, hi, key in placeable for e, r in zip(experts, rows) if lo == offset and
                           (mode != 2 or (address + r * stride - offset - e * row_bytes) % dio.ALIGN))
        return bio.read_rows()(spec, experts, rows)

    monkeypatch.setattr(dio, "read_direct", spy)
    monkeypatch.setattr(reader_mod, "_native_read_rows", lambda: native_spy if native else None)
    with Engine(d, EngineConfig(direct_io="on", prefill_path=prefill_path)) as e:
        assert [ev.token for ev in e.stream(PROMPT, max_tokens=N)] == expected
        assert e.reader.direct and e.reader.stats.in_place_reads > 0
    assert bounced == [] and bool(calls) == native


def test_the_stats_line_says_how_experts_were_read(setups):
    d, cfg, oracle, _ = setups["exact"]
    lines = {}
    for mode in ("off", "on"):
        with Engine(d, EngineConfig(direct_io=mode, expert_source="slots")) as engine:
            lines[mode] = list(engine.stream(PROMPT, max_tokens=2))[-1].stats.line()
    assert lines["off"].endswith("| reads buffered")
    if dio.open_direct(str(next(d.glob("model*.safetensors")))) is not None:
        assert lines["on"].endswith("| reads direct")


def test_auto_is_off_where_the_platform_has_no_o_direct(tiny_model_factory, monkeypatch):
    files = [str(p) for p in tiny_model_factory("qwen3_moe").glob("model*.safetensors")]
    monkeypatch.setattr(dio, "memory_limit", lambda: 1)
    assert dio.wants_direct("auto", files)
    monkeypatch.setattr(dio, "O_DIRECT", 0)
    assert not dio.wants_direct("auto", files)



def _cached_pages(path) -> int:
    """Pages of ``path`` in the page cache (mincore over a mapping of it)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    try:
        if libc.mincore(addr, size, vec) != 0:
            pytest.skip(f"mincore refused: {os.strerror(ctypes.get_errno())}")
        return sum(b & 1 for b in vec)
    finally:
        libc.munmap(addr, size)


@pytest.mark.parametrize("config", ["staged+heads", "exact"])
def test_with_direct_reads_the_resident_weights_leave_no_pages_in_the_page_cache(setups, config):
    """The memory plan gives the expert cache what the process may use: the checkpoint's
    pages the resident weights' loading put in the page cache (a cgroup counts them) are
    dropped once they are loaded."""
    d, cfg, oracle, expected = setups[config]
    _direct_or_skip(d)
    files = sorted(d.glob("model*.safetensors"))
    for f in files:
        f.read_bytes()  # every page cached, as a fresh load finds them after a copy
    assert sum(_cached_pages(f) for f in files) > 0
    with Engine(d, EngineConfig(**{**cfg.__dict__, "direct_io": "on"}), oracle=oracle) as engine:
        assert engine.reader.direct
        assert sum(_cached_pages(f) for f in files) == 0
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
        assert sum(_cached_pages(f) for f in files) == 0  # and the expert reads bypass it
    with Engine(d, EngineConfig(**{**cfg.__dict__, "direct_io": "off"}), oracle=oracle) as engine:
        assert sum(_cached_pages(f) for f in files) > 0  # buffered reads keep what they read


def test_dropping_the_pages_is_best_effort_where_a_filesystem_refuses_it(setups, monkeypatch):
    """A read-only or special filesystem may refuse fdatasync or fadvise: the engine opens
    and generates all the same (its pages stay cached); the bench's eviction says so."""
    d, cfg, oracle, expected = setups["exact"]
    _direct_or_skip(d)

    def refuse(fd):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "fdatasync", refuse)
    with Engine(d, EngineConfig(direct_io="on")) as engine:
        assert [ev.token for ev in engine.stream(PROMPT, max_tokens=N)] == expected
    with pytest.raises(OSError, match="Read-only"):
        dio.drop_cached(sorted(d.glob("model*.safetensors")), strict=True)
