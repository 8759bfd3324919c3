"""Edge0: streaming Mixture-of-Experts inference on MLX.

Routed-expert weights stay in the int4 checkpoint on disk and are read as byte ranges
when a step needs them; everything else is resident, so peak memory follows the active
expert set rather than the parameter count.

The public names load on first use (``edge0.Engine`` imports MLX, ``import edge0`` does
not), so the command line starts, and answers Ctrl-C, before the array library loads.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "edge0.engine", "TokenEvent": "edge0.engine", "generate": "edge0.engine",
    "load_prompt_cache": "edge0.prompt_cache",
    "SamplingParams": "edge0.sampling", "EngineConfig": "edge0.config", "GenerationStats": "edge0.stats",
    "MoESpec": "edge0.model.spec", "SUPPORTED_MODEL_TYPES": "edge0.model.families", "load_spec": "edge0.model.open",
    **{name: "edge0.errors" for name in (
        "CheckpointError", "ConfigError", "Edge0Error", "ExpertReadError", "ForeignArtifactError", "HeaderError",
        "LayoutError", "TokenizerError", "UnsafeModelError", "UnsupportedModelError")},
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'edge0' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
