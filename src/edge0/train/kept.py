"""Token streams built once and kept in Edge0's cache (``edge0.cache``): one file a key,
holding the train and held-out streams, their description and the streams' hashes, which
are checked on every read (a file that does not hash to what it says is built again). A
cache that cannot be written only keeps nothing."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import zipfile
from pathlib import Path

import numpy as np


def stream_hash(tokens: np.ndarray) -> str:
    """The hash of a stream as kept: its dtype and its bytes."""
    return hashlib.sha256(str(tokens.dtype).encode() + np.ascontiguousarray(tokens).tobytes()).hexdigest()


def _file(kind: str, key: str) -> Path:
    from edge0.cache import cache_dir

    return cache_dir() / kind / f"{key[:32]}.npz"


def kept(kind: str, key: str) -> tuple[np.ndarray, np.ndarray, object] | None:
    """(train, held-out, description) kept under ``key``, or None (none kept, or not whole)."""
    try:
        with np.load(_file(kind, key), allow_pickle=False) as f:
            train, held = f["train"], f["heldout"]
            meta = json.loads(f["meta"].tobytes().decode("utf-8"))
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    if not isinstance(meta, dict) or meta.get("hashes") != [stream_hash(train), stream_hash(held)]:
        return None
    return train, held, meta.get("description")


def keep(kind: str, key: str, train: np.ndarray, held: np.ndarray, description) -> None:
    """Keep the streams under ``key`` (written whole, then renamed into place)."""
    path = _file(kind, key)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
    meta = {"hashes": [stream_hash(train), stream_hash(held)], "description": description}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(tmp, train=train, heldout=held, meta=np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
