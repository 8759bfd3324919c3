"""Edge0's CPU kernels: an MLX extension (``_ext``, built from ``csrc/`` when the project is
installed) for MLX's affine quantized layout, 4 and 8 bits, groups of 32, 64 or 128, scales
and biases in float32, bfloat16 or float16 read as stored.

The prompt's attention (softmax(q k^T) v, causal, grouped-query) has a kernel of its own
(``attention``): MLX's fused attention on the CPU backend is far slower; so do the layers'
RMS norms and rotary embeddings (``attention.rms_norm``, ``attention.rope``), which MLX's CPU
backend composes of several ops each.

One primitive serves the routed-expert matmul with indices (what ``mx.gather_qmm(...,
transpose=True)`` computes for SwitchGLU / SwitchMLP) and the dense quantized matmul
(attention, shared experts, lm_head, quantized routers). AVX-512 loops on x86-64 CPUs that
have AVX-512F, else AVX2+FMA loops (chosen at run time; from 8 rows against one expert's
weights, its rows decoded once and tiled), portable loops elsewhere (``isa()`` says which;
``EDGE0_KERNEL_ISA`` or the extension's ``limit_isa`` caps them); output rows are split over a thread pool,
never the reduction, so results do not depend on the thread count. Activations are float32;
with ``set_int8_products`` (the ``int8_products`` setting) the one-row loops (4 and 8 bits)
quantize x to int8 per 32 values and multiply with AVX-512 VNNI, where the CPU has it.

The same product can read the experts' stacked tensors where a read-only mapping of the
checkpoint file holds them (``MappedSwitchLinear``, ``mapping``): no copy into a slot. A MoE
layer's routed experts (mlx-lm's ``SwitchGLU``: gate, up, its activation, down; ``SwitchMLP``:
fc1, its activation, fc2) are one op over either (``ops.Edge0SwitchGLU``, ``ops.Edge0SwitchMLP``).

``_loader`` loads the extension (``available()``, and why not); ``ops`` holds the MLX-facing
ops, the modules that use them and the engine setting's resolution.
"""

from edge0.backend.mlx.kernels import attention
from edge0.backend.mlx.kernels._loader import (available, ext, get_threads, int8_products, isa, set_int8_products,
                                               set_threads, unavailable_reason)
from edge0.backend.mlx.kernels.ops import (BITS, CHOICES, GROUP_SIZES, Edge0QuantizedLinear, Edge0SwitchLinear,
                                           MappedSwitchLinear, describe, gather_qmm, mapping, quantize,
                                           quantized_matmul, resolve, supported, use_edge0)

__all__ = ["BITS", "CHOICES", "GROUP_SIZES", "Edge0QuantizedLinear", "Edge0SwitchLinear", "MappedSwitchLinear",
           "attention", "available", "describe", "ext", "gather_qmm", "get_threads", "int8_products", "isa", "mapping",
           "quantize", "quantized_matmul", "resolve", "set_int8_products", "set_threads", "supported",
           "unavailable_reason", "use_edge0"]
