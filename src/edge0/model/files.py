"""Reading a model directory that may have been written by an adversary.

Every file Edge0 (or the tokenizer library under it) reads from a model directory goes
through one gate first:

- it must be a regular file: a FIFO would block the reader forever, a device
  (``/dev/zero``, ``/dev/urandom``) never ends;
- a symbolic link must stay inside the directory. The one exception is the layout of a
  Hugging Face hub cache, where ``models--ORG--NAME/snapshots/REV/FILE`` links to
  ``models--ORG--NAME/blobs/HASH``: links into that repository's ``blobs`` are allowed;
- it is read with a size limit, so no file can make Edge0 allocate without bound;
- JSON must be UTF-8, parse, and nest no deeper than a fixed limit.

Each violation is one typed error naming the file (``UnsafeModelError`` for a file that
is not what it claims to be, ``ConfigError`` for JSON that does not parse).
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path

from edge0.errors import ConfigError, UnsafeModelError

MIB = 2**20
JSON_LIMIT = 16 * MIB  # config.json, index files, tokenizer_config.json (real ones are < 1 MiB)
MAX_JSON_DEPTH = 64


def allowed_roots(model_dir: Path) -> list[Path]:
    """Where the files of ``model_dir`` may really live: the directory itself and, for a
    Hugging Face hub cache snapshot, its repository's ``blobs``."""
    real = Path(os.path.realpath(model_dir))
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--")):
        roots.append(real.parent.parent / "blobs")
    return roots


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def check_entry(model_dir: Path, name: str) -> Path:
    """The real path of the file ``name`` of ``model_dir``, once it is known to be a regular
    file inside the allowed roots. Touches nothing outside the directory's own entries
    before the link's target is known to be allowed."""
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise UnsafeModelError(f"{name!r} is not a plain file name", file=model_dir)
    path = Path(model_dir) / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise
    except NotADirectoryError:
        raise ConfigError(not_a_folder(model_dir)) from None
    except OSError as e:
        raise UnsafeModelError(f"cannot inspect: {e.strerror or e}", file=path) from None
    if stat.S_ISLNK(st.st_mode):
        real = Path(os.path.realpath(path))
        if not _inside(real, allowed_roots(model_dir)):
            raise UnsafeModelError("symbolic link leaves the model directory; refused", file=path)
        try:
            st = os.stat(real)
        except OSError as e:
            raise UnsafeModelError(f"broken symbolic link: {e.strerror or e}", file=path) from None
        path = real
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or
                stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else
                "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file")
        raise UnsafeModelError(f"is {kind}, not a regular file; refused", file=Path(model_dir) / name)
    return path


def not_a_folder(path: Path) -> str:
    """What a file given where a model folder goes (``--model x.safetensors``) is told."""
    return (f"{path} is a file, not a model folder: a model (--model) is a folder holding config.json and its "
            f".safetensors weights; give the folder that holds it ({Path(path).parent})")


def check_directory(model_dir: Path) -> None:
    """Every top-level entry that is not a directory must be a regular file inside the
    allowed roots: a tokenizer library may open any of them."""
    try:
        names = sorted(os.listdir(model_dir))
    except NotADirectoryError:
        raise ConfigError(not_a_folder(model_dir)) from None
    except FileNotFoundError:
        raise ConfigError(f"{model_dir} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot list {model_dir}: {e.strerror or e}") from None
    for name in names:
        path = Path(model_dir) / name
        try:
            is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
        except OSError:
            continue
        if not is_dir:
            check_entry(model_dir, name)


def read_bytes(model_dir: Path, name: str, limit: int) -> bytes:
    """The bytes of ``model_dir/name`` (checked with ``check_entry``), at most ``limit``."""
    real = check_entry(model_dir, name)
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise UnsafeModelError(f"cannot open: {e.strerror or e}", file=Path(model_dir) / name) from None
    try:
        st = os.fstat(fd)  # the file opened is the file checked: no FIFO swapped in meanwhile
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeModelError("is not a regular file; refused", file=Path(model_dir) / name)
        if st.st_size > limit:
            raise UnsafeModelError(f"is {st.st_size} bytes, over the {limit}-byte limit for this file",
                                   file=Path(model_dir) / name)
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(limit + 1 - total, 4 * MIB))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise UnsafeModelError(f"grew past the {limit}-byte limit while being read",
                                       file=Path(model_dir) / name)
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_json(raw: bytes, where: Path):
    """JSON from UTF-8 bytes; a ``ConfigError`` naming ``where`` for anything else."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise ConfigError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and integers too long to convert
        raise ConfigError(f"{where} is not valid JSON: {e}") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise ConfigError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def read_json(model_dir: Path, name: str, limit: int = JSON_LIMIT):
    return parse_json(read_bytes(model_dir, name, limit), Path(model_dir) / name)


def _depth(value, level: int = 0) -> int:
    if level > MAX_JSON_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level + 1)
    return level


def atomic_write(path: Path, write) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, fsync it, then rename it over
    ``path``: a reader sees the old file or the new one, never half of one. The temporary
    name keeps the suffix (``mx.save_safetensors`` appends ".safetensors" otherwise)."""
    import tempfile

    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".tmp.", suffix=path.suffix)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def rewrite_metadata(path: str | Path, changes: dict[str, str]) -> None:
    """Set these string fields of a safetensors file's ``__metadata__``, every tensor byte
    and every other field as they were; temp file, fsync, rename. The header is re-padded
    so that the data section stays 8-byte aligned."""
    path = Path(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        top = json.loads(f.read(n))
        data = f.read()
    top["__metadata__"] = {**top.get("__metadata__", {}), **changes}
    raw = json.dumps(top, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)

    def write(tmp):
        with open(tmp, "wb") as out:
            out.write(struct.pack("<Q", len(raw)) + raw)
            out.write(data)

    atomic_write(path, write)
