"""``tools/load_test.py --hostile``: its hostile clients against a real server (the one of
tests/test_server.py, with short timeouts) get the outcomes the server gives them, and its
report finds a 5xx, a slow p95 and a count not back to baseline."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import hostile_clients  # noqa: E402
import hostile_report  # noqa: E402
import load_test  # noqa: E402


def test_hostile_clients_get_closed_timed_out_and_refused(tiny_model_factory):
    from edge0.config import EngineConfig
    from tests.test_server import serving

    limit = 64 * 1024
    with serving(tiny_model_factory("qwen3_moe"), EngineConfig(adapter="off"), header_timeout_s=0.5,
                 body_timeout_s=0.5, max_body_bytes=limit) as (url, state):
        ok = load_test.one_request(url, 4, 60, random.Random(0))
        counts = {"silent_stream": 1, "slowloris": 2, "unfinished_body": 2, "silent_socket": 3, "oversize": 3}
        got = hostile_clients.summarize(asyncio.run(
            hostile_clients.run_scenario(url, counts, 1.5, 4, limit, silent_hold_s=3.0)))
    assert ok["status"] == 200 and ok["total"] >= ok["ttft"] > 0
    assert {k: v["clients"] for k, v in got.items()} == counts
    # "closed": by the server, at its header timeout (a client still open at the end says "open")
    assert got["slowloris"]["outcomes"] == {"closed": 2} and got["silent_socket"]["outcomes"] == {"closed": 3}
    assert got["unfinished_body"]["outcomes"] == {"408": 2}
    assert got["oversize"]["outcomes"] == {"400 (under-limit)": 1, "413 (chunked)": 1, "413 (content-length)": 1}
    assert got["oversize"]["seconds_max"] < 1.5
    assert got["silent_stream"]["outcomes"] == {"200 (stream complete)": 1}  # 4 tokens fit any buffer


def test_the_attacks_of_one_client_get_what_the_server_answers(tiny_model_factory):
    """The attacks of tools/hostile_attacks.py against a real server: abandoned requests
    leave, an expensive schema is a 400 or a normal answer (never a 5xx), a template from the
    client and 4 MB bodies of token ids are quick 400s, schema loops get
    200s, the prompt-cache probe from another user runs to its answer (that it recovers
    nothing is tests/test_server.py's probe test, on a tokenizer whose digits it can read
    one by one), the flood from 127.0.0.2 holds connections the server keeps closing."""
    from edge0.config import EngineConfig
    from tests.test_server import serving

    with serving(tiny_model_factory("qwen3_moe"), EngineConfig(adapter="off"), header_timeout_s=0.5,
                 max_connections=64, max_connections_per_client=8) as (url, state):
        counts = {"abandoned_wait": 3, "heavy_schema": 2, "schema_loop": 1, "cache_probe": 1, "flood": 1,
                  "template_injection": 2, "big_body": 1}
        got = hostile_clients.summarize(asyncio.run(hostile_clients.run_scenario(url, counts, 1.5, 4)))
        assert load_test.one_request(url, 4, 60, random.Random(0))["status"] == 200  # still serving
    assert {k: v["clients"] for k, v in got.items()} == counts
    assert got["abandoned_wait"]["outcomes"] == {"left": 3}
    assert set(got["heavy_schema"]["outcomes"]) <= {"200", "400"}, got["heavy_schema"]
    assert all(o.startswith("200") for o in got["schema_loop"]["outcomes"]), got["schema_loop"]
    assert got["cache_probe"]["outcomes"] == {"0 digits recovered": 1}
    assert got["template_injection"]["outcomes"] == {
        "400 ('chat_template_kwargs.chat_template' is a parameter of the template renderer, se)": 2}, got
    assert got["big_body"]["outcomes"] == {"400 (400,400,400)": 1}, got["big_body"]
    (flood,) = got["flood"]["outcomes"]
    assert flood.startswith("held (") and int(flood.split("(")[1].split()[0]) > 8, flood  # closed and reopened


def _report(quiet_p95=1.0, loaded_p95=1.5, status="200", fds_after=10) -> dict:
    lat = lambda p95: {"requests": 4, "statuses": {status: 4}, "ttft_p50_s": 0.5, "ttft_p95_s": p95,  # noqa: E731
                       "total_p50_s": 0.6, "total_p95_s": p95}
    res = {k: {"before": 10, "peak": 20, "after": [10, 10], "tolerance": hostile_clients.TOLERANCE[k]}
           for k in hostile_clients.STATE_KEYS}
    res["open_fds"]["after"] = [10, fds_after]
    return {"quiet": lat(quiet_p95), "hostile": lat(loaded_p95), "by_scenario": {"burst": lat(loaded_p95)},
            "hostile_clients": {"burst": {"slowloris": {"clients": 2, "outcomes": {"closed": 2},
                                                        "seconds_median": 5.0, "seconds_max": 5.1}}},
            "resources": res, "after_request": 200, "server_5xx": 0,
            "metrics_reads": {"failed": {}, "slowest_s": 0.1},
            "settings": {"clients": 2, "requests_per_client_quiet": 2, "hold_s": 1, "rounds": 2,
                         "silent_max_tokens": 8}}


def test_the_report_finds_5xx_slow_p95_and_leaks():
    t = hostile_report.targets(_report())
    assert t["no_5xx"] and t["p95_within_2x"] and t["all_back"] and t["p95_ratio"]["total_p95_s"] == 1.5
    assert not hostile_report.targets(_report(status="503"))["no_5xx"]
    assert not hostile_report.targets(_report(loaded_p95=2.5))["p95_within_2x"]
    leaky = hostile_report.targets(_report(fds_after=13))
    assert not leaky["all_back"] and leaky["back_to_baseline"]["open_fds"] is False
    r = _report()
    r["targets"] = t
    text = hostile_report.markdown(r)
    assert "| burst | slowloris | 2 | closed: 2 |" in text and "after round 2" in text


def test_serve_model_and_out_are_the_model_and_json_flags():
    args = load_test.parse_args(["--hostile", "--serve-model", "M", "--out", "x.json", "--", "--max-queue", "8"])
    assert (args.model, args.json, args.hostile, args.serve_args) == ("M", "x.json", True, ["--max-queue", "8"])
