"""Adaptive k around a change of kind (runtime/adaptive_k.py, runtime/round_costs.py): the round
after a change between drafting and target-only rounds is timed apart from the steady ones and
charged to the decision that causes it; probes are spaced by their measured price and queue no
round ahead (docs/performance.md § Session 32)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.params import SamplingParams
from runtime.adaptive_k import (PROBE_BACKOFF_MAX, PROBE_BUDGET, PROBE_EVERY, SWITCH_HORIZON, AdaptiveK,
                                AdaptiveLoop, round_k_star)
from runtime.adaptive_plan import choose_round_k, request_ks


def test_a_target_only_round_right_after_a_drafting_one_is_not_steady_time():
    """Regression (the trace simulation of the H100 regime, ``scripts/adaptive_sim.py --leave``; the
    H100 itself ran adaptive k at 0.82 of target-only on random bytes): a target-only round right
    after a drafting round waits for the round that one queued ahead on the device. Timed as T(0)
    it made T(0) dear, drafting looked cheap beside it and the loop kept drafting. Such a round
    feeds T(0) only while no steady one was timed, and k* waits one more target-only round for
    that steady figure before it drafts again."""
    costs = AdaptiveLoop(t_verify=2e-3, t_draft=1e-4, t_exchange=2e-4)
    pol = AdaptiveK(max_k=3, successes=45.0, trials=50.0)        # drafting pays by its estimate
    t = 0.0
    for k, verify in ((3, 2e-3), (3, 2e-3), (3, 2e-3), (0, 2.5e-3)):
        costs.observe(k, 3e-4 if k else 0.0, verify, 1e-4, started=t)
        t += 3e-3
    assert costs.target_only_unsteady and costs.t_verify0 == pytest.approx(2.5e-3)   # the only one yet
    assert choose_round_k([pol], costs) == 0 and not costs.probing                    # one more, steady
    costs.observe(0, 0.0, 1e-3, 1e-4, started=t)
    assert not costs.target_only_unsteady and costs.t_verify0 == pytest.approx(1e-3)
    assert choose_round_k([pol], costs) == 3
    for verify in (2.5e-3, 1e-3, 1e-3):                          # later leave-rounds change nothing
        costs.observe(3, 3e-4, 2e-3, 1e-4)
        costs.observe(0, 0.0, verify, 1e-4)
    assert costs.t_verify0 == pytest.approx(1e-3) and costs.cost(0) == pytest.approx(1.1e-3)


def test_a_change_of_kind_is_timed_and_charged_over_the_switch_horizon():
    """What a change between drafting and target-only rounds costs beyond the steady round of the
    new kind (a drafting round after target-only ones has nothing queued ahead and a wide catch-up;
    a target-only round after a drafting one waits for the round it queued) is timed on its own
    (``entry_extra``, ``leave_extra``) and charged over SWITCH_HORIZON rounds to the k that changes
    kind: a request near the threshold keeps drafting, or keeps not drafting (hysteresis)."""
    costs = AdaptiveLoop(t_verify=1e-3, t_draft=1e-4, t_exchange=2e-4)
    t = 0.0

    def rounds(*spec):                           # (k, period) rounds, one after the other
        nonlocal t
        for k, period in spec:
            costs.observe(k, 3e-4 if k else 0.0, 1e-3, 1e-4, started=t)
            t += period

    entry, leave = 1.6e-3, 0.8e-3
    rounds(*[(3, 2e-3)] * 5, *[(0, 1e-3)] * 5, (3, 2e-3 + entry), *[(3, 2e-3)] * 4, (0, 1e-3 + leave),
           *[(0, 1e-3)] * 3, (3, 2e-3))
    assert costs.cost(0) == pytest.approx(1e-3) and costs.cost(3) == pytest.approx(2e-3)
    assert costs.entry_extra == pytest.approx(entry) and costs.leave_extra == pytest.approx(leave)
    pol = AdaptiveK(max_k=3)
    pol.pos_successes, pol.pos_trials = [0.55, 0.5, 0.5], [1.0, 1.0, 1.0]
    e3 = pol.expected(3)                                   # 1.96 tokens in 2 ms: x0.98 of target-only's 1 in 1
    assert e3 == pytest.approx(1.9625) and e3 / 2e-3 < 1 / 1e-3 < e3 / 2e-3 * (1 + leave / SWITCH_HORIZON / 1e-3)
    assert costs.last_k == 3 and not costs.probing
    assert round_k_star([pol], costs) == 3                 # drafting: leaving costs 0.1 ms a round more
    rounds((0, 1e-3))
    assert round_k_star([pol], costs) == 0                 # not drafting: entering costs 0.2 ms a round more


def test_periodic_probes_keep_their_measured_price_within_the_probe_budget():
    """A probe after target-only rounds costs its entry price (``entry_extra``); the periodic probes
    come at most once per entry / (PROBE_BUDGET * T(0)) target-only rounds, however short the backoff."""
    costs = AdaptiveLoop(t_verify=1e-3, t_draft=1e-4, t_exchange=2e-4)
    assert costs.probe_every == PROBE_EVERY                         # no price measured yet
    t = 0.0
    for k, period in [(3, 2e-3)] * 5 + [(0, 1e-3)] * 5 + [(3, 2e-3 + 1.6e-3)] + [(3, 2e-3)] * 3 + [(0, 1e-3)] * 4:
        costs.observe(k, 3e-4 if k else 0.0, 1e-3, 1e-4, started=t)
        t += period
    assert costs.entry_extra == pytest.approx(1.6e-3) and costs.cost(0) == pytest.approx(1e-3)
    assert costs.probe_every == math.ceil(1.6e-3 / (PROBE_BUDGET * 1e-3)) > PROBE_EVERY * PROBE_BACKOFF_MAX
    pol = AdaptiveK(max_k=3, successes=0.0, trials=50.0)               # drafting never pays
    ks = [choose_round_k([pol], costs) for _ in range(costs.probe_every)]
    assert ks.count(3) == 1 and ks[-1] == 3


def test_probe_rounds_say_so_and_queue_no_round_ahead():
    """``AdaptiveLoop.probing``: a round that drafts only as a probe (newcomer, periodic or follow-up:
    k* = 0 by the estimates) is marked, and the round driver's verify then asks for no round queued
    ahead (``VerifyRequest.chain``): the next round most likely does not draft, and a queued round it
    drops still runs on the device first. A round at k* > 0 chains as before."""
    costs = AdaptiveLoop(t_verify=2e-3, t_draft=1e-4, t_exchange=2e-4)
    old = costs.loop.new_policy(3)
    for _ in range(60):
        old.observe(3, 0)
    new = costs.loop.new_policy(3)
    assert request_ks([old, new], costs) == [0, 3] and costs.probing          # the newcomer probe
    new.observe(3, 0)
    assert request_ks([old, new], costs) == [0, 0] and not costs.probing
    good = costs.loop.new_policy(3)
    for _ in range(60):
        good.observe(3, 3)
    assert request_ks([good], costs) == [3] and not costs.probing

    from runtime import round_driver as rd
    from tests.unit.test_engine_bundled import _engine, _prompts

    eng = _engine("torch", max_k=3)
    target, draft = eng.target, eng.draft
    chains: list[bool] = []
    verify = target.verify
    target.verify = lambda reqs: (chains.append(all(r.chain for r in reqs if len(r.drafts))), verify(reqs))[1]
    loop = AdaptiveLoop(t_verify=2e-3, t_draft=1e-4, t_exchange=2e-4)
    for _ in range(60):
        loop.loop.observe(3, 0)                                    # the loop's prior: drafting does not pay
    seq = rd.Sequence("p", np.asarray(_prompts(1)[0], dtype=np.int64), SamplingParams(max_tokens=32), 3)
    seq.adaptive = loop.loop.new_policy(3)
    rd.admit(target, draft, [seq])
    rd.run_round(target, draft, [seq], costs=loop)
    assert seq.stats.spec_rounds == 1 and chains == [False]       # the newcomer probe drafted, unchained
    for _ in range(60):
        seq.adaptive.observe(3, 3)
    rd.run_round(target, draft, [seq], costs=loop)
    assert seq.stats.spec_rounds == 2 and chains[-1] is True
    rd.release(target, draft, seq)
