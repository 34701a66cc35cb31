"""bench adaptive's share of rounds at each k, from the orchestrator's counters (pure function)."""

from __future__ import annotations

from bench.adaptive import round_mix


def test_round_mix_counts_rounds_at_each_k_from_position_counters():
    # 10 rounds at batch 1: 3 drafted position 1 or more, 2 of them position 2, 1 position 3.
    before = {"total_count": 5.0, "drafted_1": 4.0, "drafted_2": 1.0}
    after = {"total_count": 15.0, "drafted_1": 7.0, "drafted_2": 3.0, "drafted_3": 1.0}
    assert round_mix(before, after) == {"k0": 0.7, "k1": 0.1, "k2": 0.1, "k3": 0.1}
    assert round_mix(after, after) == {}
