"""Which kernels compute the quantized matmuls: MLX's own, or Edge0's (this package's extension).

``gather_qmm`` / ``quantized_matmul`` take what ``mx.gather_qmm`` / ``mx.quantized_matmul``
take with ``transpose=True`` and ``mode="affine"``, and return the same shapes and dtype.
``use_edge0(model, templates)`` turns every supported quantized module of the resident model
and every expert stack template into its Edge0 twin (the same parameters, another
``__call__``), so every executor path, which runs the template's own code on its rows,
computes with Edge0's kernels: the four paths still share one kernel.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchMLP

from edge0.backend.mlx.kernels import _loader as K
from edge0.backend.mlx.kernels.attention import Edge0RMSNorm, Edge0RoPE, install
from edge0.errors import ConfigError, KernelError

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
CHOICES = ("auto", "edge0", "mlx")


_qmm = None  # the extension's entry points, looked up once
_qmm_at = None
_experts = None


def _call(x, w, scales, biases, indices, bits, group_size, x_repeat=1):
    global _qmm
    if _qmm is None:
        _qmm = K.ext().qmm
    try:
        return _qmm(x, w, scales, biases, indices, bits, group_size, x_repeat)
    except ValueError as e:
        raise KernelError(str(e)) from None


def _check(bits, group_size, biases):
    if bits not in BITS:
        raise KernelError(f"edge0 kernels: bits must be one of {BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise KernelError(f"edge0 kernels: group_size must be one of {GROUP_SIZES}, got {group_size}")
    if biases is None:
        raise KernelError("edge0 kernels: the affine layout needs biases")


def _gathered(x, indices):
    """``x`` [..., M, K] and ``indices`` broadcast as ``mx.gather_qmm`` broadcasts them, flat
    as the kernels take them: (x [Bx, M, K] float32, indices [B], x_repeat, batch shape)."""
    if x.ndim < 2:
        raise KernelError(f"edge0 kernels: x must have at least 2 dimensions, got shape {tuple(x.shape)}")
    if x.dtype != mx.float32:
        x = x.astype(mx.float32)
    if indices.dtype not in (mx.int32, mx.uint32):
        indices = indices.astype(mx.uint32)
    m, k = x.shape[-2:]
    xb, ib = tuple(x.shape[:-2]), tuple(indices.shape)
    try:
        batch = tuple(mx.broadcast_shapes(xb, ib)) if xb or ib else ()
    except ValueError:
        raise KernelError(f"edge0 kernels: x's batch shape {xb} does not broadcast with the indices' {ib}") from None
    xa = (1,) * (len(batch) - len(xb)) + xb
    ia = (1,) * (len(batch) - len(ib)) + ib
    # x's batch dims: the leading ones the batch's, the trailing ones 1 (x repeated across them)
    j = len(batch)
    while j > 0 and xa[j - 1] == 1 and batch[j - 1] != 1:
        j -= 1
    if ia == batch and xa[:j] == batch[:j] and all(d == 1 for d in xa[j:]):
        return x.reshape(math.prod(batch[:j]), m, k), indices.reshape(-1), math.prod(batch[j:]), batch
    # a general broadcast: materialise both
    return (mx.broadcast_to(x, (*batch, m, k)).reshape(-1, m, k), mx.broadcast_to(indices, batch).reshape(-1), 1,
            batch)


def gather_qmm(x, w, scales, biases, indices, *, bits: int = 4, group_size: int = 64):
    """``mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True)`` on
    Edge0's kernels: x [..., M, K], indices broadcast against x's batch dims."""
    _check(bits, group_size, biases)
    dtype = x.dtype
    flat_x, flat_i, repeat, batch = _gathered(x, indices)
    y = _call(flat_x, w, scales, biases, flat_i, bits, group_size, repeat)
    y = y.reshape(*batch, x.shape[-2], w.shape[-2])
    return y if dtype == mx.float32 else y.astype(dtype)


def quantized_matmul(x, w, scales, biases, *, bits: int = 4, group_size: int = 64):
    """``mx.quantized_matmul(x, w, scales, biases, transpose=True)`` on Edge0's kernels."""
    _check(bits, group_size, biases)
    if x.ndim < 1:
        raise KernelError("edge0 kernels: x must have at least 1 dimension")
    dtype = x.dtype
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    flat = x.reshape(1, -1, k) if x.dtype == mx.float32 else x.astype(mx.float32).reshape(1, -1, k)
    y = _call(flat, w, scales, biases, None, bits, group_size).reshape(*lead, w.shape[0])
    return y if dtype == mx.float32 else y.astype(dtype)


class Edge0SwitchLinear(QuantizedSwitchLinear):
    """A ``QuantizedSwitchLinear`` computing with Edge0's kernels (same parameters)."""

    def __call__(self, x, indices, sorted_indices=False):
        y = gather_qmm(x, self["weight"], self["scales"], self["biases"], indices,
                       bits=self.bits, group_size=self.group_size)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y


class Edge0QuantizedLinear(nn.QuantizedLinear):
    """An ``nn.QuantizedLinear`` computing with Edge0's kernels (same parameters)."""

    def __call__(self, x):
        y = quantized_matmul(x, self["weight"], self["scales"], self["biases"],
                             bits=self.bits, group_size=self.group_size)
        if "bias" in self:
            y = y + self["bias"]
        return y


def quantize(w, *, bits: int, group_size: int) -> tuple:
    """MLX's affine quantization of ``w`` [..., N, K] along K, as these kernels read it:
    (weight, scales, biases), the scales and biases in float32."""
    _check(bits, group_size, True)
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    return wq, s.astype(mx.float32), b.astype(mx.float32)


def mapping(path: str):
    """A read-only mapping of the file at ``path`` (the extension's ``Mapping``): what
    ``MappedSwitchLinear`` computes from. Unmapped when the last module and pending
    computation holding it are gone."""
    try:
        return K.ext().Mapping(str(path))
    except RuntimeError as e:
        raise KernelError(str(e)) from None


class MappedSwitchLinear(nn.Module):
    """A ``QuantizedSwitchLinear``'s computation with its stacked weight, scales and biases
    read where a file mapping holds them (``stacks``: name -> (mapping, byte offset, dtype
    name) for ``weight``, ``scales``, ``biases``, each in its own file or one), never copied; ``bias`` (gpt-oss's
    per-expert output bias, small) resident. The same kernel, the same bytes: the same
    numbers as the module over rows holding those experts."""

    def __init__(self, stacks: dict, num_experts: int, output_dims: int, bits: int, group_size: int, bias=None):
        super().__init__()
        (wmap, w_off, _), (smap, s_off, sdtype), (bmap, b_off, bdtype) = (stacks[n] for n in ("weight", "scales",
                                                                                             "biases"))
        if sdtype != bdtype:
            raise KernelError(f"edge0 kernels: a mapped projection's scales ({sdtype}) and biases ({bdtype}) must "
                              "share one dtype")
        _check(bits, group_size, True)
        object.__setattr__(self, "_at", (wmap, w_off, smap, s_off, bmap, b_off, sdtype, num_experts, output_dims,
                                         bits, group_size))
        if bias is not None:
            self.bias = bias

    @property
    def stack(self) -> tuple:
        """Where its tensors lie: (weight's mapping, offset, scales' mapping, offset, biases'
        mapping, offset, scales' dtype name, experts, output rows, bits, group size)."""
        return self._at

    def __call__(self, x, indices, sorted_indices=False):
        dtype = x.dtype
        flat_x, flat_i, repeat, batch = _gathered(x, indices)
        global _qmm_at
        if _qmm_at is None:
            _qmm_at = K.ext().qmm_at
        wmap, w_off, smap, s_off, bmap, b_off, sdtype, e, n, bits, gs = self._at
        try:
            y = _qmm_at(flat_x, flat_i, wmap, w_off, smap, s_off, bmap, b_off, sdtype, e, n, bits, gs, repeat)
        except ValueError as err:
            raise KernelError(str(err)) from None
        y = y.reshape(*batch, x.shape[-2], n)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y if dtype == mx.float32 else y.astype(dtype)


# mlx-lm's gated activations the one op computes: (module, class) -> the op's name and
# parameters from the instance (None: the op does not compute this instance)
ACTIVATIONS = {
    ("mlx_lm.models.switch_layers", "SwiGLU"): lambda a: ("swiglu", []),
    ("mlx_lm.models.gemma4_text", "GeGLU"): lambda a: ("geglu_tanh", []),
    ("mlx_lm.models.deepseek_v41", "DeepseekV41SwiGLU"):
        lambda a: ("swiglu_clamp_in", [float(a.limit)]) if a.limit > 0 else ("swiglu", []),
    ("mlx_lm.models.step3p5", "ClampedSwiGLU"): lambda a: ("swiglu_clamp_out", [float(a.limit)]),
    ("mlx_lm.models.activations", "SwigluOAI"): lambda a: ("swiglu_oai", [float(a._alpha), float(a._limit)]),
    ("mlx_lm.models.kimi_k3", "SiTU"):
        lambda a: ("situ", [float(a.beta), float(a.linear_beta) if a.linear_beta is not None else 0.0]),
}


# and those of mlx-lm's SwitchMLP blocks (fc1, the activation, fc2)
MLP_ACTIVATIONS = {
    ("mlx.nn.layers.activations", "ReLU2"): lambda a: ("relu2", []),
    ("mlx.nn.layers.activations", "GELU"):  # (MLX's "precise" is its tanh form)
        lambda a: {"none": ("gelu", []), "precise": ("gelu_tanh", []), "tanh": ("gelu_tanh", [])}.get(a._approx),
}


def activation_of(act, gated: bool = True) -> tuple[str, list[float]] | None:
    """The one op's name and parameters for a ``SwitchGLU``'s activation (``gated``) or a
    ``SwitchMLP``'s, None where it does not compute it (another activation, or parameters
    it does not take)."""
    how = (ACTIVATIONS if gated else MLP_ACTIVATIONS).get((type(act).__module__, type(act).__qualname__))
    try:
        return how(act) if how is not None else None
    except (AttributeError, TypeError, ValueError):
        return None


def _projections(block) -> tuple:
    """A ``SwitchGLU``'s gate, up and down, or a ``SwitchMLP``'s fc1 and fc2."""
    if isinstance(block, SwitchGLU):
        return block.gate_proj, block.up_proj, block.down_proj
    return block.fc1, block.fc2


def _stacks(block):
    """How ``block``'s projections are held, for the one-op path: ``"arrays"`` (Edge0 twins),
    ``"mapped"`` (mappings of the checkpoint), or None (another layout, a bias, an activation
    the op does not compute: the block's own calls)."""
    projs = _projections(block)
    if activation_of(block.activation, len(projs) == 3) is None or any("bias" in p for p in projs):
        return None
    kinds = {type(p) for p in projs}
    return "arrays" if kinds == {Edge0SwitchLinear} else "mapped" if kinds == {MappedSwitchLinear} else None


def experts(glu, x, indices):
    """``glu(x, indices)`` (a ``SwitchGLU``, or a ``SwitchMLP``) as one op: gate, up, activation
    and down (fc1, activation, fc2) for each row and each of its k experts, x [..., D] against
    indices [..., k] of the same leading shape; returns [..., k, D]. None where the op does
    not compute this module (see ``_stacks``)."""
    how = _stacks(glu)
    if how is None or x.ndim < 1 or indices.ndim < 1 or tuple(x.shape[:-1]) != tuple(indices.shape[:-1]):
        return None
    global _experts
    if _experts is None:
        _experts = (K.ext().experts, K.ext().experts_at)
    dtype, d, k = x.dtype, x.shape[-1], indices.shape[-1]
    flat = x.reshape(-1, d) if dtype == mx.float32 else x.astype(mx.float32).reshape(-1, d)
    idx = (indices if indices.dtype in (mx.int32, mx.uint32) else indices.astype(mx.uint32)).reshape(-1)
    projs = _projections(glu)
    act, params = activation_of(glu.activation, len(projs) == 3)
    bits, sizes = [p.bits if how == "arrays" else p.stack[9] for p in projs], \
        [p.group_size if how == "arrays" else p.stack[10] for p in projs]
    try:
        if how == "arrays":
            stacks = [p[name] for p in projs for name in ("weight", "scales", "biases")]
            y = _experts[0](flat, idx, k, stacks, bits, sizes, act, params)
        else:
            at = [p.stack for p in projs]
            y = _experts[1](flat, idx, k, [m for a in at for m in (a[0], a[2], a[4])],
                            [o for a in at for o in (a[1], a[3], a[5])], [a[6] for a in at], [a[7] for a in at],
                            [a[8] for a in at], bits, sizes, act, params)
    except ValueError as e:
        raise KernelError(str(e)) from None
    y = y.reshape(*x.shape[:-1], k, d)
    return y if dtype == mx.float32 else y.astype(dtype)


class Edge0SwitchGLU(SwitchGLU):
    """A ``SwitchGLU`` whose routed experts are one op (``experts``) where its projections are
    Edge0's (resident twins or mappings), its activation one the op computes (``ACTIVATIONS``)
    and none has an output bias;
    SwitchGLU's own calls otherwise. The same parameters."""

    def __call__(self, x, indices):
        y = experts(self, x, indices)
        return super().__call__(x, indices) if y is None else y


class Edge0SwitchMLP(SwitchMLP):
    """A ``SwitchMLP`` whose routed experts are one op (``experts``: fc1, its activation, fc2)
    where its projections are Edge0's, its activation one the op computes
    (``MLP_ACTIVATIONS``) and neither has a bias; SwitchMLP's own calls otherwise."""

    def __call__(self, x, indices):
        y = experts(self, x, indices)
        return super().__call__(x, indices) if y is None else y


def supported(module) -> bool:
    """Whether Edge0's kernels compute ``module``'s layout."""
    return (getattr(module, "mode", "affine") == "affine" and module.bits in BITS
            and module.group_size in GROUP_SIZES and module.get("biases") is not None
            and getattr(module, "global_scale", None) is None)


TWINS = {QuantizedSwitchLinear: Edge0SwitchLinear, nn.QuantizedLinear: Edge0QuantizedLinear}
# each call decides: norms and rope by attention.active, the experts' block by its projections
ROW_TWINS = {nn.RMSNorm: Edge0RMSNorm, nn.RoPE: Edge0RoPE, SwitchGLU: Edge0SwitchGLU, SwitchMLP: Edge0SwitchMLP}


def use_edge0(*trees) -> int:
    """Turn every supported quantized module under ``trees`` into its Edge0 twin, and every
    ``nn.RMSNorm``, ``nn.RoPE``, ``SwitchGLU`` and ``SwitchMLP`` into theirs; returns how many. A module of
    a layout the kernels do not compute keeps MLX's kernel."""
    n = 0
    for tree in trees:
        for _, m in tree.named_modules():
            twin = TWINS.get(type(m))
            if twin is not None and supported(m):
                m.__class__ = twin
                n += 1
            elif type(m) in ROW_TWINS:
                m.__class__ = ROW_TWINS[type(m)]
                n += 1
    install()  # the prompt's attention too, where a forward pass asks for it (attention.active)
    return n


def describe() -> str:
    """What the stats line names: ``edge0 (avx512, 2 threads)``, with ``, int8 products``
    where the one-row loops take them (``int8_products``)."""
    if not K.available():
        return "edge0 (unavailable)"
    n = K.get_threads()
    int8 = ", int8 products" if K.int8_products() else ""
    return f"edge0 ({K.isa()}, {n} thread{'s' if n != 1 else ''}{int8})"


def resolve(choice: str, *, cpu: bool, compute_dtype: str) -> str:
    """``kernels`` setting -> ``edge0`` or ``mlx``. ``auto``: Edge0's on MLX's CPU device when
    the engine computes in float32 (the kernels' activations; a bfloat16 compute dtype asks
    for mlx-lm's own numbers), MLX's elsewhere."""
    if choice not in CHOICES:
        raise ConfigError(f"kernels must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "mlx":
        return "mlx"
    if choice == "edge0":
        if not K.available():
            raise ConfigError(f"kernels='edge0': {K.unavailable_reason()}")
        if not cpu:
            raise ConfigError("kernels='edge0': Edge0's kernels run on MLX's CPU device; this process's "
                              "default device is not the CPU (use kernels='mlx' or 'auto')")
        return "edge0"
    return "edge0" if cpu and compute_dtype == "float32" and K.available() else "mlx"
