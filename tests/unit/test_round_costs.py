"""runtime.round_costs: what T(k) keeps between the rounds that change it."""

from __future__ import annotations

from runtime.round_costs import MIN_PERIODS, RoundCosts


def test_target_only_rounds_keep_the_drafting_costs_before_periods_are_measured():
    """A loop that timed one drafting round and then only target-only rounds (its probes are
    watches on text that never drafts: no steady drafting round, so its periods stay unmeasured)
    keeps T(k > 0) between rounds; T(0) follows every round, and every kept T(k) equals a fresh one."""
    costs = RoundCosts()
    t = 0.0
    costs.observe(3, 6e-4, 9e-4, 1e-4, t, frozenset({"a"}))             # a newcomer's drafting round
    versions = set()
    for i in range(40):
        t += 4e-4 + 1e-5 * (i % 3)
        costs.observe(0, 0.0, 3e-4 + 1e-5 * (i % 5), 5e-5, t, frozenset({"a"}))
        assert not costs.drafting_measured
        for k in range(4):
            assert costs.cost(k) == costs._cost(k), (i, k)
        if i >= 2:                                # the round after the drafting one and its period are in
            versions.add(costs.version)
    assert len(versions) == 1


def test_completing_the_periods_changes_the_drafting_costs_at_once():
    """The round that measures the last missing period switches T(k > 0) from the parts' sum to
    the periods: nothing kept from before may stand."""
    costs = RoundCosts()
    t, batch = 0.0, frozenset({"a"})
    for _ in range(MIN_PERIODS + 2):                                    # steady drafting rounds
        t += 1e-3
        costs.observe(3, 3e-4, 5e-4, 1e-4, t, batch)
    before = costs.cost(3)
    for i in range(2 * MIN_PERIODS + 2):                                 # then target-only rounds
        t += 4e-4
        costs.observe(0, 0.0, 3e-4, 5e-5, t, batch)
        for k in range(4):
            assert costs.cost(k) == costs._cost(k), (i, k)
    assert costs.drafting_measured and costs.cost(3) != before
