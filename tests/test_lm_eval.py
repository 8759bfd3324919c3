"""lm-evaluation-harness end to end against a real ``edge0 serve`` (skipped without the
``eval`` extra, ``pip install 'lm_eval[api]'``): ``local-completions`` scores
``loglikelihood`` and ``loglikelihood_rolling`` requests and runs ``generate_until`` in
batches of 4, ``local-chat-completions`` runs ``generate_until``; every number and text
is the engine's own for the same tokens."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

import edge0
from edge0 import EngineConfig
from tests.test_server import model, serving  # noqa: F401  (model: the fixture)

lm_eval_api = pytest.importorskip("lm_eval.api.instance", reason="lm-evaluation-harness (the eval extra)")

PAIRS = [("def add(a, b):", " return a + b"), ("import os", "\nimport sys"), ("class Stack:", "\n    pass"),
         ("for i in range(3):", " print(i)"), ("x = [1, 2, 3]", "\ny = x[0]")]
TEXTS = ["def f(x):\n    return x * 2\n", "while True:\n    break\n" * 6]


@pytest.fixture(scope="module")
def served(model):  # noqa: F811
    with serving(model[0], EngineConfig(adapter="off", prompt_cache_mb=64)) as (url, state):
        yield url, state, model[0]


def _instances(kind: str, args: list) -> list:
    return [lm_eval_api.Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def _completions(url: str, model_dir, **kw):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(base_url=url + "/v1/completions", model="tiny", tokenizer_backend="huggingface",
                               tokenizer=str(model_dir), batch_size=4, max_retries=1, **kw)


def _scored(state, ids: list[int]) -> list[float]:
    """The engine's own scoring of ``ids``: each token's log-probability after the first."""
    event = next(iter(state.engine.stream(ids, adapter=None, max_tokens=1, prompt_logprobs=0)))
    return [s[0] for s in event.prompt_logprobs[1:]]


def test_loglikelihood_is_the_engines_scoring(served):
    url, state, model_dir = served
    lm = _completions(url, model_dir)
    got = lm.loglikelihood(_instances("loglikelihood", PAIRS))
    tok = state.engine.tokenizer
    for (context, continuation), (ll, greedy) in zip(PAIRS, got):
        whole = tok.encode(context + continuation, add_special_tokens=False)
        n = len(tok.encode(context, add_special_tokens=False))
        scores = _scored(state, whole)
        assert ll == pytest.approx(sum(scores[n - 1:]), abs=1e-4)
        assert isinstance(greedy, bool)


def test_loglikelihood_rolling_is_the_engines_scoring_window_by_window(served):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    url, state, model_dir = served
    lm = _completions(url, model_dir, max_length=24)  # the second text needs several windows
    got = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in TEXTS]))
    tok = state.engine.tokenizer
    for text, ll in zip(TEXTS, got):
        ids = tok.encode(text, add_special_tokens=False)
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=ids, prefix_token=tok.eos_token_id, max_seq_len=22, context_len=1)]
        expected = sum(sum(_scored(state, ctx + cont)[-len(cont):]) for ctx, cont in windows)
        assert len(windows) >= (2 if len(ids) > 23 else 1)
        assert ll == pytest.approx(expected, abs=1e-3) and math.isfinite(ll)


def test_generate_until_is_the_engines_greedy_text(served):
    from lm_eval.models.api_models import JsonChatStr
    from lm_eval.models.openai_completions import LocalChatCompletion

    url, state, model_dir = served
    until = {"until": ["\n\n"], "max_gen_toks": 12}
    prompts = [c for c, _ in PAIRS]
    got = _completions(url, model_dir).generate_until(_instances("generate_until", [(p, until) for p in prompts]))
    tok = state.engine.tokenizer
    for prompt, text in zip(prompts, got):
        ids = tok.encode(prompt, add_special_tokens=False)
        assert text == state.engine.generate_text(ids, adapter=None, max_tokens=12, stop=["\n\n"])[0]
    chat = LocalChatCompletion(base_url=url + "/v1/chat/completions", model="tiny", max_retries=1)
    messages = [[{"role": "user", "content": p}] for p in prompts[:2]]
    answers = chat.generate_until(_instances("generate_until", [(JsonChatStr(json.dumps(m)), until) for m in messages]))
    for m, text in zip(messages, answers):
        ids = state.engine.prompt_ids(messages=m)
        assert text == state.engine.generate_text(ids, adapter=None, max_tokens=12, stop=["\n\n"])[0]


ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "lm_eval_tasks"  # local task files; their data_files resolve from the repo root
DEMO = Path(edge0.__file__).parent / "data" / "demo_model"


@pytest.fixture(scope="module")
def demo_served():
    with serving(DEMO, EngineConfig(adapter="off", prompt_cache_mb=64)) as (url, state):
        yield url, state


def _evaluate(monkeypatch, model: str, model_args: str, tasks: list[str], **kw) -> dict:
    """``lm_eval.simple_evaluate`` as a user runs it: the local tasks by name, from the repo root."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True,
                                   task_manager=TaskManager(include_path=str(TASKS)), **kw)


def test_local_tasks_through_the_harness_are_the_engines_numbers(demo_served, monkeypatch):
    """``tests/lm_eval_tasks`` (multiple choice, perplexity, generation) run by
    ``simple_evaluate`` on the demo model: every task reports its metrics, and the
    per-sample numbers are the engine's own for the same tokens."""
    url, state = demo_served
    out = _evaluate(monkeypatch, "local-completions",
                    f"model=tiny,base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={DEMO},"
                    "batch_size=4,max_retries=1", ["edge0_python"])
    results, samples, tok = out["results"], out["samples"], state.engine.tokenizer
    assert math.isfinite(results["edge0_python_mc"]["acc,none"])
    assert 0 <= results["edge0_python_gen"]["exact_match,first_line"] <= 1

    mc = samples["edge0_python_mc"]
    assert len(mc) == 6 and sum(len(s["doc"]["choices"]) for s in mc) == 24
    for s in mc:  # one (context, choice) request per choice, scored as the engine scores it
        assert [a[1] for a in s["arguments"]] == s["doc"]["choices"]
        for (context, continuation), resp in zip(s["arguments"], s["resps"]):
            whole = tok.encode(context + continuation, add_special_tokens=False)
            n = len(tok.encode(context, add_special_tokens=False))
            assert resp[0][0] == pytest.approx(sum(_scored(state, whole)[n - 1:]), abs=1e-4)
        lls = [r[0][0] for r in s["resps"]]
        assert s["acc"] == float(lls.index(max(lls)) == s["doc"]["answer"])

    ppl, total, words, nbytes = samples["edge0_python_ppl"], 0.0, 0, 0
    assert len(ppl) == 3
    for s in ppl:  # each snippet is one window after the end-of-text token
        text = s["doc"]["text"]
        expected = sum(_scored(state, [tok.eos_token_id] + tok.encode(text, add_special_tokens=False)))
        assert s["resps"][0][0] == pytest.approx(expected, abs=1e-3)
        total, words, nbytes = total + expected, words + len(re.split(r"\s+", text)), nbytes + len(text.encode())
    ppl_results = results["edge0_python_ppl"]
    assert ppl_results["word_perplexity,none"] == pytest.approx(math.exp(-total / words), rel=1e-4)
    assert ppl_results["byte_perplexity,none"] == pytest.approx(math.exp(-total / nbytes), rel=1e-4)
    assert ppl_results["bits_per_byte,none"] == pytest.approx(-total / nbytes / math.log(2), rel=1e-4)
    assert all(math.isfinite(v) and v > 0 for v in (ppl_results["word_perplexity,none"],
                                                    ppl_results["byte_perplexity,none"]))

    gen = samples["edge0_python_gen"]
    assert len(gen) == 3
    for s in gen:  # greedy, up to 16 tokens, cut at the first blank line
        ids = tok.encode(s["doc"]["prompt"], add_special_tokens=False)
        assert s["resps"][0][0] == state.engine.generate_text(ids, adapter=None, max_tokens=16, stop=["\n\n"])[0]

    chat = _evaluate(monkeypatch, "local-chat-completions",
                     f"model=tiny,base_url={url}/v1/chat/completions,max_retries=1", ["edge0_python_gen"],
                     apply_chat_template=True)
    assert 0 <= chat["results"]["edge0_python_gen"]["exact_match,first_line"] <= 1
    for s in chat["samples"]["edge0_python_gen"]:
        ids = state.engine.prompt_ids(messages=[{"role": "user", "content": s["doc"]["prompt"]}])
        assert s["resps"][0][0] == state.engine.generate_text(ids, adapter=None, max_tokens=16, stop=["\n\n"])[0]
