"""bench adaptive's pure functions: the share of rounds at each k from the orchestrator's counters,
and a column over the best fixed k paired prompt by prompt, with its interval."""

from __future__ import annotations

import math

import pytest

from bench.adaptive import paired_interval, paired_ratio, round_mix


def test_round_mix_counts_rounds_at_each_k_from_position_counters():
    # 10 rounds at batch 1: 3 drafted position 1 or more, 2 of them position 2, 1 position 3.
    before = {"total_count": 5.0, "drafted_1": 4.0, "drafted_2": 1.0}
    after = {"total_count": 15.0, "drafted_1": 7.0, "drafted_2": 3.0, "drafted_3": 1.0}
    assert round_mix(before, after) == {"k0": 0.7, "k1": 0.1, "k2": 0.1, "k3": 0.1}
    assert round_mix(after, after) == {}


def test_paired_ratio_is_the_geometric_mean_of_the_prompts_ratios():
    # two repeats of two prompts; the second repeat runs in a stretch twice as slow for both columns
    best = [{"requests": [(100, 0.10), (100, 0.20)]}, {"requests": [(100, 0.20), (100, 0.40)]}]
    cells = [{"requests": [(100, 0.125), (100, 0.20)]}, {"requests": [(100, 0.25), (100, 0.40)]}]
    assert math.isclose(paired_ratio(cells, best), math.sqrt(0.8))     # 0.8 on the first prompt, 1 on the second
    assert math.isclose(paired_ratio(best, best), 1.0)
    faster = [{"requests": [(100, s / 2) for _, s in c["requests"]]} for c in best]
    assert math.isclose(paired_ratio(faster, best), 2.0)
    assert paired_ratio([], []) == 0.0


def test_paired_interval_holds_the_ratio_and_narrows_with_agreeing_prompts():
    best = [{"requests": [(100, 0.10)] * 8}]
    spread = [{"requests": [(100, 0.10 * f) for f in (0.9, 1.0, 1.1, 1.2, 0.95, 1.05, 1.15, 1.0)]}]
    lo, hi = paired_interval(spread, best)
    assert lo < paired_ratio(spread, best) < hi and lo < 1.0 < hi          # 0.96: not told from 1.0
    steady = [{"requests": [(100, 0.10 / 0.9)] * 8}]                       # every prompt 0.9
    assert paired_interval(steady, best) == pytest.approx((0.9, 0.9))
    assert paired_interval(spread, best) == (lo, hi)                       # seeded: the same cells, the same interval
    assert paired_interval([], []) == (0.0, 0.0)
