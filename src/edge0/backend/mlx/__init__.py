"""MLX implementation of the backend facade."""

from edge0.backend.mlx import core, dist, io, kernels, nn, timing

__all__ = ["core", "dist", "io", "kernels", "nn", "timing"]
