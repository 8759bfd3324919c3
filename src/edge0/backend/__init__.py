"""The array-library facade.

Core logic (spec, checkpoint index, routing, engine) reaches the array library only
through these modules, so another backend can implement the same surface:

- ``core``:  arrays, dtypes, evaluation, memory counters, the ops routing needs;
- ``nn``:    model classes, building and loading the resident part of a model;
- ``io``:    device buffers that reader threads can fill in place;
- ``dist``:  the distributed group, transfers between ranks, the stand-ins of a pipeline rank;
- ``kernels``: which kernels compute the quantized matmuls (MLX's or Edge0's own);
- ``timing``: the products of a step timed on random weights (the speed forecast's kernels).

Only the MLX implementation exists today; it is chosen by name so a second one (for
example a NumPy reference) plugs in without touching callers.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from edge0.errors import ConfigError

BACKENDS = {"mlx": "edge0.backend.mlx"}
NAME = "mlx"


def load(name: str = NAME) -> ModuleType:
    """Return the backend package ``name`` (it has ``core``, ``nn``, ``io``, ``dist``, ``kernels``, ``timing``)."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; available: {sorted(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])


_default = load(NAME)
core = _default.core
nn = _default.nn
io = _default.io
dist = _default.dist
kernels = _default.kernels
timing = _default.timing

__all__ = ["BACKENDS", "NAME", "core", "dist", "io", "kernels", "load", "nn"]
