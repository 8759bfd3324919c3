"""Where the server does the work a client's input decides the cost of: child processes
that parse and check large request bodies and render chat templates.

A thread cannot be stopped and holds the interpreter lock while C code runs
(``json.loads`` of a 4 MB body holds it for about 0.1 s here), so neither a template with
nested loops nor a body of two million token ids may run in the server's own process. Here
each job runs in one of a few child processes, at a lower CPU priority than the engine, under
an address-space limit (an allocation past it is a ``MemoryError`` in the child, a 400 to the
client), and with a deadline: a child still busy at the deadline, or whose client left, is
killed and replaced. What comes back is small (a checked request is bounded by the checks it
passed; a rendered prompt by the model's context), so unpickling it costs the server little.

Frames on the child's stdin and stdout: 8 bytes of length, then a pickle (both ends are this
module: nothing a client sends is unpickled, only what the child built from it).
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from edge0.child_python import python_module
from edge0.errors import Edge0Error

_HEADER = struct.Struct("<Q")


class SandboxError(Edge0Error):
    """A job in the server's child processes did not give an answer."""


class JobTimeout(SandboxError):
    """The job ran past its deadline; its child was killed."""


class JobAbandoned(SandboxError):
    """The job's client left before it ended; its child was killed."""


class JobRefused(SandboxError):
    """The job failed on its input (a template that raises, runs out of memory, a body that
    is not a valid request): the message says how."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


class SandboxBusy(SandboxError):
    """No child was free within the wait for one."""


@dataclass(frozen=True)
class SandboxLimits:
    """The bounds of one job."""

    timeout_s: float = 2.0  # a job running longer is killed (a 400 naming what it was)
    memory_bytes: int = 512 * 2**20  # address space a child may add to what it holds once ready
    wait_s: float = 30.0  # longest wait for a free child (503 beyond)
    workers: int = 2  # children
    nice: int = 10  # their CPU priority below the engine's: they never slow a decode step much


def _write_frame(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the child closed its output")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _read_frame(fd: int) -> Any:
    (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    return pickle.loads(_read_exact(fd, n))


class _Child:
    def __init__(self, setup: dict, limits: SandboxLimits):
        self.proc = subprocess.Popen(python_module("edge0.server.sandbox"), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
                                     start_new_session=True)  # a Ctrl-C to the server's group is the server's
        self.inp, self.out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        _write_frame(self.inp, {**setup, "memory_bytes": limits.memory_bytes, "nice": limits.nice})
        if not self._readable(120.0) or _read_frame(self.out) != "ready":
            self.kill()
            raise SandboxError("a request worker process did not start")

    def _readable(self, timeout: float) -> bool:
        return bool(select.select([self.out], [], [], max(timeout, 0.0))[0])

    def run(self, job: tuple, deadline: float, abandoned: threading.Event | None) -> Any:
        _write_frame(self.inp, job)
        while not self._readable(min(0.05, deadline - time.monotonic())):
            if abandoned is not None and abandoned.is_set():
                raise JobAbandoned("the client left")
            if time.monotonic() >= deadline:
                raise JobTimeout("the job ran past its deadline")
        return _read_frame(self.out)

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class Sandbox:
    """A pool of child processes for a request's bounded jobs. ``setup`` (picklable) is what
    every child holds: the tokenizer, the request checks' parameters. Thread-safe; ``run``
    blocks its (worker) thread."""

    def __init__(self, setup: dict, limits: SandboxLimits = SandboxLimits()):
        self.setup, self.limits = setup, limits
        self._idle: queue.SimpleQueue[_Child] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._all: set[_Child] = set()
        self._closed = False
        self._starting = 0  # children being started
        self.killed = 0  # children killed at a deadline or for a client that left
        self.jobs: Counter[str] = Counter()  # jobs answered, by kind
        starting = [self._replace() for _ in range(limits.workers)]
        for t in starting:  # ready when constructed: a first request does not wait seconds for a child
            t.join()
        if not self._all:
            raise SandboxError("no request worker process started")

    def _replace(self) -> threading.Thread:
        """A new child, started on a thread of its own (it takes a second or more to import)."""
        def start():
            child = None
            try:
                child = _Child(self.setup, self.limits)
            except (OSError, SandboxError):
                pass  # the pool is one smaller until run() finds it short
            with self._lock:
                self._starting -= 1
                if child is not None and self._closed:
                    child.kill()
                    return
                if child is not None:
                    self._all.add(child)
            if child is not None:
                self._idle.put(child)
        with self._lock:
            self._starting += 1
        t = threading.Thread(target=start, name="edge0-sandbox-start", daemon=True)
        t.start()
        return t

    def size(self) -> int:
        """Children alive and started."""
        with self._lock:
            return len(self._all)

    def _idle_child(self) -> _Child | None:
        """A free child that is alive (one that died idle, killed from outside or by the
        kernel, is dropped here rather than blamed on the next request's input), or None
        after a short wait. A pool left short by a failed start starts another first."""
        with self._lock:
            short = not self._closed and len(self._all) + self._starting < self.limits.workers
        if short:
            self._replace()
        try:
            child = self._idle.get(timeout=0.05)
        except queue.Empty:
            return None
        if child.proc.poll() is not None:
            self._drop(child, killed=False)
            return None
        return child

    def run(self, job: tuple, *, abandoned: threading.Event | None = None, timeout_s: float | None = None) -> Any:
        """The job's value; ``JobRefused`` (its input's fault), ``JobTimeout``,
        ``JobAbandoned`` (``abandoned`` was set) or ``SandboxBusy``."""
        waited = time.monotonic() + self.limits.wait_s
        while True:
            if self._closed:
                raise SandboxError("the server is shutting down")
            if abandoned is not None and abandoned.is_set():
                raise JobAbandoned("the client left")
            child = self._idle_child()
            if child is not None:
                break
            if time.monotonic() >= waited:
                raise SandboxBusy(f"no request worker was free within {self.limits.wait_s:g} s")
        deadline = time.monotonic() + (self.limits.timeout_s if timeout_s is None else timeout_s)
        try:
            reply = child.run(job, deadline, abandoned)
        except (SandboxError, OSError, EOFError, pickle.UnpicklingError) as e:
            self._drop(child)
            if isinstance(e, SandboxError):
                raise
            if self._closed:  # close() killed it
                raise SandboxError("the server is shutting down") from None
            raise JobRefused(f"the request's worker process died ({type(e).__name__}): the input took more memory "
                             f"or time than a request may") from None
        self._idle.put(child)
        self.jobs[job[0]] += 1
        if reply[0] == "ok":
            return reply[1]
        raise JobRefused(*reply[1:])

    def _drop(self, child: _Child, killed: bool = True) -> None:
        child.kill()
        with self._lock:
            self._all.discard(child)
            self.killed += killed
            closed = self._closed
        if not closed:
            self._replace()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            children, self._all = list(self._all), set()
        for child in children:
            child.kill()


# -- the child ---------------------------------------------------------------------------------


def _limit_memory(extra: int) -> None:
    import resource

    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (held + extra, held + extra))


def _serve(inp: int, out: int) -> None:
    setup = _read_frame(inp)
    try:
        os.nice(setup["nice"])
    except OSError:
        pass
    from edge0.server import sandbox_jobs

    jobs = sandbox_jobs.Jobs(setup)
    if sys.platform.startswith("linux"):
        _limit_memory(setup["memory_bytes"])
    _write_frame(out, "ready")
    while True:
        try:
            job = _read_frame(inp)
        except EOFError:
            return
        _write_frame(out, jobs.run(job))


if __name__ == "__main__":
    _frames_out = os.dup(1)
    os.dup2(2, 1)  # whatever a library prints goes where stderr goes, not into the frames
    _serve(sys.stdin.fileno(), _frames_out)
