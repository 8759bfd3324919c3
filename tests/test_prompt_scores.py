"""The engine scores a prompt (``prompt_logprobs``) as ``edge0 eval`` scores text: the same
numbers as mlx-lm's resident model read through ``B.score_tokens``, whether the prompt is
prefilled whole, in chunks, or in one pass with others arriving together; a scored prompt
is forwarded whole (never shortened by the prompt cache)."""

from __future__ import annotations

import numpy as np
import pytest

from edge0 import Engine, EngineConfig
from edge0.errors import ConfigError
from tests.test_batch import _arriving_together

TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


def _scores(engine: Engine, prompt, k: int = 0) -> list:
    return next(iter(engine.stream(prompt, max_tokens=1, prompt_logprobs=k))).prompt_logprobs


def _eval_scores(model_dir, ids: list[int]) -> np.ndarray:
    """What ``edge0 eval`` computes for the text: its resident model, ``B.score_tokens``."""
    from edge0.backend import core as B
    from edge0.train import evaluate

    resident, _ = evaluate.load_model(model_dir)
    _, picked = B.score_tokens(resident(B.array([ids[:-1]])), B.array([ids[1:]]))
    return B.to_host(picked)[0]


def test_prompt_scores_are_edge0_evals_numbers_whole_or_in_chunks(model):
    with Engine(model, EngineConfig(adapter="off")) as e:
        ids = e.encode(TEXT)
        whole = _scores(e, ids, k=3)
    with Engine(model, EngineConfig(adapter="off", prefill_step_size=8)) as e:
        chunked = _scores(e, ids, k=3)
    assert len(whole) == len(ids) > 20 and whole[0] is None and chunked[0] is None
    expected = _eval_scores(model, ids)
    np.testing.assert_allclose([s[0] for s in whole[1:]], expected, atol=1e-5)
    np.testing.assert_allclose([s[0] for s in chunked[1:]], expected, atol=1e-5)
    for lp, top in whole[1:]:  # the three likeliest, likeliest first; the token itself no likelier than the first
        assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert lp <= top[0][1] + 1e-6


def test_prompts_arriving_together_score_as_each_alone(model):
    prompts = ["def f(x):\n    return x", "import os\nimport sys\n", "class Stack:\n    def"]
    with Engine(model, EngineConfig(adapter="off")) as e:
        alone = [[s[0] for s in _scores(e, p)[1:]] for p in prompts]
        passes = e.metrics().prefill_passes
        together = _arriving_together(e, prompts, take=lambda events: events[0].prompt_logprobs, max_tokens=1,
                                      prompt_logprobs=0)
        assert e.metrics().prefill_passes == passes + 1  # one left-padded pass for the three
    for scores, expected in zip(together, alone):
        np.testing.assert_allclose([s[0] for s in scores[1:]], expected, atol=1e-5)


def test_a_scored_prompt_is_forwarded_whole_past_the_prompt_cache(model):
    with Engine(model, EngineConfig(adapter="off", prompt_cache_mb=64)) as e:
        ids = e.encode(TEXT)
        first = list(e.stream(ids, max_tokens=4, prompt_logprobs=0))
        again = list(e.stream(ids + [ev.token for ev in first], max_tokens=2, prompt_logprobs=0))
        assert again[-1].stats.cached_tokens == 0
        np.testing.assert_allclose([s[0] for s in again[0].prompt_logprobs[1:len(ids)]],
                                   [s[0] for s in first[0].prompt_logprobs[1:]], atol=1e-5)
        assert first[1].prompt_logprobs is None  # the first event only
        plain = list(e.stream(ids + [ev.token for ev in first], max_tokens=2))
        assert plain[-1].stats.cached_tokens > 0 and plain[0].prompt_logprobs is None


def test_prompt_logprobs_out_of_range_is_a_config_error(model):
    with Engine(model, EngineConfig(adapter="off")) as e:
        with pytest.raises(ConfigError, match=r"prompt_logprobs must be an integer in 0\.\.20, got 21"):
            _scores(e, "x", k=21)
