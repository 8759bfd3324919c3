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


# every sampling on the exact path and the demo's default, greedy and sampled on the README's other
# paths; the heads' other flushes and sources, and the heads merely observing, on one each
CASES = ([(path, sampling) for path in ("exact", "staged_heads") for sampling in SAMPLING]
         + [(path, sampling) for path in ("hot", "whole_layer") for sampling in ("greedy", "sampled")]
         + [("staged_heads_replace_numpy", "greedy"), ("staged_heads_mlx_slots", "sampled"),
            ("exact_heads_observing", "greedy")])


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


FREE = "The history of the city began"  # text the demo does not repeat: few drafts


@pytest.mark.parametrize("heads", ["off", "auto"])
def test_rows_with_and_without_drafts_share_steps_and_give_their_tokens(heads, monkeypatch):
    """Rows drafting different lengths and a row without drafts in one batch (every pass
    shared here, as where passes cost less than steps): each row's tokens and
    log-probabilities are those decoding without drafts gives, the drafting rows' drafts
    were taken, and each row's cache, trimmed apart, holds its own sequence (the prompt
    cache continues each prompt as before)."""
    from edge0.drafts import BatchPace

    monkeypatch.setattr(BatchPace, "allows", lambda self, rows: True)
    lookup = [4, 0, 2]

    async def together(e, prompts, drafts, n=24):
        async def one(p, k):
            events = [ev async for ev in e.generate(p, max_tokens=n, prompt_lookup=k, logprobs=True)]
            return [ev.token for ev in events], [ev.logprob for ev in events], events[-1].stats
        return await asyncio.gather(*(one(p, k) for p, k in zip(prompts, drafts)))

    with Engine(DEMO, EngineConfig(prerouter=heads, log_level="error")) as e:
        prompts = [e.tokenizer.encode(p) for p in REPEATS + [FREE]]
        plain = asyncio.run(together(e, prompts, [0, 0, 0]))
        more = [p + t for p, (t, _, _) in zip(prompts, plain)]
        plain_more = asyncio.run(together(e, more, [0, 0, 0], 8))
    with Engine(DEMO, EngineConfig(prerouter=heads, prompt_cache_mb=64, log_level="error")) as e:
        mixed = asyncio.run(together(e, prompts, lookup))
        m = e.metrics()
        # each sequence continued from the cache its row left: what it holds is that row's own
        again = asyncio.run(together(e, more, lookup, 8))
    for (a, la, _), (b, lb, _) in zip(plain, mixed):
        assert a == b
        assert la == pytest.approx(lb, abs=1e-4)
    assert [t for t, _, _ in again] == [t for t, _, _ in plain_more]
    assert all(s.cached_tokens >= len(p) for p, (_, _, s) in zip(prompts, again))
    stats = [s for _, _, s in mixed]
    assert stats[0].verify_passes > 0 and stats[0].accepted_tokens > 0 and stats[1].verify_passes == 0
    assert m.decode_steps < 0.75 * m.decode_tokens  # they shared steps, some of them verify passes
    assert 0 < m.verify_passes < m.decode_steps and m.accepted_tokens == sum(s.accepted_tokens for s in stats)


@pytest.mark.parametrize("heads", ["off", "auto"])
def test_a_row_whose_sampler_fails_in_a_shared_pass_fails_alone(heads, monkeypatch):
    """A row whose sampling raises inside a verify pass it shares: its generation ends
    with that error; the other rows go on with their tokens."""
    import edge0.decoding

    sample, verify, shared = edge0.decoding._sample, edge0.decoding.Decoder.verify, []

    def failing(row, logits, ahead=()):
        if row.max_tokens == 23 and ahead and shared and shared[-1] > 1:  # a drafted position of a shared pass
            raise RuntimeError("the sampler of the row of 23 tokens")
        return sample(row, logits, ahead)

    def passes(self, batch, drafts):
        shared.append(sum(map(bool, drafts)))
        return verify(self, batch, drafts)

    async def together(e):
        async def one(p, n):
            try:
                return [ev.token async for ev in e.generate(p, max_tokens=n, prompt_lookup=4)]
            except RuntimeError as err:
                return str(err)
        return await asyncio.gather(*(one(p, n) for p, n in zip(REPEATS + [FREE], [24, 23, 24])))

    with Engine(DEMO, EngineConfig(prerouter=heads, log_level="error")) as e:
        plain = asyncio.run(together(e))
        monkeypatch.setattr(edge0.decoding, "_sample", failing)
        monkeypatch.setattr(edge0.decoding.Decoder, "verify", passes)
        monkeypatch.setattr(edge0.decoding.BatchPace, "allows", lambda self, rows: True)  # (shared passes go on)
        got = asyncio.run(together(e))
        m = e.metrics()
    assert got[1] == "the sampler of the row of 23 tokens"
    assert got[0] == plain[0] and got[2] == plain[2] and m.verify_passes > 0


@pytest.mark.parametrize("costly", [False, True])
def test_rows_sharing_steps_stop_drafting_where_a_pass_costs_more_a_token_than_a_step(costly, monkeypatch):
    """The batch loop's clock (a fake: each reading a second later, a step one more, a
    verify pass 0.5 more, a hundred where ``costly``): passes of several rows that cost
    less than steps go on (every row's tokens come as fast as without drafts); passes that
    cost more stop after three timed steps (the row without drafts would be slowed)."""
    from types import SimpleNamespace

    import edge0.batch
    from edge0.decoding import Decoder

    clock, sizes = [0.0], []

    def reading():
        clock[0] += 1.0
        return clock[0]

    verify, step = Decoder.verify, Decoder.step

    def costed(self, batch, drafts):
        sizes.append(len(batch))
        clock[0] += 100.0 if costly else 0.5
        return verify(self, batch, drafts)

    def stepped(self, batch):
        clock[0] += 1.0
        return step(self, batch)

    monkeypatch.setattr(edge0.batch, "time", SimpleNamespace(perf_counter=reading))
    monkeypatch.setattr(Decoder, "verify", costed)
    monkeypatch.setattr(Decoder, "step", stepped)

    async def together(e):
        async def one(p, k):
            return [ev async for ev in e.generate(p, max_tokens=40, prompt_lookup=k)][-1].stats
        return await asyncio.gather(*(one(p, k) for p, k in zip(REPEATS + [FREE], [4, 4, 0])))

    with Engine(DEMO, EngineConfig(prerouter="off", log_level="error")) as e:
        asyncio.run(together(e))
    shared = [n for n in sizes if n > 1]
    if costly:
        assert 0 < len(shared) <= 2 * 2  # a pass, three timed steps and one more pass a batch size
    else:
        assert len(shared) > 8


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


def test_the_server_takes_prompt_lookup_per_request(monkeypatch):
    """With the demo's heads (the engine's tokens with and without them: the tests above)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai

    from edge0.drafts import BatchPace
    from tests.test_server import client, serving

    with serving(DEMO, EngineConfig(log_level="error")) as (url, state):
        c = client(url)
        complete = lambda p, extra: c.completions.create(  # noqa: E731
            model="tiny", prompt=p, max_tokens=30, temperature=0, extra_body=extra).choices[0].text
        texts = [complete(REPEATS[0], extra) for extra in ({}, {"prompt_lookup": 4})]
        assert texts[0] == texts[1] and texts[0]
        m = state.engine.metrics()
        assert m.last_generation.verify_passes > 0 and m.accepted_tokens == m.last_generation.accepted_tokens > 0
        metrics = httpx.get(url + "/metrics").text
        assert f"edge0_verify_passes_total {m.verify_passes}" in metrics
        assert f"edge0_draft_tokens_total {m.draft_tokens}" in metrics
        assert f"edge0_draft_tokens_accepted_total {m.accepted_tokens}" in metrics
        with pytest.raises(openai.BadRequestError, match="prompt_lookup"):
            c.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"prompt_lookup": 17})
        # requests with and without drafts at once, their passes shared: each its own text
        plain = [complete(p, {}) for p in REPEATS + [FREE]]
        monkeypatch.setattr(BatchPace, "allows", lambda self, rows: True)
        passes = state.engine.metrics().verify_passes
        with ThreadPoolExecutor(3) as pool:
            both = list(pool.map(complete, REPEATS + [FREE], [{"prompt_lookup": 4}, {}, {"prompt_lookup": 2}]))
        assert both == plain and state.engine.metrics().verify_passes > passes


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


def test_a_batch_cache_s_rows_trimmed_apart_hold_their_own_tokens_and_no_padding_all_share():
    """After a pass, each row of a batch cache keeps what it took: its tokens end where the
    batch's do, its padding masks what it dropped, and padding every row has is cut off."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from edge0.backend import nn as bnn

    def valid(c, r):  # row r's cached keys, oldest first, as plain values
        return c.keys[r, 0, c.left_padding.tolist()[r]:c._idx, 0].tolist()

    c = BatchKVCache([0, 0])
    first = mx.arange(12, dtype=mx.float32).reshape(2, 1, 6, 1)
    c.update_and_fetch(first, first)
    bnn.trim_rows([c], [1, 3])  # row 0 took 5 of its 6, row 1 3
    assert c._idx == 5 and c.left_padding.tolist() == [0, 2] and c.offset.tolist() == [5, 3]
    assert valid(c, 0) == [0, 1, 2, 3, 4] and valid(c, 1) == [6, 7, 8]
    more = mx.array([[20, 21], [30, 31]], dtype=mx.float32).reshape(2, 1, 2, 1)
    c.update_and_fetch(more, more)
    bnn.trim_rows([c], [2, 0])  # row 0 dropped both: every row is padded by 2 at the front, cut off
    assert c._idx == 5 and c.left_padding.tolist() == [0, 0] and c.offset.tolist() == [5, 5]
    assert valid(c, 0) == [0, 1, 2, 3, 4] and valid(c, 1) == [6, 7, 8, 30, 31]
    mask = c.make_mask(1, return_array=True)
    assert mask.shape[-1] == 6  # the next token sees the five and itself, nothing padded


@pytest.mark.parametrize("routing", ["select", "replace"])
def test_a_pass_of_several_rows_routes_each_as_that_row_alone_and_pads_as_its_last_position(routing):
    """A verify pass of two rows, one with a shorter draft: each row's positions route as a
    pass of that row alone routes them (to float32 rounding), and the shorter row's pad
    positions route as its last own position (no expert staged for them alone)."""
    import numpy as np

    from edge0.backend import core as B
    from edge0.exec.plan import DraftedRouting
    from edge0.prerouter.runtime import Observed

    def routes(e):
        planner, rng = e.streaming.stager.planner, np.random.default_rng(1)
        heads = planner.prerouter.heads
        x = B.array(rng.standard_normal((2, 3, heads.hidden)).astype(np.float32))
        inds = B.array(np.stack([[rng.permutation(heads.experts)[:heads.k] for _ in range(3)]
                                 for _ in range(2)]).astype(np.int32))
        before = Observed({o: (x[:, 0], inds[:, 0]) for o in heads.owners},
                          {o: inds[:, 1] for o in heads.owners})
        tokens = [[5, 9, 11], [7, 8, 8]]

        def made(rows, lengths):
            state = before if rows == [0, 1] else before.select(rows)
            first = planner.flush(B.array([[tokens[r][0]] for r in rows], dtype=B.int32), state)
            drafted = DraftedRouting(planner, state, [tokens[r] for r in rows], first, lengths)
            for o in heads.owners:
                drafted.observe(o, x[B.array(rows)].reshape(-1, heads.hidden),
                                inds[B.array(rows)].reshape(-1, heads.k), decode=True)
            return {c: (np.array(r.logits).reshape(len(rows), 3, -1),
                        None if r.staged is None else np.array(r.staged).reshape(len(rows), 3, -1))
                    for c, r in drafted.routes.items()}
        return made([0, 1], [3, 2]), made([0], None), made([1], [2])

    with Engine(DEMO, EngineConfig(routing=routing, log_level="error")) as e:
        both, first, second = e._worker.call(routes, e)
    assert both
    for c, (z, staged) in both.items():
        np.testing.assert_allclose(z[0], first[c][0][0], rtol=1e-5, atol=1e-4 * np.abs(z).max())
        np.testing.assert_allclose(z[1], second[c][0][0], rtol=1e-5, atol=1e-4 * np.abs(z).max())
        assert np.array_equal(z[1, 2], z[1, 1]) and not np.array_equal(z[1, 1], z[1, 0])
        assert (staged is None) == (routing == "replace")
        if staged is not None:
            assert np.array_equal(staged[1, 2], staged[1, 1])
            assert np.array_equal(staged[0], first[c][1][0])


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


@pytest.mark.parametrize("costly", [False, True])
def test_the_batch_loop_times_a_draft_model_s_tokens_and_pauses_it_where_they_cost_more(costly, monkeypatch):
    """The batch loop's clock (a fake here: each reading a second later; a draft costing 1.5
    more, a hundred where ``costly``): drafts the model takes every time pay for themselves
    (up to four tokens for 2.5 seconds, against a second a step) and drafting goes on; drafts that cost more a token than a step pause drafting after
    one timed step, for this generation and the next."""
    from types import SimpleNamespace

    import edge0.batch
    from edge0.draft_model import ModelDrafter

    clock = [0.0]

    def reading():
        clock[0] += 1.0
        return clock[0]

    propose = ModelDrafter.propose

    def costed(self):
        draft = propose(self)
        clock[0] += (100.0 if costly else 1.5) * bool(draft)
        return draft

    monkeypatch.setattr(edge0.batch, "time", SimpleNamespace(perf_counter=reading))
    monkeypatch.setattr(ModelDrafter, "propose", costed)
    with Engine(DEMO, EngineConfig(draft_model=str(DEMO), num_draft_tokens=3, prerouter="off",
                                   log_level="error")) as e:
        first = [ev for ev in e.stream(REPEATS[0], max_tokens=40)][-1].stats
        second = [ev for ev in e.stream(REPEATS[1], max_tokens=40)][-1].stats
        unpaid = e._rt.draft.unpaid
    if costly:
        assert unpaid and first.verify_passes == 2 and second.verify_passes == 0
    else:
        assert not unpaid and first.verify_passes > 5 and second.verify_passes > 5


def test_sampled_tokens_keep_their_distribution_over_many_draws():
    """Sampled at temperature 1 with 32 seeds: the tokens prompt lookup's drafts give are
    distributed as those without drafts (each draw, its seed's tokens), with drafts taken
    and refused. (A draft model's sampled tokens: the draft model's test above.)"""
    drafting = dict(prompt_lookup=4)
    from collections import Counter

    def draws(config):
        with Engine(DEMO, EngineConfig(prerouter="off", log_level="error", **config)) as e:
            out = [[ev.token for ev in e.stream(REPEATS[1], max_tokens=6, temp=1.0, seed=seed)] for seed in range(32)]
            return out, e.metrics()

    plain, _ = draws({})
    drafted, m = draws(drafting)
    at = lambda d, j: d[j] if j < len(d) else None  # noqa: E731  (a draw may end early)
    for j in range(6):  # each position's tokens over the draws
        assert Counter(at(d, j) for d in drafted) == Counter(at(p, j) for p in plain)
    assert drafted == plain
    assert 0 < m.accepted_tokens < m.draft_tokens  # drafts were taken and refused


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
        assert m.verify_passes > 0 and m.accepted_tokens > 0  # (the demo drafting for itself costs more than
        # it saves: timed, it pauses, and the later requests start paused)
        assert f"edge0_draft_tokens_accepted_total {m.accepted_tokens}" in httpx.get(url + "/metrics").text
    outs = []
    for flags in ([], ["--draft-model", str(DEMO), "--num-draft-tokens", "2"]):
        assert main(["generate", "--model", str(DEMO), "--prompt", REPEATS[0], "--max-tokens", "24",
                     "--ignore-chat-template", "--log-level", "error", *flags]) == 0
        out = capsys.readouterr().out
        outs.append((out.split("==========")[1], out.strip().splitlines()[-1]))
    assert outs[0][0] == outs[1][0] and " | drafts " not in outs[0][1] and " | drafts " in outs[1][1]
