"""runtime.adaptive_plan: a kept plan (the hold) plans what the full plan would."""

from __future__ import annotations

import random

import pytest

from runtime import adaptive_plan
from runtime.adaptive_k import AdaptiveLoop


def _serve(monkeypatch, hold: bool, watch: bool, rounds: int = 400, easy_from: int | None = None,
           rate: float = 0.0, jitter: float = 0.0):
    """A request after six drafting rounds that timed both kinds; each draft matches with
    probability ``rate`` (0: never) until round ``easy_from`` (from there: always); round times
    constant, or moved by up to ``jitter`` (seeded). -> (each round's (k, watched), how many rounds
    ran the full plan (round_k_star))."""
    if not hold:
        monkeypatch.setattr(adaptive_plan, "HOLD_ROUNDS", 0)
        monkeypatch.setattr(adaptive_plan, "DRAFT_HOLD_ROUNDS", 0)
    full = [0]
    k_star = adaptive_plan.round_k_star

    def counted(policies, costs):
        full[0] += 1
        return k_star(policies, costs)

    monkeypatch.setattr(adaptive_plan, "round_k_star", counted)
    rng = random.Random(7)
    costs = AdaptiveLoop(watch=watch)
    pol = costs.loop.new_policy(3)
    t, batch, plan = 0.0, frozenset({"a"}), []
    pending = None                                          # a watch's k until the target's tokens judge it
    for i in range(rounds):
        if watch:
            ks, wks = adaptive_plan.round_plan([pol], costs, [pending is None])
        else:
            ks, wks = adaptive_plan.request_ks([pol], costs), [0]
        k = ks[0] if i >= 6 else 3                          # the first rounds draft whatever the plan says
        plan.append((k, wks[0]))
        easy = easy_from is not None and i >= easy_from
        accepted = 3 if easy else next((j for j in range(3) if rng.random() >= rate), 3)
        if k:
            pol.observe(k, min(accepted, k))
        if wks[0]:
            pending = wks[0]
        elif pending is not None:                           # judged by the target's next tokens
            pol.observe(pending, min(accepted, pending))
            pending = None
        move = 1.0 + jitter * (2 * rng.random() - 1)
        t += (8e-4 if k else 4e-4) * move                  # an H100's rounds queued ahead (§ Session 32)
        costs.observe(k, 9e-5 * move if k else 0.0, (6e-4 if k else 3.5e-4) * move, 5e-5, t, batch,
                      watched=bool(wks[0]))
    return plan, full[0]


@pytest.mark.parametrize("watch", [False, True])
def test_a_kept_target_only_plan_probes_and_watches_in_the_same_rounds(monkeypatch, watch):
    plain, full_plain = _serve(monkeypatch, False, watch)
    monkeypatch.undo()
    held, full_held = _serve(monkeypatch, True, watch)
    assert held == plain
    assert sum(1 for k, _ in plain if k == 0) > 300                 # mostly target-only rounds ...
    assert sum(1 for k, w in plain if k or w) > 3                   # ... with probes (or watches) between
    assert full_plain == 400 and full_held < 0.4 * full_plain       # most of them kept, not planned again


@pytest.mark.parametrize("watch", [False, True])
def test_a_request_whose_estimate_moves_is_planned_again_at_once(monkeypatch, watch):
    """The text turns easy at round 200: the first probe (or watch) after it accepts all, and the
    round after it is planned afresh (the estimate's stamp changed): the request drafts from the
    same round with and without the hold."""
    plain, _ = _serve(monkeypatch, False, watch, easy_from=200)
    monkeypatch.undo()
    held, full = _serve(monkeypatch, True, watch, easy_from=200)
    assert held == plain and full < 300
    assert all(k == 3 for k, _ in plain[-100:])           # drafting again by then


@pytest.mark.parametrize("rate", [0.85, 0.95])
def test_a_kept_drafting_plan_drafts_the_same_k(monkeypatch, rate):
    """Drafts matching at 85 % or 95 % a position, round times moving by ±10 %: the same k every
    round with the drafting hold as without, and a third of the rounds or more not planned again."""
    plain, full_plain = _serve(monkeypatch, False, False, rate=rate, jitter=0.1)
    monkeypatch.undo()
    held, full_held = _serve(monkeypatch, True, False, rate=rate, jitter=0.1)
    assert held == plain
    assert sum(1 for k, _ in plain if k == 3) > 300
    assert full_held < 0.67 * full_plain


@pytest.mark.parametrize("rate", [0.3, 0.45, 0.6])
@pytest.mark.parametrize("watch", [False, True])
def test_near_the_threshold_both_holds_plan_what_the_full_plan_does(monkeypatch, rate, watch):
    """Acceptance where k* moves between drafting and target-only (and k = 2 / 3): the same plan
    every round with both holds as without them."""
    plain, _ = _serve(monkeypatch, False, watch, rate=rate, jitter=0.1)
    monkeypatch.undo()
    held, full_held = _serve(monkeypatch, True, watch, rate=rate, jitter=0.1)
    assert held == plain and full_held < 400


def test_a_round_that_accepts_nothing_ends_a_drafting_hold():
    costs = AdaptiveLoop()
    pol = costs.loop.new_policy(3)
    pol.newcomer = False
    for _ in range(20):
        pol.observe(3, 3)
    costs.k_star_margin = 1.0 + 2 * adaptive_plan.DRAFT_HOLD_MARGIN
    adaptive_plan._hold([pol], costs, [3], adaptive_plan.DRAFT_HOLD_ROUNDS, watches=False)
    assert adaptive_plan._held([pol], costs) == [3]
    pol.observe(3, 0)
    assert adaptive_plan._held([pol], costs) is None and costs.held_rounds == 0


def test_no_hold_where_the_plan_won_by_less_than_the_margin():
    costs = AdaptiveLoop()
    pol = costs.loop.new_policy(3)
    pol.newcomer = False
    costs.k_star_margin = 1.0 + adaptive_plan.HOLD_MARGIN / 2
    adaptive_plan._hold([pol], costs, [0], 10, watches=False)
    assert costs.held_rounds == 0 and adaptive_plan._held([pol], costs) is None
    costs.k_star_margin = 1.0 + 2 * adaptive_plan.HOLD_MARGIN
    adaptive_plan._hold([pol], costs, [0], 10, watches=False)
    assert costs.held_rounds == adaptive_plan.HOLD_ROUNDS
    costs.version += 1                                      # a drafting cost changed: plan again
    assert adaptive_plan._held([pol], costs) is None and costs.held_rounds == 0
    costs.k_star_margin = 1.0 + adaptive_plan.HOLD_MARGIN * 2     # wins a target-only hold, not a drafting one
    adaptive_plan._hold([pol], costs, [3], adaptive_plan.DRAFT_HOLD_ROUNDS, watches=False)
    assert costs.held_rounds == 0
