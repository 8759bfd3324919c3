"""Speculative decoding by prompt lookup through the public API: the tokens are those decoding
without drafts gives (greedy and sampled, with logits processors, on every path: those that
route by the model's own gates and the staged path routed by the prerouter's heads, replace
and select, each flush, over the mapping and over slots; with and without the adapter, sync
and async), the drafts were really taken, and what cannot draft decodes as before."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from edge0 import Engine, EngineConfig
from edge0.errors import ConfigError

DEMO = Path(__file__).resolve().parent.parent / "src" / "edge0" / "data" / "demo_model"
# text the demo continues by repeating what it holds, so drafts are taken
REPEATS = ["import os\nimport sys\nimport os\nimport sys\nimport os\n",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\n"]
PATHS = {
    "exact": dict(prerouter="off"),
    "hot": dict(prerouter="off", decode_path="hot", hot_experts=8),
    "whole_layer": dict(prerouter="off", decode_path="whole_layer"),
    # the demo's default: staged layers routed by its heads (select, the token input, the 8-bit flush)
    "staged_heads": dict(),
    "staged_heads_replace_numpy": dict(routing="replace", prerouter_flush="numpy"),
    "staged_heads_mlx_slots": dict(prerouter_flush="mlx", expert_source="slots"),
    # the heads loaded and observing, every layer exact (none routed by them)
    "exact_heads_observing": dict(layer_paths=tuple((layer, "decode", "exact") for layer in range(8))),
}
SAMPLING = {
    "greedy": dict(),
    "sampled": dict(temp=0.8, top_p=0.95, seed=3),
    "processors": dict(repetition_penalty=1.3, repetition_context_size=3, logit_bias={199: 2.0}),
}


def _run(config: dict, prompts, **sampling) -> list[tuple[list[int], object, list]]:
    with Engine(DEMO, EngineConfig(log_level="error", **config)) as e:
        out = []
        for p in prompts:
            events = list(e.stream(p, max_tokens=40, logprobs=True, top_logprobs=2, **sampling))
            assert all(ev.logprob is not None and len(ev.top_logprobs) == 2 for ev in events)
            out.append(([ev.token for ev in events], events[-1].stats, [ev.logprob for ev in events]))
        return out


# every sampling on the paths the README shows (the demo's default among them); the heads'
# other flushes and sources, and the heads merely observing, on fewer
CASES = ([(path, sampling) for path in ("exact", "hot", "whole_layer", "staged_heads") for sampling in SAMPLING]
         + [(path, sampling) for path in ("staged_heads_replace_numpy", "staged_heads_mlx_slots")
            for sampling in ("greedy", "sampled")] + [("exact_heads_observing", "greedy")])


@pytest.mark.parametrize("path, sampling", CASES)
def test_prompt_lookup_gives_the_tokens_decoding_without_it_gives(path, sampling):
    plain = _run(PATHS[path], REPEATS, **SAMPLING[sampling])
    drafted = _run({**PATHS[path], "prompt_lookup": 4}, REPEATS, **SAMPLING[sampling])
    assert [t for t, _, _ in drafted] == [t for t, _, _ in plain]
    for (_, _, a), (_, _, b) in zip(drafted, plain):  # each position's log-probability, from the pass's logits
        assert a == pytest.approx(b, abs=1e-4)
    stats = [s for _, s, _ in drafted]
    assert all(s.verify_passes > 0 for s in stats) and all(s.verify_passes == 0 for _, s, _ in plain)
    taken = sum(s.accepted_tokens for s in stats)
    share = 0.02 if sampling == "sampled" else 0.3  # (at temperature 0.8 the demo repeats itself less)
    assert taken > share * sum(s.generated_tokens for s in stats)  # drafts were taken, not only checked
    assert "drafts" in stats[0].line() and "tokens a pass" in stats[0].line()


@pytest.mark.parametrize("heads", ["off", "auto"])
def test_a_request_s_prompt_lookup_overrides_the_engine_s_async_and_without_the_adapter(heads):
    async def run(e, **kw):
        tokens, last = [], None
        async for ev in e.generate(REPEATS[1], max_tokens=30, adapter=None, **kw):
            tokens.append(ev.token)
            last = ev
        return tokens, last.stats

    with Engine(DEMO, EngineConfig(prerouter=heads, log_level="error")) as e:
        plain, s0 = asyncio.run(run(e))
        drafted, s1 = asyncio.run(run(e, prompt_lookup=3))
        assert s1.adapter is None
    with Engine(DEMO, EngineConfig(prerouter=heads, prompt_lookup=5, log_level="error")) as e:
        off, s2 = asyncio.run(run(e, prompt_lookup=0))
    assert drafted == plain == off
    assert s0.verify_passes == 0 and s1.verify_passes > 0 and s1.accepted_tokens > 0 and s2.verify_passes == 0
    assert s1.draft_tokens <= 3 * s1.verify_passes  # never more than the request's bound a pass


@pytest.mark.parametrize("limit", [1, 2, 7])
def test_the_length_bound_and_stop_strings_end_it_where_they_end_decoding_without_drafts(limit):
    config = dict(prerouter="off")
    for sampling in (dict(max_tokens=limit), dict(max_tokens=40, stop=["sys\nimport"])):
        with Engine(DEMO, EngineConfig(log_level="error", **config)) as e:
            plain = list(e.stream(REPEATS[0], **sampling))
        with Engine(DEMO, EngineConfig(log_level="error", prompt_lookup=8, **config)) as e:
            drafted = list(e.stream(REPEATS[0], **sampling))
            # the cache it kept holds what was handed out: the same prompt again continues as before
            again = list(e.stream(REPEATS[0], **sampling))
        key = lambda evs: ([ev.token for ev in evs], "".join(ev.text for ev in evs), evs[-1].finish_reason)
        assert key(drafted) == key(plain) == key(again)
        assert drafted[-1].stats.generated_tokens == len(plain)


@pytest.mark.parametrize("heads", ["off", "auto"])
def test_rows_sharing_steps_decode_without_drafts_and_give_their_tokens(heads):
    async def together(e):
        async def one(p):
            events = [ev async for ev in e.generate(p, max_tokens=24)]
            return [ev.token for ev in events], events[-1].stats.verify_passes
        return await asyncio.gather(*(one(p) for p in REPEATS))

    with Engine(DEMO, EngineConfig(prerouter=heads, log_level="error")) as e:
        plain = asyncio.run(together(e))
    with Engine(DEMO, EngineConfig(prerouter=heads, prompt_lookup=4, log_level="error")) as e:
        drafted = asyncio.run(together(e))
        m = e.metrics()
    assert [t for t, _ in drafted] == [t for t, _ in plain]
    assert m.decode_steps < 0.75 * m.decode_tokens  # they shared steps ...
    assert sum(v for _, v in drafted) < m.decode_steps  # ... and those steps drafted nothing


def test_prompt_lookup_runs_with_the_demo_s_heads_and_bad_values_are_named():
    with Engine(DEMO, EngineConfig(prompt_lookup=4, log_level="error")) as e:  # the demo's heads
        events = list(e.stream(REPEATS[0], max_tokens=24))
        assert events[-1].stats.verify_passes > 0 and "heads prerouter" in events[-1].stats.line()
        assert len(list(e.stream("x", max_tokens=2, prompt_lookup=0))) == 2
    with Engine(DEMO, EngineConfig(prerouter="off", log_level="error")) as e:
        for bad in (-1, 17, 2.5, True):
            with pytest.raises(ConfigError, match="prompt_lookup"):
                list(e.stream("x", max_tokens=2, prompt_lookup=bad))
    for field, bad in (("prompt_lookup", 17), ("prompt_lookup_ngram", 1), ("prompt_lookup_ngram", 9)):
        with pytest.raises(ConfigError, match=field):
            EngineConfig(**{field: bad})


@pytest.mark.parametrize("heads", ["off", "auto"])
def test_the_server_takes_prompt_lookup_per_request(heads):
    import httpx
    import openai

    from tests.test_server import client, serving

    with serving(DEMO, EngineConfig(prerouter=heads, log_level="error")) as (url, state):
        c = client(url)
        texts = [c.completions.create(model="tiny", prompt=REPEATS[0], max_tokens=30, temperature=0,
                                      extra_body=extra).choices[0].text
                 for extra in ({}, {"prompt_lookup": 4})]
        assert texts[0] == texts[1] and texts[0]
        m = state.engine.metrics()
        assert m.last_generation.verify_passes > 0 and m.accepted_tokens == m.last_generation.accepted_tokens > 0
        metrics = httpx.get(url + "/metrics").text
        assert f"edge0_verify_passes_total {m.verify_passes}" in metrics
        assert f"edge0_draft_tokens_total {m.draft_tokens}" in metrics
        assert f"edge0_draft_tokens_accepted_total {m.accepted_tokens}" in metrics
        with pytest.raises(openai.BadRequestError, match="prompt_lookup"):
            c.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"prompt_lookup": 17})


@pytest.mark.parametrize("heads", ["off", "auto"])
def test_edge0_generate_takes_prompt_lookup_and_its_stats_line_says_what_the_drafts_did(capsys, heads):
    from edge0.cli import main

    def generate(*flags) -> tuple[str, str]:
        assert main(["generate", "--model", str(DEMO), "--prerouter", heads, "--prompt", REPEATS[0],
                     "--max-tokens", "24", "--ignore-chat-template", "--log-level", "error", *flags]) == 0
        out = capsys.readouterr().out
        text = out.split("==========")[1]
        return text, out.strip().splitlines()[-1]

    plain, line0 = generate()
    drafted, line1 = generate("--prompt-lookup", "4")
    assert drafted == plain and "drafts" not in line0
    assert " | drafts " in line1 and "taken" in line1 and "tokens a pass" in line1


@pytest.mark.parametrize("flush", ["numpy", "mlx", "edge0"])
def test_a_head_s_predictions_of_a_pass_s_positions_are_the_step_s_flushes(flush):
    """What a verify pass routes its drafted positions by (one head's predictions for its
    positions together) is, row by row, what each position's own step flushes for that
    head's consumer: bit for bit for one row, to float32 rounding for several; and a block's
    routing code routes several rows as it routes each alone."""
    import numpy as np

    from edge0.backend import core as B
    from edge0.prerouter.runtime import Observed

    def check(e):
        pre = e.streaming.prerouter
        heads, rng = pre.heads, np.random.default_rng(0)
        rows = lambda *shape: B.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
        experts = lambda n: B.array(np.stack([rng.permutation(heads.experts)[:heads.k]  # noqa: E731
                                              for _ in range(n)]).astype(np.int32))
        checked = 0
        for n in (1, 4, 7):
            x, inds, prev, tok = rows(n, heads.hidden), experts(n), experts(n), rows(n, heads.token_dim)
            for o in heads.owners:
                many = pre.predict(o, x, inds, prev, tok)
                c = heads.consumer[o]
                routed = np.array(e.streaming.route(c, many, pre.width))
                for r in range(n):
                    state = Observed({h: (x[r:r + 1], inds[r:r + 1]) for h in heads.owners},
                                     {h: prev[r:r + 1] for h in heads.owners})
                    alone = np.array(pre.flush(state, tok[r:r + 1])[c])
                    row = np.array(many[r:r + 1])
                    if n == 1:
                        assert np.array_equal(row, alone), (flush, o)
                    np.testing.assert_allclose(row, alone, rtol=1e-5, atol=1e-4 * np.abs(alone).max())
                    assert np.array_equal(routed[r:r + 1], np.array(e.streaming.route(c, many[r:r + 1], pre.width)))
                    checked += 1
        return checked

    with Engine(DEMO, EngineConfig(prerouter_flush=flush, log_level="error")) as e:
        assert e.streaming.prerouter.heads.token_dim > 0  # (the demo's heads see the token)
        assert e._worker.call(check, e) == 12 * 7


def test_over_slots_a_verify_pass_reads_what_its_slots_miss_once_and_throws_no_read_away():
    """Staged with heads over slots that never grow (slot_budget_mb 0): each staged layer of
    a verify pass reads what its slots miss of the union of its positions' experts once
    (where the union does not fit, the rest on the exact path), and the step before does
    not plan (read ahead for) a pass that routes its own positions."""
    def run(**kw):
        with Engine(DEMO, EngineConfig(expert_source="slots", slot_budget_mb=0, log_level="error", **kw)) as e:
            tokens, read = [], 0
            for prompt in REPEATS:
                events = list(e.stream(prompt, max_tokens=128))
                tokens.append([ev.token for ev in events])
                read += events[-1].stats.decode_expert_bytes
            return tokens, read, events[-1].stats, e.streaming.stager.scheduler.stats.cancelled

    plain, read0, _, _ = run()
    drafted, read1, stats, cancelled = run(prompt_lookup=4)
    assert drafted == plain and stats.accepted_tokens > 0
    # (0.23x here; each pass's union read on the exact path: 0.81x; a union that does not fit the
    # slots read on the exact path whole, not only what the slots miss: 0.43x)
    assert read1 < 0.35 * read0
    assert cancelled == 0


# -- a draft model (mlx-lm's --draft-model) ---------------------------------------------------------------

def _dense_draft(directory: Path, swap_tokens: bool = False) -> Path:
    """A tiny dense qwen3 (random weights) with the demo's tokenizer: a draft whose drafts are
    rarely taken; ``swap_tokens``: two of its tokenizer's ids swapped (not the model's)."""
    import json
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    config = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, vocab_size=2048,
                  max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=10000.0)
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs(**config))
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO / name, directory / name)
    if swap_tokens:
        tok = json.loads((directory / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        a, b = list(vocab)[300:302]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (directory / "tokenizer.json").write_text(json.dumps(tok))
    return directory


@pytest.fixture(scope="module")
def dense_draft(tmp_path_factory) -> Path:
    return _dense_draft(tmp_path_factory.mktemp("draft") / "dense")


DRAFTS = {"the demo itself": DEMO}  # (its drafts are mostly taken: the same model on MLX's own model class)


@pytest.mark.parametrize("draft, heads, sampling", [("the demo itself", "auto", "greedy"),
                                                    ("the demo itself", "off", "sampled"),
                                                    ("a tiny dense model", "auto", "sampled")])
def test_a_draft_model_gives_the_tokens_decoding_without_it_gives(draft, heads, sampling, dense_draft):
    path = DRAFTS.get(draft, dense_draft)
    plain = _run(dict(prerouter=heads), REPEATS, **SAMPLING[sampling])
    drafted = _run(dict(prerouter=heads, draft_model=str(path), num_draft_tokens=3), REPEATS, **SAMPLING[sampling])
    assert [t for t, _, _ in drafted] == [t for t, _, _ in plain]
    for (_, _, a), (_, _, b) in zip(drafted, plain):
        assert a == pytest.approx(b, abs=1e-4)
    stats = [s for _, s, _ in drafted]
    # (a later generation may start paused, where the first found drafting did not pay on this machine)
    assert stats[0].verify_passes > 0 and all(s.draft_tokens <= 3 * s.verify_passes for s in stats)
    taken = sum(s.accepted_tokens for s in stats) / sum(s.draft_tokens for s in stats)
    if draft == "the demo itself":  # (greedy drafts: at temperature 0.8 fewer of them are what is sampled)
        assert taken > (0.5 if sampling == "greedy" else 0.2)
    else:  # random weights: its drafts are refused, and it stops drafting
        assert taken < 0.2 and sum(s.verify_passes for s in stats) < 0.5 * sum(s.generated_tokens for s in stats)


def test_a_request_s_num_draft_tokens_and_what_a_draft_model_refuses(dense_draft, tmp_path):
    with Engine(DEMO, EngineConfig(draft_model=str(DEMO), log_level="error")) as e:
        on = list(e.stream(REPEATS[0], max_tokens=24, num_draft_tokens=2))
        off = list(e.stream(REPEATS[0], max_tokens=24, num_draft_tokens=0))
        lookup = list(e.stream(REPEATS[0], max_tokens=24, prompt_lookup=4))  # a request may still ask for it
        assert [ev.token for ev in on] == [ev.token for ev in off] == [ev.token for ev in lookup]
        assert on[-1].stats.verify_passes > 0 and on[-1].stats.draft_tokens <= 2 * on[-1].stats.verify_passes
        assert off[-1].stats.verify_passes == 0 and lookup[-1].stats.verify_passes > 0
        for bad in (-1, 17, 1.5):
            with pytest.raises(ConfigError, match="num_draft_tokens"):
                list(e.stream("x", max_tokens=2, num_draft_tokens=bad))
    with Engine(DEMO, EngineConfig(log_level="error")) as e:
        with pytest.raises(ConfigError, match="no draft model"):
            list(e.stream("x", max_tokens=2, num_draft_tokens=2))
    with pytest.raises(ConfigError, match="prompt_lookup"):
        Engine(DEMO, EngineConfig(draft_model=str(dense_draft), prompt_lookup=4, log_level="error"))
    with pytest.raises(ConfigError, match="vocabulary"):
        Engine(DEMO, EngineConfig(draft_model=str(_dense_draft(tmp_path / "swapped", swap_tokens=True)),
                                  log_level="error"))
    with pytest.raises(ConfigError, match="not a model directory"):
        Engine(DEMO, EngineConfig(draft_model=str(tmp_path), log_level="error"))


def test_the_server_and_edge0_generate_draft_with_a_draft_model(capsys):
    import httpx

    from edge0.cli import main
    from tests.test_server import client, serving

    with serving(DEMO, EngineConfig(draft_model=str(DEMO), log_level="error")) as (url, state):
        c = client(url)
        texts = [c.completions.create(model="tiny", prompt=REPEATS[0], max_tokens=30, temperature=0,
                                      extra_body=extra).choices[0].text
                 for extra in ({"num_draft_tokens": 0}, {}, {"num_draft_tokens": 2})]
        assert texts[0] == texts[1] == texts[2] and texts[0]
        m = state.engine.metrics()
        assert m.last_generation.verify_passes > 0 and m.accepted_tokens > 0
        assert f"edge0_draft_tokens_accepted_total {m.accepted_tokens}" in httpx.get(url + "/metrics").text
    outs = []
    for flags in ([], ["--draft-model", str(DEMO), "--num-draft-tokens", "2"]):
        assert main(["generate", "--model", str(DEMO), "--prompt", REPEATS[0], "--max-tokens", "24",
                     "--ignore-chat-template", "--log-level", "error", *flags]) == 0
        out = capsys.readouterr().out
        outs.append((out.split("==========")[1], out.strip().splitlines()[-1]))
    assert outs[0][0] == outs[1][0] and " | drafts " not in outs[0][1] and " | drafts " in outs[1][1]
