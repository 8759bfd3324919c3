"""Would a repacked checkpoint (each expert's tensors as one contiguous byte range) read
faster than the layout as stored (an expert's rows scattered over its layer's stacked
tensors)? Measured before building one.

Per draw: a random MoE layer and k random experts of it (a decode step's reads of one
layer), read with direct reads (O_DIRECT, so the page cache plays no part) by ``--threads``
threads, the ranges split among them biggest first as the engine's reader splits them
(buffered reads, and ``direct: false`` in the report, where the filesystem refuses O_DIRECT):

- ``stored``: what the engine reads today, one range per stacked tensor and run of
  adjacent experts (with nine tensors, 9 x k ranges);
- ``repacked``: one range of the expert's whole bytes per expert, at a place of the same
  file with the layer's layout (offset of its first tensor + expert x expert bytes, moved
  back where the file would end before it), i.e.
  a repacked file's ranges, on the same disk, of the same total size.

The two layouts alternate draw by draw (the same number of each, different experts), so a
slower disk moment falls on both. Prints the median and quartiles of the time per draw and
the throughput of each; ``--json`` writes them.

    python tools/repack_probe.py --model ~/.cache/edge0/bench-35b-40L --draws 400 --k 8
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from edge0.io_sched.direct import ALIGN  # O_DIRECT's alignment, as the engine's reader uses it


def _aligned(offset: int, length: int) -> tuple[int, int]:
    lo = offset - offset % ALIGN
    hi = -(-(offset + length) // ALIGN) * ALIGN
    return lo, hi - lo


def _runs(experts: list[int]) -> list[tuple[int, int]]:
    """(first expert, count) of each run of adjacent experts."""
    out: list[tuple[int, int]] = []
    for e in sorted(experts):
        if out and out[-1][0] + out[-1][1] == e:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((e, 1))
    return out


def stored_ranges(layer, experts):
    return [(loc.file, loc.offset + e * loc.row_bytes, loc.row_bytes * n)
            for e, n in _runs(experts) for loc in layer.tensors]


def repacked_ranges(layer, experts, expert_bytes: int, num_experts: int):
    """Where the layer's experts would lie repacked: from its first tensor's offset on (or
    earlier, where the file ends before the layer's repacked bytes would)."""
    first = min(layer.tensors, key=lambda loc: loc.offset)
    base = min(first.offset, os.path.getsize(first.file) - num_experts * expert_bytes - ALIGN)
    return [(first.file, base + e * expert_bytes, expert_bytes * n) for e, n in _runs(experts)]


def _open(path: str) -> tuple[int, bool]:
    """A direct descriptor of ``path``, or a buffered one where the filesystem refuses
    O_DIRECT (then the page cache plays a part, and the report says so)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    except OSError:
        return os.open(path, os.O_RDONLY), False


class Probe:
    def __init__(self, files: list[str], threads: int):
        self.fds = {f: _open(f) for f in files}
        self.direct = all(direct for _, direct in self.fds.values())
        self.fds = {f: fd for f, (fd, _) in self.fds.items()}
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads)
        self.buffers = [memoryview(mmap.mmap(-1, 64 << 20)) for _ in range(threads)]

    def _part(self, i: int, ranges) -> int:
        buf, total = self.buffers[i], 0
        for file, offset, length in ranges:
            lo, n = _aligned(offset, length)
            done, need = 0, offset + length - lo  # the last page may lie past the end of the file
            while done < need:
                step = min(n - done, len(buf))
                got = os.preadv(self.fds[file], [buf[:step]], lo + done)
                if got <= 0:
                    raise OSError(f"short read at {lo + done} of {file}")
                done += got
            total += length
        return total

    def read(self, ranges) -> int:
        ranges = sorted(ranges, key=lambda r: -r[2])
        parts = [ranges[i::self.threads] for i in range(self.threads)]
        return sum(self.pool.map(self._part, range(self.threads), parts))

    def close(self) -> None:
        self.pool.shutdown()
        for fd in self.fds.values():
            os.close(fd)


def _summary(times: list[float], nbytes: int, reads: int) -> dict:
    q = statistics.quantiles(times, n=4)
    return {"draws": len(times), "median_ms": round(1e3 * statistics.median(times), 2),
            "q1_ms": round(1e3 * q[0], 2), "q3_ms": round(1e3 * q[2], 2),
            "mib_per_s": round(nbytes / sum(times) / 2**20, 1), "reads_per_draw": reads / len(times)}


def main() -> None:
    from edge0.model.open import open_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draws", type=int, default=400, help="draws of each layout")
    ap.add_argument("--k", type=int, default=8, help="experts per draw (a step's reads of one layer)")
    ap.add_argument("--threads", type=int, default=2, help="reading threads (the engine's reader_threads)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    spec, index, _ = open_checkpoint(a.model)
    layers = sorted(index.layers)
    expert_bytes = sum(loc.row_bytes for loc in index.layers[layers[0]].tensors)
    probe = Probe(index.files, a.threads)
    rng = random.Random(a.seed)
    times = {"stored": [], "repacked": []}
    reads = {"stored": 0, "repacked": 0}
    nbytes = {"stored": 0, "repacked": 0}
    try:
        for i in range(2 * a.draws):
            kind = ("stored", "repacked")[i % 2]
            layer = index.layers[rng.choice(layers)]
            experts = rng.sample(range(spec.num_experts), a.k)
            ranges = stored_ranges(layer, experts) if kind == "stored" else repacked_ranges(layer, experts, expert_bytes,
                                                                                             spec.num_experts)
            t0 = time.perf_counter()
            nbytes[kind] += probe.read(ranges)
            times[kind].append(time.perf_counter() - t0)
            reads[kind] += len(ranges)
    finally:
        probe.close()
    out = {"model": Path(a.model).name, "k": a.k, "threads": a.threads, "direct": probe.direct,
           "expert_bytes": expert_bytes,
           "tensors_per_expert": len(index.layers[layers[0]].tensors)}
    for kind in times:
        out[kind] = _summary(times[kind], nbytes[kind], reads[kind])
    out["repacked_vs_stored_median"] = round(out["repacked"]["median_ms"] / out["stored"]["median_ms"], 3)
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
