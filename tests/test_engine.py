"""The engine's Python API: async context manager, async iterator, sync helper, errors."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

import edge0
from edge0 import ConfigError, Engine, EngineConfig

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def qwen(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


@pytest.fixture(scope="module")
def engine(qwen):
    with Engine(qwen) as e:
        yield e


def test_sync_stream_reports_stats(engine):
    events = list(engine.stream(PROMPT, max_tokens=12))
    assert len(events) == 12
    assert [e.finish_reason for e in events[:-1]] == [None] * 11
    last = events[-1]
    assert last.finish_reason == "length" and last.stats is not None
    s = last.stats
    assert s.prompt_tokens == len(engine.encode(PROMPT)) and s.generated_tokens == 12
    assert s.prefill_tps > 0 and s.decode_tps > 0
    assert s.peak_active_memory > 0 and s.peak_rss > s.peak_active_memory
    # the checkpoint fits: its experts are computed where its mapping holds them, nothing read
    assert s.reads == "mapped" and s.expert_bytes_per_token == 0
    assert "tok/s" in s.line() and "MiB/token" in s.line()
    # over slots each decode step reads at least k experts of every MoE layer it did not already hold
    with Engine(engine.model_dir, EngineConfig(expert_source="slots")) as slots:
        s = list(slots.stream(PROMPT, max_tokens=12))[-1].stats
    min_bytes = engine.spec.k * engine.index.layers[engine.spec.moe_layers[0]].expert_bytes
    assert s.reads == "buffered" and s.expert_bytes_per_token >= min_bytes


@pytest.mark.asyncio
async def test_async_api_matches_sync(qwen):
    with anyio.fail_after(120):
        async with Engine.open(qwen) as engine:
            tokens = [e.token async for e in engine.generate(PROMPT, max_tokens=10)]
            texts = [e.text async for e in engine.generate(PROMPT, max_tokens=10)]
    with Engine(qwen) as sync_engine:
        expected = list(sync_engine.stream(PROMPT, max_tokens=10))
    assert tokens == [e.token for e in expected]
    assert "".join(texts) == "".join(e.text for e in expected)


@pytest.mark.asyncio
async def test_event_loop_stays_responsive_during_generation(qwen):
    """Compute runs on the engine's thread: a concurrent task keeps ticking."""
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await anyio.sleep(0)
            ticks += 1

    with anyio.fail_after(120):
        async with Engine.open(qwen) as engine:
            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                n = 0
                async for _ in engine.generate(PROMPT, max_tokens=8):
                    n += 1
                tg.cancel_scope.cancel()
    # a loop blocked by compute would tick about once per token; a free one ticks far more
    assert n == 8 and ticks > 20 * n


@pytest.mark.asyncio
async def test_cancelled_generation_leaves_engine_usable(qwen):
    threads_before = {t.name for t in threading.enumerate()}
    with anyio.fail_after(120):
        async with Engine.open(qwen) as engine:
            got = []
            with anyio.CancelScope() as scope:
                async for event in engine.generate(PROMPT, max_tokens=50):
                    got.append(event.token)
                    if len(got) == 2:  # a slow consumer: tokens wait for it (no await between them)
                        time.sleep(0.5)
                    if len(got) == 3:
                        scope.cancel()
            assert len(got) == 3  # a waiting token is no reason to miss the cancellation
            again = [e.token async for e in engine.generate(PROMPT, max_tokens=5)]
            assert again[:3] == got
    leftover = {t.name for t in threading.enumerate()} - threads_before
    assert not any(name.startswith("edge0-") and name != "edge0-idle" for name in leftover), leftover


def test_sync_helper(qwen, engine):
    text = edge0.generate(qwen, PROMPT, max_tokens=6)
    expected = "".join(e.text for e in engine.stream(PROMPT, max_tokens=6))
    assert text == expected and text


def test_seeded_sampling_is_reproducible(engine):
    a = [e.token for e in engine.stream(PROMPT, max_tokens=8, temp=1.0, top_p=0.9, seed=7)]
    b = [e.token for e in engine.stream(PROMPT, max_tokens=8, temp=1.0, top_p=0.9, seed=7)]
    greedy = [e.token for e in engine.stream(PROMPT, max_tokens=8)]
    assert a == b and a != greedy


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens must be an integer in 1..1000000, got 0"),
    (dict(max_tokens=1.5), "max_tokens must be an integer"),
    (dict(temp=-0.1), r"temp must be a number in \[0, 100\], got -0.1"),
    (dict(top_p=1.5), r"top_p must be a number in \(0, 1\], got 1.5"),
    (dict(top_p=0.0), r"top_p must be a number in \(0, 1\], got 0.0"),
    (dict(top_k=-1), r"top_k must be an integer in >= 0, got -1"),
    (dict(min_p=1.0), r"min_p must be a number in \[0, 1\), got 1.0"),
    (dict(repetition_penalty=0), r"repetition_penalty must be a number in \(0, 100\], got 0"),
    (dict(top_logprobs=21), r"top_logprobs must be an integer in 0..20, got 21"),
    (dict(stop_token_ids=(10**9,)), r"stop_token_ids \[1000000000\] are outside the vocabulary"),
    (dict(seed=-1), r"seed must be an integer in 0..9223372036854775807, got -1"),
])
def test_bad_sampling_parameters(engine, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        list(engine.stream(PROMPT, **kwargs))


def test_sampling_options_change_the_output_as_mlx_lm_does(engine):
    """top-k 1 is greedy; logprobs are the chosen token's and the top-n, sorted; a stop
    token ends the generation with finish "stop"."""
    greedy = list(engine.stream(PROMPT, max_tokens=8))
    topk1 = list(engine.stream(PROMPT, max_tokens=8, temp=1.0, top_k=1, seed=3))
    assert [e.token for e in topk1] == [e.token for e in greedy]
    lp = list(engine.stream(PROMPT, max_tokens=4, logprobs=True, top_logprobs=3))
    for e in lp:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0][0] == e.token and abs(e.top_logprobs[0][1] - e.logprob) < 1e-6  # greedy
        assert [v for _, v in e.top_logprobs] == sorted((v for _, v in e.top_logprobs), reverse=True)
    assert greedy[0].logprob is None and greedy[0].top_logprobs is None
    stop = greedy[3].token
    cut = list(engine.stream(PROMPT, max_tokens=8, stop_token_ids=(stop,)))
    first = next(i for i, e in enumerate(greedy) if e.token == stop)
    assert len(cut) == first + 1 and cut[-1].finish_reason == "stop"
    # a repetition penalty lowers the logits of the prompt's tokens: the first step's
    # distribution (reported after the logits processors, as mlx-lm does) moves
    plain = list(engine.stream(PROMPT, max_tokens=1, top_logprobs=5))[0].top_logprobs
    penalised = list(engine.stream(PROMPT, max_tokens=1, top_logprobs=5, repetition_penalty=5.0))[0].top_logprobs
    assert plain != penalised


def test_prompt_longer_than_the_context_is_refused(engine):
    ctx = engine.context_length
    assert ctx is not None
    with pytest.raises(ConfigError, match=f"the prompt is {ctx} tokens; the model's context is {ctx} tokens"):
        list(engine.stream([5] * ctx))


def test_bad_prompts(engine):
    with pytest.raises(ConfigError, match="prompt is empty"):
        list(engine.stream(""))
    with pytest.raises(ConfigError, match=r"prompt token ids must be in \[0, "):
        list(engine.stream([1, 2, 10**9]))


def test_a_closed_engine_says_so_with_its_own_error(qwen):
    from edge0.errors import EngineClosedError

    e = Engine(qwen)
    e.close()
    with pytest.raises(EngineClosedError, match="the engine is closed") as info:
        list(e.stream(PROMPT, max_tokens=2))
    assert isinstance(info.value, edge0.Edge0Error) and not isinstance(info.value, ConfigError)


@pytest.mark.parametrize("kwargs,match", [
    (dict(compute_dtype="int8"), "compute_dtype must be auto, float32, bfloat16 or float16, got .int8."),
    (dict(bundle_capacity=0), "bundle_capacity must be a positive integer, got 0"),
    (dict(reader_threads=-1), "reader_threads must be a positive integer, got -1"),
])
def test_bad_engine_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("source", ["slots", "mapping"])
def test_truncated_checkpoint_fails_the_request_not_the_engine(tiny_model_factory, tmp_path, source):
    """A shard truncated after open: the request fails with a typed error naming the file,
    tensor, layer and expert (over the mapping: the file and layer); once the file is whole
    again the engine serves correctly."""
    from edge0.errors import ExpertReadError
    from tests.ckpt_tools import copy_model

    d = copy_model(tiny_model_factory("qwen3_moe"), tmp_path / "m")
    shard = d / "model.safetensors"
    original = shard.read_bytes()
    with Engine(d, EngineConfig(expert_source=source)) as engine:
        expected = [e.token for e in engine.stream(PROMPT, max_tokens=6)]
        with open(shard, "r+b") as f:
            f.truncate(len(original) // 2)
        with pytest.raises(ExpertReadError, match="short read" if source == "slots" else "short: the file holds") as err:
            list(engine.stream(PROMPT, max_tokens=6))
        assert err.value.file == str(shard) and err.value.layer is not None
        if source == "slots":
            assert ".switch_mlp." in err.value.tensor and err.value.expert is not None
        shard.write_bytes(original)
        assert [e.token for e in engine.stream(PROMPT, max_tokens=6)] == expected


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_prompt_cache_reuses_a_prefix_and_changes_nothing(tiny_model_factory, family):
    """A prompt extending an earlier generation's tokens prefills only the new ones, with the
    same tokens out as without the cache. qwen3_5_moe's linear-attention state cannot be
    trimmed: it reuses an exact prefix only, and a prompt diverging inside the cached tokens
    starts from scratch."""
    d = tiny_model_factory(family)
    first = "def fibonacci(n):"
    with Engine(d, EngineConfig(prompt_cache_mb=16)) as cached, Engine(d) as plain:
        ids = cached.encode(first)
        out1 = [e for e in cached.stream(ids, max_tokens=6)]
        assert out1[-1].stats.cached_tokens == 0
        follow = ids + [e.token for e in out1] + cached.encode("\n    return 1")
        out2 = list(cached.stream(follow, max_tokens=6))
        ref2 = list(plain.stream(follow, max_tokens=6))
        assert [e.token for e in out2] == [e.token for e in ref2]
        # the cache held the prompt and the generated tokens but the last (sampled, never
        # forwarded: a step computes no token beyond what it hands out)
        assert out2[-1].stats.cached_tokens == len(ids) + 5
        diverging = ids[:-1] + [(ids[-1] + 1) % 256] + [7, 8, 9]
        out3 = list(cached.stream(diverging, max_tokens=4))
        assert [e.token for e in out3] == [e.token for e in plain.stream(diverging, max_tokens=4)]
        trimmable = family == "qwen3_moe"
        assert out3[-1].stats.cached_tokens == (len(ids) - 1 if trimmable else 0)
        assert cached.prompt_cache.nbytes <= 16 * 2**20


@pytest.mark.parametrize("routing", ["replace", "select"])
def test_prompt_cache_with_prerouter_heads_changes_nothing(tiny_model_factory, tmp_path, routing):
    """With heads, a prompt whose prefix is cached leaves its last three tokens to compute:
    the heads observe the two before the last as after a whole prefill, so the first
    step's prediction, and the text, are the ones without the cache: the same prompt again
    (a prefix of the cached generation)."""
    import mlx.core as mx

    from edge0.train.heads import make_warm_heads
    from tests.ckpt_tools import copy_model

    d = copy_model(tiny_model_factory("qwen3_moe"), tmp_path / "m")
    make_warm_heads(d, d / "prerouter.safetensors", width=32)
    heads, meta = mx.load(str(d / "prerouter.safetensors"), return_metadata=True)
    mx.random.seed(1)  # a token path that changes the prediction (warm-start heads have none)
    heads = {k: (mx.random.normal(v.shape) * 0.5).astype(v.dtype) if k.endswith("token.weight") else v
             for k, v in heads.items()}
    mx.save_safetensors(str(d / "prerouter.safetensors"), heads, metadata=meta)
    config = {"routing": routing, "stage_extra": 2 if routing == "select" else 0}
    with Engine(d, EngineConfig(prompt_cache_mb=16, **config)) as cached, Engine(d, EngineConfig(**config)) as plain:
        assert cached.streaming.prerouter is not None
        ids = cached.encode("def f(x):")
        first = [e.token for e in cached.stream(ids, max_tokens=6)]
        again = list(cached.stream(ids, max_tokens=24))
        assert [e.token for e in again] == [e.token for e in plain.stream(ids, max_tokens=24)]
        assert again[-1].stats.cached_tokens == len(ids) - 3
        # a next turn: its last three tokens computed too (the generated tokens' keys and
        # values are the decode path's, routed by the prediction: a whole prefill of the
        # turn, routed by the model's own routers, need not reproduce them under replace)
        follow = ids + first + cached.encode("\n    return 1")
        turn = list(cached.stream(follow, max_tokens=24))
        assert turn[-1].stats.cached_tokens == len(follow) - 3


def test_top_k_at_or_above_the_vocabulary_keeps_every_token(engine):
    vocab = engine.vocab_size
    for top_k in (vocab, vocab + 5):
        a = [e.token for e in engine.stream(PROMPT, max_tokens=6, temp=1.0, seed=3, top_k=top_k)]
        b = [e.token for e in engine.stream(PROMPT, max_tokens=6, temp=1.0, seed=3)]
        assert a == b


def test_a_broken_random_state_does_not_outlive_the_generation_that_broke_it(engine):
    """mlx-lm's compiled top-k raising inside its trace leaves MLX's global random state
    unusable; every generation starts from its own random state, so the next one samples."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    logits = mx.zeros((1, engine.vocab_size))
    try:
        with pytest.raises(ValueError):
            mx.eval(make_sampler(temp=1.0, top_k=engine.vocab_size)(logits))
        events = list(engine.stream(PROMPT, max_tokens=4, temp=1.0))
        assert len(events) == 4
    finally:
        mx.random.seed(0)  # this thread's code outside an engine would still see the broken state


def test_another_prompt_between_two_turns_keeps_the_conversations_cache(tiny_model_factory):
    """A request sharing only a prefix with a cached conversation gets a copy of that prefix;
    the conversation's entry stays, so its next turn prefills only its new tokens."""
    d = tiny_model_factory("qwen3_moe")
    with Engine(d, EngineConfig(prompt_cache_mb=16)) as cached, Engine(d) as plain:
        ids = cached.encode("def fibonacci(n):")
        out1 = list(cached.stream(ids, max_tokens=6))
        other = ids[:1] + cached.encode(" something else entirely")
        out_other = list(cached.stream(other, max_tokens=4))
        assert out_other[-1].stats.cached_tokens == 1
        assert [e.token for e in out_other] == [e.token for e in plain.stream(other, max_tokens=4)]
        follow = ids + [e.token for e in out1] + cached.encode("\n    return 1")
        out2 = list(cached.stream(follow, max_tokens=6))
        assert out2[-1].stats.cached_tokens == len(ids) + 5  # all it generated but the last token
        assert [e.token for e in out2] == [e.token for e in plain.stream(follow, max_tokens=6)]


def test_an_oversize_text_is_refused_before_it_is_tokenized(engine, monkeypatch):
    """No token covers more than the longest token's characters: a text longer than the
    context times that cannot fit, and is refused without tokenizer work (a 4 MiB prompt
    once cost 700 MiB of tokens before the length check)."""
    calls = []

    class Counting:
        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def encode(self, *a, **k):
            calls.append(1)
            return self._tok.encode(*a, **k)

    monkeypatch.setattr(engine, "tokenizer", Counting(engine.tokenizer))
    huge = "x = 1\n" * (4 * 2**20 // 6)
    for call in (lambda: engine.validate(huge), lambda: engine.prompt_ids(huge),
                 lambda: engine.prompt_ids(messages=[{"role": "user", "content": huge}])):
        with pytest.raises(ConfigError, match="characters: at least .* tokens, more than the model's context"):
            call()
    assert calls == []
    assert engine.validate("def f(x):")[0]  # an ordinary prompt is tokenized as before


def _first_step(engine, prompt, **sampling) -> dict[int, float]:
    """The first generated step's 20 most likely tokens -> log-probability (after the
    logits processors, as mlx-lm reports them)."""
    return dict(list(engine.stream(prompt, max_tokens=1, top_logprobs=20, **sampling))[0].top_logprobs)


@pytest.mark.parametrize("name", ["presence", "frequency"])
def test_presence_and_frequency_penalties_subtract_from_the_window_tokens(engine, name):
    """presence: the logit of every token among the last N drops by p; frequency: by p
    times its count there. Compared by differences of log-probabilities between tokens,
    which a penalty changes by exactly that amount and normalisation does not (a bias
    lifts the window's tokens into the top 20 in both runs)."""
    prompt = "a = a + b\nb = a + a\n"
    ids = engine.encode(prompt)
    window = ids[-6:]
    lift = {t: 20.0 for t in window}  # the window's tokens among the 20 most likely, in both runs
    plain = _first_step(engine, prompt, logit_bias=lift)
    penalised = _first_step(engine, prompt, logit_bias=lift, **{f"{name}_penalty": 1.5, f"{name}_context_size": 6})
    both = [t for t in plain if t in penalised]

    def drop(t):
        return 1.5 * ((t in window) if name == "presence" else window.count(t))

    pairs = [(a, b) for a in both for b in both if drop(a) != drop(b)]
    assert pairs, "no pair of tokens with different penalties: the check would be empty"
    for a, b in pairs:
        expected = (plain[a] - plain[b]) - (drop(a) - drop(b))
        assert abs((penalised[a] - penalised[b]) - expected) < 1e-3, (a, b)


def test_logit_bias_adds_to_the_named_tokens(engine):
    greedy = [e.token for e in engine.stream(PROMPT, max_tokens=6)]
    eos = set(engine.tokenizer.eos_token_ids)
    forced = next(t for t in range(5, 100) if t not in greedy and t not in eos)
    out = [e.token for e in engine.stream(PROMPT, max_tokens=6, logit_bias={str(forced): 100})]
    assert out == [forced] * 6
    banned = [e.token for e in engine.stream(PROMPT, max_tokens=6, logit_bias={greedy[0]: -100})]
    assert banned[0] != greedy[0]
    plain, biased = _first_step(engine, PROMPT), _first_step(engine, PROMPT, logit_bias={greedy[0]: -0.5})
    others = [t for t in plain if t in biased and t != greedy[0]]
    assert greedy[0] in biased and others
    assert abs((biased[greedy[0]] - biased[others[0]]) - (plain[greedy[0]] - plain[others[0]] - 0.5)) < 1e-3


@pytest.mark.parametrize("kwargs,match", [
    (dict(presence_penalty=2.5), r"presence_penalty must be a number in \[-2, 2\], got 2.5"),
    (dict(frequency_penalty=float("nan")), r"frequency_penalty must be a number in \[-2, 2\]"),
    (dict(presence_context_size=0), r"presence_context_size must be an integer in 1..1048576, got 0"),
    (dict(logit_bias=[1, 2]), "logit_bias must be an object of token id -> bias"),
    (dict(logit_bias={"x": 1}), r"logit_bias keys must be token ids \(non-negative integers\), got 'x'"),
    (dict(logit_bias={-1: 1}), r"logit_bias keys must be token ids"),
    (dict(logit_bias={3: 101}), r"logit_bias\[3\] must be a number in \[-100, 100\], got 101"),
    (dict(logit_bias={3: "1"}), r"logit_bias\[3\] must be a number"),
    (dict(logit_bias={10**9: 1}), r"logit_bias token ids \[1000000000\] are outside the vocabulary"),
    (dict(logit_bias={i: 1 for i in range(1025)}), "logit_bias names 1025 tokens; at most 1024"),
])
def test_bad_penalties_and_biases(engine, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        list(engine.stream(PROMPT, **kwargs))


def test_freed_buffers_are_given_back_beyond_the_bound(qwen, monkeypatch):
    """MLX keeps freed buffers for reuse; after each generation the engine gives back what
    it holds beyond BUFFER_CACHE_BYTES, so memory follows what is live: prompt-cache
    entries evicted by later prompts do not stay behind as cached buffers."""
    import mlx.core as mx

    from edge0.backend.mlx import core

    monkeypatch.setattr(core, "BUFFER_CACHE_BYTES", 256 * 1024)
    held = []
    with Engine(qwen, EngineConfig(prompt_cache_mb=1)) as e:
        for n in range(4):  # distinct long prompts: each evicts the one before
            e.generate_text([5 + (n + i) % 200 for i in range(600)], max_tokens=2)
            held.append(mx.get_cache_memory())
    assert max(held) <= 256 * 1024, held
