"""MLX implementation of the backend facade."""

from edge0.backend.mlx import core, io, nn, quant

__all__ = ["core", "io", "nn", "quant"]
