"""Prompt lookup's drafts (``edge0.drafts``): what it proposes, how many, and when it pauses."""

import pytest

from edge0 import drafts
from edge0.drafts import PromptLookup
from edge0.errors import ConfigError


def _lookup(seq, **kw) -> PromptLookup:
    d = PromptLookup(kw.pop("max_draft", 4), **{"ngram_min": 1, "trusted": True, **kw})
    d.extend(seq)
    return d


def test_it_proposes_what_followed_the_latest_occurrence_of_the_longest_matching_ngram():
    # "5 6" occurred twice: followed by 7 8 9 first, by 1 2 3 later; the latest wins
    d = _lookup([5, 6, 7, 8, 9, 0, 5, 6, 1, 2, 3, 4, 4, 5, 6], max_draft=3)
    assert d.propose() == [1, 2, 3]
    # the longest n wins: "0 5 6" occurred before 7 9, "5 6" last before 8 0
    d = _lookup([0, 5, 6, 7, 9, 5, 6, 8, 0, 5, 6], max_draft=2, ngram_max=3)
    assert d.propose() == [7, 9]


def test_the_sequence_s_own_last_ngram_is_not_its_match_and_nothing_is_proposed_without_one():
    assert _lookup([1, 2, 3, 4]).propose() == []
    assert _lookup([]).propose() == []
    d = _lookup([1, 2, 1, 2])  # "1 2" ended at 2 (followed by "1 2"); the latest occurrence is the last
    assert d.propose() == [1, 2]


def test_a_match_near_the_end_proposes_fewer_tokens_and_appending_tokens_finds_new_matches():
    d = _lookup([7, 8, 9, 7], max_draft=4)
    assert d.propose() == [8, 9, 7]  # what follows "7", to the end
    d.extend([8])
    assert d.propose() == [9, 7, 8]  # "7 8" now


def test_k_grows_after_a_pass_that_took_every_draft_and_shrinks_to_what_was_taken_plus_one():
    d = _lookup([1, 2, 3, 4, 5, 6, 7, 8, 9, 1], max_draft=6)
    assert d.k == 4 and len(d.propose()) == 4
    d.accepted(4, 4)
    assert d.k == 5
    d.accepted(5, 1)
    assert d.k == 2
    for _ in range(10):
        d.accepted(d.k, d.k)
    assert d.k == 6  # never past max_draft


def test_drafting_pauses_after_passes_that_took_nothing_and_the_pause_doubles():
    d = _lookup([1, 2, 3, 1], max_draft=2)
    for _ in range(drafts.BACKOFF_AFTER):
        assert d.propose()
        d.accepted(2, 0)
    assert [d.propose() for _ in range(drafts.BACKOFF_STEPS)] == [[]] * drafts.BACKOFF_STEPS
    assert d.propose()  # drafting again
    for _ in range(drafts.BACKOFF_AFTER):
        d.accepted(1, 0)
    assert d.pause == 2 * drafts.BACKOFF_STEPS
    d.pause = 0
    d.accepted(1, 1)  # a pass that took something resets the back-off
    assert d.backoff == drafts.BACKOFF_STEPS and d.misses == 0


def test_one_repeated_token_drafts_nothing_by_default():
    d = PromptLookup(4, trusted=True)
    d.extend([5, 1, 2, 3, 9, 1])
    assert d.propose() == []  # "1" alone occurred before; "9 1" did not
    d.extend([2])
    assert d.propose() == [3, 9, 1, 2]


def test_until_a_pass_took_a_draft_only_the_longest_runs_draft():
    """Text that does not repeat recurs in short runs by chance: until a pass took one of
    its drafts, a sequence drafts on matches of ``ngram_max`` tokens only."""
    d = PromptLookup(4)  # 3 tokens, then 2
    d.extend([5, 1, 2, 3, 9, 1, 2])
    assert not d.ready() and d.propose() == []  # "1 2" occurred before, "9 1 2" did not
    d.extend([3])
    assert d.ready() and d.propose() == [9, 1, 2, 3]  # "1 2 3" did
    d.accepted(4, 0)
    d.extend([7, 1, 2])
    assert d.propose() == []
    d.accepted(1, 1)  # a pass took a draft: "1 2" drafts now
    assert d.ready() and d.propose() == [3, 7]


def test_a_long_sequence_is_indexed_as_it_grows():
    d = PromptLookup(3, trusted=True)  # the defaults: 3 tokens, then 2
    seq = list(range(1000)) * 3
    d.extend(seq)
    d.extend([10, 11])
    assert d.propose() == [12, 13, 14]


@pytest.mark.parametrize("kw, named", [({"max_draft": 0}, "prompt_lookup"), ({"max_draft": 17}, "prompt_lookup"),
                                        ({"max_draft": True}, "prompt_lookup"),
                                        ({"max_draft": 2, "ngram_max": 1}, "prompt_lookup_ngram"),
                                        ({"max_draft": 2, "ngram_max": 9}, "prompt_lookup_ngram")])
def test_bad_settings_are_refused_naming_them(kw, named):
    with pytest.raises(ConfigError, match=named):
        PromptLookup(**kw)


def test_a_draft_model_s_cache_follows_the_sequence_through_what_the_passes_took():
    """A ``ModelDrafter`` fed the sequence as it grows, its cache trimmed to what each pass
    took, proposes what a fresh one proposes after the whole sequence at once."""
    from pathlib import Path

    from edge0.backend import nn as bnn
    from edge0.draft_model import DraftModel, ModelDrafter

    demo = Path(__file__).resolve().parent.parent / "src" / "edge0" / "data" / "demo_model"
    draft = DraftModel(demo, bnn.load_tokenizer(demo))
    prompt = bnn.load_tokenizer(demo).encode("import os\nimport sys\nimport os\n")
    d, generated = ModelDrafter(draft, 4), []
    for taken in (4, 0, 2, 5, 1, 3):  # a pass that took all (of 4, then 5), none, some
        d.follow(prompt, generated)
        proposal = d.propose()
        fresh = ModelDrafter(draft, d.k)
        fresh.follow(prompt, generated)
        assert proposal == fresh.propose()
        taken = min(taken, len(proposal))
        d.accepted(len(proposal), taken)
        generated += proposal[:taken] + [7]  # the pass's own token after what it took
    d.follow(prompt, generated)
    assert d.propose() == d.propose()  # proposed again with nothing new (a pass that did not run): the same


def test_drafting_pauses_where_its_passes_make_too_few_tokens_to_pay_for_themselves():
    d = _lookup([1, 2, 3, 1, 2, 3, 1, 2], max_draft=4)
    made = drafts.MADE_AT_START
    for taken in (1, 0, 1, 0, 1, 0, 1):  # one draft taken every other pass: never three misses in a row
        d.accepted(2, taken)
        made = 0.7 * made + 0.3 * (taken + 1)
        assert d.pause == 0 and d.made == pytest.approx(made) and made >= drafts.MIN_TOKENS_A_PASS
    d.accepted(2, 0)  # 0.7 * 1.68 + 0.3 = 1.48 tokens a pass: under 1.5
    assert d.pause == drafts.BACKOFF_STEPS and d.made == drafts.MADE_AT_START
    assert [d.propose() for _ in range(drafts.BACKOFF_STEPS)] == [[]] * drafts.BACKOFF_STEPS
    assert d.propose() == [3]  # drafting again (one token: the last pass took none)


def test_a_draft_model_s_drafting_pauses_where_a_token_costs_more_with_drafts_than_without():
    class Timed:  # a drafter's pacing state, as a ModelDrafter has it
        misses, pause, step_time, draft_time, unpaid = 0, 0, None, None, False

    d = Timed()
    drafts.pace(d, 0.012, 2, drafted=True)  # 6 ms a token with a draft, no step timed yet: the next one a step
    assert d.pause == 1 and d.draft_time == pytest.approx(0.006) and not d.unpaid
    d.pause = 0
    for _ in range(3):
        drafts.pace(d, 0.010, 1, drafted=False)  # steps: 10 ms a token
    drafts.pace(d, 0.014, 2, drafted=True)  # 7 ms: the running mean 0.7 * 6 + 0.3 * 7 = 6.3 ms, it pays
    assert d.pause == 0 and d.draft_time == pytest.approx(0.0063) and not d.unpaid
    drafts.pace(d, 0.030, 1, drafted=True)  # 0.7 * 6.3 + 0.3 * 30 = 13.4 ms: it does not
    assert d.pause == drafts.MAX_BACKOFF and d.unpaid and d.draft_time is None
    drafts.pace(d, 0.0, 0, drafted=True)  # (an iteration that made no token weighs nothing)
    assert d.draft_time is None


def test_a_draft_model_that_did_not_pay_starts_its_next_generations_paused():
    from pathlib import Path

    from edge0.backend import nn as bnn
    from edge0.draft_model import DraftModel

    demo = Path(__file__).resolve().parent.parent / "src" / "edge0" / "data" / "demo_model"
    draft = DraftModel(demo, bnn.load_tokenizer(demo))
    first = draft.drafter(3)
    drafts.pace(first, 0.010, 1, drafted=False)
    drafts.pace(first, 0.050, 2, drafted=True)
    assert first.pause == drafts.MAX_BACKOFF and draft.unpaid
    assert draft.drafter(3).pause == drafts.MAX_BACKOFF  # what the first learnt, the next knows
    drafts.pace(first, 0.008, 2, drafted=True)  # a draft that paid: no longer marked
    assert not draft.unpaid and draft.drafter(3).pause == 0


def test_a_batch_size_s_drafting_pauses_where_its_passes_cost_more_a_token_than_its_steps():
    """``BatchPace``: a batch of one is never paused by it; a batch size's first pass is
    followed by timed steps (the first after a pass not counted: it plans its reads when it
    starts); a pass costing more a token than those steps pauses that size alone."""
    p = drafts.BatchPace()
    assert p.allows(1) and p.allows(3)
    p.record(1, 9.0, 1, drafted=True)
    assert p.allows(1)
    p.record(3, 0.012, 6, drafted=True)  # 2 ms a token with drafts, no step of 3 rows timed yet
    assert not p.allows(3) and p.allows(2)
    p.record(3, 0.090, 3, drafted=False)  # the step after a pass: 30 ms a token, not counted
    for _ in range(drafts.PROBE_STEPS - 1):
        assert not p.allows(3)
        p.record(3, 0.009, 3, drafted=False)  # steps: 3 ms a token
    assert p.allows(3)
    p.record(3, 0.015, 6, drafted=True)  # 0.7 * 2 + 0.3 * 2.5 = 2.15 ms: it pays
    assert p.allows(3)
    p.record(3, 0.060, 6, drafted=True)  # 0.7 * 2.15 + 0.3 * 10 = 4.5 ms: it does not
    assert not p.allows(3) and p.allows(2)
    for _ in range(drafts.MAX_BACKOFF):
        assert not p.allows(3)
        p.record(3, 0.009, 3, drafted=False)
    assert p.allows(3)


def test_the_bench_on_one_engine_drafts_in_one_arm_only(tmp_path):
    """tools/prompt_lookup_bench.py --same-engine (docs/BENCHMARKS.md's free-text figures):
    one engine runs both arms, the one without drafts asking for none by its requests; both
    make the same tokens, and each round's rates are kept."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import prompt_lookup_bench

    out = tmp_path / "r.json"
    prompt_lookup_bench.main(["--same-engine", "--case", "repeating: lines", "--rounds", "2", "--max-tokens", "16",
                              "--out", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    assert row["same_tokens"] and row["off_verify_passes"] == 0 and row["verify_passes"] > 0, row
    assert len(row["rates"]["off"]) == len(row["rates"]["lookup"]) == 2
    lo, hi = row["paired_mean_ci95"]
    assert lo <= row["paired_mean"] <= hi
