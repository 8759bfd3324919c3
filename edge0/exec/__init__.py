"""The compute side: executor paths and the generic streaming MoE layer."""

from edge0.exec.exact import ExactExecutor, switch_glu
from edge0.exec.moe_layer import StreamingMoE

__all__ = ["ExactExecutor", "StreamingMoE", "switch_glu"]
