"""ExpertCache: expert bytes kept in the process's memory beside the slots, keyed by
(layer, expert) and filled by the reads the buffers make anyway; the reader
(``edge0.io_sched.reader``) serves a cached expert as a memory copy, not a read. It never holds
more than its budget, only an expert whose read completed enters it, and its policy
(``POLICIES``: LFU with dynamic aging, or LRU) chooses what leaves.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import sys
import threading

import numpy as np


class LRU:
    """Least recently used first out."""

    def __init__(self):
        self._order: dict = {}  # key -> None, least recent first (a dict keeps insertion order)

    def touch(self, key) -> None:
        self._order.pop(key, None)
        self._order[key] = None

    def remove(self, key) -> None:
        self._order.pop(key, None)

    def victim(self):
        """The key to evict next (None when empty)."""
        return next(iter(self._order), None)


class LFUAging:
    """LFU with dynamic aging (LFU-DA): a key's priority is the cache's age when it was last
    used plus how often it was used since it entered; the least is evicted and the age rises
    to its priority, so what was used often long ago ages out. Ties: the least recently used."""

    def __init__(self):
        self.age = 0
        self._count: dict = {}
        self._priority: dict = {}
        self._heap: list = []  # (priority, tick, key); an entry whose priority changed since is stale
        self._tick = itertools.count()

    def touch(self, key) -> None:
        self._count[key] = self._count.get(key, 0) + 1
        self._priority[key] = self.age + self._count[key]
        heapq.heappush(self._heap, (self._priority[key], next(self._tick), key))

    def remove(self, key) -> None:
        if self._count.pop(key, None) is not None:
            self.age = max(self.age, self._priority.pop(key))

    def victim(self):
        while self._heap and self._priority.get(self._heap[0][2]) != self._heap[0][0]:
            heapq.heappop(self._heap)  # stale
        return self._heap[0][2] if self._heap else None


POLICIES = {"lfu": LFUAging, "lru": LRU}


class ExpertCache:
    """Expert bytes (every stacked tensor's row of an expert, one after the other) kept in
    memory, keyed by (layer, expert): ``budget // expert_bytes`` entries of ``expert_bytes``
    (the largest expert) in one array allocated at once, so that what is evicted is reused in
    place (no allocation per expert: a freed copy in a reader thread's heap is not memory given
    back) and the budget holds by construction. Safe from several reader threads (copies under
    its lock: a copy holds the interpreter's lock anyway)."""

    def __init__(self, budget: int, policy: str, expert_bytes: int):
        if policy not in POLICIES:
            raise ValueError(f"cache policy {policy!r} is not one of {sorted(POLICIES)}")
        self.budget, self.name = int(budget), policy
        self.policy = POLICIES[policy]()
        self.capacity = max(0, self.budget // max(1, expert_bytes))  # entries
        self._store = np.empty((self.capacity, expert_bytes), dtype=np.uint8)
        self._free = list(range(self.capacity - 1, -1, -1))  # handed out from entry 0 up
        if self.capacity:
            _populate(self._store)
        self.entries: dict = {}  # (layer, expert) -> its row of the store
        self.uses: dict = {}  # (layer, expert) -> how often a read asked for it, held or not
        self.nbytes = 0  # the bytes of the entries held
        self.evictions = self.refused = 0
        self._lock = threading.Lock()

    def serve(self, layer: int, experts: list[int], rows: list[int], buffers) -> tuple[list, list, int]:
        """Copy each cached expert of ``experts`` into its row of ``buffers``; returns the
        experts and rows left to read, and how many were served."""
        left_e, left_r, hits = [], [], 0
        with self._lock:
            for e, r in zip(experts, rows):
                self.uses[layer, e] = self.uses.get((layer, e), 0) + 1
                slot = self.entries.get((layer, e))
                if slot is None:
                    left_e.append(e)
                    left_r.append(r)
                    continue
                self.policy.touch((layer, e))
                at = 0
                for buf in buffers:
                    n = buf.host.shape[1]
                    buf.host[r] = self._store[slot, at:at + n]
                    at += n
                hits += 1
        return left_e, left_r, hits

    def keep(self, layer: int, experts: list[int], rows: list[int], buffers) -> None:
        """Copies of the experts just read into ``rows`` of ``buffers``; when the cache is
        full, each in the entry the policy's victim leaves, unless reads asked for it less
        often than for the victim (a copy costs the step its time: what is needed less than what
        the cache holds is not copied)."""
        size = sum(buf.host.shape[1] for buf in buffers)
        if size > self._store.shape[1] or not self.capacity:
            return
        with self._lock:
            for e, r in zip(experts, rows):
                key = (layer, e)
                if key in self.entries:
                    continue
                if not self._free:
                    victim = self.policy.victim()
                    if self.uses.get(key, 0) < self.uses.get(victim, 0):
                        self.refused += 1  # asked for less often than what it would push out: not copied
                        continue
                    self._free.append(self.entries.pop(victim))
                    self.policy.remove(victim)
                    self.nbytes -= size
                    self.evictions += 1
                slot = self._free.pop()
                at = 0
                for buf in buffers:
                    n = buf.host.shape[1]
                    self._store[slot, at:at + n] = buf.host[r]
                    at += n
                self.entries[key] = slot
                self.nbytes += size
                self.policy.touch(key)

    def row(self, layer: int, expert: int):
        """The cached bytes of an expert (its tensors' rows one after the other), or None."""
        with self._lock:
            slot = self.entries.get((layer, expert))
            return None if slot is None else self._store[slot].copy()

    def clear(self) -> None:
        """Forget everything (the checkpoint's files changed)."""
        with self._lock:
            for key, slot in self.entries.items():
                self.policy.remove(key)
                self._free.append(slot)
            self.entries.clear()
            self.nbytes = 0


MADV_POPULATE_WRITE = 23  # Linux 5.14+


def _populate(store) -> None:
    """Have the kernel map every page of ``store`` now, in one call, its bytes untouched: the
    first write to each page is otherwise a page fault during a step (one per 4 KiB, about
    2.7 s per GiB on a virtual machine measured here, against 0.05 s per GiB this way). Where
    the call is unknown (another kernel or system) the pages are mapped as they are filled."""
    if not sys.platform.startswith("linux") or not store.size:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        start = -(-store.ctypes.data // 4096) * 4096
        end = (store.ctypes.data + store.nbytes) // 4096 * 4096
        if end > start:
            libc.madvise(start, end - start, MADV_POPULATE_WRITE)  # a failure leaves the pages as they were
    except (OSError, AttributeError):
        pass
