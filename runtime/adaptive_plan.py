"""Each round's plan under adaptive k: who drafts how many this round, and the probes.

Owns: the per-round decisions on top of the model of ``runtime.adaptive_k`` (k*, its
estimates and the loop's schedule state live there, with the whole model in its module doc):
the periodic probe (``choose_round_k``), newcomer and follow-up probes (``request_ks``,
``follow_ups``), watch probes (``round_plan``), and the hold of a target-only plan.

Must not know: workers, gRPC, tensors.

The hold (``HOLD_ROUNDS``): a plan of target-only rounds is kept for up to ``HOLD_ROUNDS``
more rounds of the same requests while nothing it was made of changes — no request's
estimates (their stamps), no drafting cost (``costs.version``; a target-only round changes
only T(0)) — when target-only won by ``HOLD_MARGIN`` or more (``target_only_margin``) and no
probe or watch is due before it ends. A kept round only advances the probe clock (or the
watch clock) as the full plan would. What it skips is the plan's host work: on the 2-core CPU
a target-only round's planning took ~50 us in the served loop against ~5 for a k = 0 request
(docs/performance.md § Session 33), and on a GPU host that is a share of a target-only round
(~0.45 ms on an H100) where drafting never pays. What it gives up: T(0) moving by more than the
margin, or a probe or watch interval shrinking with it, is seen up to ``HOLD_ROUNDS`` rounds
later; a request's tokens never depend on its k.
"""

from __future__ import annotations

from runtime.adaptive_k import AdaptiveK, AdaptiveLoop, _argmax, _rates, round_k_star

HOLD_ROUNDS = 4              # target-only rounds a target-only plan is kept for, at most (module doc) ...
HOLD_MARGIN = 0.05           # ... when target-only beat the best drafting k by this share or more


def _held(policies: list[AdaptiveK], costs: AdaptiveLoop) -> bool:
    """Whether this round keeps the last target-only plan (module doc); a kept round advances the
    clock its plan would have: the watch clock where watches were the probes, else the probe clock."""
    if costs.held_rounds <= 0:
        return False
    if costs.held_for[:2] != (costs.version, tuple(p._stamp for p in policies)):
        costs.held_rounds = 0
        return False
    costs.held_rounds -= 1
    costs.probing = False
    if costs.held_for[2]:
        costs.rounds_unwatched += 1
    else:
        costs.target_only_rounds += 1
    return True


def _hold(policies: list[AdaptiveK], costs: AdaptiveLoop, before_due: int, watches: bool) -> None:
    """Keep this round's target-only plan for the next rounds (module doc): at most ``HOLD_ROUNDS``
    and ``before_due`` (rounds before a probe or watch would be due), where target-only won by
    ``HOLD_MARGIN``. ``watches``: the plan's probes are watches (``round_plan``)."""
    rounds = min(HOLD_ROUNDS, before_due) if costs.target_only_margin >= 1.0 + HOLD_MARGIN else 0
    costs.held_rounds = rounds
    if rounds > 0:
        costs.held_for = (costs.version, tuple(p._stamp for p in policies), watches)


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
    if _held(policies, costs):
        return [0] * len(policies)
    k = choose_round_k(policies, costs)
    new = [p for p in policies if p.newcomer and not p.measured and p.max_k > 0]
    for p in policies:
        p.newcomer = False
    if k > 0:
        return [min(k, p.max_k) for p in policies]
    follow = follow_ups(policies, costs)
    if not (follow or new):
        # choose_round_k probes once the probe clock (counted up this round) reaches probe_every
        _hold(policies, costs, costs.probe_every - costs.target_only_rounds - 1, watches=False)
        return [0] * len(policies)
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
    if costs.held_rounds > 0 and _held(policies, costs):
        return [0] * n, [0] * n
    if not costs.watch or watchable is None or not costs.watching_pays(max((p.max_k for p in policies), default=0)):
        return request_ks(policies, costs), [0] * n
    k = round_k_star(policies, costs)
    costs.probing = False                  # a round here drafts at k* or not at all
    for p in policies:
        p.newcomer = False                 # a newcomer is watched, not drafted
    if k > 0:
        costs.rounds_unwatched = costs.watches_in_a_row = 0
        return [min(k, p.max_k) for p in policies], [0] * n
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
        _hold(policies, costs, at - costs.rounds_unwatched - 1, watches=True)
    return [0] * n, watch
