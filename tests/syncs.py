"""Count host syncs at MLX's own level, whoever makes them.

``B.SYNCS`` counts only the calls Edge0 makes through its backend facade; a stray
``mx.eval``, ``.item()`` or ``np.array(x)`` written anywhere else would go unseen. This
counter patches MLX and NumPy themselves for the duration of a ``with`` block:

- ``mx.eval`` and ``mx.async_eval`` (``async_eval`` schedules work and does not wait: it
  is counted apart from the waiting kinds);
- ``mx.array.item``, ``.tolist``, ``__array__``, and the scalar conversions ``__bool__``,
  ``__int__``, ``__float__``, ``__index__`` (an ``if x:`` on an array is a sync too);
- ``np.array``, ``np.asarray`` and ``np.asanyarray`` applied to an ``mx.array`` (NumPy
  takes MLX arrays through the buffer protocol, which no Python-level patch of
  ``mx.array`` sees; a bare ``memoryview(x)`` is not counted).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter

import mlx.core as mx
import numpy as np

WAITING = ("eval", "item", "tolist", "__array__", "__bool__", "__int__", "__float__", "__index__", "numpy")


class SyncCounter:
    def __init__(self):
        self.counts: Counter = Counter()
        self._lock = threading.Lock()

    def hit(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    def waiting(self) -> int:
        """Syncs that block until the array is computed (everything but async_eval)."""
        return sum(self.counts[k] for k in WAITING)

    def snapshot(self) -> Counter:
        with self._lock:
            return Counter(self.counts)


@contextlib.contextmanager
def count_syncs():
    counter = SyncCounter()
    saved_mx = {name: getattr(mx, name) for name in ("eval", "async_eval")}
    methods = ("item", "tolist", "__array__", "__bool__", "__int__", "__float__", "__index__")
    saved_methods = {name: getattr(mx.array, name) for name in methods if hasattr(mx.array, name)}
    saved_np = {name: getattr(np, name) for name in ("array", "asarray", "asanyarray")}

    def wrap_fn(kind, fn):
        def wrapper(*args, **kwargs):
            counter.hit(kind)
            return fn(*args, **kwargs)
        return wrapper

    def wrap_np(fn):
        def wrapper(obj, *args, **kwargs):
            if isinstance(obj, mx.array):
                counter.hit("numpy")
            return fn(obj, *args, **kwargs)
        return wrapper

    try:
        for name, fn in saved_mx.items():
            setattr(mx, name, wrap_fn(name, fn))
        for name, fn in saved_methods.items():
            setattr(mx.array, name, wrap_fn(name, fn))
        for name, fn in saved_np.items():
            setattr(np, name, wrap_np(fn))
        yield counter
    finally:
        for name, fn in saved_mx.items():
            setattr(mx, name, fn)
        for name, fn in saved_methods.items():
            setattr(mx.array, name, fn)
        for name, fn in saved_np.items():
            setattr(np, name, fn)
