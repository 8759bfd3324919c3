"""Strict reader of the safetensors header.

File layout::

    [8 bytes]  N, little-endian u64: length of the header
    [N bytes]  UTF-8 JSON object (may be padded with trailing spaces)
    [rest]     data section: the raw bytes of every tensor, back to back

The JSON object maps each tensor name to
``{"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}``, offsets counted
from the start of the data section, plus an optional ``"__metadata__"`` object of
string -> string.

Contract:

* Only the 8-byte prefix and the N header bytes are read; the data section is never
  touched (its size comes from ``os.stat``), so a broken checkpoint is rejected before
  any tensor is loaded, and a huge one is described in microseconds.
* Every defect raises :class:`~edge0.errors.HeaderError` naming the file and, where one
  is at fault, the tensor, with a reason that says expected vs found. No other exception
  escapes, whatever the bytes, and parsing is linear in the header size.
* Tensors must tile the data section exactly: sorted by offset, the first begins at 0,
  each begins where the previous ends, and the last ends at the end of the file. Tensors
  of 0 bytes take no room, so any number of them may sit at the current offset (also
  sharing it with the next non-empty tensor); two non-empty tensors never share bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import reprlib
import stat
from dataclasses import dataclass

from edge0.errors import HeaderError

DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "F64": 8, "I64": 8, "U64": 8,
}
# MLX's loader refuses a header of 100,000,000 bytes or more with an untyped RuntimeError; every
# file MLX may load later (resident weights, heads, adapters) is refused here first instead.
MAX_HEADER_BYTES = 100_000_000 - 1
_MAX_NBYTES = 2**63 - 1  # offsets become signed 64-bit file positions downstream
_MAX_INT_DIGITS = 24  # longer than any u64; stops quadratic int() on hostile literals
_FIELDS = ("dtype", "shape", "data_offsets")

_repr = reprlib.Repr()  # hostile values can be megabytes long; messages must stay short
_repr.maxstring = _repr.maxother = 60
_repr.maxlist = 8
_repr.repr__Object = lambda obj, level: "{...}"


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # relative to the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def file_offset(self, data_start: int) -> int:
        """Absolute position of the first byte of this tensor in the file."""
        return data_start + self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    data_start: int  # 8 + N
    file_size: int
    tensors: dict[str, TensorEntry]  # in header order
    metadata: dict[str, str]
    digest: str = ""  # sha256 of the header's JSON bytes (to notice a rewritten header)


class _Object(dict):
    """A JSON object that remembers the first key it saw twice (json keeps the last)."""

    duplicate: str | None = None


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file at ``path``."""
    name = os.fspath(path)
    try:
        st = os.stat(name)
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block open(); a device never ends
            raise HeaderError("not a regular file", file=name)
        size = st.st_size
        with open(name, "rb") as f:
            prefix = f.read(8)
            n = _header_length(prefix, size, name)
            raw = f.read(n)
    except OSError as e:
        raise HeaderError(f"cannot read file: {e.strerror or e}", file=name) from e
    if len(raw) != n:  # the file shrank between stat and read
        raise HeaderError(f"short read: expected {n} header bytes, got {len(raw)}", file=name)
    return _parse(raw, size, name)


def parse_header_bytes(buf: bytes, *, path: str = "<bytes>",
                       file_size: int | None = None) -> SafetensorsHeader:
    """Validate a header held in memory; ``file_size`` defaults to ``len(buf)``."""
    buf = bytes(buf)
    size = len(buf) if file_size is None else file_size
    n = _header_length(buf[:8], size, path)
    if len(buf) < 8 + n:
        raise HeaderError(f"buffer holds {len(buf) - 8} of the {n} header bytes", file=path)
    return _parse(buf[8:8 + n], size, path)


def _header_length(prefix: bytes, size: int, path: str) -> int:
    if size == 0:
        raise HeaderError("file is empty", file=path)
    if size < 8 or len(prefix) < 8:
        raise HeaderError(f"file is {size} bytes, shorter than the 8-byte header length prefix",
                          file=path)
    n = int.from_bytes(prefix, "little")
    if n == 0:
        raise HeaderError("header length is 0", file=path)
    if n > MAX_HEADER_BYTES:  # checked before reading, so a hostile length allocates nothing
        raise HeaderError(f"header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes",
                          file=path)
    if 8 + n > size:
        raise HeaderError(f"header length {n} runs past end of file "
                          f"(only {size - 8} bytes follow the prefix)", file=path)
    return n


def _parse(raw: bytes, size: int, path: str) -> SafetensorsHeader:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(f"header is not valid UTF-8 (byte {e.start}: {e.reason})",
                          file=path) from None
    try:
        top = json.loads(text, object_pairs_hook=_object, parse_int=_int(path))
    except (ValueError, RecursionError, MemoryError) as e:
        raise HeaderError(f"header is not valid JSON ({type(e).__name__}: {str(e)[:200]})",
                          file=path) from None
    if not isinstance(top, dict):
        raise HeaderError(f"header JSON must be an object, found {_kind(top)}", file=path)
    if top.duplicate is not None:
        dup = top.duplicate
        raise HeaderError(f"duplicate key {dup!r} in header JSON", file=path,
                          tensor=None if dup == "__metadata__" else dup)
    metadata = _metadata(top.get("__metadata__", _Object()), path)
    tensors = {k: _entry(k, v, path) for k, v in top.items() if k != "__metadata__"}
    data_len = size - 8 - len(raw)
    for e in tensors.values():
        _check_size(e, data_len, path)
    _check_tiling(tensors, data_len, path)
    return SafetensorsHeader(path=path, data_start=8 + len(raw), file_size=size,
                             tensors=tensors, metadata=metadata, digest=hashlib.sha256(raw).hexdigest())


def _object(pairs: list) -> _Object:
    obj = _Object(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        obj.duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
    return obj


def _int(path: str):
    def parse(s: str) -> int:
        if len(s) > _MAX_INT_DIGITS:
            raise HeaderError(f"integer literal of {len(s)} digits is out of range", file=path)
        return int(s)
    return parse


def _kind(v: object) -> str:
    for t, name in ((bool, "boolean"), (dict, "object"), (list, "array"), (str, "string"),
                    (int, "integer"), (float, "number")):
        if isinstance(v, t):
            return f"{name} {_repr.repr(v)}"
    return "null"


def _is_uint(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _metadata(meta: object, path: str) -> dict[str, str]:
    if meta is None:  # the reference implementation reads null as "no metadata" (MLX writes it)
        return {}
    if not isinstance(meta, dict):
        raise HeaderError(f"__metadata__ must be an object of string -> string, found {_kind(meta)}",
                          file=path)
    if meta.duplicate is not None:
        raise HeaderError(f"duplicate key {meta.duplicate!r} in __metadata__", file=path)
    for k, v in meta.items():
        if not isinstance(v, str):
            raise HeaderError(f"__metadata__ value for key {k!r} must be a string, "
                              f"found {_kind(v)}", file=path)
    return dict(meta)


def _entry(name: str, raw: object, path: str) -> TensorEntry:
    def fail(msg: str) -> HeaderError:
        return HeaderError(msg, file=path, tensor=name)

    if not isinstance(raw, dict):
        raise fail(f"entry must be an object with {', '.join(_FIELDS)}, found {_kind(raw)}")
    if raw.duplicate is not None:
        raise fail(f"duplicate field {raw.duplicate!r} in entry")
    missing = [f for f in _FIELDS if f not in raw]
    if missing:
        raise fail(f"entry is missing field(s) {', '.join(missing)}")
    extra = [f for f in raw if f not in _FIELDS]
    if extra:
        raise fail(f"entry has unexpected field(s) {_repr.repr(extra)}")
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise fail(f"unknown dtype {_kind(dtype)}; expected one of {', '.join(DTYPE_SIZES)}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise fail(f"shape must be a list of non-negative integers, found {_kind(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_uint, offsets))):
        raise fail(f"data_offsets must be two non-negative integers, found {_kind(offsets)}")
    begin, end = offsets
    if begin > end:
        raise fail(f"data_offsets begin {begin} is after end {end}")
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _check_size(e: TensorEntry, data_len: int, path: str) -> None:
    # Multiply with an early exit: a long list of big dims must not build a huge integer.
    count = 0 if 0 in e.shape else 1
    for d in e.shape:
        count *= d
        if d > _MAX_NBYTES or count * DTYPE_SIZES[e.dtype] > _MAX_NBYTES:
            raise HeaderError(f"shape overflow: {_repr.repr(list(e.shape))} x {e.dtype} "
                              f"needs more than 2**63 - 1 bytes", file=path, tensor=e.name)
    expected = count * DTYPE_SIZES[e.dtype]
    if expected != e.nbytes and expected > data_len:
        raise HeaderError(f"shape overflow: {list(e.shape)} x {e.dtype} needs {expected} bytes, "
                          f"more than the whole data section ({data_len} bytes)",
                          file=path, tensor=e.name)
    if expected != e.nbytes:
        raise HeaderError(f"byte size mismatch: shape {list(e.shape)} x {e.dtype} needs "
                          f"{expected} bytes, data_offsets [{e.begin}, {e.end}] hold {e.nbytes}",
                          file=path, tensor=e.name)


def _check_tiling(tensors: dict[str, TensorEntry], data_len: int, path: str) -> None:
    cursor, prev = 0, None
    for e in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if prev is not None and e.nbytes and (e.begin, e.end) == (prev.begin, prev.end):
            raise HeaderError(f"shares data_offsets [{e.begin}, {e.end}] with tensor "
                              f"{prev.name!r}", file=path, tensor=e.name)
        if e.begin < cursor:
            raise HeaderError(f"overlaps tensor {prev.name!r}: begins at {e.begin}, "
                              f"but {prev.name!r} ends at {cursor}", file=path, tensor=e.name)
        if e.begin > cursor and prev is None:
            raise HeaderError(f"offsets do not start at 0: first tensor begins at {e.begin}",
                              file=path, tensor=e.name)
        if e.begin > cursor:
            raise HeaderError(f"gap of {e.begin - cursor} bytes: begins at {e.begin}, but "
                              f"{prev.name!r} ends at {cursor}", file=path, tensor=e.name)
        if e.end > data_len:
            raise HeaderError(f"missing bytes: data_offsets end at {e.end}, but the data "
                              f"section holds only {data_len} bytes (file truncated?)",
                              file=path, tensor=e.name)
        cursor, prev = e.end, e
    if cursor < data_len:
        raise HeaderError(f"trailing bytes: tensors end at {cursor}, but the data section "
                          f"holds {data_len} bytes ({data_len - cursor} unaccounted)", file=path)
