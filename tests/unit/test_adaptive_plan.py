"""runtime.adaptive_plan: a kept target-only plan (the hold) plans what the full plan would."""

from __future__ import annotations

import pytest

from runtime import adaptive_plan
from runtime.adaptive_k import AdaptiveLoop

HOLD = adaptive_plan.HOLD_ROUNDS


def _serve(monkeypatch, hold_rounds: int, watch: bool, rounds: int = 400, easy_from: int | None = None):
    """A request on text its draft never matches (every drafting round and watch: 0 accepted) until
    round ``easy_from`` (from there: all accepted), after six drafting rounds that timed both
    kinds; constant round times. -> (each round's (k, watched), how many rounds ran the full plan
    (round_k_star))."""
    monkeypatch.setattr(adaptive_plan, "HOLD_ROUNDS", hold_rounds)
    full = [0]
    k_star = adaptive_plan.round_k_star

    def counted(policies, costs):
        full[0] += 1
        return k_star(policies, costs)

    monkeypatch.setattr(adaptive_plan, "round_k_star", counted)
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
        accepted = 3 if easy_from is not None and i >= easy_from else 0
        if k:
            pol.observe(k, min(accepted, k))
        if wks[0]:
            pending = wks[0]
        elif pending is not None:                           # judged by the target's next token: no match
            pol.observe(pending, pending if accepted else 0)
            pending = None
        t += 1.2e-3 if k else 4e-4
        costs.observe(k, 4e-4 if k else 0.0, 6e-4 if k else 3.5e-4, 5e-5, t, batch, watched=bool(wks[0]))
    return plan, full[0]


@pytest.mark.parametrize("watch", [False, True])
def test_a_kept_target_only_plan_probes_and_watches_in_the_same_rounds(monkeypatch, watch):
    plain, full_plain = _serve(monkeypatch, 0, watch)
    held, full_held = _serve(monkeypatch, HOLD, watch)
    assert held == plain
    assert sum(1 for k, _ in plain if k == 0) > 300                 # mostly target-only rounds ...
    assert sum(1 for k, w in plain if k or w) > 3                   # ... with probes (or watches) between
    assert full_plain == 400 and full_held < 0.4 * full_plain       # most of them kept, not planned again


@pytest.mark.parametrize("watch", [False, True])
def test_a_request_whose_estimate_moves_is_planned_again_at_once(monkeypatch, watch):
    """The text turns easy at round 200: the first probe (or watch) after it accepts all, and the
    round after it is planned afresh (the estimate's stamp changed): the request drafts from the
    same round with and without the hold."""
    plain, _ = _serve(monkeypatch, 0, watch, easy_from=200)
    held, full = _serve(monkeypatch, HOLD, watch, easy_from=200)
    assert held == plain and full < 300
    assert all(k == 3 for k, _ in plain[-100:])           # drafting again by then


def test_no_hold_where_target_only_wins_by_less_than_the_margin():
    costs = AdaptiveLoop()
    pol = costs.loop.new_policy(3)
    costs.target_only_margin = 1.0 + adaptive_plan.HOLD_MARGIN / 2
    adaptive_plan._hold([pol], costs, 10, watches=False)
    assert costs.held_rounds == 0 and not adaptive_plan._held([pol], costs)
    costs.target_only_margin = 1.0 + 2 * adaptive_plan.HOLD_MARGIN
    adaptive_plan._hold([pol], costs, 10, watches=False)
    assert costs.held_rounds == adaptive_plan.HOLD_ROUNDS
    costs.version += 1                                      # a drafting cost changed: plan again
    assert not adaptive_plan._held([pol], costs) and costs.held_rounds == 0
