"""Edge0's CPU kernels (edge0/backend/mlx/kernels, ``kernels=edge0``) through their public ops and the engine.

- every op within 1e-5 relative L2 of a float64 reference built from the dequantized
  weights, for 4 and 8 bits, groups of 32/64/128, scales in float32/bfloat16/float16, 1 to
  96 rows, gathered and dense, on the AVX-512 loops, the AVX2 ones and the portable ones;
- the result does not depend on the thread count (output rows are split, not the sum);
- hostile inputs get a KernelError naming what was wrong, or a correct answer (empty rows,
  non-contiguous inputs), never a crash; an index out of range is an error at evaluation;
- the engine: ``kernels=edge0`` gives ``kernels=mlx``'s greedy text on the demo for the
  README's prompts, the stats line names the kernels, and the setting is validated.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from edge0 import Engine, EngineConfig
from edge0.backend.mlx import kernels as K
from edge0.errors import ConfigError, KernelError

pytestmark = pytest.mark.skipif(not K.available(), reason=f"kernels not built: {K.unavailable_reason()}")

DEMO = "src/edge0/data/demo_model"
README_PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef read_lines(path):"]


def quantized(shape, bits, group_size, scale_dtype, seed=0):
    w = mx.random.normal(shape, key=mx.random.key(seed)) * 0.05
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    return wq, s.astype(scale_dtype), b.astype(scale_dtype)


def dequantized64(wq, s, b, bits, group_size):
    return np.array(mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), group_size=group_size,
                                  bits=bits)).astype(np.float64)


def rel_l2(a, ref):
    return float(np.linalg.norm(np.asarray(a, dtype=np.float64) - ref) / np.linalg.norm(ref))


ISAS = ("avx512", "avx2", "portable")


@pytest.fixture(params=ISAS)
def isa(request):
    widest = K.isa()
    if ISAS.index(request.param) < ISAS.index(widest):
        pytest.skip(f"this CPU's widest loops are {widest}")
    K.ext().limit_isa(request.param)
    assert K.isa() == request.param
    yield request.param
    K.ext().limit_isa("avx512")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_gather_qmm_matches_a_float64_reference(isa, bits, group_size, scale_dtype):
    E, N, D, k = 16, 96, 256, 4
    wq, s, b = quantized((E, N, D), bits, group_size, scale_dtype)
    ref_w = dequantized64(wq, s, b, bits, group_size)
    rng = np.random.default_rng(bits * group_size)
    for rows in (1, 4, 16, 96):  # 96 x 4 rows over 16 experts: the rows of an expert tiled (from 8)
        x = mx.array(rng.standard_normal((rows, 1, 1, D)).astype(np.float32))  # SwitchGLU's gate/up call
        idx = mx.array(rng.integers(0, E, size=(rows, k)).astype(np.int32))
        y = K.gather_qmm(x, wq, s, b, idx, bits=bits, group_size=group_size)
        assert y.shape == (rows, k, 1, N) and y.dtype == mx.float32
        xn, ii = np.array(x, dtype=np.float64), np.array(idx)
        ref = np.stack([np.stack([xn[r, 0] @ ref_w[ii[r, j]].T for j in range(k)]) for r in range(rows)])
        assert rel_l2(y, ref) < 1e-5, (rows, rel_l2(y, ref))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.bfloat16])
def test_quantized_matmul_matches_a_float64_reference(isa, bits, scale_dtype):
    N, D = 200, 384
    wq, s, b = quantized((N, D), bits, 64, scale_dtype, seed=3)
    ref_w = dequantized64(wq, s, b, bits, 64)
    for lead in ((1,), (2, 5), (16,), (70,)):
        x = mx.random.normal((*lead, D), key=mx.random.key(len(lead)))
        y = K.quantized_matmul(x, wq, s, b, bits=bits, group_size=64)
        assert y.shape == (*lead, N)
        assert rel_l2(y, np.array(x, dtype=np.float64) @ ref_w.T) < 1e-5


@pytest.mark.parametrize("bits, k", [(4, 96), (4, 32), (8, 96), (4, 192), (8, 160)])
def test_widths_that_are_not_whole_blocks_match_the_reference(isa, bits, k):
    """K not a multiple of the AVX-512 loops' block (128 values at 4 bits, 64 at 8): the AVX2
    loops compute it; not a multiple of theirs (64, 32) either: the portable loops, as
    accurately."""
    wq, s, b = quantized((6, 40, k), bits, 32, mx.bfloat16, seed=5)
    x = mx.random.normal((3, 1, 1, k), key=mx.random.key(7))
    idx = mx.array([[0, 5], [2, 2], [4, 1]], dtype=mx.uint32)
    ref_w, xn, ii = dequantized64(wq, s, b, bits, 32), np.array(x, dtype=np.float64), np.array(idx)
    ref = np.stack([np.stack([xn[r, 0] @ ref_w[ii[r, j]].T for j in range(2)]) for r in range(3)])
    assert rel_l2(K.gather_qmm(x, wq, s, b, idx, bits=bits, group_size=32), ref) < 1e-5


@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(isa, bits):
    """From 8 rows against one expert's weights each weight row is decoded once and the rows'
    products are tiles: a row's result is the same, bit for bit, whatever rows share its
    call and wherever the tiles' boundaries fall."""
    wq, s, b = quantized((4, 100, 256), bits, 32, mx.bfloat16, seed=9)
    x = mx.random.normal((40, 1, 256), key=mx.random.key(11))
    idx = mx.array([0] * 20 + [3] * 20, dtype=mx.uint32)
    whole = K.gather_qmm(x, wq, s, b, idx, bits=bits, group_size=32)
    part = K.gather_qmm(x[3:14], wq, s, b, idx[3:14], bits=bits, group_size=32)  # 11 rows of expert 0
    assert mx.array_equal(whole[3:14], part).item()
    dense = K.quantized_matmul(x[:, 0], wq[3], s[3], b[3], bits=bits, group_size=32)
    assert mx.array_equal(dense[20:], whole[20:, 0]).item()  # the dense call: its rows tiled alike


def test_the_sorted_and_the_down_projection_calls_match_mlx():
    """SwitchGLU's other two call shapes: rows sorted by expert ([T*k, 1, D] against [T*k])
    and the down projection ([T, k, 1, I] against [T, k])."""
    E, N, D = 8, 64, 128
    wq, s, b = quantized((E, N, D), 4, 64, mx.float32)
    rng = np.random.default_rng(1)
    idx = mx.array(np.sort(rng.integers(0, E, size=40)).astype(np.uint32))
    x = mx.random.normal((40, 1, D))
    theirs = mx.gather_qmm(x, wq, s, b, rhs_indices=idx, transpose=True, group_size=64, bits=4)
    assert rel_l2(K.gather_qmm(x, wq, s, b, idx), np.array(theirs, dtype=np.float64)) < 1e-5
    idx2 = mx.array(rng.integers(0, E, size=(5, 4)).astype(np.int32))
    x2 = mx.random.normal((5, 4, 1, D))
    theirs = mx.gather_qmm(x2, wq, s, b, rhs_indices=idx2, transpose=True, group_size=64, bits=4)
    assert rel_l2(K.gather_qmm(x2, wq, s, b, idx2), np.array(theirs, dtype=np.float64)) < 1e-5


def test_results_do_not_depend_on_the_thread_count():
    wq, s, b = quantized((32, 512, 1024), 4, 64, mx.bfloat16)
    x = mx.random.normal((16, 1, 1, 1024))
    idx = mx.array(np.random.default_rng(2).integers(0, 32, size=(16, 8)).astype(np.uint32))
    before = K.get_threads()
    try:
        outs = []
        for n in (1, 2, 3, 7):
            K.set_threads(n)
            outs.append(K.gather_qmm(x, wq, s, b, idx))
            mx.eval(outs[-1])
    finally:
        K.set_threads(before)
    assert all(mx.array_equal(o, outs[0]).item() for o in outs[1:])


_SPIN_SCRIPT = """
import sys, numpy as np, mlx.core as mx
from edge0.backend.mlx import kernels as K
rng = np.random.default_rng(3)
w = mx.random.randint(0, 2**32, (16, 256, 64), dtype=mx.uint32, key=mx.random.key(0))
s = mx.random.uniform(0.01, 0.02, (16, 256, 8), key=mx.random.key(1)).astype(mx.bfloat16)
b = mx.random.uniform(-0.1, 0.1, (16, 256, 8), key=mx.random.key(2)).astype(mx.bfloat16)
x = mx.random.normal((1, 1, 1, 512), key=mx.random.key(3))
outs = []
for threads in (1, 3):
    K.set_threads(threads)
    res = []
    for i in range(60):  # back-to-back calls: workers wake from spinning, or from sleep
        idx = mx.array(rng.integers(0, 16, size=(1, 4)).astype(np.uint32))
        res.append(np.array(K.gather_qmm(x, w, s, b, idx)))
    outs.append(np.stack(res))
    rng = np.random.default_rng(3)
np.save(sys.argv[1], np.stack(outs))
"""


@pytest.mark.parametrize("spin_us", ["0", "100000"])
def test_workers_that_sleep_or_spin_between_calls_give_the_same_results(tmp_path, spin_us):
    """EDGE0_KERNEL_SPIN_US bounds how long a worker spins before it sleeps; with 0 every
    call wakes sleeping workers, with a long spin none sleeps: both give the one-thread result."""
    import os
    import subprocess
    import sys

    out = tmp_path / "r.npy"
    env = dict(os.environ, EDGE0_KERNEL_SPIN_US=spin_us)
    subprocess.run([sys.executable, "-c", _SPIN_SCRIPT, str(out)], env=env, check=True, timeout=120)
    one, three = np.load(out)
    assert np.array_equal(one, three) and np.isfinite(one).all() and np.abs(one).max() > 0


def test_non_contiguous_inputs_give_the_contiguous_result():
    wq, s, b = quantized((8, 64, 256), 4, 64, mx.float32)
    base = mx.random.normal((6, 256))
    x = mx.random.normal((256, 6)).T  # transposed: not row-contiguous
    idx = mx.array(np.arange(12, dtype=np.uint32) % 8).reshape(6, 2)
    want = K.gather_qmm(mx.array(np.array(x))[:, None, None, :], wq, s, b, idx)
    assert mx.array_equal(K.gather_qmm(x[:, None, None, :], wq, s, b, idx), want).item()
    wide = mx.stack([wq, wq], axis=2).reshape(8, 128, -1)[:, ::2]  # a strided view of the weight
    assert mx.array_equal(K.gather_qmm(base[:, None, None, :], wide, s, b, idx),
                          K.gather_qmm(base[:, None, None, :], wq, s, b, idx)).item()


def test_zero_rows_give_an_empty_result():
    wq, s, b = quantized((4, 32, 64), 4, 64, mx.float32)
    y = K.gather_qmm(mx.zeros((0, 1, 1, 64)), wq, s, b, mx.zeros((0, 2), dtype=mx.uint32))
    assert y.shape == (0, 2, 1, 32)
    assert K.quantized_matmul(mx.zeros((0, 64)), wq[0], s[0], b[0]).shape == (0, 32)


@pytest.mark.parametrize("case, message", [
    ("odd_groups", "not a multiple of group_size"),
    ("bits", "bits must be one of"),
    ("group_size", "group_size must be one of"),
    ("scales_shape", "scales (4, 16, 2) and biases (4, 16, 2) must both be"),
    ("x_dims", "x must be [batch, rows, K]"),
    ("k_mismatch", "x has K = 128"),
    ("no_biases", "needs biases"),
    ("broadcast", "does not broadcast"),
])
def test_hostile_inputs_get_a_kernel_error(case, message):
    wq, s, b = quantized((4, 32, 128), 4, 64, mx.float32)
    x = mx.random.normal((3, 1, 1, 128))
    idx = mx.zeros((3, 2), dtype=mx.uint32)
    call = {
        "odd_groups": lambda: K.gather_qmm(mx.zeros((3, 1, 1, 96)), wq[..., :12], s, b, idx, group_size=64),
        "bits": lambda: K.gather_qmm(x, wq, s, b, idx, bits=3),
        "group_size": lambda: K.gather_qmm(x, wq, s, b, idx, group_size=48),
        "scales_shape": lambda: K.gather_qmm(x, wq, s[:, :16], b[:, :16], idx),
        "x_dims": lambda: K.ext().qmm(mx.zeros((3, 128)), wq, s, b, mx.zeros((3,), dtype=mx.uint32), 4, 64, 1),
        "k_mismatch": lambda: K.gather_qmm(x, wq[..., :8], s, b, idx),
        "no_biases": lambda: K.gather_qmm(x, wq, s, None, idx),
        "broadcast": lambda: K.gather_qmm(x, wq, s, b, mx.zeros((5, 2), dtype=mx.uint32)),
    }[case]
    with pytest.raises((KernelError, ValueError), match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")) as info:
        call()
    if case != "x_dims":  # the raw extension raises ValueError; the ops raise the typed error
        assert isinstance(info.value, KernelError)


def test_an_index_out_of_range_is_an_error_at_evaluation_not_a_crash():
    wq, s, b = quantized((4, 32, 64), 4, 64, mx.float32)
    idx = mx.array(np.array([[0, 1], [2, 9]], dtype=np.uint32))
    y = K.gather_qmm(mx.random.normal((2, 1, 1, 64)), wq, s, b, idx)
    with pytest.raises(RuntimeError, match=r"expert index 9 at position 3 is outside \[0, 4\)"):
        mx.eval(y)
    neg = K.gather_qmm(mx.random.normal((1, 1, 1, 64)), wq, s, b, mx.array([[-1, 0]], dtype=mx.int32))
    with pytest.raises(RuntimeError, match=r"expert index -1 at position 0"):
        mx.eval(neg)
    # the process and the kernels go on
    ok = K.gather_qmm(mx.random.normal((1, 1, 1, 64)), wq, s, b, mx.array([[3, 0]], dtype=mx.uint32))
    mx.eval(ok)


def test_the_kernels_setting_is_validated():
    with pytest.raises(ConfigError, match="kernels must be auto, edge0 or mlx, got 'fast'"):
        EngineConfig(kernels="fast")
    assert K.resolve("auto", cpu=True, compute_dtype="float32") == "edge0"
    assert K.resolve("auto", cpu=True, compute_dtype="bfloat16") == "mlx"
    assert K.resolve("auto", cpu=False, compute_dtype="float32") == "mlx"
    with pytest.raises(ConfigError, match="run on MLX's CPU device"):
        K.resolve("edge0", cpu=False, compute_dtype="float32")


def test_kernels_edge0_is_a_config_error_where_the_extension_is_missing(monkeypatch):
    from edge0.backend.mlx.kernels import _loader

    monkeypatch.setattr(_loader, "_ext", None)
    monkeypatch.setattr(_loader, "_reason", "the extension is not built (test)")
    from tests.test_async_misuse import edge0_threads, open_fds

    import gc

    gc.collect()  # earlier tests' garbage closed now, not during the count
    fds, threads = open_fds(), edge0_threads()
    with pytest.raises(ConfigError, match=r"kernels='edge0': the extension is not built \(test\)"):
        Engine(DEMO, EngineConfig(kernels="edge0"))
    assert (open_fds(), edge0_threads()) == (fds, threads)  # the refused open left nothing open
    assert K.resolve("auto", cpu=True, compute_dtype="float32") == "mlx"


def test_demo_greedy_text_equals_mlx_kernels_for_64_tokens():
    texts = {}
    for kernels in ("edge0", "mlx"):
        with Engine(DEMO, EngineConfig(kernels=kernels)) as e:
            assert e.streaming.kernels == kernels
            texts[kernels] = [[ev.token for ev in e.stream(p, max_tokens=64)] for p in README_PROMPTS]
    assert texts["edge0"] == texts["mlx"]


def test_edge0_kernels_compute_every_quantized_module_and_the_stats_line_names_them():
    with Engine(DEMO, EngineConfig(kernels="edge0")) as e:
        names = {type(m).__name__ for _, m in e.streaming.model.named_modules()}
        assert "QuantizedLinear" not in names and "Edge0QuantizedLinear" in names
        assert all(type(c).__name__ == "Edge0SwitchLinear"
                   for t in e.streaming.switches().values() for _, c in t.template.named_modules()
                   if "SwitchLinear" in type(c).__name__)
        events = list(e.stream("def f(x):", max_tokens=4))
    n = K.get_threads()
    assert f"kernels edge0 ({K.isa()}, {n} thread{'s' if n != 1 else ''})" in events[-1].stats.line()
    with Engine(DEMO, EngineConfig(kernels="mlx")) as e:
        assert "Edge0QuantizedLinear" not in {type(m).__name__ for _, m in e.streaming.model.named_modules()}
        events = list(e.stream("def f(x):", max_tokens=4))
    assert "| kernels mlx |" in events[-1].stats.line()


def test_the_c_plus_plus_harness_builds_and_times_the_kernel(tmp_path):
    """tools/qmm_bench.cpp (the kernels timed without MLX, docs/KERNELS.md) builds with the
    line its header gives and prints its percentiles; a bad flag exits 2."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("g++") is None:
        pytest.skip("no g++")
    root = Path(__file__).resolve().parents[1]
    csrc = root / "src" / "edge0" / "backend" / "mlx" / "kernels" / "csrc"
    exe = tmp_path / "qmm_bench"
    subprocess.run(["g++", "-O2", "-std=c++17", "-I", str(csrc), str(root / "tools" / "qmm_bench.cpp"),
                    str(csrc / "qmm.cpp"), "-o", str(exe), "-lpthread"], check=True, timeout=300)
    out = subprocess.run([str(exe), "--n", "64", "--k", "128", "--experts", "4", "--threads", "2", "--calls", "10"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    p10, p50, p90 = map(float, re.search(r"p10 ([\d.]+) p50 ([\d.]+) p90 ([\d.]+) ms", out).groups())
    assert 0 < p10 <= p50 <= p90
    assert subprocess.run([str(exe), "--bogus", "1"], capture_output=True, timeout=60).returncode == 2


def test_the_kernel_is_timed_against_another_commits_in_one_process():
    """tools/qmm_vs.sh builds this tree's kernel and another commit's into one program, which
    alternates their calls and counts the calls whose outputs differ in any bit: none against
    the commit checked out (the kernel sources there are this tree's when unchanged)."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if shutil.which("g++") is None or shutil.which("git") is None:
        pytest.skip("no g++ or git")
    csrc = "src/edge0/backend/mlx/kernels/csrc/"
    if subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD", "--", csrc + "qmm.cpp", csrc + "qmm.h"],
                      capture_output=True, timeout=60).returncode != 0:
        pytest.skip("not a git checkout, or the kernel changed since HEAD")
    out = subprocess.run([str(root / "tools" / "qmm_vs.sh"), "HEAD", "64", "128", "2"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = re.search(r"n 64 k 128 threads 2: this tree ([\d.]+) ms, other ([\d.]+) ms .*differing: (\d+) of 300", out.stdout)
    assert line is not None, out.stdout
    assert float(line.group(1)) > 0 and float(line.group(2)) > 0 and line.group(3) == "0"


@pytest.mark.parametrize("cap", ["avx2", "portable"])
def test_edge0_kernel_isa_caps_the_loops_and_the_stats_line_says_which_ran(cap):
    """EDGE0_KERNEL_ISA, read when the extension loads, caps the loops; the same numbers to
    float32's rounding; the stats line names the loops that ran."""
    import subprocess
    import sys

    if ISAS.index(cap) < ISAS.index(K.isa()):
        pytest.skip(f"this CPU's widest loops are {K.isa()}")
    code = ("from edge0 import Engine, EngineConfig\nfrom edge0.backend.mlx import kernels as K\n"
            "with Engine('src/edge0/data/demo_model', EngineConfig(kernels='edge0')) as e:\n"
            "    events = list(e.stream('def f(x):', max_tokens=4))\n"
            "print(K.isa(), '|', events[-1].stats.line())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "EDGE0_KERNEL_ISA": cap})
    assert done.returncode == 0, done.stderr[-2000:]
    isa, line = done.stdout.strip().splitlines()[-1].split(" | ", 1)
    assert isa == cap and f"kernels edge0 ({cap}, " in line
