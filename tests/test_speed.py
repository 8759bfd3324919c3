"""The speed forecast (``edge0 plan --speed``, ``edge0 bench --forecast``): a step is the
replica's own step plus the kernels at the real widths plus the reads it waits for; each
measurement is made once and cached; the replica keeps the checkpoint's layer pattern."""

from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace

import pytest

from edge0 import speed
from edge0.cli import main
from tests.test_async_misuse import setups  # noqa: F401


@pytest.fixture
def speed_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE0_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "speed"


def _plan(*args: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *args])
    return code, out.getvalue() + err.getvalue()


def _no_measuring(monkeypatch) -> None:
    """Every measurement fails: what a forecast then gives comes from the cache."""
    def refuse(*a, **k):
        raise AssertionError("measured again")
    from edge0.backend import timing

    for name in ("dense_seconds", "step_pair_seconds", "attention_seconds"):
        monkeypatch.setattr(timing, name, refuse)
    from edge0.io_sched import drive_rate

    for name in ("drive_seconds_per_byte", "copy_seconds_per_byte"):
        monkeypatch.setattr(drive_rate, name, refuse)
    import edge0.benchmark.harness as harness

    monkeypatch.setattr(harness, "run_bench", refuse)


@pytest.mark.parametrize("config", ["staged+heads", "exact"])
def test_plan_forecasts_a_step_as_its_measured_terms_and_measures_once(setups, config, speed_cache, monkeypatch):
    d, cfg, _, _ = setups[config]
    flags = ["--prerouter", "on" if config == "staged+heads" else "off"]
    code, out = _plan("--model", str(d), "--speed", "--prompt-tokens", "64", "--json", *flags)
    assert code == 0, out
    sp = json.loads(out)["speed"]
    t = sp["terms_ms"]
    assert t["replica_step"] > 0 and sp["prompt_tokens"] == 64
    assert sp["step_ms"] == pytest.approx(t["replica_step"] - t["replica_copies"] + t["kernels"] + t["heads_flush"]
                                          + t["reads_exposed"])
    assert sp["compute_ms"] == pytest.approx(t["replica_step"] - t["replica_copies"] + t["kernels"] + t["heads_flush"])
    assert sp["decode_tok_s"] == pytest.approx(1e3 / sp["step_ms"])
    for entry in speed_cache.glob("*.json"):  # an entry's key names what it holds: an older entry is measured anew
        kept = json.loads(entry.read_text())
        if "measures" in kept["key"]:
            assert set(kept["value"]) == set(kept["key"]["measures"]), entry.name
    assert sp["ttft_s"] * 1e3 == pytest.approx(t["prefill_replica"] + t["prefill_kernels"] + t["prefill_attention"]
                                               + t["prompt_reads"])
    kinds = {p.name.split("-")[0] for p in speed_cache.glob("*.json")}
    assert {"replica", "kernels", "attention"} <= kinds
    _no_measuring(monkeypatch)  # a second forecast measures nothing and says the same
    code, again = _plan("--model", str(d), "--speed", "--prompt-tokens", "64", "--json", *flags)
    assert code == 0, again
    assert json.loads(again)["speed"] == sp
    code, text = _plan("--model", str(d), "--speed", "--prompt-tokens", "64", *flags)
    assert f"speed forecast on this machine: {sp['decode_tok_s']:.2f} tok/s decode" in text
    assert "64-token prompt" in text and "assumed: the engine's own step measured on a replica" in text


def test_the_replicas_own_copies_into_slots_are_taken_out_where_layers_read_on_demand(setups, speed_cache):
    d = setups["exact"][0]
    code, out = _plan("--model", str(d), "--speed", "--prompt-tokens", "8", "--json", "--expert-source", "slots")
    assert code == 0, out
    t = json.loads(out)["speed"]["terms_ms"]
    (replica,) = [json.loads(p.read_text())["value"] for p in speed_cache.glob("replica-*.json")]
    (copy,) = [json.loads(p.read_text())["value"] for p in speed_cache.glob("copy-*.json")]
    assert replica["expert_bytes"] > 0  # exact over slots: the replica copied its experts every step
    assert t["replica_copies"] == pytest.approx(replica["expert_bytes"] * copy * 1e3)
    assert 0 < t["replica_copies"] < t["replica_step"]


def test_plan_refuses_a_prompt_of_no_tokens(setups):
    d = setups["exact"][0]
    code, out = _plan("--model", str(d), "--speed", "--prompt-tokens", "0")
    assert code == 2 and "--prompt-tokens must be at least 1, got 0" in out


def test_the_replica_keeps_the_checkpoints_architecture_moe_layers_and_widths(tiny_model_factory, speed_cache,
                                                                               monkeypatch):
    from edge0.model.open import open_checkpoint

    d = tiny_model_factory("qwen3_moe", layers=5, experts=24, k=3, hidden=192, moe_intermediate=128,
                           mlp_only_layers=(0, 3), num_attention_heads=3, num_key_value_heads=1, head_dim=48)
    spec, index, _ = open_checkpoint(d)
    raw = json.loads((d / "config.json").read_text())
    rc = speed.replica_config(spec, raw, speed.products(spec, index))
    rspec, _, _ = open_checkpoint(speed.replica_dir(rc))
    assert rspec.model_type == spec.model_type and rspec.num_layers == spec.num_layers
    assert (rspec.num_experts, rspec.k) == (spec.num_experts, spec.k)
    assert rspec.moe_layers == spec.moe_layers == (1, 2, 4)
    rraw = json.loads((speed.replica_dir(rc) / "config.json").read_text())
    widths = ("hidden_size", "moe_intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    assert {w: rraw[w] for w in widths} == {w: raw[w] for w in widths} == {
        "hidden_size": 192, "moe_intermediate_size": 128, "num_attention_heads": 3, "num_key_value_heads": 1,
        "head_dim": 48}
    assert rraw["vocab_size"] <= raw["vocab_size"]
    # experts that would not fit the replica's budget: halved while 2k (and at least 8) stay
    from edge0.backend import timing

    routed = [c for c in speed.products(spec, index)["calls"] if c[0] == "routed"]
    assert len(routed) == 3 * 3  # gate, up, down of 3 MoE layers, one expert's shape each
    one = sum(timing.nbytes(c[1], c[2], c[3], 2) for c in routed)  # an expert's bytes over the layers
    assert one == 3 * 3 * (128 * 192 // 2 + 2 * 128 * 192 // 64 * 2)  # 4-bit words, bfloat16 scales and biases
    for budget, experts in ((30, 24), (13, 12), (1, 12)):
        monkeypatch.setattr(speed, "REPLICA_EXPERT_BYTES", budget * one)
        assert speed.replica_config(spec, raw, speed.products(spec, index))["experts"] == experts


def _lay(staged: list[int], layers: int = 4, source: str = "slots", direct: bool = True):
    spec = SimpleNamespace(moe_layers=tuple(range(layers)))
    plan = SimpleNamespace(source=source, direct=direct, planned=0, limit=1)
    return SimpleNamespace(plan=plan, on={"staged": staged}, opened=SimpleNamespace(spec=spec))


@pytest.mark.parametrize("compute", [0.010, 0.500])
def test_staged_reads_run_beside_the_compute_and_slow_it_and_on_demand_reads_do_not(monkeypatch, speed_cache,
                                                                                     compute):
    import os

    # 1 GB/s the first time (4 read again at once), 0.5 while the kernels compute; the kernels 1.5x as long
    # while the drive reads
    drive = {"fresh": 1e-9, "wall": 0.25e-9, "cpu": 0.5e-9, "fresh_busy": 2e-9, "compute_busy": 1.5}
    monkeypatch.setattr(speed, "_drive", lambda lay, direct, kernels: drive)
    from edge0.io_sched import drive_rate

    monkeypatch.setattr(drive_rate, "copy_seconds_per_byte", lambda: 1e-10)  # 10 GB/s
    fc = {"disk_bytes_per_token": 100e6, "expert_bytes_per_token": 300e6}
    reads = 100e6 * 1e-9 + 200e6 * 1e-10  # 0.12 s
    total, added, _ = speed._reads(_lay(staged=[]), fc, compute)
    assert total == pytest.approx(reads) and added == pytest.approx(reads)  # exact: on the step's path
    total, added, said = speed._reads(_lay(staged=[1, 2, 3]), fc, compute)
    beside = (100e6 * 2e-9 + 200e6 * 1e-10) * 3 / 4  # the staged reads' time while the kernels compute: 0.165 s
    copies = 200e6 * 1e-10 * 3 / 4 / len(os.sched_getaffinity(0))  # the copies' CPU, a share of the cores
    if compute == 0.010:  # the reads outlast the compute: it runs 1.5x as long, then the reads' rest at the idle rate
        slowed = compute * 1.5 + copies
        assert added == pytest.approx(reads / 4 + (slowed - compute) + (1 - slowed / beside) * reads * 3 / 4)
    else:  # the compute outlasts the reads: slowed for as long as they run, nothing of them left
        slowed = compute + beside * (1 - 1 / 1.5) + copies
        assert added == pytest.approx(reads / 4 + slowed - compute)
    assert "beside the compute" in said[1] and "0.50 while the kernels compute" in said[0]
    assert "the compute 1.50x as long while they run" in said[1] and "1.00 GB/s, the rate of experts read the first" \
        in said[0] and "read again at once: 4.00" in said[0]
    assert speed._reads(_lay(staged=[1, 2, 3], source="mapping"), fc, compute)[:2] == (0.0, 0.0)


def test_a_prompt_and_a_decode_read_their_experts_at_the_rate_of_a_first_read(monkeypatch, speed_cache):
    drive = {"fresh": 4e-9, "wall": 1e-9, "cpu": 0.5e-9, "fresh_busy": 4e-9, "compute_busy": 1.0}
    monkeypatch.setattr(speed, "_drive", lambda lay, direct, kernels: drive)
    lay = _lay(staged=[])
    lay.opened.spec.num_experts, lay.opened.spec.k = 16, 2
    lay.opened.index = SimpleNamespace(layers={l: SimpleNamespace(expert_bytes=1e6) for l in range(4)})
    fc = {"disk_bytes_per_token": 100e6, "expert_bytes_per_token": 100e6, "prompt_experts": 40, "source": "trace"}
    seconds, why = speed._prompt_reads(lay, 64, fc, "edge0")
    assert seconds == pytest.approx(40 * 1e6 * 4e-9) and "read the first time" in why
    assert speed._reads(lay, fc, 0.01)[0] == pytest.approx(100e6 * 4e-9)  # not the faster second read's


def test_bench_prints_the_forecast_beside_what_each_arm_measured(setups, speed_cache, tmp_path):
    d = setups["exact"][0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["bench", "--model", str(d), "--arms", "exact,resident", "--forecast", "--rounds", "1", "--cache",
                     "warm", "--prompt-tokens", "8", "--decode-tokens", "4", "--no-progress", "--no-chart",
                     "--out", str(tmp_path / "b")])
    assert code == 0, out.getvalue()
    doc = json.loads((tmp_path / "b" / "bench-warm.json").read_text())
    forecast = doc["arms"]["exact"]["forecast"]
    assert forecast["decode_tok_s"] > 0 and forecast["prompt_tokens"] == 8
    assert "forecast" not in doc["arms"]["resident"]  # mlx-lm's own model: no plan to forecast
    measured = doc["arms"]["exact"]["decode_tps"]["median"]
    prefill = 8 / doc["arms"]["exact"]["prefill_tps"]["median"]
    assert forecast["probe_ms"] > 0 and len(doc["arms"]["exact"]["probe_ms"]) == 1  # the machine's speed, both times
    row = (f"| exact | {forecast['decode_tok_s']:.2f} | {measured:.2f} | "
           f"{forecast['decode_tok_s'] / measured:.2f}x | {forecast['ttft_s']:.2f} | {prefill:.2f} |")
    assert row in out.getvalue() and row in (tmp_path / "b" / "bench.md").read_text()


def test_the_drive_is_read_idle_and_beside_a_step_of_products_whose_slowdown_is_measured(setups, monkeypatch):
    import time

    from edge0.io_sched import drive_rate
    from edge0.model.open import open_checkpoint

    monkeypatch.setattr(drive_rate, "DRIVE_BYTES", 2**20)
    _, index, _ = open_checkpoint(setups["exact"][0])
    real = drive_rate.drive_seconds_per_byte(index, 2, direct=False)  # the real reads, idle only
    assert real["wall"] > 0 and real["fresh"] > 0 and real["cpu"] >= 0 and real["fresh_busy"] == real["fresh"]
    assert real["compute_busy"] == 1.0
    steps, seen, reading = [], [], []

    def step():
        steps.append(1)
        time.sleep(0.001)

    def timed(run):  # a step takes 3 ms idle and 6 ms while the drive reads beside it
        busy = bool(reading)
        run()
        return 0.006 if busy and reading else 0.003
    monkeypatch.setattr(drive_rate, "_timed", timed)

    idle = drive_rate.IDLE_PASSES
    # each idle pass's experts read twice: the first reads (median 0.6), the second (median 0.2); then, beside
    # the products, other experts read once each pass
    passes = iter([0.5, 0.3, 0.7, 0.1, 0.6, 0.2] + [0.9] * drive_rate.BUSY_PASSES)
    ranges_read = []

    def reads(ranges, threads, direct):  # each pass: how many steps ran while it read
        before = len(steps)
        ranges_read.append(ranges)
        if len(seen) >= 2 * idle:  # the idle passes are the first; the products run beside the busy reads
            reading.append(1)
        took = next(passes)
        time.sleep(took / 2)
        reading.clear()
        seen.append(len(steps) - before)
        return took, 0.01, 1000
    monkeypatch.setattr(drive_rate, "_read_ranges", reads)
    out = drive_rate.drive_seconds_per_byte(index, 2, direct=False, busy=lambda: step)
    assert seen[:2 * idle] == [0] * 2 * idle and seen[2 * idle] > 0  # the products ran beside the later passes
    assert out["fresh"] == pytest.approx(0.6 / 1000) and out["wall"] == pytest.approx(0.2 / 1000)
    busy = ranges_read[2 * idle:]
    assert busy and all(r not in ranges_read[:2 * idle] for r in busy)  # experts the idle passes did not read ...
    assert len({str(r) for r in busy}) == len(busy)  # ... each read once: the first read's rate beside the products
    assert out["fresh_busy"] == pytest.approx(0.9 / 1000)
    assert out["compute_busy"] == pytest.approx(2.0)  # 6 ms beside the reads against 3 ms idle


def test_the_drive_is_read_in_one_task_a_thread_as_the_engines_readers_read(tmp_path, monkeypatch):
    import concurrent.futures
    import os

    from edge0.io_sched import drive_rate

    f = tmp_path / "experts.bin"
    f.write_bytes(os.urandom(64 * 8192))
    ranges = [(str(f), i * 8192 + 100, 5000) for i in range(40)]  # unaligned: each read widened to whole pages
    tasks, calls = [], []
    submit, preadv = concurrent.futures.ThreadPoolExecutor.submit, os.preadv
    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit",
                        lambda pool, *a, **k: tasks.append(1) or submit(pool, *a, **k))
    monkeypatch.setattr(drive_rate.os, "preadv", lambda *a: calls.append(1) or preadv(*a))
    wall, cpu, got = drive_rate._read_ranges(ranges, 3, direct=False)
    assert len(tasks) == 3 and len(calls) == 40  # a task a thread, not a task a read
    assert got == 40 * 8192 and wall > 0 and cpu >= 0


def test_a_forecast_leaves_the_kernels_thread_count_as_it_was(setups, speed_cache):
    from edge0.backend import kernels as bk

    if not bk.available():
        pytest.skip("Edge0's kernels are not built")
    before = bk.get_threads()
    try:
        bk.set_threads(1)  # an engine beside, on one thread
        code, out = _plan("--model", str(setups["exact"][0]), "--speed", "--prompt-tokens", "8", "--json")
        assert code == 0, out
        assert json.loads(out)["speed"]["decode_tok_s"] > 0 and bk.get_threads() == 1
    finally:
        bk.set_threads(before)


def test_a_forecast_with_integer_products_measures_them_and_leaves_them_as_they_were(setups, speed_cache):
    """``--int8-products on``: the replica runs with them and the kernels' extra time is
    measured with them (each its own cache entry); the process's setting is put back."""
    from edge0.backend import kernels as bk

    if not bk.available() or not bk.set_int8_products(False):
        pytest.skip("Edge0's kernels are not built")
    if not bk.set_int8_products(True):
        pytest.skip("needs a CPU with AVX-512 VNNI")
    bk.set_int8_products(False)
    code, out = _plan("--model", str(setups["exact"][0]), "--speed", "--prompt-tokens", "8", "--json",
                      "--int8-products", "on")
    assert code == 0, out
    assert json.loads(out)["speed"]["decode_tok_s"] > 0 and not bk.int8_products()
    keys = {p.name.split("-")[0]: json.loads(p.read_text())["key"] for p in speed_cache.glob("*.json")}
    assert keys["kernels"].get("int8_products") is True
    assert '"int8_products": "on"' in json.dumps(keys["replica"])


def test_the_kernels_extra_time_is_the_real_steps_less_the_replicas_timed_in_turns(monkeypatch, speed_cache):
    """The checkpoint's products and the replica's alternate in one process (a drift of the
    machine's speed falls on both); the term is the difference of their medians, cached."""
    from edge0.backend import timing

    clock, order = [0.0], []

    def runner(calls, *args):
        cost = {"real": 0.030, "replica": 0.002}[calls]

        def run(i):
            order.append(calls)
            clock[0] += cost * (2 if len(order) > 20 else 1)  # the machine slows down halfway
        return run
    monkeypatch.setattr(timing, "step_runner", runner)
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    prods = lambda calls: {"calls": calls, "scale_dtype": "float32", "experts": 4, "k": 2}
    extra = speed.extra_kernel_seconds(prods("real"), prods("replica"), "edge0", 1)
    assert order[:6] == ["real", "replica"] * 3 and len(order) == 62
    assert extra == pytest.approx(0.060 - 0.004)  # both medians after the slow-down: the same drift
    _no_measuring(monkeypatch)
    assert speed.extra_kernel_seconds(prods("real"), prods("replica"), "edge0", 1) == extra


def test_a_replica_its_model_class_refuses_makes_the_forecast_unavailable_saying_why(setups, speed_cache, monkeypatch):
    import edge0.tiny

    def refuse(*args, **kwargs):
        raise ValueError("num_attention_heads must divide hidden_size")
    monkeypatch.setattr(edge0.tiny, "make_tiny", refuse)
    code, out = _plan("--model", str(setups["exact"][0]), "--speed", "--prompt-tokens", "8", "--json")
    assert code == 0, out
    assert json.loads(out)["speed"] == {"unavailable": "the replica at the checkpoint's widths could not be built: "
                                                       "ValueError: num_attention_heads must divide hidden_size"}
