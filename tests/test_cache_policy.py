"""tools/cache_policy.py: the slots in front of the cache, each policy's replay, and Belady's
optimum (never more misses than any policy, on any trace)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import cache_policy as cp  # noqa: E402

from edge0.exec.oracle import OracleRouting  # noqa: E402


def test_the_slots_take_what_the_last_steps_used_and_pass_the_rest_to_the_cache():
    trace = OracleRouting([{0: (1, 2)}, {0: (2, 3)}, {0: (1, 4)}, {0: (3, 1)}])
    # two slots: step 0 reads 1, 2; step 1 holds 2, reads 3 (evicting 1); step 2 reads 1 and 4;
    # step 3 holds 1, reads 3 again (evicting 4)
    assert cp.cache_accesses(trace, 2) == [[(0, 1), (0, 2)], [(0, 3)], [(0, 1), (0, 4)], [(0, 3)]]


def test_known_misses_of_each_policy():
    a, b, c = (0, 1), (0, 2), (0, 3)
    steps = [[a], [b], [a], [c], [b], [a]]
    assert cp.replay(steps, 2, "lru") == 5  # a b a c(evicts b) b(evicts a) a(evicts c)
    assert cp.replay(steps, 2, "belady") == 3  # c is never used again: not kept, a and b stay
    assert cp.replay(steps, 0, "lru") == 6 and cp.replay(steps, 3, "lfu") == 3


@pytest.mark.parametrize("seed", range(5))
def test_belady_is_never_beaten(seed):
    rng = random.Random(seed)
    hot = [rng.randrange(64) for _ in range(8)]
    steps = [[(l, rng.choice(hot) if rng.random() < 0.6 else rng.randrange(64)) for l in range(4)] for _ in range(300)]
    routed = [set(s) for s in steps]
    for capacity in (4, 16, 64):
        best = cp.replay(steps, capacity, "belady")
        for policy in (*cp.POLICY_ORDER[:-1], *cp.MORE):
            assert best <= cp.replay(steps, capacity, policy, routed)


def test_the_variants_tried_against_the_shipped_policy_do_what_they_say():
    a, b, c = (0, 1), (0, 2), (0, 3)
    # one entry: a is asked for twice, then b: the shipped rule lets b replace a at a tie (its
    # second ask), the strict one only once b was asked for more often (its third)
    steps = [[a], [a], [b], [b], [b], [a]]
    assert cp.replay(steps, 1, "lfu") == 4  # a, b (refused: 1 < 2), b (2 >= 2: in), a (3 >= 3: in)
    assert cp.replay(steps, 1, "lfu>") == 5 and cp.replay(steps, 1, "lru>") == 5  # a, b, b, b (3 > 2: in), a
    # the next two steps' experts are never evicted: with c protected, nothing is admitted over it
    routed = [set(s) for s in [[c], [a], [c], [a], [c]]]
    assert cp.replay([[c], [a], [c], [a], [c]], 1, "lfu+next2", routed) == 3  # c stays: a never enters
    assert cp.replay([[c], [a], [c], [a], [c]], 1, "lfu") == 5  # without: a and c replace each other at ties
    # static: the most accessed over the whole trace held from its first access; the rest all miss
    assert cp.replay([[a], [b], [a], [c], [a], [b], [b], [b]], 1, "static") == 5  # b (4 accesses) held: a 3x, c, b's first
    assert cp.replay([[a], [b], [a], [c], [a], [b], [b], [b]], 0, "static") == 8
    # ARC keeps what was asked for twice over a stream seen once
    loop = [[(0, i)] for i in range(3, 9)]
    assert cp.replay([[a], [a], *loop, [a]], 2, "arc") == 1 + len(loop)  # a hits at the end


def test_the_tool_prints_a_table_per_trace(tmp_path, capsys):
    path = tmp_path / "t.json"
    rng = random.Random(1)
    OracleRouting([{l: tuple(sorted(rng.sample(range(16), 2))) for l in range(3)} for _ in range(50)]).save(path)
    assert cp.main([str(path), "--sizes", "0.25,0.5"]) == 0
    out = capsys.readouterr().out
    assert "t.json: 50 decode steps, 3 MoE layers" in out and "| 25% (12 experts) |" in out and "belady" in out
    assert "arc" not in out
    assert cp.main([str(path), "--sizes", "0.25", "--more"]) == 0
    out = capsys.readouterr().out
    assert all(p in out for p in cp.MORE)
