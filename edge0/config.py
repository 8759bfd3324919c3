"""EngineConfig: the typed settings of an Edge0 engine."""

from __future__ import annotations

from dataclasses import dataclass, fields

from edge0.errors import ConfigError

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    # Activation dtype. float32 by default: on the CPU backend the quantized matmul with
    # bf16 activations is about 8x slower; scales stay as stored.
    compute_dtype: str = "float32"
    # Experts the exact path's bundle holds at once; a prefill needing more distinct experts
    # loops over expert chunks. Memory: bundle_capacity x bytes per expert.
    bundle_capacity: int = 32
    # Threads issuing positional reads of expert byte ranges.
    reader_threads: int = 2
    # Prompt tokens per prefill forward pass (as mlx-lm's prefill_step_size).
    prefill_step_size: int = 2048

    def __post_init__(self):
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}")
        for name in ("bundle_capacity", "reader_threads", "prefill_step_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
