"""The benchmark checkpoint writer and the A/B harness, on tiny shapes (no heavy runs)."""

from __future__ import annotations

import json
import os
import shutil
from collections import namedtuple

import mlx.core as mx
import pytest

from edge0 import EngineConfig
from edge0.backend import nn as bnn
from edge0.benchmark import arms as arms_mod
from edge0.benchmark import harness
from edge0.benchmark.checkpoint import BYTES_PER_EXPERT_35B, BenchShape, make_bench_checkpoint
from edge0.benchmark.report import markdown
from edge0.loader import load_streaming_model
from edge0.errors import ConfigError

SMALL = BenchShape(layers=2, experts=16, k=4, hidden=256, moe_intermediate=128, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    return make_bench_checkpoint(tmp_path_factory.mktemp("bench") / "m", SMALL, seed=3)


def test_default_shape_is_the_35b_tier():
    shape = BenchShape()
    assert shape.bytes_per_expert == BYTES_PER_EXPERT_35B == 1_769_472
    assert (shape.hidden, shape.experts, shape.moe_intermediate, shape.k) == (2048, 256, 512, 8)
    assert round(shape.expert_bytes / 1e9, 1) == 5.4
    assert round(BenchShape(layers=40).expert_bytes / 1e9, 1) == 18.1


def test_bench_checkpoint_loads_and_streams_like_resident(bench_model):
    from mlx_lm import load

    model, tokenizer = load(str(bench_model))  # mlx-lm itself accepts it
    bnn.cast_model(model, mx.float32)
    s = load_streaming_model(bench_model, EngineConfig(bundle_capacity=4, kernels="mlx"))  # mlx-lm's kernels
    try:
        assert s.index.layers[0].expert_bytes == SMALL.bytes_per_expert
        tokens = mx.array([tokenizer.encode("def f(x):\n    return x * 2\n")])
        assert mx.array_equal(s.model(tokens), model(tokens)).item()
        # routing is spread: a 24-token prompt touches most experts of each layer
        x = mx.random.normal((24, SMALL.hidden))
        inds = s.route(1, s.routers()[1].logits(x).astype(mx.float32))
        assert len(set(inds.flatten().tolist())) >= SMALL.experts // 2
    finally:
        s.close()


def test_bench_checkpoint_refuses_without_disk_room(tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**12, 10**12, 10**6))
    with pytest.raises(ConfigError, match=r"not enough disk space .* needs 0.0\d GB"):
        make_bench_checkpoint(tmp_path / "m", SMALL)
    assert not list((tmp_path / "m").glob("*.safetensors"))


def test_bench_checkpoint_does_not_overwrite(bench_model):
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        make_bench_checkpoint(bench_model, SMALL)


def fake_runner(calls):
    def run(name, model_dir, replay, settings):
        calls.append(name)
        n = len(calls)
        return dict(arm=name, consumed_digest=arms_mod.tokens_digest(replay["prompt"] + replay["continuation"]),
                    argmax_digest="x", decode_tps=10.0 + n, step_ms_median=100.0 / (10.0 + n), prefill_tps=20.0, peak_active_memory=100 * n,
                    peak_rss=1000, expert_bytes_per_token=0.0, read_wait_ms_per_step=0.0, load_seconds=1.0)
    return run


def test_order_rotates_and_a_new_arm_plugs_in(bench_model, monkeypatch):
    monkeypatch.setitem(arms_mod.ARMS, "later-arm", lambda d, s: None)
    monkeypatch.setattr(harness, "make_replay", lambda *a: {"prompt": [1, 2], "continuation": [3]})
    calls = []
    settings = harness.BenchSettings(arms=("resident", "exact", "later-arm"), rounds=4, cache="warm")
    doc = harness.run_bench(bench_model, settings, runner=fake_runner(calls))
    assert doc["orders"] == [["resident", "exact", "later-arm"], ["exact", "later-arm", "resident"],
                             ["later-arm", "resident", "exact"], ["resident", "exact", "later-arm"]]
    assert calls == sum(doc["orders"], [])
    a = doc["arms"]["exact"]
    assert a["decode_tps"]["n"] == 4 and a["decode_tps"]["min"] <= a["decode_tps"]["median"] <= a["decode_tps"]["max"]
    assert doc["arms"]["resident"]["ratio_to_resident"]["decode_tps"] == 1.0


def test_the_machines_speed_is_probed_around_each_round_and_scales_the_forecast(bench_model, monkeypatch):
    monkeypatch.setattr(harness, "make_replay", lambda *a: {"prompt": [1, 2], "continuation": [3]})
    calls, times = [], iter([0.01, 0.03, 0.02, 0.02, 0.04, 0.02])  # seconds; before and after each round

    def probe():
        calls.append("probe")
        return next(times)
    settings = harness.BenchSettings(arms=("exact",), rounds=3, cache="warm")
    forecast = {"decode_tok_s": 5.0, "step_ms": 200.0, "compute_ms": 100.0, "ttft_s": 1.0, "prompt_tokens": 2,
                "probe_ms": 40.0, "terms_ms": {"replica_step": 90.0, "kernels": 5.0, "heads_flush": 5.0}}
    doc = harness.run_bench(bench_model, settings, runner=fake_runner(calls), probe=probe,
                            forecaster=lambda *a: {"exact": forecast})
    assert calls == ["probe", "exact", "probe"] * 3  # around each round, not during it
    assert doc["arms"]["exact"]["probe_ms"] == pytest.approx([20.0, 20.0, 30.0])
    row = next(l for l in markdown(doc).splitlines() if l.startswith("| exact | 5.00"))
    measured = doc["arms"]["exact"]["decode_tps"]["median"]
    # the rounds ran 2x as fast as the forecast's replica (40 ms against 20): its 100 ms of compute is 50
    assert row.endswith(f"| 2.00x | {1e3 / 150.0 / measured:.2f}x |")
    assert "harness" not in row and harness.run_bench(bench_model, settings, runner=fake_runner([]))["arms"][
        "exact"].get("probe_ms") is None  # no probe asked: none timed


def test_variant_of_an_arm_that_reads_no_experts_has_no_bytes_ratio(bench_model, monkeypatch):
    monkeypatch.setattr(harness, "make_replay", lambda *a: {"prompt": [1, 2], "continuation": [3]})
    settings = harness.BenchSettings(arms=("resident", "resident@again"), rounds=2, cache="warm")
    doc = harness.run_bench(bench_model, settings, runner=fake_runner([]))
    v = doc["arms"]["resident@again"]["vs_base_arm"]
    assert v["expert_bytes_per_token_ratio"] is None and v["decode_tps_ratio"]["n"] == 2
    line = next(l for l in markdown(doc).splitlines() if l.startswith("- resident@again vs resident"))
    assert "expert bytes" not in line and "peak MLX active +" in line


def test_bad_settings_are_refused(bench_model):
    with pytest.raises(ConfigError, match=r"unknown arm\(s\) \['nope'\]; available:"):
        harness.run_bench(bench_model, harness.BenchSettings(arms=("nope",)))
    with pytest.raises(ConfigError, match="cache must be one of"):
        harness.run_bench(bench_model, harness.BenchSettings(cache="lukewarm"))


RESULT_KEYS = {"schema", "overlap", "model", "checkpoint_bytes", "settings", "replay", "orders", "arms", "machine"}
ARM_KEYS = {"runs", "consumed_digest", "argmax_digest", "ratio_to_resident", *harness.FIGURES}
RUN_KEYS = {"arm", "settings", "info", "load_seconds", "prompt_tokens", "decode_tokens", "consumed_digest",
            "argmax_digest", "prefill_tps", "decode_tps", "step_ms", "step_ms_median", "read_wait_ms_per_step",
            "expert_bytes_per_token", "disk_bytes_per_token", "prefill_expert_bytes", "peak_active_memory", "peak_rss", "total_wait_ms"}


def test_real_arms_replay_the_same_tokens(bench_model, tmp_path):
    """Two rounds of real child processes, cold cache: identical inputs (and, since exact
    reproduces resident, identical outputs) in every run; stable JSON schema."""
    settings = harness.BenchSettings(arms=("resident", "exact"), rounds=2, cache="cold", prompt_tokens=12,
                                     decode_tokens=4, arm_options={"exact": {"expert_source": "slots"}})
    doc = harness.run_bench(bench_model, settings)
    assert set(doc) == RESULT_KEYS and doc["schema"] == harness.SCHEMA_VERSION
    machine = doc["machine"]  # what it ran on, in the document and its report
    assert machine["cores"] == os.cpu_count() and machine["cpu"] and machine["memory_bytes"] > 2**30
    assert f"Machine: {machine['cpu']}" in markdown(doc) and f"{machine['cores']} cores" in markdown(doc)
    assert len(doc["replay"]["prompt"]) == 12 and len(doc["replay"]["continuation"]) == 4
    digests = {d for a in doc["arms"].values() for d in a["consumed_digest"]}
    outputs = {d for a in doc["arms"].values() for d in a["argmax_digest"]}
    assert len(digests) == 1 and len(outputs) == 1
    for name, a in doc["arms"].items():
        assert set(a) == ARM_KEYS, name
        for run in a["runs"]:
            assert set(run) == RUN_KEYS and run["arm"] == name and len(run["step_ms"]) == 4
    exact, resident = doc["arms"]["exact"], doc["arms"]["resident"]
    assert exact["expert_bytes_per_token"]["median"] >= SMALL.k * SMALL.layers * SMALL.bytes_per_expert
    assert resident["expert_bytes_per_token"]["median"] == 0
    json.dumps(doc)  # serialisable
    table = markdown(doc)
    assert table.count("\n| ") == 3 and "| exact |" in table and "cold" in table


def test_an_arm_over_the_mapping_reads_nothing_and_counts_the_disk_by_its_page_faults(bench_model, tmp_path):
    """An Edge0 arm whose experts are computed where the checkpoint's mapping holds them (the
    default where it fits): the same outputs as resident, nothing read into buffers, the
    source in its info; what the disk gave it is the kernel's count of the process's reads
    (``/proc/self/io``), which a read of pages not in the page cache moves."""
    from edge0.benchmark.machine import proc_read_bytes
    from edge0.io_sched.direct import drop_cached

    settings = harness.BenchSettings(arms=("resident", "exact"), rounds=1, cache="warm", prompt_tokens=8,
                                     decode_tokens=4)
    doc = harness.run_bench(bench_model, settings)
    exact = doc["arms"]["exact"]
    assert {r["info"]["expert_source"] for r in exact["runs"]} == {"mapping"}
    assert exact["expert_bytes_per_token"]["median"] == 0
    assert len({d for a in doc["arms"].values() for d in a["argmax_digest"]}) == 1
    f = tmp_path / "cold.bin"
    f.write_bytes(os.urandom(4 * 2**20))
    drop_cached([str(f)], strict=True)
    before = proc_read_bytes()
    f.read_bytes()
    assert proc_read_bytes() - before >= 4 * 2**20


def test_the_floor_arms_run_on_slots_where_the_checkpoint_fits(bench_model):
    """compute-only and read-only are the staged step without its reads and its reads alone:
    they read into slots even where the checkpoint fits (the default there computes over its
    mapping, which has no reads to switch off or time)."""
    settings = harness.BenchSettings(arms=("compute-only", "read-only"), rounds=1, cache="warm", prompt_tokens=8,
                                     decode_tokens=3)
    doc = harness.run_bench(bench_model, settings)
    for name in ("compute-only", "read-only"):
        run = doc["arms"][name]["runs"][0]
        assert run["info"]["expert_source"] == "slots" and len(run["step_ms"]) == 3, name
    assert doc["arms"]["compute-only"]["runs"][0]["info"]["reads"] == "off"
    assert doc["arms"]["read-only"]["expert_bytes_per_token"]["median"] > 0


def test_memory_limit_parsing_and_errors(monkeypatch):
    from edge0.benchmark import cgroup

    assert cgroup.parse_size("8G") == 8 * 2**30 and cgroup.parse_size("512MiB") == 512 * 2**20
    assert cgroup.parse_size(str(2**30)) == 2**30
    for bad in ("8X", "", "-1G", "1M"):
        with pytest.raises(ConfigError):
            cgroup.parse_size(bad)
    monkeypatch.setattr(cgroup, "_v2_root", lambda: None)
    monkeypatch.setattr(cgroup, "V1", cgroup.Path("/nonexistent"))
    with pytest.raises(ConfigError, match="needs a memory cgroup controller"):
        cgroup.MemoryCap(2**30, "x")


@pytest.mark.skipif(not harness.os.path.isdir("/sys/fs/cgroup") or harness.os.geteuid() != 0,
                    reason="memory cgroups need root")
def test_memory_limit_caps_every_arm_and_reports_oom_as_a_result(bench_model):
    """Under a cap too small for Python and MLX, every run is killed for memory and
    reported as such; under a roomy cap the arms run and the cgroup's peak is reported."""
    tight = harness.BenchSettings(arms=("resident", "exact"), rounds=1, cache="cold", prompt_tokens=12,
                                  decode_tokens=2, memory_limit=24 * 2**20)
    doc = harness.run_bench(bench_model, tight)
    for name, a in doc["arms"].items():
        assert a["did_not_run"].startswith("out of memory at") and a["out_of_memory_runs"] == 1, name
        assert "decode_tps" not in a
    table = markdown(doc)
    assert "| resident | did not run: out of memory at" in table and "capped at **24 MiB**" in table
    roomy = harness.BenchSettings(arms=("resident", "exact"), rounds=1, cache="cold", prompt_tokens=12,
                                  decode_tokens=2, memory_limit=4 * 2**30)
    doc = harness.run_bench(bench_model, roomy)
    for name, a in doc["arms"].items():
        peak = a["cgroup_peak_bytes"]["median"]
        assert 50 * 2**20 < peak < 4 * 2**30 and a["runs"][0]["memory_cap"]["oom_killed"] is False
    assert "peak cgroup (MiB)" in markdown(doc)
    assert not [p for p in harness.Path("/sys/fs/cgroup/memory").glob("edge0-bench-*")]  # groups removed


def test_resident_arm_computes_every_float_in_the_compute_dtype(bench_model):
    """The fair baseline: every floating parameter of mlx-lm's model, the routed experts'
    scales and biases included, is in the compute dtype before timing starts."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from edge0.benchmark.arms import ARMS

    loaded = ARMS["resident"](str(bench_model), {"compute_dtype": "float32"})
    params = dict(tree_flatten(loaded.model.parameters()))
    floats = {k: v.dtype for k, v in params.items() if mx.issubdtype(v.dtype, mx.floating)}
    expert_scales = [k for k in floats if "switch_mlp" in k and k.endswith((".scales", ".biases"))]
    assert expert_scales, "the bench model's expert stacks must be quantized for this test to mean anything"
    assert {floats[k] for k in floats} == {mx.float32}, {k: d for k, d in floats.items() if d != mx.float32}


def test_variants_are_compared_with_their_base_arm_round_by_round(bench_model, tmp_path):
    """``ARM@label`` variants (here an adapter, and a narrower routing width) get their
    decode and memory against the base arm of the same round, and the run records the
    adapter's bytes and the width it served."""
    from tests.test_adapters import random_adapter

    adapter = random_adapter(bench_model, tmp_path / "a", rank=4)
    weights = mx.load(str(adapter / "adapters.safetensors"))
    adapter_bytes = sum(w.nbytes for w in weights.values())
    settings = harness.BenchSettings(arms=("exact", "exact@lora", "exact@k2"), rounds=2, cache="warm",
                                     prompt_tokens=8, decode_tokens=4,
                                     arm_options={"exact": {"expert_source": "slots"},
                                                  "exact@lora": {"adapter": str(adapter), "expert_source": "slots"},
                                                  "exact@k2": {"experts_per_token": 2, "expert_source": "slots"}})
    doc = harness.run_bench(bench_model, settings)
    arms = doc["arms"]
    assert "vs_base_arm" not in arms["exact"]
    lora, k2 = arms["exact@lora"]["vs_base_arm"], arms["exact@k2"]["vs_base_arm"]
    ratios = [v["decode_tps"] / b["decode_tps"] for b, v in zip(arms["exact"]["runs"], arms["exact@lora"]["runs"])]
    assert lora["arm"] == "exact" and lora["decode_tps_ratio"]["median"] == pytest.approx(sorted(ratios)[0] / 2
                                                                                          + sorted(ratios)[1] / 2)
    assert lora["adapter_bytes"] == adapter_bytes and lora["experts_per_token"] == lora["base_experts_per_token"]
    assert lora["expert_bytes_per_token_ratio"]["median"] == 1.0
    assert k2["adapter_bytes"] == 0 and (k2["experts_per_token"], k2["base_experts_per_token"]) == (2, SMALL.k)
    assert k2["expert_bytes_per_token_ratio"]["max"] < 0.75  # half the experts per token, fewer bytes
    assert str(tmp_path) not in json.dumps(doc) and '"adapter": "a"' in json.dumps(doc)  # names, not paths
    table = markdown(doc)
    assert f"exact@lora vs exact: decode {lora['decode_tps_ratio']['median']:.3f}" in table
    assert f"adapter {adapter_bytes / 2**20:.3f} MiB" in table and "2 experts per token (base arm 4)" in table


def test_resident_at_edge0_is_mlx_lms_model_on_edge0s_kernels(bench_model):
    """``resident@X`` with ``kernels=edge0`` runs mlx-lm's own model with every supported
    quantized module computed by Edge0's kernels (the step without Edge0's executors), and
    gives the resident model's logits to within float rounding."""
    import mlx.core as mx
    import numpy as np

    from edge0.backend.mlx.kernels.ops import Edge0QuantizedLinear, Edge0SwitchLinear
    from edge0.benchmark.arms import ARMS

    plain = ARMS["resident"](str(bench_model), {"compute_dtype": "float32", "arm": "resident"})
    ours = ARMS["resident"](str(bench_model), {"compute_dtype": "float32", "arm": "resident@e",
                                                "arm_options": {"resident@e": {"kernels": "edge0"}}})
    assert plain.info["kernels"] == "mlx" and ours.info["kernels"].startswith("edge0 (")
    kinds = {type(m) for _, m in ours.model.named_modules()}
    assert Edge0SwitchLinear in kinds and Edge0QuantizedLinear in kinds
    assert not {Edge0SwitchLinear, Edge0QuantizedLinear} & {type(m) for _, m in plain.model.named_modules()}
    ids = mx.array([[3, 14, 15, 92, 65, 35]])
    a, b = np.array(plain.model(ids)), np.array(ours.model(ids))
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 1e-4


def test_the_command_shows_a_bar_per_run_and_charts_when_it_can(bench_model, tmp_path):
    """`edge0 bench` said one line per run: it shows a bar over the rounds x arms with the
    run in progress; it draws bench.png whenever matplotlib is installed (no flag needed),
    and says what to install when --chart insists on it."""
    import importlib.util
    import subprocess
    import sys

    def bench(*extra):
        return subprocess.run([sys.executable, "-m", "edge0", "bench", "--model", str(bench_model), "--arms", "exact",
                               "--rounds", "2", "--cache", "warm", "--prompt-tokens", "6", "--decode-tokens", "2",
                               "--out", str(tmp_path / "out"), *extra], capture_output=True, text=True, timeout=600)

    r = bench()
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.replace("\r", "\n").splitlines()
    assert any("bench (warm) round 2/2: exact" in line for line in lines), r.stderr[-1500:]
    assert any("2/2 [" in line for line in lines), r.stderr[-1500:]  # both runs counted
    has_plot = importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / "out" / "bench.png").exists() == has_plot
    if not has_plot:
        insisted = bench("--chart")
        assert insisted.returncode == 2 and "pip install 'edge0[plot]'" in insisted.stderr
    quiet = bench("--no-progress", "--no-chart")
    assert quiet.returncode == 0 and "[bench] round 1/2: exact (warm)" in quiet.stderr


def test_an_arm_with_a_source_runs_on_that_trees_edge0(tmp_path):
    """``--arm-option ARM@label:source=DIR``: the arm's process imports Edge0 from DIR (an A/B
    of two versions in one run), is handed the arm's engine settings without ``source``, and
    a directory that holds no Edge0 is refused naming it."""
    from edge0.benchmark.command import arm_options

    tree = tmp_path / "other"
    (tree / "edge0" / "benchmark").mkdir(parents=True)
    (tree / "edge0" / "__init__.py").write_text("")
    (tree / "edge0" / "benchmark" / "__init__.py").write_text("")
    (tree / "edge0" / "benchmark" / "arms.py").write_text(
        "import json, sys\nimport edge0\n"
        "job = json.load(open(sys.argv[1]))\n"
        "print(json.dumps({'edge0_from': edge0.__file__, 'options': job['settings']['arm_options']}))\n")
    options = arm_options([f"exact@old:source={tree},compute_threads=1", "exact:compute_threads=2"], ("exact", "exact@old"))
    assert options == {"exact@old": {"compute_threads": 1, "source": str(tree.resolve())},
                       "exact": {"compute_threads": 2}}
    # a key with a digit in its name after a comma is a key of its own
    assert arm_options(["exact:kernels=edge0,int8_products=on"], ("exact",)) == {
        "exact": {"kernels": "edge0", "int8_products": "on"}}
    clone = tmp_path / "clone"  # a clone of the src layout: its package under src/
    (clone / "src").mkdir(parents=True)
    (clone / "src" / "edge0").symlink_to(tree / "edge0")
    assert arm_options([f"exact@new:source={clone}"], ("exact@new",)) == {"exact@new": {"source": str((clone / "src").resolve())}}
    replay = {"prompt": [1], "continuation": [2]}
    out = harness.run_arm_process("exact@old", tmp_path, replay, {"arm_options": options})
    assert out["edge0_from"] == str(tree / "edge0" / "__init__.py")
    assert out["options"] == {"exact@old": {"compute_threads": 1}, "exact": {"compute_threads": 2}}
    with pytest.raises(ConfigError, match=f"source {tmp_path} is not an Edge0 source tree"):
        arm_options([f"exact@old:source={tmp_path}"], ("exact@old",))
    assert harness._portable({"arm_options": options})["arm_options"]["exact@old"]["source"] == "other"


@pytest.mark.parametrize("how, says", [
    ("os.kill(os.getpid(), signal.SIGILL)", r"was ended by SIGILL: an instruction this CPU does not run.*AMX"),
    ("sys.exit(3)", r"failed \(exit status 3\):\n\(it printed nothing on stderr\)"),
])
def test_an_arm_that_crashes_is_named_with_its_signal_and_what_to_do(tmp_path, how, says):
    """An arm's process that dies (llama.cpp's SIGILL at an AMX tile load in a VM, with
    nothing on stderr) is a typed error naming the arm, the signal and what to do, never an
    empty message."""
    from edge0.errors import BenchArmError
    from edge0.benchmark.command import arm_options

    tree = tmp_path / "crashing"
    (tree / "edge0" / "benchmark").mkdir(parents=True)
    (tree / "edge0" / "__init__.py").write_text("")
    (tree / "edge0" / "benchmark" / "__init__.py").write_text("")
    (tree / "edge0" / "benchmark" / "arms.py").write_text(f"import os, signal, sys\n{how}\n")
    options = arm_options([f"exact@crash:source={tree}"], ("exact@crash",))
    with pytest.raises(BenchArmError, match=says) as failed:
        harness.run_arm_process("exact@crash", tmp_path, {"prompt": [1], "continuation": [2]}, {"arm_options": options})
    assert failed.value.arm == "exact@crash" and str(failed.value).startswith("exact@crash ")
