"""Rewrite a checkpoint's safetensors files tensor by tensor, to build malformed ones; and
measure what loading one costs."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable

Tensor = dict  # {"name", "dtype", "shape", "data": bytes}


def read_tensors(path: Path) -> tuple[list[Tensor], dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = raw[8 + n:]
    tensors = [dict(name=k, dtype=v["dtype"], shape=list(v["shape"]),
                    data=data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()]
    return tensors, meta


def write_tensors(path: Path, tensors: list[Tensor], meta: dict | None = None) -> None:
    header, offset = {}, 0
    if meta:
        header["__metadata__"] = meta
    for t in tensors:
        header[t["name"]] = {"dtype": t["dtype"], "shape": t["shape"],
                             "data_offsets": [offset, offset + len(t["data"])]}
        offset += len(t["data"])
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for t in tensors:
            f.write(t["data"])


def copy_model(src: Path, dst: Path, mutate: Callable[[list[Tensor]], list[Tensor] | None] | None = None,
               config: Callable[[dict], None] | None = None, shards: int = 1) -> Path:
    """Copy ``src`` to ``dst`` with all tensors in ``shards`` files, after ``mutate``."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            shutil.copy(f, dst / f.name)
    tensors: list[Tensor] = []
    meta = {}
    for f in sorted(src.glob("model*.safetensors")):
        ts, meta = read_tensors(f)
        tensors += ts
    if mutate is not None:
        tensors = mutate(tensors) or tensors
    if shards == 1:
        write_tensors(dst / "model.safetensors", tensors, meta)
    else:
        per = -(-len(tensors) // shards)
        weight_map = {}
        for i in range(shards):
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = tensors[i * per:(i + 1) * per]
            write_tensors(dst / name, part, meta)
            weight_map.update({t["name"]: name for t in part})
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def find(tensors: list[Tensor], suffix: str) -> Tensor:
    return next(t for t in tensors if t["name"].endswith(suffix))


def rewrite_header(src: Path, dst: Path, mutate: Callable[[list[Tensor], dict], None]) -> Path:
    """``src`` written to ``dst`` after ``mutate(tensors, metadata)`` changed them in place
    (as a hostile file is crafted: the header rewritten, the tensors' bytes kept)."""
    tensors, meta = read_tensors(Path(src))
    mutate(tensors, meta)
    write_tensors(Path(dst), tensors, meta)
    return Path(dst)


# A parent of its own: RUSAGE_CHILDREN is the largest of every child a process has waited for.
_PEAK = ("import resource, subprocess, sys; subprocess.run([sys.executable, '-c', *sys.argv[1:]]); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def peak_rss(code: str, *args) -> tuple[str, int]:
    """(what ``python -c code *args`` printed, its peak resident memory: KiB on Linux)."""
    out = subprocess.run([sys.executable, "-c", _PEAK, code, *map(str, args)], capture_output=True, text=True,
                         check=True).stdout
    *printed, peak = out.rstrip("\n").split("\n")
    return "\n".join(printed), int(peak)
