"""Prompt lookup's drafts (``edge0.drafts``): what it proposes, how many, and when it pauses."""

import pytest

from edge0 import drafts
from edge0.drafts import PromptLookup
from edge0.errors import ConfigError


def _lookup(seq, **kw) -> PromptLookup:
    d = PromptLookup(kw.pop("max_draft", 4), **{"ngram_min": 1, **kw})
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
    d = PromptLookup(4)
    d.extend([5, 1, 2, 3, 9, 1])
    assert d.propose() == []  # "1" alone occurred before; "9 1" did not
    d.extend([2])
    assert d.propose() == [3, 9, 1, 2]


def test_a_long_sequence_is_indexed_as_it_grows():
    d = PromptLookup(3)  # the defaults: 3 tokens, then 2
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
