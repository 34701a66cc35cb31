"""Adaptive speculation length: the round-cost model (runtime/round_costs.py) and the policy (runtime/adaptive_k.py)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from core.params import SamplingParams
from runtime.adaptive_k import (PRIOR_ACCEPTANCE, PROBE_BACKOFF_MAX, PROBE_EVERY, SWITCH_HORIZON,
                                WATCH_BACKOFF_MAX, WATCH_BUDGET, WATCH_EVERY, AdaptiveK, AdaptiveLoop, best_k,
                                best_round_k, expected_tokens, round_k_star, _argmax, _rates)
from runtime.adaptive_plan import choose_round_k, follow_ups, request_ks, round_plan
from runtime.round_costs import RoundCosts, line_fit, round_cost
from runtime.round_driver import Sequence, judge_watch, plan_round, round_ks


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 3) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_best_k_matches_brute_force_over_a_grid():
    rng = np.random.default_rng(0)
    for _ in range(200):
        a = float(rng.uniform(0, 1))
        tv, td, tx = (float(x) for x in rng.uniform(1e-4, 3e-3, 3))
        k = best_k(a, 6, tv, td, tx)
        rates = [expected_tokens(a, j) / round_cost(j, tv, td, tx) for j in range(7)]
        assert rates[k] == pytest.approx(max(rates))


def test_cheap_drafts_and_high_acceptance_draft_the_most_useless_drafts_none():
    assert best_k(0.95, 5, t_verify=2e-3, t_draft=5e-5, t_exchange=1e-4) == 5
    assert best_k(0.02, 5, t_verify=2e-3, t_draft=5e-5, t_exchange=1e-4) == 0
    # Drafting that costs as much as verifying never pays at modest acceptance.
    assert best_k(0.5, 5, t_verify=1e-3, t_draft=1e-3, t_exchange=1e-3) == 0


def test_policy_learns_acceptance_from_trials_and_probes_when_target_only():
    costs = AdaptiveLoop(t_verify=2e-3, t_draft=1e-4, t_exchange=2e-4)
    pol = AdaptiveK(max_k=4)
    assert choose_round_k([pol], costs) > 0           # the prior says drafting pays here
    for _ in range(60):
        pol.observe(4, 0)                             # every first draft rejected
    assert pol.acceptance < 0.05 and choose_round_k([pol], costs) == 0
    ks = [choose_round_k([pol], costs) for _ in range(3 * PROBE_EVERY)]
    assert set(ks) == {0, 4}
    runs = "".join("x" if k else "." for k in ks).split(".")
    assert {len(r) for r in runs if r} == {2} and ks.count(4) >= 4  # probes: two full-k rounds, every PROBE_EVERY
    for _ in range(60):
        pol.observe(4, 4)                             # the probes start to succeed
    assert pol.acceptance > 0.9 and choose_round_k([pol], costs) == 4


def test_one_k_for_the_round_counts_every_request():
    """A request that gains little still rides along: the round's exchange is paid once for all."""
    tv, td, tx = 2e-3, 2e-4, 1e-3
    alone = best_round_k([(0.35, 3)], tv, td, tx)
    together = best_round_k([(0.35, 3)] + [(0.9, 3)] * 7, tv, td, tx)
    assert alone == 0 and together == 3
    assert best_round_k([(0.9, 1), (0.9, 3)], tv, td, tx) == 3      # each request is capped by its own k
    assert best_round_k([], tv, td, tx) == 0


def test_round_costs_follow_the_observed_rounds_and_ignore_outliers():
    costs = RoundCosts()
    for i in range(200):
        costs.observe(k_max=3, draft_s=3e-4, verify_s=2e-3, overhead_s=5e-4)
        if i % 10 == 0:                                # a stream opening, a GC pause
            costs.observe(k_max=3, draft_s=3e-2, verify_s=2e-1, overhead_s=5e-2)
    assert costs.t_draft == pytest.approx(1e-4, rel=1e-6)
    assert costs.t_verify == pytest.approx(2e-3, rel=1e-6)
    assert costs.t_exchange == pytest.approx(5e-4, rel=1e-6)
    costs.observe(k_max=0, draft_s=0.0, verify_s=2e-3, overhead_s=1e-5)   # a target-only round
    assert costs.t_draft == pytest.approx(1e-4, rel=1e-6) and costs.t_exchange == pytest.approx(5e-4, rel=1e-6)


def test_rounds_after_no_drafting_do_not_feed_the_draft_costs():
    """The first drafting round of a loop (stream opening) and the first after target-only
    rounds (an eager catch-up over every skipped pair) are not steady state: only their verify
    time is observed. Regression: probes after 16 target-only rounds charged that catch-up to
    the draft, and adaptive k stayed at k = 0 on an H200 (x0.81 of fixed k)."""
    costs = AdaptiveLoop(t_verify=1.5e-3, t_draft=3e-4, t_exchange=9e-4)
    costs.observe(3, 3e-2, 1.5e-3, 5e-2)                 # first round: stream opening
    assert costs.t_draft == pytest.approx(3e-4) and costs.t_exchange == pytest.approx(9e-4)
    costs.observe(3, 9e-4, 1.5e-3, 9e-4)                 # steady
    costs.observe(0, 0.0, 1.5e-3, 2e-5)                  # target-only
    for _ in range(3):                                   # after it: one unobserved, then steady
        costs.observe(3, 6e-3, 1.5e-3, 4e-3)
        costs.observe(3, 9e-4, 1.5e-3, 9e-4)
        costs.observe(0, 0.0, 1.5e-3, 2e-5)
    assert costs.t_draft == pytest.approx(3e-4) and costs.t_exchange == pytest.approx(9e-4)
    assert costs.t_verify == pytest.approx(1.5e-3)


def test_an_early_slow_round_does_not_stop_drafting():
    """Regression: the first draft exchange (stream opening) cost ~50x a normal one; an averaged
    estimate stayed high for hundreds of rounds and adaptive k drafted almost never (x0.85)."""
    costs, pol = AdaptiveLoop(), AdaptiveK(max_k=3)
    costs.observe(3, 3e-2, 1.6e-3, 5e-2)
    for _ in range(20):
        k = choose_round_k([pol], costs)
        if k:
            pol.observe(k, k)
            costs.observe(k, 3.7e-4 * k, 1.6e-3, 9e-4)
        else:
            costs.observe(0, 0.0, 1.44e-3, 2e-5)
    assert choose_round_k([pol], costs) == 3


def test_probes_back_off_while_they_keep_failing_and_reset_once_drafting_pays():
    costs = AdaptiveLoop(t_verify=2e-3, t_draft=1e-4, t_exchange=2e-4)
    pol = AdaptiveK(max_k=4)
    for _ in range(60):
        pol.observe(4, 0)
    ks = [choose_round_k([pol], costs) for _ in range(2000)]
    starts = [i for i in range(1, len(ks)) if ks[i] and not ks[i - 1]]
    # Rounds from one probe's end to the next probe's start (the start is the interval's last round).
    gaps = [b - a - 2 + 1 for a, b in zip(starts, starts[1:])]
    assert starts[0] + 1 == PROBE_EVERY
    assert gaps[:4] == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY]   # from the third probe on
    assert set(gaps[4:]) == {PROBE_BACKOFF_MAX * PROBE_EVERY}        # capped
    newcomer = AdaptiveK(max_k=4)                                    # its prior says draft: it does, but
    assert choose_round_k([newcomer], costs) > 0 and costs.probe_every == PROBE_BACKOFF_MAX * PROBE_EVERY
    for _ in range(60):
        pol.observe(4, 4)                                            # drafting pays again
    assert choose_round_k([pol], costs) == 4 and costs.probe_every == PROBE_EVERY


def test_measured_round_periods_replace_the_part_sums():
    """Regression (H200, bundled model, batch 1): a target-only round took 1.17 ms inside but 1.38 ms
    start to start, a k = 3 round 3.69 vs 3.72 ms; from the parts alone k = 0 looked better at
    acceptance 0.81 and adaptive k ran at x0.86 of fixed k = 3, which measured 914 vs 725 tok/s."""
    pol = AdaptiveK(max_k=3, successes=0.81 * 50, trials=50.0)
    parts = AdaptiveLoop()
    t = 0.0
    for _ in range(10):                                   # the parts as measured (no periods given)
        for _ in range(3):
            parts.observe(0, 0.0, 1.15e-3, 2e-5)
        parts.observe(3, 1.28e-3, 1.34e-3, 1.06e-3)
        parts.observe(3, 1.28e-3, 1.34e-3, 1.06e-3)
    assert choose_round_k([pol], parts) == 0
    timed = AdaptiveLoop()
    for _ in range(10):                                   # the same rounds, with their start times
        for _ in range(3):
            timed.observe(0, 0.0, 1.15e-3, 2e-5, started=t)
            t += 1.38e-3
        for _ in range(2):
            timed.observe(3, 1.28e-3, 1.34e-3, 1.06e-3, started=t)
            t += 3.72e-3
    assert timed.cost(0) == pytest.approx(1.38e-3) and timed.cost(3) == pytest.approx(3.72e-3, rel=0.03)
    assert choose_round_k([pol], timed) == 3
    assert choose_round_k([AdaptiveK(max_k=3, successes=0.3 * 50, trials=50.0)], timed) == 0


def test_a_new_request_starts_from_the_loops_measured_acceptance():
    """Regression: every request started at the 0.8 prior, so on prompts where drafting never pays
    each one drafted its first three or four rounds (x0.91 of target-only on an H200)."""
    costs = AdaptiveLoop(t_verify=2e-3, t_draft=1e-4, t_exchange=2e-4)
    assert costs.loop.new_policy(4).acceptance == PRIOR_ACCEPTANCE      # nothing measured yet
    first = costs.loop.new_policy(4)
    for _ in range(60):
        first.observe(4, 0)                                             # it reports to the loop too
    assert costs.loop.prior < 0.01
    new = costs.loop.new_policy(4)
    assert new.acceptance < 0.01 and not new.measured
    assert request_ks([new], costs) == [4]                              # the newcomer probe: one round
    new.observe(4, 0)
    assert request_ks([new], costs) == [0]                              # (from 0.8 it would still draft)
    for _ in range(60):
        first.observe(4, 4)                                             # the loop sees drafting pay again
    assert costs.loop.new_policy(4).acceptance > 0.9


def test_the_newcomer_probe_drafts_only_the_newcomer():
    """A request that never drafted drafts its first round even where its prior says k = 0 (its
    catch-up is one pair); the measured requests beside it stay target-only."""
    costs = AdaptiveLoop(t_verify=2e-3, t_draft=1e-4, t_exchange=2e-4)
    old = costs.loop.new_policy(3)
    for _ in range(60):
        old.observe(3, 0)
    new = costs.loop.new_policy(3)
    assert request_ks([old, new], costs) == [0, 3]
    new.observe(3, 0)
    assert request_ks([old, new], costs) == [0, 0]
    # The round driver hands each request its own k.
    seqs = [Sequence(rid, np.arange(4), SamplingParams(max_tokens=32), k=3) for rid in "ab"]
    seqs[0].adaptive, seqs[1].adaptive = old, costs.loop.new_policy(3)
    for s in seqs:
        s.drafting = True
    assert round_ks(seqs, draft=object(), costs=costs) == {"a": 0, "b": 3}


def test_every_newcomer_is_probed_while_the_periodic_probes_back_off():
    """Where no request drafts well, the periodic probes back off, but every newcomer still drafts
    its first round: one round per request, against a whole request at k = 0 where it drafts well."""
    costs = AdaptiveLoop(t_verify=2e-3, t_draft=1e-4, t_exchange=2e-4)
    first = costs.loop.new_policy(3)
    for _ in range(60):
        first.observe(3, 0)
    firsts = []
    for _ in range(12):
        pol = costs.loop.new_policy(3)
        for r in range(40):                            # its rounds: drafting never pays
            ks = request_ks([pol], costs)
            if r == 0:
                firsts.append(ks)
            pol.observe(ks[0], 0)
    assert firsts == [[3]] * 12
    assert costs.probe_every == PROBE_EVERY * PROBE_BACKOFF_MAX


def test_follow_up_probes_go_on_while_they_pay():
    """At k* = 0 a request whose last round drafted and paid drafts again, until its own estimate
    makes k* > 0; a probe round that did not pay ends the probe."""
    costs = AdaptiveLoop(t_verify=1e-3, t_draft=1e-4, t_exchange=1.4e-3)    # T(3) / T(0) = 2.7, as on an H100
    low = costs.loop.new_policy(3)
    for _ in range(60):
        low.observe(3, 0)                              # the loop's prior: drafting never pays
    bad = costs.loop.new_policy(3)
    assert request_ks([bad], costs) == [3]             # its newcomer probe ...
    bad.observe(3, 0)
    assert request_ks([bad], costs) == [0]             # ... did not pay: it ends
    good = costs.loop.new_policy(3)
    assert request_ks([good], costs) == [3]
    follow = 0
    for _ in range(30):
        good.observe(3, 3)
        if round_k_star([good], costs) > 0:
            break
        assert request_ks([good], costs) == [3]        # a follow-up: the last round paid
        follow += 1
    assert round_k_star([good], costs) > 0 and follow > 0      # one probe alone was not enough


def test_follow_ups_are_judged_for_the_whole_round():
    """A follow-up round costs every request of the batch T(k): it goes ahead only where the
    followers' last results pay for the others' round too."""
    costs = AdaptiveLoop(t_verify=1e-3, t_draft=1e-4, t_exchange=5e-4)      # T(3) / T(0) = 1.8
    a, b = AdaptiveK(3), AdaptiveK(3)
    a.observe(3, 1)                                    # 2 tokens in T(3): pays alone (2 >= 1.8)
    assert follow_ups([a], costs) == [a]
    assert follow_ups([a, b], costs) == []             # 3 tokens for two requests: < 2 x 1.8
    b.observe(3, 3)
    assert follow_ups([a, b], costs) == [a, b]         # 6 >= 3.6
    a.observe(0, 0)
    assert follow_ups([a], costs) == []                # its last round did not draft


def test_a_probe_lasts_one_round_once_drafting_rounds_were_timed():
    """The second probe round exists to time a steady drafting round; once the cost model has
    those, it only repeats what the first round's acceptance already said (a wasted round
    where drafting does not pay)."""
    costs = AdaptiveLoop(t_verify=2e-3, t_draft=1e-4, t_exchange=2e-4)
    pol = AdaptiveK(max_k=3, successes=0.0, trials=50.0)
    t = 0.0
    for k in (3, 3, 3, 3, 3, 0, 0, 0, 0):               # steady drafting rounds, then target-only
        costs.observe(k, 3e-4 if k else 0.0, 2e-3, 5e-4, started=t)
        t += 3e-3 if k else 2e-3
    assert costs.drafting_measured
    ks = [choose_round_k([pol], costs) for _ in range(3 * PROBE_EVERY)]
    runs = "".join("x" if k else "." for k in ks).split(".")
    assert {len(r) for r in runs if r} == {1}


def test_expected_tokens_per_position_follow_where_drafts_fail():
    """A head whose first draft is always right and whose later drafts rarely are: c = (1, 0.3,
    1/3), E(k) = 2, 2.3, 2.4. The pooled rate (1.4 of 2.3 trials, 0.61) says 1.61, 1.98, 2.21
    and picks k = 3 below, where k = 2 commits more per second."""
    pol = AdaptiveK(max_k=3)
    for _ in range(30):
        for a in (1, 2, 1, 1, 3, 1, 1, 2, 1, 1):
            pol.observe(3, a)
    assert [pol.expected(k) for k in (1, 2, 3)] == pytest.approx([2.0, 2.3, 2.4], abs=0.08)
    assert expected_tokens(pol.acceptance, 1) < 1.7
    costs = AdaptiveLoop(t_verify=2e-3, t_draft=2e-4, t_exchange=1e-3)
    assert best_k(pol.acceptance, 3, 2e-3, 2e-4, 1e-3) == 3
    assert choose_round_k([pol], costs) == 2


def test_no_round_period_across_a_change_of_the_batch():
    """Regression (CPU, batch 1): a request's last round is often k = 0 (one token left) and the
    next round starts after the next request's prefill; those periods made T(0) ~60 ms where a
    target-only round took ~8 ms. A period is only measured between rounds of the same batch."""
    costs, t = RoundCosts(), 0.0
    for r in range(8):                                   # eight requests, one after the other
        batch = frozenset({f"r{r}"})
        # Each ends with a k = 0 round (one token left); the first has a target-only stretch.
        for k in ((3, 0, 0, 0, 0, 3, 3, 3, 0) if r == 0 else (3, 3, 3, 3, 3, 0)):
            costs.observe(k, 9e-4 if k else 0.0, 1.5e-3, 9e-4, started=t, batch=batch)
            t += 3.3e-3 if k else 1.5e-3
        t += 0.06                                        # the next request's admission
    assert costs.cost(0) == pytest.approx(1.5e-3) and costs.cost(3) == pytest.approx(3.3e-3)


def test_a_request_that_fell_to_k1_goes_back_to_k3_when_its_first_drafts_keep_passing():
    """Regression (2-core CPU, bench adaptive, held-out prose in the mix): the first four rounds
    rejected draft 2, the request fell to k = 1, and with drafts 2 and 3 no longer tested their
    estimates stayed where those four rounds had left them: k = 1 for the rest of the request
    while its first draft passed every time. Untested positions now drift back to the pooled rate."""
    costs = AdaptiveLoop(t_verify=10e-3, t_draft=1.8e-3, t_exchange=0.5e-3)
    pol = AdaptiveK(max_k=3)
    for _ in range(4):
        pol.observe(3, 1)                             # draft 1 right, draft 2 wrong
    ks = []
    for _ in range(40):                               # from here on every draft is right
        k = choose_round_k([pol], costs)
        ks.append(k)
        pol.observe(k, k)
    assert ks[0] == 1, ks                             # the four rounds did make k = 1 the choice
    assert ks[-10:] == [3] * 10, ks                   # and it comes back to k = 3


def test_draft_time_is_a_catch_up_plus_substeps_not_k_times_one_round_per_draft():
    """A round's draft time is one catch-up pass plus k - 1 substeps. Regression: charged per
    draft, a stretch of k = 1 rounds (all catch-up) priced every draft at a catch-up, and k = 3
    looked dearer the longer a request stayed at k = 1."""
    costs = RoundCosts(t_verify=10e-3, t_draft=1.8e-3, t_exchange=0.5e-3)
    catch_up, substep = 2.9e-3, 1.2e-3
    for _ in range(6):
        costs.observe(3, catch_up + 2 * substep, 10e-3, 0.5e-3)
    for _ in range(25):
        costs.observe(1, catch_up, 10e-3, 0.5e-3)
    assert costs.draft_time(3) == pytest.approx(catch_up + 2 * substep)          # measured at k = 3
    assert costs.draft_time(1) == pytest.approx(catch_up)
    assert costs.draft_time(2) == pytest.approx(catch_up + substep)              # on the line between
    assert costs.t_draft == pytest.approx(catch_up)                              # what k = 3 was charged before
    assert costs.cost(3) - costs.cost(1) == pytest.approx(2 * substep)


def test_line_fit_never_lets_a_draft_time_shrink_with_k_or_go_below_zero():
    assert line_fit({1: 2.0, 3: 4.0}) == pytest.approx((1.0, 1.0))
    assert line_fit({1: 3.0, 2: 2.0}) == pytest.approx((2.5, 0.0))               # noise: flat, not falling
    a, b = line_fit({2: 1.0, 3: 3.0})                                              # would cross zero at k = 1.5
    assert a == 0.0 and b == pytest.approx((2 * 1.0 + 3 * 3.0) / 13)


def test_kept_costs_and_expectations_equal_fresh_ones():
    """T(k), E(k) and the best drafting k are kept between the observations that change them:
    over a seeded mix of target-only stretches, probes and drafting rounds (batch changes
    included), every kept value, and the round's k*, equals the one computed afresh."""
    rng = random.Random(3)
    costs = AdaptiveLoop()
    pols = [costs.loop.new_policy(3)]
    t, batch = 0.0, frozenset({"a"})
    for i in range(600):
        ks = request_ks(pols, costs)
        for p in pols:
            for k in range(4):
                fresh = AdaptiveK(p.max_k, p.successes, p.trials, pos_successes=list(p.pos_successes),
                                  pos_trials=list(p.pos_trials))
                assert p.expected(k) == fresh.expected(k)
        for k in range(4):
            assert costs.cost(k) == costs._cost(k), (i, k)
        # k* afresh: the switch costs charged over SWITCH_HORIZON rounds (entry unless the last
        # round queued this one, leave if it did), and none while T(0) waits for a steady round.
        queued = costs.last_k > 0 and not costs.probing
        enter = 0.0 if queued else costs.entry_extra / SWITCH_HORIZON
        fresh_rates = _rates([(lambda k, p=p: AdaptiveK(p.max_k, p.successes, p.trials,
                                                          pos_successes=list(p.pos_successes),
                                                          pos_trials=list(p.pos_trials)).expected(k), p.max_k)
                              for p in pols], lambda k: costs._cost(k) + (enter if k else 0.0))
        fresh_rates[0] = len(pols) / (costs._cost(0) + (costs.leave_extra / SWITCH_HORIZON if queued else 0.0))
        want = 0 if costs.target_only_unsteady else _argmax(fresh_rates)
        assert round_k_star(pols, costs) == want, i
        if len(fresh_rates) > 1 and not costs.target_only_unsteady:     # the kept best drafting k and its rate
            best = max(range(1, len(fresh_rates)), key=lambda k: (fresh_rates[k], -k))
            assert costs._drafting_best[1:3] == (best, fresh_rates[best]), i
        k = max(ks)
        rate = 0.9 if (i // 50) % 2 == 0 else 0.1
        for p, kp in zip(pols, ks):
            p.observe(kp, sum(1 for _ in range(kp) if rng.random() < rate))
        if i % 97 == 96:                                   # a new request joins
            batch = frozenset({f"r{i}"})
            pols = [costs.loop.new_policy(3)]
        costs.observe(k, (4e-4 + 5e-5 * k) * rng.uniform(0.9, 1.1) if k else 0.0, 6e-4 * rng.uniform(0.9, 1.1),
                      (3e-4 if k else 2e-5) * rng.uniform(0.9, 1.1), started=t, batch=batch)
        t += (1.5e-3 if k else 7e-4) * rng.uniform(0.9, 1.1)
    assert costs._periods_measured


def test_target_only_rounds_have_their_own_verify_time():
    """A round in which nobody drafts runs the target's one-position step: T(0) is that step and
    the host work around it, kept apart from a drafting round's max_k + 1 position verify; until
    one was timed, T(0) is a drafting round's verify (never less)."""
    costs = RoundCosts(t_verify=2e-3, t_draft=1e-4, t_exchange=2e-4)
    costs.observe(3, 3e-4, 2e-3, 2e-4)
    assert costs.cost(0) == pytest.approx(2e-3)
    for _ in range(5):
        costs.observe(0, 0.0, 1.2e-3, 1e-4)
        costs.observe(3, 3e-4, 2e-3, 2e-4)
    assert costs.t_verify0 == pytest.approx(1.2e-3) and costs.t_verify == pytest.approx(2e-3)
    assert costs.cost(0) == pytest.approx(1.3e-3)
    assert costs.cost(3) == pytest.approx(2e-3 + 2e-4 + 3e-4)


def test_watch_probes_replace_drafting_probes_and_back_off_while_drafting_does_not_pay():
    """With watch probes a round at k* = 0 never drafts: a request not yet measured is watched in
    its first round (no newcomer probe), then every WATCH_EVERY target-only rounds, doubling while
    no round drafts (up to WATCH_BACKOFF_MAX times); a round that drafts resets the interval."""
    costs = AdaptiveLoop(t_verify=2e-3, t_draft=1e-4, t_exchange=2e-4, watch=True)
    old = costs.loop.new_policy(3)
    for _ in range(60):
        old.observe(3, 0)                                  # the loop's prior is now ~0
    new = costs.loop.new_policy(3)
    assert round_plan([old, new], costs, [True, True]) == ([0, 0], [0, 3])
    assert round_plan([old, new], costs, [True, False]) == ([0, 0], [0, 0])     # its watch still waits
    new.observe(3, 0)                                      # judged: nothing matched
    watched_at = []
    for r in range(400):
        ks, wks = round_plan([old, new], costs, [True, True])
        assert ks == [0, 0]
        if wks != [0, 0]:
            assert wks == [3, 3]
            watched_at.append(r)
    gaps = [b - a for a, b in zip(watched_at, watched_at[1:])]
    assert gaps[:5] == [WATCH_EVERY * min(2 ** i, WATCH_BACKOFF_MAX) for i in range(5)]
    assert 0 <= watched_at[0] < WATCH_EVERY
    for _ in range(40):
        new.observe(3, 3)                                  # a watch finds drafting pays: the round drafts
    assert round_plan([old, new], costs, [True, True])[0] == [3, 3]
    assert costs.watch_every == WATCH_EVERY
    # Where a request's drafts cannot be watched (None), probes draft as without watching.
    plain = AdaptiveLoop(t_verify=2e-3, t_draft=1e-4, t_exchange=2e-4, watch=True)
    stale = plain.loop.new_policy(3)
    for _ in range(60):
        stale.observe(3, 0)
    assert round_plan([stale, plain.loop.new_policy(3)], plain, None) == ([0, 3], [0, 0])


def test_a_watch_is_judged_by_the_targets_next_tokens():
    """A watch probe's drafts d_1..d_k against the tokens the target commits from that round on:
    the matching prefix, reported once the first mismatch or the k-th token is in."""
    pol = AdaptiveK(3)
    s = Sequence("a", np.arange(4), SamplingParams(max_tokens=32), k=3, adaptive=pol)
    s.watched = np.array([5, 6, 7])
    judge_watch(s, (5,))                                   # d_1 matched; d_2 not known yet
    assert s.watched is not None and pol.trials == 2.0
    judge_watch(s, (6, 9))                                 # d_2 matched, d_3 did not (a drafting round's tokens)
    assert s.watched is None
    assert pol.pos_trials[:3] == pytest.approx([0.9 * 2 + 1, 0.9 * 2 + 1, 0.9 * 2 + 1])
    assert pol.pos_successes[:2] == pytest.approx([0.9 * 1.6 + 1, 0.9 * 1.6 + 1])
    assert pol.pos_successes[2] == pytest.approx(0.9 * 1.6)
    s.watched = np.array([1, 2, 3])
    judge_watch(s, (4,))                                   # d_1 wrong: judged at once, 0 of 3
    assert s.watched is None and pol.trials == pytest.approx(0.9 * (0.9 * 2 + 3) + 1)     # 3 tested, then 1


def test_the_round_plan_watches_only_greedy_or_coupled_drafts():
    costs = AdaptiveLoop(t_verify=2e-3, t_draft=1e-4, t_exchange=2e-4, watch=True)
    for _ in range(60):
        costs.loop.observe(3, 0)
    greedy = Sequence("g", np.arange(4), SamplingParams(max_tokens=32), k=3, adaptive=costs.loop.new_policy(3))
    greedy.drafting = True
    assert plan_round([greedy], draft=object(), costs=costs) == ({"g": 0}, {"g": 3})
    sampled = Sequence("s", np.arange(4), SamplingParams(max_tokens=32, temperature=0.8, draft_sampling=True), k=3,
                       adaptive=costs.loop.new_policy(3))
    sampled.drafting = True
    greedy.watched = np.array([1, 2, 3])
    # A sampled draft's match rate understates its acceptance: the batch probes by drafting.
    assert plan_round([greedy, sampled], draft=object(), costs=costs) == ({"g": 0, "s": 3}, {})



@pytest.mark.parametrize("extra,pays", [(0.05e-3, True), (0.5e-3, False)])
def test_watches_time_themselves_and_give_way_to_drafting_probes_where_they_cost_a_draft(extra, pays):
    """A round that carried a watch is timed apart (``watch_extra``: beyond T(0)); watches stay
    probes while that is under half of what a drafting round adds to T(0), no more often than
    keeps them within WATCH_BUDGET of the decoding between them, and else probes draft."""
    costs, t, batch = AdaptiveLoop(t_verify=2e-3, t_draft=1e-4, t_exchange=2e-4, watch=True), 0.0, frozenset("a")
    for _ in range(6):
        costs.observe(0, 0.0, 1e-3, 1e-4, started=t, batch=batch)
        t += 1.1e-3
    assert costs.watch_extra is None and costs.watching_pays(3) and costs.watch_floor == 1
    costs.observe(0, 0.0, 1e-3, 1e-4, started=t, batch=batch, watched=True)
    t += 1.1e-3 + extra
    costs.observe(0, 0.0, 1e-3, 1e-4, started=t, batch=batch)
    assert costs.watch_extra == pytest.approx(extra)
    assert costs.cost(0) == pytest.approx(1.1e-3)                   # the watched round is not in T(0)
    assert costs.watching_pays(3) == pays                          # T(3) - T(0) = 0.4 ms here
    assert costs.watch_floor == math.ceil(extra / (WATCH_BUDGET * 1.1e-3))
    stale = costs.loop.new_policy(3)
    for _ in range(60):
        stale.observe(3, 0)
    _, watch = round_plan([stale, costs.loop.new_policy(3)], costs, [True, True])
    assert watch == ([0, 3] if pays else [0, 0])
