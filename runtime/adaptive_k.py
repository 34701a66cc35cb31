"""Adaptive speculation length: how many drafts the requests of a round ask for.

Owns: the per-request acceptance estimates, the loop's acceptance prior for
new requests, the probe schedule's state and the choice of the round's k that
maximizes expected committed tokens per second (the round costs it divides by:
``runtime.round_costs``). Pure Python, no frameworks: the round driver asks
``runtime.adaptive_plan`` (``request_ks``, ``round_plan``: the probes below, which
this doc describes with the model) before each round and reports each request's
round back with ``AdaptiveK.observe`` (and the round's times with ``AdaptiveLoop.observe``).

Must not know: workers, gRPC, tensors.

The model (the usual one for speculative decoding, e.g. Leviathan et al.
2023, § 3.3): a round in which request i drafts k commits on average

    E_i(k) = 1 + c_1 + c_1 c_2 + ... + c_1 c_2 ... c_k

tokens (the accepted prefix plus one target token), c_j = P(draft j accepted
| drafts 1..j-1 were); with one rate a for every position this is the
geometric 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a). The round's cost is

    T(k) = t_verify(k) + [k > 0] * (t_exchange + k * t_draft)

(a round in which nobody drafts runs the target's one-position step, t_verify(0),
and skips the draft exchange altogether; a drafting round's verify is padded to
max_k + 1 positions whatever its k, t_verify(k > 0) one figure). One k serves the whole round —
every request shares its verify and its draft exchange — so the loop picks

    k* = argmax_k  sum_i E_i(min(k, k_i)) / T(k),   k in [0, max_i k_i]

and request i drafts min(k*, k_i) (k_i: what it asked for). A batch where
drafting never pays (every c_1 near 0) gets k* = 0: target-only rounds, no
draft exchange.

The estimates count trials, not drafts: a round that accepts a of k drafts
tested a + 1 of them when it rejected one (a < k) and k when it accepted
all (later drafts were never tested). Per position j, c_j = (rounds that
accepted draft j) / (rounds that tested it), over exponentially weighted sums
(``EMA_WEIGHT`` per round) started at a prior; pooled over positions the same
sums give the request's ``acceptance`` (successes / trials), which is what
the loop learns from. Why per position (``AdaptiveK.expected``): each product
c_1..c_j estimates P(the first j drafts accepted) directly, while a pooled a
under-counts E when the first drafts are accepted more often than the later
ones (an MTP head's usual shape) or when easy and hard stretches alternate
(E is convex in a).

Positions a request stopped testing: a drafting round whose k does not
reach position j adds (1 - decay) ``PRIOR_TRIALS`` trials at the request's
pooled rate to that position's sums (which decay as every position's do), so
in a long stretch at a smaller k the position drifts back to the pooled rate,
``PRIOR_TRIALS`` trials' worth, instead of keeping the estimate it had when it
was last tested. (A position a round's k reached but an earlier rejection kept
untested is left alone: that is how its rate is measured.) Regression it
fixes: a request on held-out prose whose first rounds rejected drafts 2 and 3
fell to k = 1, and with those two estimates frozen it stayed there for the
rest of the request (44 rounds, c_1 at 0.99) where k = 3 ran about x1.4
faster.

Where a new request's estimate starts (``LoopAcceptance``): the acceptance of
the loop's recent request-rounds, counted as ``PRIOR_TRIALS`` trials at each
position; ``PRIOR_ACCEPTANCE`` only until the loop has measured anything.
Regression it fixes: every request started at 0.8, so where drafting never
pays each one drafted its first three or four rounds (x0.91 of target-only on
an H200). A request whose prior says k = 0 still drafts its first round,
alone in its batch (a "newcomer probe"): its own text may draft well where
the last requests' did not, and that round is cheap — its catch-up is the one
pair its draft prefill left, while a probe after a target-only stretch carries
every skipped pair.

Probes: rounds at k* = 0 observe nothing, so after ``PROBE_EVERY`` of them a
probe drafts the full k. It lasts two rounds until steady drafting rounds
have been timed (its first round is not steady, below), then one: what it is
for is the acceptance, and the next round's choice already sees it. A
newcomer probe counts as a probe. When probes keep finding that drafting does
not pay, the interval doubles from the third probe on (up to
``PROBE_BACKOFF_MAX`` times), back to ``PROBE_EVERY`` once a measured
acceptance (not a new request's prior) makes a round draft. Every newcomer is
probed, whatever the backoff: one round per request where drafting never
pays, against a whole request at k = 0 where its text drafts well.

Follow-up probes (``follow_ups``): one probe round moves an estimate only so
far (a request after random ones starts near the loop's low prior, and
``PRIOR_TRIALS`` trials' worth of it stay), so at k* = 0 a request whose last
round drafted and paid — committed, as a round of its own, at least what
target-only rounds would have in the same time — drafts again, and goes on
while its rounds pay, until its estimate alone makes k* > 0. A probe whose
round did not pay ends there. Regression it fixes: ``bench adaptive
--repeats 2`` on an H100 served the second held-out set after the first mix,
and adaptive k ran 34-40 % of its held-out rounds at k = 0 (0.85 of the best
fixed k): the loop's prior was low, the backoff had thinned the newcomer
probes to one request in 8 and the periodic ones to one in 128 rounds, and a
single probe that accepted all its drafts did not lift the request's estimate
over the threshold. In the trace simulation of that regime (``--repeats 2``,
held-out / random / mix over the best fixed k) 0.966 / 0.970 / 1.006 became
0.988 / 0.970 / 1.026 with both changes. (Where probes are watch probes, a
watch that matched all k is followed up the same way: ``round_plan``'s re-watch.)

Watch probes (``AdaptiveLoop.watch``, ``round_plan``): a probe need not be
a drafting round. While the target decodes alone (a target-only round, its
one-position step), the draft drafts the full k for the watched requests at
the same time, and nobody verifies those drafts: the round loop compares them
with the tokens the target commits in this round and the next k - 1 and
reports the matching prefix to ``AdaptiveK.observe`` as that many accepted of
k. For greedy drafts against a greedy target that is the acceptance itself;
for greedy drafts against a sampling target, P(d = t) = p(d), the rejection
test's acceptance of a one-hot draft; for coupled drafts the match is the
coupled test. (Sampled drafts, whose match rate understates the acceptance,
are not watched: a loop that holds one probes by drafting.) Such a probe costs
the target only the exchange's host work, not a verify k + 1 wide after a
drafting round, so the loop affords one every ``WATCH_EVERY`` target-only
rounds (doubling while no round drafts, up to ``WATCH_BACKOFF_MAX`` times),
and a new request is watched in its first round instead of drafting it (no
newcomer probe). In a trace simulation of the H200 regime this took adaptive k
from 0.988 / 0.976 / 1.048 of the best fixed k (held-out / random / mix) to
0.994 / 0.985 / 1.090 with a watch costing 0.1 ms (docs/performance.md §
Session 22). What a watch cannot give is the cost of a drafting round: that
still comes from the rounds that draft, and a round that carried a watch feeds
none of the other estimates (``RoundCosts.observe``). It is timed on its own
(``RoundCosts.watch_extra``), because "beside" holds only where the draft has a
GPU of its own: on one H200 shared by both workers a watch took about a
draft's time, and watching every 4 rounds lost the mix (0.78 of the best
fixed k against 0.97 with drafting probes). So watches stay probes while one
costs less than ``WATCH_SHARE_MAX`` of what a drafting round adds to T(0), at
most one per ``watch_floor`` target-only rounds (``WATCH_BUDGET``), and
otherwise probes draft. A request whose last round matched (or accepted) all k
is watched again as soon as the floor allows, whatever the loop's backoff.

A change of kind has a price (``RoundCosts.entry_extra``, ``leave_extra``): a drafting round after
target-only ones has nothing queued ahead and a catch-up over the skipped pairs (on an H100 a probe
so took ~4 target-only rounds); a target-only round after a drafting one waits for the round that
one queued. k* charges it over ``SWITCH_HORIZON`` rounds to the k that changes kind (T(0) + leave/H
after a round that queued this one, else T(k) + entry/H): a request near the threshold keeps what it
was doing. Periodic probes keep that price within ``PROBE_BUDGET`` of the target-only time between
them (``probe_every``), as watches do within ``WATCH_BUDGET``. A probe's round queues nothing ahead
(``AdaptiveLoop.probing`` -> ``VerifyRequest.chain``: the next round most likely does not draft),
and after a target-only round right after a drafting one, k* waits one more target-only round while
T(0) has no steady figure (``RoundCosts.target_only_unsteady``). Simulated (docs/performance.md §
Session 32), the worst of held-out / random / mix over the best fixed k went from 0.78-0.81 to
0.96-0.97 on H100 regimes.

What a round costs, T(k), and which rounds feed that estimate:
``runtime.round_costs`` (``RoundCosts``). ``AdaptiveLoop`` is a loop's whole
adaptive state: those cost estimates, the probe schedule above and the loop's
acceptance prior.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

from runtime.round_costs import RoundCosts, round_cost

PRIOR_ACCEPTANCE = 0.8       # before a request has drafted anything (a trained MTP head's typical first-position rate)
EMA_WEIGHT = 0.1             # weight of the newest round in the acceptance estimate
PROBE_EVERY = 16             # target-only rounds between two probes (module doc)
PROBE_BACKOFF_MAX = 8        # the probe interval grows to at most this many times PROBE_EVERY ...
PROBE_BUDGET = 0.01          # ... and at least what keeps a probe's measured price to this share of T(0)
WATCH_EVERY = 4              # target-only rounds between two watch probes (module doc) ...
WATCH_BACKOFF_MAX = 8        # ... doubling while they keep finding that drafting does not pay, up to this many times,
WATCH_BUDGET = 0.03          # ... and never more often than keeps their measured cost to this share of T(0)
WATCH_SHARE_MAX = 0.5        # watch while a watch costs less than this share of what a drafting round adds to T(0)
PRIOR_TRIALS = 2.0           # the weight of a new request's prior, in trials
SWITCH_HORIZON = 8.0         # rounds a change between drafting and target-only rounds is charged over (module doc)
LOOP_WEIGHT = 0.05           # weight of one request-round in the loop's acceptance (~20 request-rounds)

_STAMPS = itertools.count(1)  # one number per state of a policy's estimates (round_k_star's cache key)


def expected_tokens(a: float, k: int) -> float:
    """E[tokens committed | k drafts, acceptance a] = sum_{j=0..k} a^j."""
    return float(sum(a ** j for j in range(k + 1)))


def best_k(a: float, max_k: int, t_verify: float, t_draft: float, t_exchange: float) -> int:
    """argmax_k E[tokens | k] / T(k) over k in [0, max_k] for one request (the smallest k on ties)."""
    return best_round_k([(a, max_k)], t_verify, t_draft, t_exchange)


def best_round_k(requests: list[tuple[float, int]], t_verify: float, t_draft: float, t_exchange: float) -> int:
    """argmax_k sum_i E(a_i, min(k, k_i)) / T(k) over k in [0, max k_i]; requests = [(a_i, k_i)]."""
    return _best(requests, lambda k: round_cost(k, t_verify, t_draft, t_exchange))


Expected = Callable[[int], float]     # k -> E[tokens committed | k drafts] of one request


def _rates(requests: list[tuple[Expected, int]], cost: Callable[[int], float]) -> list[float]:
    """Expected committed tokens per second of the round at each k in [0, max k_i]; requests = [(E_i, k_i)]."""
    top = max((k for _, k in requests), default=0)
    rates = []
    for k in range(top + 1):                 # plain loops: this runs every round (host time, see _Window)
        tokens = 0.0
        for e, ki in requests:
            tokens += e(ki if ki < k else k)
        rates.append(tokens / max(cost(k), 1e-9))
    return rates


def _argmax(rates: list[float]) -> int:
    """The best k (the smallest on ties)."""
    best, best_rate = 0, -1.0
    for k in range(len(rates)):
        if rates[k] > best_rate * (1 + 1e-9):
            best, best_rate = k, rates[k]
    return best


def _best(requests: list[tuple[float, int]], cost: Callable[[int], float]) -> int:
    return _argmax(_rates([(lambda k, a=a: expected_tokens(a, k), ki) for a, ki in requests], cost))


def _trials(k: int, accepted: int) -> int:
    """Drafts a round tested: the accepted ones, plus the rejected one if any (module doc)."""
    return accepted + (1 if accepted < k else 0)


class LoopAcceptance:
    """The acceptance of the loop's recent request-rounds: where a new request's estimate starts.

    successes / trials over exponentially weighted sums, ``LOOP_WEIGHT`` per
    request-round (every drafting request of every round); ``PRIOR_ACCEPTANCE``
    until one has been observed.
    """

    def __init__(self) -> None:
        self.successes = 0.0
        self.trials = 0.0

    @property
    def prior(self) -> float:
        return self.successes / self.trials if self.trials > 0 else PRIOR_ACCEPTANCE

    def observe(self, k: int, accepted: int) -> None:
        decay = 1.0 - LOOP_WEIGHT
        self.successes = decay * self.successes + accepted
        self.trials = decay * self.trials + _trials(k, accepted)

    def new_policy(self, max_k: int) -> "AdaptiveK":
        """A new request's policy: the loop's prior, counted as ``PRIOR_TRIALS`` trials; it reports back here."""
        return AdaptiveK(max_k, self.prior * PRIOR_TRIALS, PRIOR_TRIALS, loop=self)


@dataclass
class AdaptiveK:
    """One request's acceptance estimates (k_max = what the request asked for): the pooled rate
    ``acceptance`` (what the loop learns from) and the per-position rates ``expected`` uses."""

    max_k: int
    successes: float = PRIOR_ACCEPTANCE * PRIOR_TRIALS    # the prior counts as PRIOR_TRIALS trials
    trials: float = PRIOR_TRIALS
    loop: LoopAcceptance | None = field(default=None, repr=False, compare=False)
    drafted: bool = False                                 # has it drafted a round yet?
    all_accepted: bool = field(default=False, repr=False)  # did its last observed round accept all k?
    newcomer: bool = field(default=True, repr=False)      # not yet considered for a newcomer probe
    last_round: tuple[int, int] | None = field(default=None, repr=False)   # (k, accepted) if its last round drafted
    # Per draft position j = 1..max_k: weighted rounds that tested draft j (reached it), and
    # that accepted it; both start at the prior (the pooled rate, PRIOR_TRIALS trials each).
    pos_successes: list[float] = field(default_factory=list, repr=False)
    pos_trials: list[float] = field(default_factory=list, repr=False)
    _expected: list[float] | None = field(default=None, init=False, repr=False, compare=False)   # E(0..max_k)
    _stamp: int = field(default_factory=lambda: next(_STAMPS), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.pos_trials:
            a = self.successes / self.trials
            self.pos_successes = [a * PRIOR_TRIALS] * self.max_k
            self.pos_trials = [PRIOR_TRIALS] * self.max_k

    @property
    def acceptance(self) -> float:
        return self.successes / self.trials

    def expected(self, k: int) -> float:
        """E[tokens | k drafts] = 1 + sum_{j=1..k} c_1 c_2 ... c_j, c_j = P(draft j accepted | j-1 were).

        Each product c_1..c_j estimates P(the first j drafts accepted) directly; the pooled
        geometric sum_j a^j under-counts it when early drafts are accepted more often than late
        ones (module doc). In a trace simulation of the H200 bench at batch 1 (first draft
        accepted 10% above a request's mean, third 10% below) adaptive k ran at x0.966 of fixed
        k = 3 on held-out prompts with these estimates, x0.957 with the pooled one; with the
        same rate at every position the two were within the simulation's noise.

        E(0..max_k) are kept until ``observe`` changes the estimates (a round asks every k)."""
        if self._expected is None:
            total, run, es = 1.0, 1.0, [1.0]
            for j in range(self.max_k):
                run *= self.pos_successes[j] / max(self.pos_trials[j], 1e-12)
                total += run
                es.append(total)
            self._expected = es
        return self._expected[min(max(k, 0), self.max_k)]

    @property
    def measured(self) -> bool:
        """Has drafted at least once (the estimate is no longer the prior alone)."""
        return self.drafted or self.trials > PRIOR_TRIALS

    def observe(self, k: int, accepted: int) -> None:
        self.last_round = (k, accepted) if k > 0 else None
        if k > 0:
            self._expected, self._stamp = None, next(_STAMPS)
            decay = 1.0 - EMA_WEIGHT
            self.drafted = True
            self.all_accepted = accepted >= k
            self.successes = decay * self.successes + accepted
            self.trials = decay * self.trials + _trials(k, accepted)
            pooled = self.acceptance
            for j in range(self.max_k):       # draft j + 1 was tested iff j <= accepted and j < k
                self.pos_successes[j] = decay * self.pos_successes[j] + (1.0 if j < accepted else 0.0)
                self.pos_trials[j] = decay * self.pos_trials[j] + (1.0 if j <= accepted and j < k else 0.0)
                if j >= k:                    # beyond this round's k: back toward the pooled rate
                    self.pos_successes[j] += EMA_WEIGHT * PRIOR_TRIALS * pooled
                    self.pos_trials[j] += EMA_WEIGHT * PRIOR_TRIALS
            if self.loop is not None:
                self.loop.observe(k, accepted)


class AdaptiveLoop(RoundCosts):
    """One round loop's adaptive state: its round costs (``RoundCosts``), the probe schedule and
    the acceptance prior of its new requests (module doc)."""

    def __init__(self, t_verify: float = 1e-3, t_draft: float = 1e-4, t_exchange: float = 3e-4,
                 watch: bool = False) -> None:
        super().__init__(t_verify, t_draft, t_exchange)
        self.watch = watch             # probes are watch probes where every request allows one (round_plan)
        self.rounds_unwatched = 0      # target-only rounds since the last watch probe
        self.watches_in_a_row = 0      # watch probes since a round last drafted
        self.target_only_rounds = 0    # rounds at k* = 0 since the last probe
        self.probe_rounds_left = 0     # full-k rounds still owed to the probe under way
        self.probes_in_a_row = 0       # probes since measured acceptance last said drafting pays
        self.loop = LoopAcceptance()   # new requests' prior (module doc)
        self._drafting_best: tuple[tuple, int, float, float] | None = None  # (key, k, rate, next best rate)
        self.probing = False           # the last round planned drafts only as a probe (k* = 0): queue nothing ahead
        self.k_star_margin = 0.0       # round_k_star's last: the chosen k's rate over the best other k's
        self.held_for: tuple = ()      # a kept plan (runtime/adaptive_plan.py): what it holds for ...
        self.held_rounds = 0           # ... and for how many more rounds

    @property
    def watch_every(self) -> int:
        """Target-only rounds before the next watch probe: ``WATCH_EVERY``, doubling from the
        second watch in a row (no round drafted since) up to ``WATCH_BACKOFF_MAX`` times, and at
        least as many as keep a watch's measured cost (``watch_extra``) within ``WATCH_BUDGET``
        of the target-only decoding between two watches."""
        return max(self.watch_backoff, self.watch_floor)

    @property
    def watch_backoff(self) -> int:
        """``watch_every`` before the cost floor: the backoff alone."""
        return WATCH_EVERY * min(2 ** max(0, self.watches_in_a_row - 1), WATCH_BACKOFF_MAX)

    @property
    def watch_floor(self) -> int:
        """The fewest target-only rounds between two watches that keep a watch's measured cost
        (``watch_extra``) within ``WATCH_BUDGET`` of the decoding between them (1 before one was timed)."""
        extra = self.watch_extra
        return max(1, math.ceil(extra / (WATCH_BUDGET * max(self.cost(0), 1e-9)))) if extra else 1

    def watching_pays(self, max_k: int) -> bool:
        """Whether probes should be watches (module doc): until one was timed, and while a watch
        costs less than ``WATCH_SHARE_MAX`` of what a round drafting ``max_k`` adds to T(0). With
        the draft on the target's GPU a watch's kernels take turns with the target's step and it
        costs about a draft; a drafting probe then costs little more and commits its accepted
        drafts (docs/performance.md § Session 22)."""
        extra = self.watch_extra
        return extra is None or extra < WATCH_SHARE_MAX * max(self.cost(max_k) - self.cost(0), 0.0)

    @property
    def probe_every(self) -> int:
        """Target-only rounds before the next probe (module doc: backoff from the third probe), and
        at least as many as keep a probe's measured price (``entry_extra``: its catch-up over the
        skipped pairs, nothing queued ahead for it) within ``PROBE_BUDGET`` of the target-only
        decoding between two probes."""
        backoff = PROBE_EVERY * min(2 ** max(0, self.probes_in_a_row - 1), PROBE_BACKOFF_MAX)
        price = self.entry_extra
        if not price:
            return backoff
        return max(backoff, math.ceil(price / (PROBE_BUDGET * max(self.cost(0), 1e-9))))


def round_k_star(policies: list[AdaptiveK], costs: AdaptiveLoop) -> int:
    """argmax_k sum_i E_i(min(k, k_i)) / T(k) (the smallest k on ties), as ``_argmax(_rates(..))``.

    Split as rate(0) = n / T(0) (E(0) = 1) against the best k >= 1, which is kept on ``costs``
    until a policy's estimates or T(k > 0) change (their stamps and ``costs.version``): in a
    stretch of target-only rounds only T(0) moves, so a round asks for one division, not every
    T(k) and E(k) (module doc of ``RoundCosts.observe``: the policy's host time per round)."""
    if costs.target_only_unsteady:
        # NOTE: a target-only round right after a drafting one is timed with what that round left
        # on the device (a round it queued ahead, runtime/round_ahead.py): one more target-only
        # round gives T(0) its first steady figure (RoundCosts.t_round0) before k* may draft again.
        costs.k_star_margin = 0.0
        return 0
    queued = costs.last_k > 0 and not costs.probing       # the last round queued this one ahead
    enter = 0.0 if queued else costs.entry_extra / SWITCH_HORIZON
    key = (costs.version, queued, tuple(p._stamp for p in policies))
    cached = costs._drafting_best
    if cached is not None and cached[0] == key:
        k_pos, rate_pos, rate_next = cached[1], cached[2], cached[3]
    else:
        rates = _rates([(p.expected, p.max_k) for p in policies], lambda k: costs.cost(k) + enter)
        k_pos, rate_pos = 0, -1.0
        for k in range(1, len(rates)):                # _argmax's rule, among k >= 1
            if rates[k] > rate_pos * (1 + 1e-9):
                k_pos, rate_pos = k, rates[k]
        rate_next = max((rates[k] for k in range(1, len(rates)) if k != k_pos), default=0.0)
        costs._drafting_best = (key, k_pos, rate_pos, rate_next)
    leave = costs.leave_extra / SWITCH_HORIZON if queued else 0.0
    rate0 = len(policies) / max(costs.cost(0) + leave, 1e-9)
    if k_pos > 0 and rate_pos > rate0 * (1 + 1e-9):
        costs.k_star_margin = rate_pos / max(rate_next, rate0)
        return k_pos
    costs.k_star_margin = rate0 / rate_pos if k_pos > 0 else math.inf
    return 0
