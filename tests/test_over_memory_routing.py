"""The routing a heads file recommends where the checkpoint is larger than the memory the
process may use (its serving record's ``over_memory``), chosen by ``routing = "auto"`` at
open; rewriting that record keeps the heads' tensors and the adapters trained under them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edge0 import CheckpointError, ConfigError, Engine, EngineConfig
from edge0.adapters import artifact_identity
from edge0.prerouter.files import heads_identity
from edge0.model.safetensors_header import read_header
from edge0.prerouter.files import load_heads, parse_routing, serving_of, set_serving
from edge0.train.heads import train_heads
from tests.reference import record_staging

ROOT = Path(__file__).resolve().parents[1]
SERVING = {"routing": "select", "stage_extra": 2, "over_memory": {"routing": "select", "stage_extra": 0}}


@pytest.fixture(scope="module")
def model(tiny_model_factory, tmp_path_factory):
    from tests.ckpt_tools import copy_model

    d = copy_model(tiny_model_factory("qwen3_moe"), tmp_path_factory.mktemp("over") / "m")
    train_heads(d, tokens=3000, heldout_tokens=600, steps=40, width=32, seq_len=64, token_input=True,
                serving=SERVING)
    return d


def _over(monkeypatch, value: bool):
    """The checkpoint's files larger than the memory the process may use (or not)."""
    import edge0.loader

    monkeypatch.setattr(edge0.loader, "over_memory", lambda files, limit=None: value)


def test_files_over_the_limit_are_over_memory(tmp_path):
    from edge0.io_sched.direct import over_memory

    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * 600)
    b.write_bytes(b"x" * 500)
    assert over_memory([str(a), str(b)], 1099) and not over_memory([str(a), str(b)], 1100)


@pytest.mark.parametrize("over", [False, True])
def test_auto_serves_the_record_for_where_the_checkpoint_is(model, monkeypatch, over):
    _over(monkeypatch, over)
    with Engine(model) as engine:
        s = engine.streaming
        k = s.spec.k
        assert s.routing == (("select", 0) if over else ("select", 2))
        heads, _ = s.describe_artifacts()
        assert (f"select k+0, over memory" in heads) if over else ("select k+2)" in heads)
        plans, used, _ = record_staging(engine, "def f(x):\n    return", 8)
        steps = [st for st in used if st in plans]
        assert steps
        for st in steps:
            for layer, experts in used[st].items():
                assert len(plans[st][layer]) == k + (0 if over else 2)
                assert experts <= plans[st][layer]
    # what the config says wins over either record
    with Engine(model, EngineConfig(routing="select", stage_extra=3)) as engine:
        assert engine.streaming.routing == ("select", 3)
        assert ", over memory" not in engine.streaming.describe_artifacts()[0]
    with Engine(model, EngineConfig(routing="select")) as engine:  # the count from the record that applies
        assert engine.streaming.routing == ("select", 0 if over else 2)
        assert (", over memory" in engine.streaming.describe_artifacts()[0]) == over
    with Engine(model, EngineConfig(routing="replace")) as engine:
        assert engine.streaming.routing == ("replace", 0)


def test_plan_says_the_routing_is_the_over_memory_choice(model, monkeypatch, capsys):
    from edge0.cli import main

    _over(monkeypatch, True)
    assert main(["plan", "--model", str(model)]) == 0
    out = capsys.readouterr().out
    assert "routing select, the heads file's choice for a checkpoint larger than the memory" in out
    _over(monkeypatch, False)
    assert main(["plan", "--model", str(model), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["routing"], doc["stage_extra"], doc["over_memory_routing"]) == ("select", 2, False)


def test_records_are_checked(model, tmp_path):
    assert serving_of({"serving": json.dumps(SERVING)}) == SERVING
    for bad, match in (({"routing": "select", "over_memory": {"routing": "both"}}, "serving.over_memory"),
                       ({"routing": "select", "over_memory": {"routing": "select", "stage_extra": -1}},
                        "over_memory.stage_extra"),
                       ({"routing": "select", "over_memory": dict(SERVING)}, "another over_memory")):
        with pytest.raises(CheckpointError, match=match):
            serving_of({"serving": json.dumps(bad)})
    assert parse_routing("select:0") == {"routing": "select", "stage_extra": 0}
    assert parse_routing("replace") == {"routing": "replace", "stage_extra": 0}
    for text in ("select", "select:-1", "replace:2", "both"):
        with pytest.raises(ConfigError, match="'replace' or 'select:M'"):
            parse_routing(text)


def test_set_serving_keeps_the_tensors_and_the_adapters_trained_under_them(model, tmp_path):
    from edge0.adapters import WEIGHTS_FILE
    from tests.ckpt_tools import copy_model
    from tests.test_adapters import random_adapter

    d = copy_model(model, tmp_path / "m")
    heads = d / "prerouter.safetensors"
    before, data = read_header(heads), heads.read_bytes()
    ident, legacy = heads_identity(heads), artifact_identity(heads)
    fresh = random_adapter(d, tmp_path / "fresh", provenance={"heads_identity": ident, "heads_k": 4})
    old = random_adapter(d, tmp_path / "old", provenance={"heads_identity": legacy, "heads_k": 4})
    with Engine(d, EngineConfig(adapter=str(old))) as engine:  # the whole header's hash, as adapters recorded it
        assert engine.streaming.adapters is not None
    record = {"routing": "replace", "stage_extra": 0, "over_memory": {"routing": "select", "stage_extra": 1}}
    assert set_serving(heads, record, [fresh / WEIGHTS_FILE]) == []  # it recorded what the rewrite keeps
    after = read_header(heads)
    assert serving_of(after.metadata) == record
    assert {k: v for k, v in after.metadata.items() if k != "serving"} == \
        {k: v for k, v in before.metadata.items() if k != "serving"}
    assert after.tensors == before.tensors
    assert heads.read_bytes()[after.data_start:] == data[before.data_start:]
    assert heads_identity(heads) == ident and artifact_identity(heads) != legacy
    load_heads(heads, d)
    with Engine(d, EngineConfig(adapter=str(fresh))) as engine:
        assert engine.streaming.routing == ("replace", 0) and engine.streaming.adapters is not None
    with pytest.raises(CheckpointError, match="trained under other prerouter heads"):
        Engine(d, EngineConfig(adapter=str(old)))  # the whole header's hash changed with the record
    # given to the rewrite, an adapter that recorded the whole header is re-recorded, and loads
    older = random_adapter(d, tmp_path / "older", provenance={"heads_identity": artifact_identity(heads),
                                                               "heads_k": 4})
    tensors = (older / WEIGHTS_FILE).read_bytes()[read_header(older / WEIGHTS_FILE).data_start:]
    assert set_serving(heads, dict(record, routing="select", stage_extra=2), [older / WEIGHTS_FILE]) == [older / WEIGHTS_FILE]
    rewritten = read_header(older / WEIGHTS_FILE)
    assert rewritten.metadata["heads_identity"] == ident
    assert (older / WEIGHTS_FILE).read_bytes()[rewritten.data_start:] == tensors
    with Engine(d, EngineConfig(adapter=str(older))) as engine:
        assert engine.streaming.routing == ("select", 2) and engine.streaming.adapters is not None


def test_the_tool_shows_and_sets_the_record(model, tmp_path):
    from tests.ckpt_tools import copy_model

    d = copy_model(model, tmp_path / "m")
    heads = str(d / "prerouter.safetensors")

    def tool(*args):
        return subprocess.run([sys.executable, str(ROOT / "tools" / "heads_serving.py"), heads, *args],
                              capture_output=True, text=True, cwd=ROOT)

    shown = tool()
    assert shown.returncode == 0 and json.loads(shown.stdout) == SERVING
    set_ = tool("--routing", "select:4")
    assert set_.returncode == 0 and serving_of(read_header(heads).metadata) == dict(SERVING, stage_extra=4)
    dropped = tool("--over-memory", "none")
    assert dropped.returncode == 0 and serving_of(read_header(heads).metadata) == {"routing": "select",
                                                                                    "stage_extra": 4}
    bad = tool("--over-memory", "select:x")
    assert bad.returncode == 2 and "'replace' or 'select:M'" in bad.stderr
    assert serving_of(read_header(heads).metadata) == {"routing": "select", "stage_extra": 4}  # nothing written


def test_the_demo_over_memory_serves_select_m0_with_its_adapter(monkeypatch):
    """The packaged demo records select m=2 where it fits and select m=0 over memory; over
    memory it opens with m=0, its shipped adapter still applied (trained under the same
    heads; the record changed after it was trained)."""
    from edge0.cli import PACKAGED_DEMO
    from edge0.prerouter.files import HEADS_FILENAME

    assert serving_of(read_header(PACKAGED_DEMO / HEADS_FILENAME).metadata) == SERVING
    _over(monkeypatch, True)
    with Engine(PACKAGED_DEMO) as engine:
        assert engine.streaming.routing == ("select", 0)
        with_adapter = list(engine.stream("def f(x):", max_tokens=8, logprobs=True))
        bare = list(engine.stream("def f(x):", max_tokens=8, logprobs=True, adapter=None))
    stats = with_adapter[-1].stats
    assert "select k+0, over memory" in stats.heads and stats.adapter.startswith("adapter (rank 8")
    assert [e.logprob for e in with_adapter] != [e.logprob for e in bare]
