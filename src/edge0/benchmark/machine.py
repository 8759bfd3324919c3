"""What machine a benchmark ran on, written into its results: the CPU's model and the vector
instructions that matter to the kernels, the cores, the memory, and the disk that holds the
checkpoint."""

from __future__ import annotations

import os
import platform
from pathlib import Path

FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def _cpuinfo() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    first = text.split("\n\n", 1)[0]
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}


def _disk(path: Path) -> str | None:
    """The block device of the filesystem holding ``path`` and whether it spins (Linux)."""
    try:
        device = os.stat(path).st_dev
        sysfs = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}").resolve()
    except OSError:
        return None
    for block in (sysfs, sysfs.parent):
        rotational = block / "queue" / "rotational"
        if rotational.exists():
            spins = rotational.read_text().strip() == "1"
            return f"{block.name} ({'rotational' if spins else 'solid-state'}, as the kernel reports it)"
    return sysfs.name or None


def describe(checkpoint: str | Path) -> dict:
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    return {"cpu": info.get("model name") or platform.processor() or platform.machine(),
            "cpu_flags": [f for f in FLAGS if f in flags], "cores": os.cpu_count(),
            "memory_bytes": memory, "disk": _disk(Path(checkpoint)), "system": platform.platform()}


def line(machine: dict | None) -> str:
    if not machine:
        return "Machine: not recorded (results from before the bench recorded it)."
    memory = f", {machine['memory_bytes'] / 2**30:.0f} GiB of memory" if machine.get("memory_bytes") else ""
    flags = f" ({', '.join(machine['cpu_flags'])})" if machine.get("cpu_flags") else ""
    disk = f", disk {machine['disk']}" if machine.get("disk") else ""
    return f"Machine: {machine['cpu']}{flags}, {machine['cores']} cores{memory}{disk}; {machine['system']}."


def proc_read_bytes() -> int:
    """Bytes this process has had read from the disk (``/proc/self/io``'s ``read_bytes``: its
    reads and its page faults on mapped files that missed the page cache); 0 where there is
    no such file."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
