"""The compute side: executor paths, and the modules Edge0 puts inside mlx-lm's MoE blocks."""

from edge0.exec.rows import ExactExecutor
from edge0.exec.taps import RouterTap, StreamingSwitch

__all__ = ["ExactExecutor", "RouterTap", "StreamingSwitch"]
