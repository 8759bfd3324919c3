"""Hostile variants of a model directory, and the worker process that opens them, for the
fuzz test and tools/fuzz_checkpoints.py.

``mutate(src, dst, rng)`` copies the model directory ``src`` to ``dst`` with one random
mutation and returns a short description of it. Mutations cover what an adversary
controls: safetensors headers (dtypes, shapes, offsets, keys, metadata, length prefix),
file bytes (truncation, trailing bytes, flips), config.json values (wrong types, zero,
negative, huge, deeply nested, missing), the shard index (names outside the directory,
missing files), the prerouter heads file (another model's shapes, bad metadata), the
tokenizer (broken JSON) and file kinds (FIFOs, devices, directories, links leaving the
directory in place of a file).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import shutil
import signal
import struct
import traceback
from pathlib import Path

import numpy as np

DTYPES = ["F32", "F16", "BF16", "I32", "U32", "I16", "U8", "I8", "I64", "F64", "BOOL", "U16", "XX"]
CONFIG_VALUES = [0, -1, 1, 2, 3, True, False, None, "", "abc", 1.5, -2.5, 10**9, 2**63, 10**30, [],
                 [1, 2], {}, {"a": 1}, float("nan"), float("inf"), "nested"]


def _copy(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            try:
                os.link(f, dst / f.name)  # hard links: mutators replace files, never write into them
            except OSError:
                shutil.copyfile(f, dst / f.name)


def _replace(path: Path, data: bytes) -> None:
    """Write ``data`` as a new file at ``path`` (never through a hard link)."""
    if path.exists() or path.is_symlink():
        path.unlink()
    path.write_bytes(data)


def _weight_files(d: Path) -> list[Path]:
    return sorted(p for p in d.glob("model*.safetensors") if p.is_file() and not p.is_symlink())


def _split(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(header: dict, data: bytes) -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data


def mutate_header(d: Path, rng: np.random.Generator) -> str:
    f = _weight_files(d)[rng.integers(len(_weight_files(d)))]
    header, data = _split(f.read_bytes())
    names = [k for k in header if k != "__metadata__"]
    name = names[rng.integers(len(names))]
    entry = header[name]
    kind = rng.integers(12)
    if kind == 0:
        entry["dtype"] = DTYPES[rng.integers(len(DTYPES))]
    elif kind == 1:
        i = rng.integers(len(entry["shape"])) if entry["shape"] else 0
        shape = list(entry["shape"]) or [1]
        shape[i] = [0, 1, -1, shape[i] + 1, shape[i] * 2, 2**40, "x", 1.5][rng.integers(8)]
        entry["shape"] = shape
    elif kind == 2:
        entry["shape"] = entry["shape"][:-1] if entry["shape"] else [1, 1]
    elif kind == 3:
        a, b = entry["data_offsets"]
        delta = int(rng.choice([-8, -1, 1, 8, 4096, b - a]))
        entry["data_offsets"] = [a + delta, b + delta] if rng.integers(2) else [a, b + delta]
    elif kind == 4:
        entry["data_offsets"] = [entry["data_offsets"][1], entry["data_offsets"][0]]
    elif kind == 5:
        del header[name]
    elif kind == 6:
        other = names[rng.integers(len(names))]
        header[other + ".dup"] = dict(header[other])
    elif kind == 7:
        header["__metadata__"] = {"format": 1} if rng.integers(2) else ["x"]
    elif kind == 8:
        entry["data_offsets"] = [0, entry["data_offsets"][1] - entry["data_offsets"][0]]
    elif kind == 9:
        entry["shape"] = [2**31, 2**31, 2**31]
    elif kind == 10:
        entry["data_offsets"] = "0-10"
    else:
        header[name] = [1, 2, 3]
    _replace(f, _join(header, data))
    return f"header {f.name}: {name} kind {kind}"


def mutate_bytes(d: Path, rng: np.random.Generator) -> str:
    f = _weight_files(d)[0]
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    kind = rng.integers(7)
    if kind == 0:
        raw = raw[: rng.integers(0, len(raw))]
    elif kind == 1:
        raw += bytes(rng.integers(1, 4096))
    elif kind == 2:
        raw[:8] = struct.pack("<Q", int(rng.choice([0, 1, n - 1, n + 1, 2**40, 2**63, len(raw)])))
    elif kind == 3:  # flip bytes in the header
        for _ in range(rng.integers(1, 8)):
            raw[8 + rng.integers(n)] = rng.integers(256)
    elif kind == 4:  # non-UTF-8 header
        raw[8 + rng.integers(n)] = 0xFF
    elif kind == 5:
        raw = raw[:7]
    else:  # flip bytes in the data (any output or typed error; never a crash)
        for _ in range(rng.integers(1, 64)):
            raw[8 + n + rng.integers(len(raw) - 8 - n)] = rng.integers(256)
    _replace(f, bytes(raw))
    return f"bytes {f.name} kind {kind}"


def _config_paths(cfg, prefix=()) -> list[tuple]:
    out = []
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            out.append(prefix + (k,))
            out += _config_paths(v, prefix + (k,))
    return out


def mutate_config(d: Path, rng: np.random.Generator) -> str:
    path = d / "config.json"
    cfg = json.loads(path.read_text())
    paths = _config_paths(cfg)
    where = paths[rng.integers(len(paths))]
    parent = cfg
    for k in where[:-1]:
        parent = parent[k]
    kind = rng.integers(10)
    depth = 0
    if kind == 0:
        del parent[where[-1]]
        desc = "deleted"
    else:
        value = CONFIG_VALUES[rng.integers(len(CONFIG_VALUES))]
        depth = int(rng.choice([50, 500, 50000])) if value == "nested" else 0
        parent[where[-1]] = "@@NESTED@@" if depth else value
        desc = f"{depth}-deep list" if depth else repr(value)[:40]
    text = json.dumps(cfg)
    if depth:
        text = text.replace('"@@NESTED@@"', "[" * depth + "1" + "]" * depth)
    if rng.integers(20) == 0:
        text = text[: rng.integers(len(text))]  # truncated JSON
        desc += " (truncated)"
    _replace(path, text.encode())
    return f"config {'.'.join(map(str, where))} = {desc}"


def mutate_index(d: Path, rng: np.random.Generator) -> str:
    path = d / "model.safetensors.index.json"
    files = _weight_files(d)
    if path.exists():
        doc = json.loads(path.read_text())
    else:
        doc = {"metadata": {}, "weight_map": {}}
        for f in files:
            header, _ = _split(f.read_bytes())
            doc["weight_map"].update({k: f.name for k in header if k != "__metadata__"})
    wm = doc["weight_map"]
    key = list(wm)[rng.integers(len(wm))] if wm else "x"
    value = ["../../etc/passwd", "/etc/passwd", "model-missing.safetensors", "config.json", 5, None, "",
             "model.safetensors/../config.json"][rng.integers(8)]
    kind = rng.integers(4)
    if kind == 0:
        wm[key] = value
    elif kind == 1:
        doc["weight_map"] = [1, 2]
    elif kind == 2:
        doc = "not an object"
    else:
        _replace(path, b"{ not json")
        return "index: not JSON"
    _replace(path, json.dumps(doc).encode())
    return f"index: kind {kind} {value!r}"


def mutate_heads(d: Path, rng: np.random.Generator) -> str:
    """Warm-start heads beside the checkpoint, then one change to their file."""
    path = d / "prerouter.safetensors"
    if not path.exists():
        return "heads: none"
    header, data = _split(path.read_bytes())
    meta = header["__metadata__"]
    kind = rng.integers(7)
    shape = json.loads(meta["shape"])
    if kind == 0:
        shape["experts"] = int(rng.choice([1, shape["experts"] * 2, 0, 10**9]))
    elif kind == 1:
        shape["hidden"] = int(rng.choice([1, shape["hidden"] + 64, -1]))
    elif kind == 2:
        meta["owners"] = json.dumps([int(x) for x in rng.choice([0, 1, 2, 3, 50, 10**6], size=3)])
    elif kind == 3:
        meta["owners"] = "[not json"
    elif kind == 4:
        shape["k"] = int(rng.choice([0, 1, 99]))
    elif kind == 5:
        names = [k for k in header if k != "__metadata__"]
        header[names[rng.integers(len(names))]]["dtype"] = DTYPES[rng.integers(len(DTYPES))]
    else:
        meta["base_identity"] = "0" * 32
    meta["shape"] = json.dumps(shape)
    _replace(path, _join(header, data))
    return f"heads kind {kind}"


def mutate_tokenizer(d: Path, rng: np.random.Generator) -> str:
    path = d / "tokenizer.json"
    raw = path.read_bytes()
    kind = rng.integers(4)
    if kind == 0:
        raw = raw[: rng.integers(len(raw))]
    elif kind == 1:
        raw = b'{"model": 5}'
    elif kind == 2:
        raw = bytes(rng.integers(0, 256, 2048, dtype=np.uint8))
    else:
        doc = json.loads(raw)
        doc["model"]["vocab"] = {"a": -1}
        raw = json.dumps(doc).encode()
    _replace(path, raw)
    return f"tokenizer kind {kind}"


def mutate_file_kind(d: Path, rng: np.random.Generator, outside: Path) -> str:
    names = ["config.json", "tokenizer.json", "model.safetensors", "tokenizer_config.json", "prerouter.safetensors",
             "model.safetensors.index.json"]
    name = names[rng.integers(len(names))]
    path = d / name
    if name == "model.safetensors" and not path.exists():
        path = _weight_files(d)[0]
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    kind = rng.integers(7)
    if kind == 0:
        os.mkfifo(path)
    elif kind == 1:
        os.symlink("/dev/zero", path)
    elif kind == 2:
        os.symlink("/dev/urandom", path)
    elif kind == 3:
        target = outside / name
        target.write_bytes(b"{}")
        os.symlink(target, path)
    elif kind == 4:
        path.mkdir()
    elif kind == 5:
        path.write_bytes(b"")
    else:
        os.symlink("../" * 6 + "etc/passwd", path)
    return f"file kind {kind} at {path.name}"


MUTATORS = {
    "header": mutate_header, "bytes": mutate_bytes, "config": mutate_config, "index": mutate_index,
    "heads": mutate_heads, "tokenizer": mutate_tokenizer,
}


def mutate(src: Path, dst: Path, rng: np.random.Generator, outside: Path) -> str:
    """Copy ``src`` to ``dst`` with one mutation (or, rarely, two); return what was done."""
    _copy(src, dst)
    kinds = list(MUTATORS) + ["file_kind"]
    picked = [kinds[rng.integers(len(kinds))] for _ in range(1 if rng.integers(8) else 2)]
    picked.sort(key=lambda k: k == "file_kind")  # a FIFO or /dev/zero link is never read back
    heads = dst / "prerouter.safetensors"
    if heads.exists() and "heads" not in picked and rng.integers(4):
        heads.unlink()  # heads pin config.json's identity: most variants go without, to reach the model
    done = []
    for kind in picked:
        try:
            done.append(mutate_file_kind(dst, rng, outside) if kind == "file_kind" else MUTATORS[kind](dst, rng))
        except Exception:  # e.g. the other mutation already removed what this one edits
            done.append(f"{kind}: not applicable")
    return "; ".join(done)


def worker(conn, memory_limit: int) -> None:
    """Serve variants from ``conn`` until it closes: open, generate 2 tokens, close."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    from edge0 import Edge0Error, Engine

    while True:
        try:
            path = conn.recv()
        except EOFError:
            return
        try:
            with Engine(path) as engine:
                for _ in engine.stream("def f(x):", max_tokens=2):
                    pass
            conn.send(("opened", ""))
        except Edge0Error as e:
            conn.send(("typed", f"{type(e).__name__}: {str(e)[:200]}"))
        except MemoryError as e:
            conn.send(("memory", f"MemoryError {e}"))
        except BaseException as e:
            conn.send(("untyped", "".join(traceback.format_exception_only(type(e), e))[-400:]
                       + traceback.format_exc()[-1200:]))


class Worker:
    def __init__(self, memory_limit: int):
        self.memory_limit = memory_limit
        self.start()

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(child, self.memory_limit), daemon=True)
        self.proc.start()
        child.close()

    def run(self, path: Path, time_limit: float) -> tuple[str, str]:
        self.conn.send(str(path))
        if self.conn.poll(time_limit):
            try:
                return self.conn.recv()
            except EOFError:
                pass
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
            self.start()
            return "hang", f"no answer in {time_limit:.0f} s"
        code = self.proc.exitcode
        self.proc.join()
        self.start()
        if code is not None and code < 0 and -code in (signal.SIGKILL, signal.SIGABRT, signal.SIGSEGV):
            # allocation failures under RLIMIT_AS abort in C++ (std::bad_alloc) or are killed
            kind = "memory" if -code in (signal.SIGKILL, signal.SIGABRT) else "crash"
            return kind, f"worker died with signal {-code}"
        return "crash", f"worker exited with code {code}"

    def close(self) -> None:
        self.conn.close()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
