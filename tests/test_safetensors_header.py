"""Tests for edge0.model.safetensors_header: valid files, every malformed case, no data read, fuzz."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save, save_file

import edge0.model.safetensors_header as sh
from edge0.errors import CheckpointError, HeaderError
from edge0.model.safetensors_header import (
    DTYPE_SIZES, MAX_HEADER_BYTES, SafetensorsHeader, TensorEntry, parse_header_bytes,
    read_header,
)

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def st_bytes(header: dict | str | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    """Build a safetensors file by hand: prefix, header, data."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode()
    n = len(header) if length is None else length
    return struct.pack("<Q", n) + header + data


def write(tmp_path, blob: bytes, name: str = "model.safetensors") -> str:
    p = tmp_path / name
    p.write_bytes(blob)
    return str(p)


def t(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# ---------------------------------------------------------------- valid files


def test_file_written_by_safetensors_library(tmp_path):
    arrays = {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "ids": np.arange(5, dtype=np.uint32),
        "half": np.ones((7,), dtype=np.float16),
        "scalar": np.array(3, dtype=np.int64),
    }
    path = str(tmp_path / "lib.safetensors")
    save_file(arrays, path, metadata={"format": "np", "note": "hi"})
    h = read_header(path)

    assert isinstance(h, SafetensorsHeader)
    assert h.path == path
    assert h.metadata == {"format": "np", "note": "hi"}
    assert set(h.tensors) == set(arrays)
    with open(path, "rb") as f:
        blob = f.read()
    assert h.file_size == len(blob)
    assert h.data_start == 8 + struct.unpack("<Q", blob[:8])[0]
    dtypes = {"w": "F32", "ids": "U32", "half": "F16", "scalar": "I64"}
    for name, arr in arrays.items():
        e = h.tensors[name]
        assert e.name == name and e.dtype == dtypes[name]
        assert e.shape == arr.shape and e.nbytes == arr.nbytes
        raw = blob[e.file_offset(h.data_start):e.file_offset(h.data_start) + e.nbytes]
        assert np.array_equal(np.frombuffer(raw, dtype=arr.dtype).reshape(arr.shape), arr)
    assert parse_header_bytes(blob, path=path) == h


def test_hand_written_bf16_and_header_order(tmp_path):
    header = {"b": t("BF16", [2, 2], 0, 8), "__metadata__": {"k": "v"}, "a": t("U8", [3], 8, 11)}
    path = write(tmp_path, st_bytes(header, bytes(11)))
    h = read_header(path)
    assert list(h.tensors) == ["b", "a"]  # header order, not sorted
    assert h.tensors["b"] == TensorEntry("b", "BF16", (2, 2), 0, 8)
    assert h.tensors["a"].file_offset(h.data_start) == h.data_start + 8
    assert h.metadata == {"k": "v"}


def test_header_padded_with_spaces_is_valid(tmp_path):
    text = json.dumps({"a": t("F32", [1], 0, 4)}) + "    "
    h = read_header(write(tmp_path, st_bytes(text, bytes(4))))
    assert h.data_start == 8 + len(text)


def test_metadata_only_header_with_empty_data_is_valid(tmp_path):
    assert read_header(write(tmp_path, st_bytes({"__metadata__": None}))).metadata == {}  # as MLX writes it
    h = read_header(write(tmp_path, st_bytes({"__metadata__": {"a": "b"}})))
    assert h.tensors == {} and h.metadata == {"a": "b"}


def test_zero_size_tensors_may_share_offsets(tmp_path):
    header = {
        "e0": t("F32", [0], 0, 0), "e1": t("F16", [0, 5], 0, 0),  # two empties at 0
        "a": t("F32", [2], 0, 8),                                  # non-empty at 0 too
        "e2": t("I8", [3, 0], 8, 8),                               # empty between tensors
        "b": t("U8", [4], 8, 12),
        "e3": t("BOOL", [0], 12, 12),                              # empty at the very end
    }
    h = read_header(write(tmp_path, st_bytes(header, bytes(12))))
    assert [h.tensors[n].nbytes for n in header] == [0, 0, 8, 0, 4, 0]


def test_all_dtypes_accepted(tmp_path):
    header, off = {}, 0
    for dtype, size in DTYPE_SIZES.items():
        header[dtype.lower()] = t(dtype, [3], off, off + 3 * size)
        off += 3 * size
    h = read_header(write(tmp_path, st_bytes(header, bytes(off))))
    assert {e.dtype for e in h.tensors.values()} == set(DTYPE_SIZES)


# ------------------------------------------------------------- malformed files

F4 = t("F32", [1], 0, 4)

# (id, file bytes, regex on the reason, tensor named or None)
MALFORMED = [
    ("empty", b"", r"file is empty", None),
    ("under_8_bytes", b"\x05\x00\x00", r"file is 3 bytes, shorter than the 8-byte", None),
    ("header_len_0", struct.pack("<Q", 0) + b"{}", r"header length is 0", None),
    ("header_len_past_eof", st_bytes('{"a": 1}', length=100), r"header length 100 runs past end of file \(only 8 bytes", None),
    ("header_over_max", st_bytes("{}", length=MAX_HEADER_BYTES + 1), rf"header length {MAX_HEADER_BYTES + 1} exceeds the limit of {MAX_HEADER_BYTES}", None),
    ("not_utf8", st_bytes(b'{"a\xff\xfe": 1}'), r"header is not valid UTF-8", None),
    ("not_json", st_bytes('{"a": '), r"header is not valid JSON", None),
    ("json_nan_garbage", st_bytes("{'a': 1}"), r"header is not valid JSON", None),
    ("deep_nesting", st_bytes('{"a":' + "[" * 100_000 + "]" * 100_000 + "}"), r"header is not valid JSON \(RecursionError", None),
    ("huge_int_literal", st_bytes('{"a": {"dtype": "U8", "shape": [' + "9" * 5000 + "]}}"), r"integer literal of 5000 digits is out of range", None),
    ("json_array", st_bytes("[1, 2]"), r"header JSON must be an object, found array", None),
    ("json_string", st_bytes('"x"'), r"header JSON must be an object, found string", None),
    ("duplicate_tensor", st_bytes('{"a": %s, "a": %s}' % (json.dumps(F4), json.dumps(F4)), bytes(4)), r"duplicate key 'a' in header JSON", "a"),
    ("duplicate_metadata_key", st_bytes('{"__metadata__": {"k": "1", "k": "2"}}'), r"duplicate key 'k' in __metadata__", None),
    ("duplicate_field", st_bytes('{"a": {"dtype": "F32", "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', bytes(4)), r"duplicate field 'dtype' in entry", "a"),
    ("metadata_not_object", st_bytes({"__metadata__": ["k", "v"]}), r"__metadata__ must be an object of string -> string, found array", None),
    ("metadata_int_value", st_bytes({"__metadata__": {"k": 1}}), r"__metadata__ value for key 'k' must be a string, found integer 1", None),
    ("metadata_null_value", st_bytes({"__metadata__": {"k": None}}), r"value for key 'k' must be a string, found null", None),
    ("entry_not_object", st_bytes({"a": [0, 4]}, bytes(4)), r"entry must be an object with dtype, shape, data_offsets, found array", "a"),
    ("missing_field", st_bytes({"a": {"dtype": "F32", "shape": [1]}}, bytes(4)), r"entry is missing field\(s\) data_offsets", "a"),
    ("extra_field", st_bytes({"a": {**F4, "offset": 0}}, bytes(4)), r"entry has unexpected field\(s\) \['offset'\]", "a"),
    ("unknown_dtype", st_bytes({"a": t("Q4", [1], 0, 4)}, bytes(4)), r"unknown dtype string 'Q4'; expected one of BOOL, U8", "a"),
    ("dtype_not_string", st_bytes({"a": {**F4, "dtype": 4}}, bytes(4)), r"unknown dtype integer 4", "a"),
    ("shape_not_list", st_bytes({"a": t("F32", 1, 0, 4)}, bytes(4)), r"shape must be a list of non-negative integers, found integer 1", "a"),
    ("shape_negative", st_bytes({"a": t("F32", [-1], 0, 4)}, bytes(4)), r"shape must be a list of non-negative integers, found array \[-1\]", "a"),
    ("shape_bool", st_bytes({"a": t("F32", [True], 0, 4)}, bytes(4)), r"shape must be a list of non-negative integers, found array \[True\]", "a"),
    ("shape_float", st_bytes({"a": t("F32", [1.0], 0, 4)}, bytes(4)), r"shape must be a list of non-negative integers", "a"),
    ("offsets_one_int", st_bytes({"a": {**F4, "data_offsets": [4]}}, bytes(4)), r"data_offsets must be two non-negative integers, found array \[4\]", "a"),
    ("offsets_negative", st_bytes({"a": t("F32", [1], -4, 0)}, bytes(4)), r"data_offsets must be two non-negative integers", "a"),
    ("offsets_bool", st_bytes({"a": t("BOOL", [1], False, True)}, bytes(1)), r"data_offsets must be two non-negative integers", "a"),
    ("offsets_reversed", st_bytes({"a": t("F32", [1], 4, 0)}, bytes(4)), r"data_offsets begin 4 is after end 0", "a"),
    ("shape_overflow_2_63", st_bytes({"a": t("F32", [2**31, 2**31], 0, 4)}, bytes(4)), r"shape overflow: .* needs more than 2\*\*63 - 1 bytes", "a"),
    ("shape_overflow_many_dims", st_bytes({"a": t("U8", [2**16] * 10_000, 0, 4)}, bytes(4)), r"shape overflow", "a"),
    ("shape_overflow_data_section", st_bytes({"a": t("F32", [1000, 1000], 0, 4)}, bytes(4)), r"shape overflow: \[1000, 1000\] x F32 needs 4000000 bytes, more than the whole data section \(4 bytes\)", "a"),
    ("byte_size_mismatch", st_bytes({"a": t("F32", [2], 0, 4)}, bytes(8)), r"byte size mismatch: shape \[2\] x F32 needs 8 bytes, data_offsets \[0, 4\] hold 4", "a"),
    ("offsets_not_at_0", st_bytes({"a": t("F32", [1], 4, 8)}, bytes(8)), r"offsets do not start at 0: first tensor begins at 4", "a"),
    ("gap", st_bytes({"a": t("F32", [1], 0, 4), "b": t("F32", [1], 8, 12)}, bytes(12)), r"gap of 4 bytes: begins at 8, but 'a' ends at 4", "b"),
    ("overlap", st_bytes({"a": t("F32", [2], 0, 8), "b": t("F32", [2], 4, 12)}, bytes(12)), r"overlaps tensor 'a': begins at 4, but 'a' ends at 8", "b"),
    ("empty_inside_other", st_bytes({"a": t("F32", [2], 0, 8), "z": t("F32", [0], 4, 4)}, bytes(8)), r"overlaps tensor 'a'", "z"),
    ("shared_offsets", st_bytes({"a": t("F32", [1], 0, 4), "b": t("I32", [1], 0, 4)}, bytes(4)), r"shares data_offsets \[0, 4\] with tensor 'a'", "b"),
    ("missing_bytes", st_bytes({"a": t("F32", [1], 0, 4), "b": t("F32", [2], 4, 12)}, bytes(10)), r"missing bytes: data_offsets end at 12, but the data section holds only 10 bytes", "b"),
    ("trailing_bytes", st_bytes({"a": t("F32", [1], 0, 4)}, bytes(7)), r"trailing bytes: tensors end at 4, but the data section holds 7 bytes \(3 unaccounted\)", None),
    ("metadata_only_with_data", st_bytes({"__metadata__": {}}, bytes(1)), r"trailing bytes: tensors end at 0", None),
]


@pytest.mark.parametrize("blob,reason,tensor", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_file_raises_header_error(tmp_path, blob, reason, tensor):
    path = write(tmp_path, blob)
    with pytest.raises(HeaderError, match=reason) as info:
        read_header(path)
    err = info.value
    assert err.file == path and err.tensor == tensor
    assert str(err).startswith(f"file {path}")  # the message itself names the file
    if tensor is not None:
        assert repr(tensor) in str(err)
    # The in-memory parser agrees with the file reader, reason for reason.
    with pytest.raises(HeaderError) as again:
        parse_header_bytes(blob, path=path)
    assert (again.value.reason, again.value.tensor) == (err.reason, err.tensor)


def test_header_error_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError):
        read_header(write(tmp_path, b""))


def test_missing_file_is_a_header_error(tmp_path):
    path = str(tmp_path / "nope.safetensors")
    with pytest.raises(HeaderError, match="cannot read file") as info:
        read_header(path)
    assert info.value.file == path


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_non_regular_file_is_refused_without_blocking(tmp_path, kind):
    path = tmp_path / "model.safetensors"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()  # opening a FIFO would block
    with pytest.raises(HeaderError, match="not a regular file") as info:
        read_header(path)
    assert info.value.file == str(path)


def test_buffer_shorter_than_declared_header():
    blob = st_bytes({"a": F4}, bytes(4))
    with pytest.raises(HeaderError, match=r"buffer holds 10 of the"):
        parse_header_bytes(blob[:18], file_size=len(blob))


# -------------------------------------------------------------- no data read


class _CountingFile:
    def __init__(self, f, log):
        self._f, self._log = f, log

    def read(self, n=-1):
        assert n is not None and n >= 0, "must not read to end of file"
        data = self._f.read(n)
        self._log.append(len(data))
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __getattr__(self, name):  # readinto, mmap via fileno, seek...: none are expected
        raise AssertionError(f"unexpected file method {name}")


def test_reads_only_prefix_and_header(tmp_path, monkeypatch):
    gib = 1 << 30
    header = json.dumps({"big": t("F32", [gib // 4], 0, gib), "__metadata__": {"x": "y"}})
    path = tmp_path / "sparse.safetensors"
    with open(path, "wb") as f:
        f.write(st_bytes(header))
        f.truncate(8 + len(header) + gib)  # sparse: a 1 GiB data section costs nothing

    log: list[int] = []
    real_open = open
    monkeypatch.setattr(sh, "open", lambda p, mode="r": _CountingFile(real_open(p, mode), log),
                        raising=False)
    h = read_header(path)
    assert h.tensors["big"].nbytes == gib and h.file_size == 8 + len(header) + gib
    assert log and sum(log) <= 8 + len(header)


# ------------------------------------------------------------------------ fuzz

VALID = save({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "ids": np.arange(3, dtype=np.uint32),
              "h": np.ones(2, dtype=np.float16), "e": np.zeros((0, 2), dtype=np.int8)},
             metadata={"format": "np"})
VALID_N = struct.unpack("<Q", VALID[:8])[0]


def check_parse(blob: bytes, file_size: int | None = None) -> None:
    """Only HeaderError, or a header whose tensors really tile the data section."""
    try:
        h = parse_header_bytes(blob, path="fuzz", file_size=file_size)
    except HeaderError as e:
        assert e.file == "fuzz" and e.reason
        return
    cursor = 0
    for e in sorted(h.tensors.values(), key=lambda e: (e.begin, e.end)):
        assert e.begin == cursor
        assert e.nbytes == int(np.prod(e.shape, dtype=object)) * DTYPE_SIZES[e.dtype]
        cursor = e.end
    assert cursor == h.file_size - h.data_start
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in h.metadata.items())


# Half the written bytes are JSON punctuation or digits, so mutations reach past the parser.
mutation = st.tuples(st.sampled_from(["flip", "truncate", "insert", "delete", "set"]),
                     st.integers(0, 10_000),
                     st.sampled_from(b'0123456789[]{},:" -.e') | st.integers(0, 255))


def mutate(blob: bytes, ops) -> bytes:
    b = bytearray(blob)
    for kind, pos, val in ops:
        i = pos % (len(b) + 1)
        if kind == "flip" and i < len(b):
            b[i] ^= 1 << (val % 8)
        elif kind == "truncate":
            del b[i:]
        elif kind == "insert":
            b[i:i] = bytes([val])
        elif kind == "delete" and i < len(b):
            del b[i]
        elif kind == "set" and i < len(b):
            b[i] = val
    return bytes(b)


@FUZZ
@given(st.binary(max_size=200), st.one_of(st.none(), st.integers(0, 2**64)))
def test_fuzz_random_bytes(blob, file_size):
    check_parse(blob, file_size if file_size is None or file_size >= len(blob) else None)


@FUZZ
@given(st.lists(mutation, min_size=1, max_size=6))
def test_fuzz_mutated_valid_file(ops):
    check_parse(mutate(VALID, ops))


@FUZZ
@given(st.lists(mutation, min_size=1, max_size=6))
def test_fuzz_mutated_header_with_fixed_length(ops):
    # Re-prefixing the mutated JSON keeps the length check passing, so the JSON and
    # offset validation get exercised rather than the first 8 bytes.
    header = mutate(VALID[8:8 + VALID_N], ops)
    check_parse(struct.pack("<Q", len(header)) + header + VALID[8 + VALID_N:])


json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-5, 40), st.floats(allow_nan=False),
                        st.sampled_from([*DTYPE_SIZES, "Q4", ""]), st.text(max_size=4))
json_value = st.recursive(json_scalar, lambda c: st.lists(c, max_size=3)
                          | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=8)


@FUZZ
@given(st.dictionaries(st.sampled_from(["a", "b", "__metadata__"]), json_value, max_size=3))
def test_fuzz_arbitrary_json_values(header):
    check_parse(st_bytes(header))


layout = st.lists(st.tuples(st.sampled_from(sorted(DTYPE_SIZES)), st.lists(st.integers(0, 3), max_size=3)),
                  max_size=5)
perturbation = st.tuples(st.integers(0, 4),
                         st.sampled_from(["begin", "end", "dim", "dtype", "copy_offsets", "data"]),
                         st.integers(-9, 9).filter(bool))


@FUZZ
@given(layout, st.lists(perturbation, max_size=3))
def test_fuzz_perturbed_valid_layouts(tensors, perturbations):
    # A valid back-to-back layout parses; nudging offsets, shapes, dtypes or the data
    # length must then give HeaderError (or a layout that is still valid).
    header, off = {}, 0
    for i, (dtype, shape) in enumerate(tensors):
        n = int(np.prod(shape, dtype=object)) * DTYPE_SIZES[dtype]
        header[f"t{i}"] = t(dtype, shape, off, off + n)
        off += n
    if not perturbations:
        assert len(parse_header_bytes(st_bytes(header, bytes(off))).tensors) == len(tensors)
    for idx, what, delta in perturbations:
        if what == "data" or not header:
            off = max(0, off + delta)
            continue
        e = header[f"t{idx % len(header)}"]
        if what in ("begin", "end"):
            e["data_offsets"][what == "end"] += delta
        elif what == "dim" and e["shape"]:
            e["shape"][delta % len(e["shape"])] += delta
        elif what == "dtype":
            e["dtype"] = sorted(DTYPE_SIZES)[delta % len(DTYPE_SIZES)]
        elif what == "copy_offsets":
            e["data_offsets"] = list(header[f"t{delta % len(header)}"]["data_offsets"])
    check_parse(st_bytes(header, bytes(off)))
