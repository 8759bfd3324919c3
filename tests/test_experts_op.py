"""A MoE layer's routed experts as one op (``edge0.backend.mlx.kernels.ops.experts``, the
``Edge0SwitchGLU`` twin of mlx-lm's ``SwitchGLU``):

- its numbers are SwitchGLU's own three calls on Edge0's kernels within float32's rounding
  (the activation's exp apart) and MLX's within 1e-5 of them, for one row, a few, and the
  sorted shape SwitchGLU takes from 64 (row, expert) pairs; 4 and 8 bits, float32 and
  bfloat16 scales;
- over a mapped file it equals itself over arrays holding the same bytes, bit for bit;
- the activations of mlx-lm's blocks (SwiGLU and its clamped forms, GeGLU, SiTU; SwitchMLP's
  ReLU² and GELU) are the module's own code's numbers;
- a layout it does not compute (another activation, an output bias, MLX's kernels) is
  SwitchGLU's own code; bad inputs are typed errors naming what was wrong;
- through the engine, one op a MoE layer on every path (exact, staged, hot, whole-layer),
  over slots and over the mapping, and the greedy text equals kernels mlx's.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from edge0 import Engine, EngineConfig
from edge0.backend.mlx import kernels as K
from edge0.backend.mlx.kernels import ops
from edge0.errors import KernelError

pytestmark = pytest.mark.skipif(not K.available(), reason=f"kernels not built: {K.unavailable_reason()}")

DEMO = "src/edge0/data/demo_model"
ST = {mx.float32: "F32", mx.bfloat16: "BF16"}


def _glu(bits, scale_dtype, E=16, D=256, I=128, seed=0):
    glu = SwitchGLU(D, I, E)
    mx.random.seed(seed)
    glu.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.05, glu.parameters()))
    nn.quantize(glu, group_size=64, bits=bits)
    for name in ("gate_proj", "up_proj", "down_proj"):
        p = glu[name]
        p.scales, p.biases = p.scales.astype(scale_dtype), p.biases.astype(scale_dtype)
    return glu


def _rel(a, b) -> float:
    a, b = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("rows, k", [(1, 8), (3, 2), (40, 4)])  # 40 x 4 pairs: SwitchGLU's sorted call
def test_one_op_gives_switchglus_numbers(bits, scale_dtype, rows, k):
    glu = _glu(bits, scale_dtype)
    theirs = SwitchGLU.__call__  # the module's own three calls
    x = mx.random.normal((1, rows, 256), key=mx.random.key(rows))
    idx = mx.array(np.random.default_rng(rows).integers(0, 16, size=(1, rows, k)).astype(np.uint32))
    mlx_ref = theirs(glu, x, idx)
    K.use_edge0(glu)
    assert type(glu) is ops.Edge0SwitchGLU
    got = glu(x, idx)
    unfused = theirs(glu, x, idx)  # the three calls on Edge0's kernels
    assert got.shape == mlx_ref.shape == (1, rows, k, 256) and got.dtype == mx.float32
    assert _rel(got, unfused) < 1e-6
    assert _rel(got, mlx_ref) < 1e-5


def _write(path, arrays, pad=1):
    offsets = []
    with open(path, "wb") as f:
        for a in arrays:
            f.write(b"\0" * pad)
            offsets.append(f.tell())
            f.write(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes())
    return offsets


def test_over_a_mapped_file_it_equals_itself_over_arrays(tmp_path):
    glu = _glu(4, mx.bfloat16, seed=3)
    K.use_edge0(glu)
    mapped = SwitchGLU(256, 128, 16)
    mapped.__class__ = ops.Edge0SwitchGLU
    for name in ("gate_proj", "up_proj", "down_proj"):
        p = glu[name]
        path = tmp_path / f"{name}.bin"
        offs = _write(path, [p.weight, p.scales, p.biases])
        m = K.mapping(str(path))
        stacks = {t: (m, off, "BF16") for t, off in zip(("weight", "scales", "biases"), offs)}
        mapped[name] = K.MappedSwitchLinear(stacks, 16, p.weight.shape[1], 4, 64)
    x = mx.random.normal((2, 5, 256), key=mx.random.key(4))
    idx = mx.array(np.random.default_rng(4).integers(0, 16, size=(2, 5, 8)).astype(np.int32))
    assert mx.array_equal(mapped(x, idx), glu(x, idx)).item()


def _activations():
    """mlx-lm's own activation modules of SwitchGLU blocks, with limits small enough that
    their clamps act on these numbers."""
    from mlx_lm.models.activations import SwigluOAI
    from mlx_lm.models.deepseek_v41 import DeepseekV41SwiGLU
    from mlx_lm.models.gemma4_text import GeGLU
    from mlx_lm.models.kimi_k3 import SiTU
    from mlx_lm.models.step3p5 import ClampedSwiGLU
    from mlx_lm.models.switch_layers import SwiGLU

    return {"SwiGLU": SwiGLU(), "GeGLU": GeGLU(),
            "DeepseekV41SwiGLU": DeepseekV41SwiGLU(0.02), "DeepseekV41SwiGLU, no limit": DeepseekV41SwiGLU(0.0),
            "ClampedSwiGLU": ClampedSwiGLU(0.01), "SwigluOAI": SwigluOAI(alpha=1.3, limit=0.02),
            "SiTU": SiTU(beta=0.05, linear_beta=0.02), "SiTU, no linear beta": SiTU(beta=0.05)}


@pytest.mark.parametrize("name", list(_activations()))
def test_one_op_computes_each_activation_of_mlx_lms_blocks(name):
    glu = _glu(4, mx.bfloat16, seed=7)
    glu.activation = _activations()[name]
    x = mx.random.normal((1, 6, 256), key=mx.random.key(8))
    idx = mx.array(np.random.default_rng(8).integers(0, 16, size=(1, 6, 4)).astype(np.uint32))
    mlx_ref = SwitchGLU.__call__(glu, x, idx)
    K.use_edge0(glu)
    assert ops.activation_of(glu.activation) is not None  # the op computes it
    got = glu(x, idx)
    assert _rel(got, SwitchGLU.__call__(glu, x, idx)) < 1e-6  # the module's own code on Edge0's kernels
    assert _rel(got, mlx_ref) < 1e-5
    plain = _glu(4, mx.bfloat16, seed=7)
    K.use_edge0(plain)
    differs = _rel(got, plain(x, idx)) > 1e-3  # each parameter acts on these numbers
    assert differs == (name not in ("SwiGLU", "DeepseekV41SwiGLU, no limit"))


def _mlp(activation, bias=False, seed=9):
    mlp = SwitchMLP(256, 128, 16, activation=activation, bias=bias)
    mx.random.seed(seed)
    mlp.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape) * 0.05, mlp.parameters()))
    nn.quantize(mlp, group_size=64, bits=4)
    return mlp


@pytest.mark.parametrize("activation", [nn.ReLU2(), nn.GELU(approx="precise"), nn.GELU()],
                         ids=["relu2", "gelu-precise", "gelu"])
@pytest.mark.parametrize("rows, k", [(1, 6), (30, 4)])
def test_one_op_gives_switchmlps_numbers(activation, rows, k):
    mlp = _mlp(activation)
    x = mx.random.normal((1, rows, 256), key=mx.random.key(rows))
    idx = mx.array(np.random.default_rng(rows).integers(0, 16, size=(1, rows, k)).astype(np.uint32))
    mlx_ref = SwitchMLP.__call__(mlp, x, idx)
    K.use_edge0(mlp)
    assert type(mlp) is ops.Edge0SwitchMLP
    got = ops.experts(mlp, x, idx)
    assert got is not None and got.shape == (1, rows, k, 256)
    # fc1, activation, fc2 on Edge0's kernels (erf: the C library's against MLX's)
    assert _rel(got, SwitchMLP.__call__(mlp, x, idx)) < (1e-6 if isinstance(activation, nn.ReLU2) else 5e-6)
    assert _rel(got, mlx_ref) < 1e-5
    assert _rel(mlp(x, idx), got) == 0  # the twin's call is the op


def test_switchmlps_it_does_not_compute_keep_their_own_calls():
    x = mx.random.normal((1, 2, 256), key=mx.random.key(5))
    idx = mx.array([[[0, 1], [2, 3]]], dtype=mx.uint32)
    for mlp in (_mlp(nn.GELU(approx="fast")), _mlp(nn.ReLU2(), bias=True)):  # another GELU; phixtral's biases
        want = SwitchMLP.__call__(mlp, x, idx)
        K.use_edge0(mlp)
        assert ops.experts(mlp, x, idx) is None
        assert _rel(mlp(x, idx), want) < 1e-5
    stacks = [_mlp(nn.ReLU2())[p][t] for p in ("fc1", "fc2") for t in ("weight", "scales", "biases")]
    with pytest.raises(ValueError, match=r"the activation takes 2 stacks \(fc1, fc2\), got 3"):
        K.ext().experts(mx.zeros((1, 256)), mx.zeros((2,), dtype=mx.uint32), 2, stacks + stacks[:3], [4] * 3,
                        [64] * 3, "relu2")
    with pytest.raises(ValueError, match=r"the activation takes 3 stacks \(gate, up, down\), got 2"):
        K.ext().experts(mx.zeros((1, 256)), mx.zeros((2,), dtype=mx.uint32), 2, stacks, [4] * 2, [64] * 2, "swiglu")


class GeGLU(nn.Module):
    def __call__(self, x, gate):
        return nn.gelu(gate) * x


def test_layouts_it_does_not_compute_are_switchglus_own_code(monkeypatch):
    calls = []
    real = ops.experts

    def spy(glu, x, indices):
        y = real(glu, x, indices)
        calls.append(y is not None)
        return y
    monkeypatch.setattr(ops, "experts", spy)
    x = mx.random.normal((1, 2, 256), key=mx.random.key(5))
    idx = mx.array([[[0, 1], [2, 3]]], dtype=mx.uint32)
    gelu = _glu(4, mx.float32)
    gelu.activation = GeGLU()
    biased = _glu(4, mx.float32)
    biased.down_proj.bias = mx.ones((16, 256))
    for glu in (gelu, biased):
        want = SwitchGLU.__call__(glu, x, idx)
        K.use_edge0(glu)
        assert _rel(glu(x, idx), want) < 1e-5
    plain = _glu(4, mx.float32)  # not turned: MLX's kernels, mlx-lm's module
    plain(x, idx)
    assert calls == [False, False]


@pytest.mark.parametrize("change, match", [
    (lambda s: s[:3] + s[3:6] + [s[6][:, :128], s[7][:, :128], s[8][:, :128]], "do not chain"),
    (lambda s: s[:3] + [s[3][:8], s[4][:8], s[5][:8]] + s[6:], "as many experts"),
    (lambda s: [s[0], s[1][:, :, :2], s[2][:, :, :2]] + s[3:], r"scales .* must both be"),
])
def test_bad_inputs_are_typed_errors_naming_what_is_wrong(change, match):
    glu = _glu(4, mx.float32)
    stacks = [glu[p][t] for p in ("gate_proj", "up_proj", "down_proj") for t in ("weight", "scales", "biases")]
    x, idx = mx.zeros((2, 256)), mx.zeros((4,), dtype=mx.uint32)
    with pytest.raises(ValueError, match=match):
        K.ext().experts(x, idx, 2, change(stacks), [4, 4, 4], [64, 64, 64], "swiglu")
    with pytest.raises(ValueError, match="indices hold 3 entries"):
        K.ext().experts(x, idx[:3], 2, stacks, [4, 4, 4], [64, 64, 64], "swiglu")
    with pytest.raises(ValueError, match="activation must be one of swiglu, geglu_tanh, .*got 'gelu_new'"):
        K.ext().experts(x, idx, 2, stacks, [4, 4, 4], [64, 64, 64], "gelu_new")
    with pytest.raises(ValueError, match="swiglu_clamp_in takes 1 parameters, got 0"):
        K.ext().experts(x, idx, 2, stacks, [4, 4, 4], [64, 64, 64], "swiglu_clamp_in")
    with pytest.raises(ValueError, match="swiglu_oai's limit must be > 0"):
        K.ext().experts(x, idx, 2, stacks, [4, 4, 4], [64, 64, 64], "swiglu_oai", [1.7, 0.0])
    with pytest.raises(ValueError, match="situ's parameters must be finite"):
        K.ext().experts(x, idx, 2, stacks, [4, 4, 4], [64, 64, 64], "situ", [float("nan"), 1.0])


def test_an_index_outside_the_stack_fails_at_evaluation():
    glu = _glu(4, mx.float32)
    K.use_edge0(glu)
    y = glu(mx.zeros((1, 1, 256)), mx.array([[[3, 16]]], dtype=mx.uint32))
    with pytest.raises(RuntimeError, match="expert index 16 at position 1 is outside"):
        mx.eval(y)


SETTINGS = [  # the demo as shipped (staged layers routed by its heads, the adapter), then each other path
    {}, {"expert_source": "slots"}, {"prerouter": "off"}, {"prerouter": "off", "expert_source": "slots"},
    {"prerouter": "off", "decode_path": "hot", "prefill_path": "whole_layer"},
    {"prerouter": "off", "decode_path": "whole_layer", "expert_source": "slots"},
]


@pytest.mark.parametrize("setting", SETTINGS)
def test_an_engine_runs_one_op_a_moe_layer_on_every_path(monkeypatch, setting):
    ops_made, three_calls = [], []
    real, own = ops.experts, SwitchGLU.__call__

    def spy(glu, x, indices):
        y = real(glu, x, indices)
        ops_made.append(y is not None)
        return y

    def own_spy(self, x, indices):
        three_calls.append(type(self).__name__)
        return own(self, x, indices)
    monkeypatch.setattr(ops, "experts", spy)
    monkeypatch.setattr(SwitchGLU, "__call__", own_spy)
    with Engine(DEMO, EngineConfig(kernels="edge0", **setting)) as e:
        tokens = [ev.token for ev in e.stream("def fibonacci(n):", max_tokens=6, temp=0.0)]
    # (the architecture's probe at open runs the module once before it is turned: not a pass)
    assert ops_made and all(ops_made) and "Edge0SwitchGLU" not in three_calls
    with Engine(DEMO, EngineConfig(kernels="mlx", **setting)) as e:
        assert [ev.token for ev in e.stream("def fibonacci(n):", max_tokens=6, temp=0.0)] == tokens
    assert three_calls  # MLX's kernels: SwitchGLU's own three calls


@pytest.mark.parametrize("family, activation", [
    ("gemma4_text", "GeGLU"), ("step3p5", "ClampedSwiGLU"), ("kimi_k3", "SiTU"), ("minimax_m3_vl", "SwigluOAI"),
    ("deepseek_v41_text", "DeepseekV41SwiGLU"), ("nemotron_h", "ReLU2"),
])
def test_an_engine_runs_one_op_for_each_architectures_activation(tiny_model_factory, monkeypatch, family, activation):
    made = []
    real = ops.experts

    def spy(glu, x, indices):
        y = real(glu, x, indices)
        made.append((type(glu.activation).__name__, y is not None))
        return y
    monkeypatch.setattr(ops, "experts", spy)
    d = tiny_model_factory(family)
    with Engine(str(d), EngineConfig(kernels="edge0", prerouter="off")) as e:
        tokens = [ev.token for ev in e.stream([5, 9, 11, 7], max_tokens=5, temp=0.0)]
    assert made and {name for name, _ in made} <= {activation, "SwiGLU"} and activation in {n for n, _ in made}
    assert all(ran for _, ran in made)
    with Engine(str(d), EngineConfig(kernels="mlx", prerouter="off")) as e:
        assert [ev.token for ev in e.stream([5, 9, 11, 7], max_tokens=5, temp=0.0)] == tokens
