"""Experts computed where the checkpoint's mapping holds them (``expert_source``).

- the kernel over a mapped file equals the kernel over arrays holding the same bytes, bit
  for bit, at any byte offset (safetensors does not align its tensors), for 4 and 8 bits,
  every group size and scale dtype; an offset past the file is a KernelError naming it;
- through the engine, sync and async, with and without heads and adapter, on every path:
  the same tokens as over slots, nothing read (0 MiB a token), the stats line says
  ``reads mapped``, the plan holds no expert buffer and names the mapping;
- ``auto`` maps only where it can: Edge0's kernels, buffered reads, the checkpoint fitting
  beside everything planned; ``mapping`` asked for where it cannot run is a ConfigError;
- the exact path over the mapping brings no routing to the host.
"""

from __future__ import annotations

import json
import subprocess
import time
import sys
from pathlib import Path

import anyio
import mlx.core as mx
import numpy as np
import pytest

from edge0 import ConfigError, Engine, EngineConfig
from edge0.backend.mlx import kernels as K
from edge0.errors import KernelError
from edge0.exec.mapped import resolve_source
from edge0.loader import lay_out

pytestmark = pytest.mark.skipif(not K.available(), reason=f"kernels not built: {K.unavailable_reason()}")

DEMO = "src/edge0/data/demo_model"
DEMO_PATH = Path(DEMO)
PROMPT = "def add(a, b):"
ST = {mx.float32: "F32", mx.bfloat16: "BF16", mx.float16: "F16"}


def _bytes(a) -> bytes:
    if a.dtype in (mx.bfloat16, mx.float16):
        a = a.view(mx.uint16)
    return np.array(a).tobytes()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("pad", [0, 1, 3])  # the tensors' byte offsets: aligned, odd, off by 3
def test_the_kernel_over_a_mapped_file_equals_it_over_arrays(tmp_path, bits, group_size, scale_dtype, pad):
    E, N, D = 8, 48, 256
    w = mx.random.normal((E, N, D), key=mx.random.key(1)) * 0.05
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    s, b = s.astype(scale_dtype), b.astype(scale_dtype)
    path = tmp_path / "stacks.bin"
    offsets = []
    with open(path, "wb") as f:
        for a in (wq, s, b):
            f.write(b"\0" * pad)
            offsets.append(f.tell())
            f.write(_bytes(a))
    m = K.mapping(str(path))
    stacks = {name: (m, off, ST[scale_dtype]) for name, off in zip(("weight", "scales", "biases"), offsets)}
    mapped = K.MappedSwitchLinear(stacks, E, N, bits, group_size)
    x = mx.random.normal((3, 1, 1, D), key=mx.random.key(2))
    idx = mx.array([[5, 0], [7, 7], [2, 6]], dtype=mx.uint32)[:, None]  # [rows, 1, k], as SwitchGLU calls it
    got = mapped(x, idx)
    want = K.gather_qmm(x, wq, s, b, idx, bits=bits, group_size=group_size)
    assert got.shape == want.shape and mx.array_equal(got, want).item()


def test_a_mapped_stack_past_the_end_of_its_file_is_a_kernel_error(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"\0" * 1000)
    m = K.mapping(str(path))
    stacks = {"weight": (m, 0, "BF16"), "scales": (m, 0, "BF16"), "biases": (m, 0, "BF16")}
    layer = K.MappedSwitchLinear(stacks, 4, 16, 4, 64)
    with pytest.raises(KernelError, match=r"the weight: 8192 bytes at byte 0, past the end of .*short.bin \(1000 bytes\)"):
        layer(mx.zeros((1, 1, 256)), mx.array([[0]], dtype=mx.uint32))
    with pytest.raises(KernelError, match="cannot open .*missing.bin"):
        K.mapping(str(tmp_path / "missing.bin"))


def test_auto_maps_only_with_edge0_kernels_buffered_reads_and_room():
    assert resolve_source("auto", kernels="edge0", direct=False, fits=True) == "mapping"
    assert resolve_source("auto", kernels="mlx", direct=False, fits=True) == "slots"
    assert resolve_source("auto", kernels="edge0", direct=True, fits=True) == "slots"
    assert resolve_source("auto", kernels="edge0", direct=False, fits=False) == "slots"
    assert resolve_source("slots", kernels="edge0", direct=False, fits=True) == "slots"
    assert resolve_source("mapping", kernels="edge0", direct=False, fits=False) == "mapping"  # asked for: so be it
    with pytest.raises(ConfigError, match="expert_source must be auto, mapping or slots, got 'mmap'"):
        EngineConfig(expert_source="mmap")


def test_mapping_asked_for_where_it_cannot_run_is_refused():
    with pytest.raises(ConfigError, match="expert_source='mapping' computes with Edge0's kernels"):
        Engine(DEMO, EngineConfig(expert_source="mapping", kernels="mlx"))
    with pytest.raises(ConfigError, match="expert_source='mapping' reads experts through the page cache; direct_io"):
        Engine(DEMO, EngineConfig(expert_source="mapping", direct_io="on"))


def test_the_plan_maps_where_the_checkpoint_fits_and_reads_into_slots_where_it_does_not():
    files = 15 * 2**20  # the demo's checkpoint is about 15 MiB
    roomy = lay_out(DEMO_PATH, EngineConfig(), limit=2**31, runtime=0).plan
    assert roomy.source == "mapping" and roomy.slots_bytes == 0 and roomy.others == 0 and roomy.mapped > 10 * 2**20
    # a limit that holds the plan without the checkpoint's files but not with them
    tight = lay_out(DEMO_PATH, EngineConfig(), limit=roomy.planned + roomy.margin + files // 2, runtime=0).plan
    assert tight.source == "slots" and tight.slots_bytes > 0
    out = subprocess.run([sys.executable, "-m", "edge0", "plan", "--model", DEMO, "--json"], capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout)["plan"]["source"] == "mapping"
    text = subprocess.run([sys.executable, "-m", "edge0", "plan", "--model", DEMO], capture_output=True, text=True,
                          check=True).stdout
    assert "none: expert_source mapping" in text and "+ mapped checkpoint" in text and "no expert reads" in text


def _tokens(config: EngineConfig, **kw) -> tuple[list[int], object]:
    with Engine(DEMO, config) as e:
        events = list(e.stream(PROMPT, max_tokens=24, temp=0.0, **kw))
        return [ev.token for ev in events], events[-1].stats


@pytest.mark.parametrize("setting", [
    {},  # the demo as shipped: staged layers routed by the heads, the adapter on
    {"adapter": "off"},
    {"prerouter": "off"},  # the exact path
    {"prerouter": "off", "decode_path": "hot", "prefill_path": "whole_layer"},
])
def test_the_engine_gives_the_same_tokens_over_the_mapping_and_reads_nothing(setting):
    slots, st = _tokens(EngineConfig(expert_source="slots", **setting))
    mapped, sm = _tokens(EngineConfig(**setting))  # auto: the demo fits
    assert mapped == slots and len(mapped) == 24
    assert (sm.reads, st.reads) == ("mapped", "buffered")
    assert sm.decode_expert_bytes == 0 and sm.prefill_expert_bytes == 0 and st.decode_expert_bytes > 0
    assert "| reads mapped" in sm.line() and "expert reads 0.00 MiB/token" in sm.line()


def test_async_generation_over_the_mapping_equals_slots():
    async def run(config):
        async with Engine.open(DEMO, config) as engine:
            out = [ev.token async for ev in engine.generate(PROMPT, max_tokens=16, temp=0.0)]
            experts = engine.streaming.exact.mapped  # the kernels read the file's pages where the page cache holds them
            return out, engine.streaming.stager.slot_bytes(), experts.resident_bytes() if experts is not None else None

    mapped, slot_bytes, resident = anyio.run(run, EngineConfig())
    slots, slot_bytes_slots, none = anyio.run(run, EngineConfig(expert_source="slots"))
    assert mapped == slots
    assert slot_bytes == 0 and slot_bytes_slots > 0 and none is None
    assert resident > 0


def test_the_exact_path_over_the_mapping_brings_no_routing_to_the_host(tiny_model_factory):
    """Over its bundle the exact path reads each layer's routing to the host; over the
    mapping a step is built with no host sync at all (counted at MLX's own level)."""
    from tests.syncs import count_syncs
    from tests.test_paths import step_model

    qwen = tiny_model_factory("qwen3_moe")

    def syncs(config):
        with step_model(qwen, config) as (model, cache):
            mx.eval(model(mx.array([[1, 2, 3]]), cache=cache))
            with count_syncs() as counter:
                before = counter.snapshot()
                logits = model(mx.array([[4]]), cache=cache)
                after = counter.snapshot()
            mx.eval(logits)
            return {k: after[k] - before[k] for k in after if after[k] != before[k]}

    assert syncs(EngineConfig(prerouter="off", expert_source="slots")).get("numpy") == 4  # one a MoE layer
    assert syncs(EngineConfig(prerouter="off", expert_source="mapping")) == {}



_TRUNCATE_DURING = """
import sys
from pathlib import Path
from edge0 import Engine, EngineConfig, ExpertReadError
d = Path(sys.argv[1])
shard = sorted(d.glob("model*.safetensors"))[0]
whole = shard.read_bytes()
with Engine(d, EngineConfig(prerouter="off", adapter="off")) as e:
    expected = [ev.token for ev in e.stream("def f(x):", max_tokens=8, temp=0.0)]
    it = e.stream("def f(x):", max_tokens=400, temp=0.0)
    next(it)
    with open(shard, "r+b") as f:
        f.truncate(len(whole) // 2)
    try:
        for _ in it:
            pass
        print("no error")
    except ExpertReadError as err:
        print("failed:", err)
    shard.write_bytes(whole)
    print("whole again:", [ev.token for ev in e.stream("def f(x):", max_tokens=8, temp=0.0)] == expected)
"""


def test_a_file_truncated_during_a_generation_fails_it_typed_and_the_engine_serves_once_it_is_whole(tmp_path):
    """Reading a mapped page past a truncated file's end is SIGBUS, which would end the
    process: the kernels' guard reads zeros there and fails the op, the request fails with
    an ExpertReadError naming the file, and the engine maps the file anew (in a child
    process: were the guard missing, the signal would end it, not the test run)."""
    from tests.ckpt_tools import copy_model

    d = copy_model(DEMO_PATH, tmp_path / "m")
    out = subprocess.run([sys.executable, "-c", _TRUNCATE_DURING, str(d)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "failed: file " in out.stdout and "truncated while mapped" in out.stdout, out.stdout
    assert "whole again: True" in out.stdout, out.stdout


def test_closing_the_engine_unmaps_the_checkpoint(tmp_path):
    """A mapped file's pages stay in the page cache while any process maps it (a later engine
    with direct reads could not drop them): closing the engine lets go of its mappings."""
    from tests.ckpt_tools import copy_model

    d = copy_model(DEMO_PATH, tmp_path / "m")
    shard = str(sorted(d.resolve().glob("model*.safetensors"))[0])
    with Engine(d, EngineConfig(prerouter="off", adapter="off")) as engine:
        list(engine.stream(PROMPT, max_tokens=4))
        assert engine.streaming.plan.source == "mapping" and shard in Path("/proc/self/maps").read_text()
    assert shard not in Path("/proc/self/maps").read_text()


def test_a_pass_failed_by_a_truncated_mapping_is_a_read_error_in_a_prefill_too(monkeypatch):
    """What the kernels' guard raises when a mapped file is truncated under a pass reaches the
    request as an ExpertReadError naming the file, from a prompt's prefill as from a decode
    step (the engine names a pass's failure in one place, ``Runtime.typed``)."""
    import edge0.prefill as prefill
    from edge0.errors import ExpertReadError
    from edge0.exec.mapped import MAPPED_TRUNCATED

    real, raised = prefill.score, []

    def truncated(*args, **kwargs):
        if not raised:
            raised.append(1)
            raise RuntimeError(f"{MAPPED_TRUNCATED}/data/model.safetensors was truncated while mapped: its experts "
                               "past the new end read as nothing")
        return real(*args, **kwargs)

    with Engine(DEMO, EngineConfig(prerouter="off", adapter="off")) as engine:
        monkeypatch.setattr(prefill, "score", truncated)
        with pytest.raises(ExpertReadError, match="file /data/model.safetensors: truncated while mapped") as err:
            list(engine.stream(PROMPT, max_tokens=4))
        assert err.value.file == "/data/model.safetensors" and raised
        assert len(list(engine.stream(PROMPT, max_tokens=4))) == 4  # and the engine serves on


def _mapped_rss(address: int) -> int:
    """Bytes of the mapping that starts at ``address`` in this process's page tables
    (``/proc/self/smaps``: a file mapping's Rss counts the pages mapped into the process)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                inside = int(head.split("-")[0], 16) == address
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_every_mapped_expert_is_put_in_the_page_tables_before_a_step_touches_it():
    """A step computing on an expert whose pages are not yet in the process's page tables
    faults on each; once mapped, a thread populates them all (the demo: nothing generated
    yet, every expert's bytes mapped in)."""
    with Engine(DEMO, EngineConfig(prerouter="off", adapter="off")) as engine:
        mapped = engine.streaming.exact.mapped
        assert mapped.populating.done.wait(60) and not mapped.populating.refused
        index = mapped.index
        want = {}
        for layer in mapped.kernels:
            for t in index.layers[layer].tensors:
                want[t.file] = want.get(t.file, 0) + index.spec.num_experts * t.row_bytes
        assert mapped.populating.populated == sum(want.values()) > 10 * 2**20
        for file, size in want.items():
            assert _mapped_rss(mapped.maps[file].address) >= size, file
        assert len(list(engine.stream(PROMPT, max_tokens=4))) == 4
    assert mapped.populating is None  # stopped with the engine


def test_populating_stops_when_asked_and_when_a_range_is_refused():
    from edge0.exec.mapped import Populating

    class Slow:
        def __init__(self, ok=True):
            self.ok, self.calls = ok, 0

        def populate(self, offset, length):
            self.calls += 1
            time.sleep(0.01)
            return self.ok

    slow = Slow()
    p = Populating([(slow, 0, 1000 * Populating.CHUNK)])
    time.sleep(0.05)
    p.stop()
    assert p.done.is_set() and 0 < slow.calls < 1000 and p.populated == slow.calls * Populating.CHUNK
    refusing = Slow(ok=False)
    p = Populating([(refusing, 0, 3 * Populating.CHUNK), (refusing, 5, 7)])
    assert p.done.wait(10) and p.refused and p.populated == 0 and refusing.calls == 1
