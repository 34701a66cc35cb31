"""Each round's plan under adaptive k: who drafts how many this round, and the probes.

Owns: the per-round decisions on top of the model of ``runtime.adaptive_k`` (k*, its
estimates and the loop's schedule state live there, with the whole model in its module doc):
the periodic probe (``choose_round_k``), newcomer and follow-up probes (``request_ks``,
``follow_ups``), watch probes (``round_plan``), and the hold of a plan.

Must not know: workers, gRPC, tensors.

The hold: a plan made by k* (not a probe) is kept for the next rounds of the same requests
where those rounds' full plans would most likely be the same, and a kept round does to the
loop's clocks what its plan's round did. What it skips is the plan's host work: on the 2-core
CPU a target-only round's planning took ~50 us in the served loop against ~5 for a k = 0
request, and an adaptive drafting round's scheduler and round driver ~80 us more than a fixed-k
one's (docs/performance.md § Session 33); on an H100 host that is a share of a 0.45 ms
target-only or 0.8 ms drafting round.
- Target-only (``HOLD_ROUNDS``): kept while nothing it was made of changes — no request's
  estimates (their stamps), no drafting cost (``costs.version``; a target-only round changes only
  T(0)) — where target-only won by ``HOLD_MARGIN`` (``k_star_margin``) and no probe or watch
  falls due before it ends. What it gives up: T(0) moving by more than the margin, or a probe or
  watch interval shrinking with it, is seen up to ``HOLD_ROUNDS`` rounds later.
- Drafting (``DRAFT_HOLD_ROUNDS``): every drafting round moves the estimates, so this one holds
  on a margin instead: k* beat every other k by ``DRAFT_HOLD_MARGIN``, every request's first
  position has ``HOLD_TRIALS`` (weighted) trials, and each kept round's request accepted at
  least one draft (a round that accepts none, which moves E(k) most, ends the hold). A round
  that accepts some moves a steady request's E(k) by a few per cent (one c_j falls by a tenth
  at most), so two rounds cannot undo a 15 % lead on their own; round times moving by more can.
In seeded tests of 400 rounds (acceptance 0 to 0.95, round times moving by ±10 %, drafting and
watch probes) every round's k and watch were the same with the hold as without
(``tests/unit/test_adaptive_plan.py``).
A request's tokens never depend on its k.
"""

from __future__ import annotations

from runtime.adaptive_k import AdaptiveK, AdaptiveLoop, _argmax, _rates, round_k_star

HOLD_ROUNDS = 4              # target-only rounds a target-only plan is kept for, at most (module doc) ...
HOLD_MARGIN = 0.05           # ... when target-only beat the best drafting k by this share or more
DRAFT_HOLD_ROUNDS = 2        # drafting rounds a drafting plan is kept for, at most (module doc) ...
DRAFT_HOLD_MARGIN = 0.15     # ... when its k beat every other k by this share or more ...
HOLD_TRIALS = 8.0            # ... and every request's first draft position was tested this much (weighted)


def _held(policies: list[AdaptiveK], costs: AdaptiveLoop) -> list[int] | None:
    """This round's drafts where it keeps the last plan (module doc), else None. A kept round does
    to the loop's clocks what its plan's round did: a target-only one advances the watch clock
    (watches were the probes) or the probe clock; a drafting one restarts them."""
    if costs.held_rounds <= 0:
        return None
    drafting, key, watches, ks = costs.held_for
    if drafting:
        same = key == tuple(id(p) for p in policies) and all(
            not p.newcomer and p.last_round is not None and p.last_round[1] > 0 for p in policies)
    else:
        same = key == (costs.version, tuple(p._stamp for p in policies))
    if not same:
        costs.held_rounds = 0
        return None
    costs.held_rounds -= 1
    costs.probing = False
    if drafting and watches:
        costs.rounds_unwatched = costs.watches_in_a_row = 0
    elif drafting:
        costs.probe_rounds_left = costs.probes_in_a_row = 0
    elif watches:
        costs.rounds_unwatched += 1
    else:
        costs.target_only_rounds += 1
    return ks


def _hold(policies: list[AdaptiveK], costs: AdaptiveLoop, ks: list[int], before_due: int, watches: bool) -> None:
    """Keep this round's plan ``ks`` (made by k*, not a probe) for the next rounds (module doc):
    target-only for at most ``HOLD_ROUNDS`` and ``before_due`` (rounds before a probe or watch
    would be due) where it won by ``HOLD_MARGIN``; drafting for at most ``DRAFT_HOLD_ROUNDS`` where
    it won by ``DRAFT_HOLD_MARGIN`` and every estimate has ``HOLD_TRIALS``. ``watches``: the plan's
    probes are watches (``round_plan``)."""
    drafting = any(ks)
    if drafting:
        steady = all(not p.newcomer and p.pos_trials and p.pos_trials[0] >= HOLD_TRIALS for p in policies)
        rounds = DRAFT_HOLD_ROUNDS if steady and costs.k_star_margin >= 1.0 + DRAFT_HOLD_MARGIN else 0
        key: tuple = tuple(id(p) for p in policies)
    else:
        rounds = min(HOLD_ROUNDS, before_due) if costs.k_star_margin >= 1.0 + HOLD_MARGIN else 0
        key = (costs.version, tuple(p._stamp for p in policies))
    costs.held_rounds = rounds
    if rounds > 0:
        costs.held_for = (drafting, key, watches, ks)


def choose_round_k(policies: list[AdaptiveK], costs: AdaptiveLoop) -> int:
    """k* for a round of these requests (module doc), with a full-k probe after
    ``costs.probe_every`` rounds that would otherwise not draft."""
    k = round_k_star(policies, costs)
    top = max((p.max_k for p in policies), default=0)
    costs.probing = False
    if k == 0 and top > 0:
        if costs.probe_rounds_left > 0:
            costs.probe_rounds_left -= 1
            costs.probing = True
            return top
        costs.target_only_rounds += 1
        if costs.target_only_rounds >= costs.probe_every:
            costs.target_only_rounds = 0
            costs.probes_in_a_row += 1
            # NOTE: the probe drafts the full k (a k = 1 round's draft time is mostly the
            # exchange's fixed part, which charged per draft made every k look too dear), and
            # for two rounds until steady drafting rounds were measured: the first one's wide
            # eager catch-up is not observed (module doc). After that one round: its acceptance
            # is what the probe is for, and the next round's choice already sees it.
            costs.probe_rounds_left = 0 if costs.drafting_measured else 1
            costs.probing = True
            return top
    else:
        costs.probe_rounds_left = 0
        # NOTE: the backoff ends only when measured acceptance says drafting pays, not when a
        # new request's prior does (the loop's prior, or 0.8 before anything was measured).
        measured = [p for p in policies if p.measured]
        if k > 0 and (len(measured) == len(policies)
                      or _argmax(_rates([(p.expected, p.max_k) for p in measured], costs.cost)) > 0):
            costs.probes_in_a_row = 0
    return k


def follow_ups(policies: list[AdaptiveK], costs: AdaptiveLoop) -> list[AdaptiveK]:
    """The requests whose last round drafted and, as a round of their own, would have paid: at
    k* = 0 they draft their k again (a follow-up probe, module doc). A round where the requests F
    draft and the others do not commits, by F's last results, sum_F (a_i + 1) + (n - |F|) tokens
    in T(max k_F), against n in T(0); F is every request whose last round drafted, and none while
    that round would not pay."""
    last = [p for p in policies if p.last_round is not None and p.max_k > 0]
    if not last:
        return []
    top = max(p.max_k for p in last)
    tokens = sum(p.last_round[1] + 1 for p in last) + len(policies) - len(last)
    return last if tokens * costs.cost(0) >= len(policies) * costs.cost(top) else []


def request_ks(policies: list[AdaptiveK], costs: AdaptiveLoop) -> list[int]:
    """Each request's drafts this round: min(k*, its k); when k* = 0, a request that has never
    drafted drafts its own k alone (the newcomer probe), and so do the ones whose last drafting
    round paid (the follow-up probe, ``follow_ups``; module doc)."""
    kept = _held(policies, costs)
    if kept is not None:
        return kept
    k = choose_round_k(policies, costs)
    new = [p for p in policies if p.newcomer and not p.measured and p.max_k > 0]
    for p in policies:
        p.newcomer = False
    if k > 0:
        ks = [min(k, p.max_k) for p in policies]
        if not costs.probing:
            _hold(policies, costs, ks, DRAFT_HOLD_ROUNDS, watches=False)
        return ks
    follow = follow_ups(policies, costs)
    if not (follow or new):
        # choose_round_k probes once the probe clock (counted up this round) reaches probe_every
        ks = [0] * len(policies)
        _hold(policies, costs, ks, costs.probe_every - costs.target_only_rounds - 1, watches=False)
        return ks
    # NOTE: after choose_round_k, which has counted this round as a target-only one: the probe
    # restarts the probe clock, and a newcomer probe counts in the backoff like any probe (a
    # follow-up continues a probe that paid: it does not).
    costs.target_only_rounds = 0
    costs.probes_in_a_row += 1 if new else 0
    costs.probing = True
    probed = {id(p) for p in follow + new}
    return [p.max_k if id(p) in probed else 0 for p in policies]


def round_plan(policies: list[AdaptiveK], costs: AdaptiveLoop, watchable: list[bool] | None
               ) -> tuple[list[int], list[int]]:
    """(each request's drafts this round, each request's drafts in a watch probe this round).

    ``watchable``: None where some request's drafts cannot be watched (sampled drafts): then,
    as without ``costs.watch``, this is ``request_ks`` and no watch. Else ``watchable[i]`` is
    False while a watch of request i still waits for the target's tokens. Probes are then
    watch probes (module doc): a round at k* = 0 watches every watchable request after
    ``WATCH_EVERY`` target-only rounds, and a watchable request not yet measured at once."""
    n = len(policies)
    kept = _held(policies, costs)
    if kept is not None:
        return kept, [0] * n
    if not costs.watch or watchable is None or not costs.watching_pays(max((p.max_k for p in policies), default=0)):
        return request_ks(policies, costs), [0] * n
    k = round_k_star(policies, costs)
    costs.probing = False                  # a round here drafts at k* or not at all
    for p in policies:
        p.newcomer = False                 # a newcomer is watched, not drafted
    if k > 0:
        costs.rounds_unwatched = costs.watches_in_a_row = 0
        ks = [min(k, p.max_k) for p in policies]
        _hold(policies, costs, ks, DRAFT_HOLD_ROUNDS, watches=True)
        return ks, [0] * n
    costs.rounds_unwatched += 1
    floor = costs.watch_floor
    due = costs.rounds_unwatched >= max(costs.watch_backoff, floor)          # watch_every, floor once
    # NOTE: a request whose last watch (or round) matched all k is watched again as soon as the
    # budget allows, whatever the backoff: the loop's backoff comes from the requests before it
    # (a held-out request after random ones), and its estimate rises one watch at a time.
    again = costs.rounds_unwatched >= floor
    watch = [p.max_k if ok and p.max_k > 0 and (due or not p.measured or (again and p.all_accepted)) else 0
             for p, ok in zip(policies, watchable)]
    if due or any(watch):
        costs.rounds_unwatched = 0
        costs.watches_in_a_row += 1 if due else 0
    else:
        # the next rounds count rounds_unwatched up: a watch is due at max(backoff, floor), and at
        # the floor for a request whose last round matched all k
        at = max(costs.watch_backoff, floor)
        if any(ok and p.all_accepted and p.max_k > 0 for p, ok in zip(policies, watchable)):
            at = floor
        _hold(policies, costs, [0] * n, at - costs.rounds_unwatched - 1, watches=True)
    return [0] * n, watch
