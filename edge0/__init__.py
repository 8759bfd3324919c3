"""Edge0: streaming Mixture-of-Experts inference on MLX.

Routed-expert weights stay in the int4 checkpoint on disk and are read as byte ranges
when a step needs them; everything else is resident, so peak memory follows the active
expert set rather than the parameter count.
"""

from edge0.config import EngineConfig
from edge0.engine import Engine, SamplingParams, TokenEvent, generate
from edge0.errors import (
    CheckpointError, ConfigError, Edge0Error, ExpertReadError, HeaderError, LayoutError,
    UnsafeModelError, UnsupportedModelError,
)
from edge0.spec import SUPPORTED_MODEL_TYPES, MoESpec, load_spec
from edge0.stats import GenerationStats

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ConfigError", "Edge0Error", "Engine", "EngineConfig", "ExpertReadError",
    "GenerationStats", "HeaderError", "LayoutError", "MoESpec", "SUPPORTED_MODEL_TYPES", "SamplingParams",
    "TokenEvent", "UnsafeModelError", "UnsupportedModelError", "generate", "load_spec",
]
