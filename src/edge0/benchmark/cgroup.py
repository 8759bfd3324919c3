"""A memory cap for one benchmark process: its own memory cgroup.

``edge0 bench --memory-limit 8G`` runs every arm's process in a fresh memory cgroup whose
limit covers anonymous memory and page cache together, so a checkpoint larger than the cap
cannot sit in RAM: every step that needs an expert evicted earlier reads it from the disk
again, as on a machine with that much memory. cgroup v2 is used where its memory
controller is mounted, else the v1 memory controller; both need root. The group is made
before the process starts (the child joins it before it execs), its peak usage and whether
the kernel killed the process for memory are read when it ends, and it is removed.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from edge0.errors import ConfigError

ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
V1 = Path("/sys/fs/cgroup/memory")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.I)


def parse_size(text: str, flag: str = "--memory-limit") -> int:
    """``8G``, ``8GiB``, ``8192M``, ``500000000``: bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{flag} must look like 8G, 512M or a byte count, got {text!r}")
    value = float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " ")
    if value < 64 * 2**20:
        raise ConfigError(f"{flag} {text!r} is under 64 MiB: nothing can run in it")
    return int(value)


def _v2_root() -> Path | None:
    for root in ROOTS:
        controllers = root / "cgroup.controllers"
        if controllers.is_file() and "memory" in controllers.read_text().split():
            return root
    return None


class MemoryCap:
    """One cgroup per capped process: ``prepare()`` before starting it (returns the
    function the child runs before exec), ``finish(returncode)`` after."""

    def __init__(self, limit_bytes: int, name: str):
        self.limit = limit_bytes
        v2 = _v2_root()
        if v2 is not None:
            self.version, self.path = 2, v2 / name
        elif (V1 / "memory.limit_in_bytes").is_file():
            self.version, self.path = 1, V1 / name
        else:
            raise ConfigError("--memory-limit needs a memory cgroup controller (cgroup v2 with 'memory' enabled, or "
                              "the v1 memory controller at /sys/fs/cgroup/memory); none is mounted here")
        if os.geteuid() != 0:
            raise ConfigError("--memory-limit creates a memory cgroup per arm, which needs root")

    def prepare(self):
        try:
            self.path.mkdir()
            if self.version == 2:
                (self.path / "memory.max").write_text(str(self.limit))
                swap = self.path / "memory.swap.max"
                if swap.exists():
                    swap.write_text("0")
            else:
                (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
                memsw = self.path / "memory.memsw.limit_in_bytes"
                if memsw.exists():  # no swapping around the cap either
                    memsw.write_text(str(self.limit))
        except OSError as e:
            self.remove()
            raise ConfigError(f"cannot set up the memory cgroup {self.path}: {e}") from None
        procs = str(self.path / "cgroup.procs")

        def join():  # in the child, before exec: everything it allocates is charged to the group
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return join

    def _read(self, name: str) -> str:
        try:
            return (self.path / name).read_text()
        except OSError:
            return ""

    def finish(self, returncode: int) -> dict:
        """{"limit_bytes", "peak_bytes", "oom_killed"} of the finished process; removes the group."""
        if self.version == 2:
            peak = self._read("memory.peak").strip()
            events = dict(line.split() for line in self._read("memory.events").splitlines() if line.strip())
            oom = int(events.get("oom_kill", 0)) > 0
        else:
            peak = self._read("memory.max_usage_in_bytes").strip()
            control = dict(line.split() for line in self._read("memory.oom_control").splitlines() if line.strip())
            oom = int(control.get("oom_kill", 0)) > 0
        oom = oom or (returncode == -signal.SIGKILL and self._at_limit(peak))
        self.remove()
        return {"limit_bytes": self.limit, "peak_bytes": int(peak) if peak.isdigit() else None, "oom_killed": oom}

    def _at_limit(self, peak: str) -> bool:
        return peak.isdigit() and int(peak) >= 0.95 * self.limit

    def remove(self) -> None:
        if self.version == 1 and self.path.exists():
            try:  # v1: move the page cache charged here to the parent so the group can go
                (self.path / "memory.force_empty").write_text("0")
            except OSError:
                pass
        try:
            self.path.rmdir()
        except OSError:
            pass
