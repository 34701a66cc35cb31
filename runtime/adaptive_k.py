"""Adaptive speculation length: how many drafts the requests of a round ask for.

Owns: the per-request acceptance estimate, the round-cost model and the
choice of the round's k that maximizes expected committed tokens per second.
Pure Python, no frameworks: the round driver asks ``choose_round_k`` before
each round and reports each request's round back with ``AdaptiveK.observe``.

Must not know: workers, gRPC, tensors.

The model (the usual one for speculative decoding, e.g. Leviathan et al.
2023, § 3.3): if each draft of request i is accepted independently with
probability a_i, a round in which it drafts k commits on average

    E_i(k) = 1 + a_i + a_i^2 + ... + a_i^k = (1 - a_i^(k+1)) / (1 - a_i)

tokens (the accepted prefix plus one target token). The round's cost is

    T(k) = t_verify + [k > 0] * (t_exchange + k * t_draft)

(the verify is padded to max_k + 1 positions whatever k is, and a round with
k = 0 skips the draft exchange altogether). One k serves the whole round —
every request shares its verify and its draft exchange — so the loop picks

    k* = argmax_k  sum_i E_i(min(k, k_i)) / T(k),   k in [0, max_i k_i]

and request i drafts min(k*, k_i) (k_i: what it asked for). A batch where
drafting never pays (every a_i near 0) gets k* = 0: target-only rounds, no
draft exchange.

The acceptance estimate counts trials, not drafts: a round that accepts a of
k drafts tested a + 1 of them when it rejected one (a < k) and k when it
accepted all (later drafts were never tested), so a = successes / trials
over exponentially weighted sums, started at a prior. Rounds at k* = 0
observe nothing, so after ``PROBE_EVERY`` of them a probe drafts the full k
for two rounds to see whether drafting pays again; when probes keep finding
that it does not, the interval doubles from the third probe on (up to
``PROBE_BACKOFF_MAX`` times), back to ``PROBE_EVERY`` once a measured
acceptance (not a new request's prior) makes a round draft.

What a round really costs: the sum above leaves out what happens around the
parts (the loop's own work between rounds, streaming the chunks, threads
competing for the interpreter), and that is not the same for both kinds of
round: measured on an H200 with the bundled model, a target-only round took
1.17 ms inside but 1.38 ms start to start, a k = 3 round 3.69 vs 3.72 ms.
So once both kinds have been seen (``MIN_PERIODS`` each), T(0) is the median
start-to-start period of target-only rounds, and T(k > 0) the median period of
drafting rounds less their draft time, plus k * t_draft.

Which rounds feed the cost estimates: a drafting round right after rounds
that did not draft (a probe's first round, the first round of the loop) is
not steady state — its catch-up carries every pair the skipped rounds left
(wider than any captured width: the draft runs it eagerly) and the first
exchange on a fresh stream pays its opening. Its verify time counts, its
draft and exchange times do not; the probe's second round measures them.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass
from typing import Callable

PRIOR_ACCEPTANCE = 0.8       # before a request has drafted anything (a trained MTP head's typical first-position rate)
EMA_WEIGHT = 0.1             # weight of the newest round in the acceptance estimate
PROBE_EVERY = 16             # target-only rounds between two probes (two full-k rounds each)
PROBE_BACKOFF_MAX = 8        # the probe interval grows to at most this many times PROBE_EVERY
MIN_PERIODS = 3              # measured round periods of each kind before they replace the part sums


def expected_tokens(a: float, k: int) -> float:
    """E[tokens committed | k drafts, acceptance a] = sum_{j=0..k} a^j."""
    return float(sum(a ** j for j in range(k + 1)))


def round_cost(k: int, t_verify: float, t_draft: float, t_exchange: float) -> float:
    """T(k): a verify, plus (when k > 0) one draft exchange and k draft substeps."""
    return t_verify + (t_exchange + k * t_draft if k > 0 else 0.0)


def best_k(a: float, max_k: int, t_verify: float, t_draft: float, t_exchange: float) -> int:
    """argmax_k E[tokens | k] / T(k) over k in [0, max_k] for one request (the smallest k on ties)."""
    return best_round_k([(a, max_k)], t_verify, t_draft, t_exchange)


def best_round_k(requests: list[tuple[float, int]], t_verify: float, t_draft: float, t_exchange: float) -> int:
    """argmax_k sum_i E(a_i, min(k, k_i)) / T(k) over k in [0, max k_i]; requests = [(a_i, k_i)]."""
    return _best(requests, lambda k: round_cost(k, t_verify, t_draft, t_exchange))


def _best(requests: list[tuple[float, int]], cost: Callable[[int], float]) -> int:
    top = max((k for _, k in requests), default=0)
    best, best_rate = 0, -1.0
    for k in range(top + 1):
        tokens = sum(expected_tokens(a, min(k, ki)) for a, ki in requests)
        rate = tokens / max(cost(k), 1e-9)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best


class RoundCosts:
    """Running estimates of the round's parts (seconds), shared by every request of a loop.

    Each part is the median of its last ``WINDOW`` observations: robust to the
    outliers a serving loop sees (a stream opened, a request joining, a GC
    pause), which would otherwise hold an average high for many rounds.
    """

    WINDOW = 31

    def __init__(self, t_verify: float = 1e-3, t_draft: float = 1e-4, t_exchange: float = 3e-4) -> None:
        self._verify: collections.deque[float] = collections.deque([t_verify], maxlen=self.WINDOW)
        self._draft: collections.deque[float] = collections.deque([t_draft], maxlen=self.WINDOW)
        self._exchange: collections.deque[float] = collections.deque([t_exchange], maxlen=self.WINDOW)
        self.target_only_rounds = 0    # rounds at k* = 0 since the last probe
        self.probe_rounds_left = 0     # full-k rounds still owed to the probe under way
        self.probes_in_a_row = 0       # probes since measured acceptance last said drafting pays
        self._drafted_last = False     # did the previous observed round draft?
        # Start-to-start periods: of target-only rounds, and of drafting rounds less their draft time.
        self._period0: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self._fixed_spec: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self._last_start: float | None = None
        self._prev_k, self._prev_steady, self._prev_draft = 0, False, 0.0

    @property
    def t_verify(self) -> float:
        return statistics.median(self._verify)

    @property
    def t_draft(self) -> float:
        """One draft substep."""
        return statistics.median(self._draft)

    @property
    def t_exchange(self) -> float:
        """The draft call's fixed cost (transport, catch-up, host work)."""
        return statistics.median(self._exchange)

    @property
    def probe_every(self) -> int:
        """Target-only rounds before the next probe (module doc: backoff from the third probe)."""
        return PROBE_EVERY * min(2 ** max(0, self.probes_in_a_row - 1), PROBE_BACKOFF_MAX)

    def cost(self, k: int) -> float:
        """T(k) in seconds: measured periods once both kinds of round were seen, else the parts' sum."""
        if len(self._period0) >= MIN_PERIODS and len(self._fixed_spec) >= MIN_PERIODS:
            if k == 0:
                return statistics.median(self._period0)
            return statistics.median(self._fixed_spec) + k * self.t_draft
        return round_cost(k, self.t_verify, self.t_draft, self.t_exchange)

    def observe(self, k_max: int, draft_s: float, verify_s: float, overhead_s: float,
                started: float | None = None) -> None:
        """One round: its largest k, draft compute, verify compute and everything else; ``started``:
        when it started (perf_counter seconds), for the start-to-start period of the round before."""
        prev_start, prev_k, self._last_start = self._last_start, self._prev_k, started
        self._prev_k = k_max
        if started is not None and prev_start is not None:
            period = started - prev_start
            if prev_k == 0:
                self._period0.append(period)
            elif self._prev_steady:
                self._fixed_spec.append(period - self._prev_draft)
        self._verify.append(verify_s)
        steady = self._drafted_last        # module doc: the first drafting round after none is not
        self._drafted_last = k_max > 0
        self._prev_steady, self._prev_draft = k_max > 0 and steady, draft_s
        if k_max > 0 and steady:
            # NOTE: a round's draft time is one catch-up pass plus k-1 substeps; charge it per
            # draft, and the round's overhead (which includes the exchange) to the exchange.
            self._draft.append(draft_s / k_max)
            self._exchange.append(overhead_s)

    def __repr__(self) -> str:
        return (f"RoundCosts(t_verify={self.t_verify:.6f}, t_draft={self.t_draft:.6f}, "
                f"t_exchange={self.t_exchange:.6f})")


@dataclass
class AdaptiveK:
    """One request's acceptance estimate (k_max = what the request asked for)."""

    max_k: int
    successes: float = PRIOR_ACCEPTANCE * 2    # the prior counts as two trials
    trials: float = 2.0

    @property
    def acceptance(self) -> float:
        return self.successes / self.trials

    @property
    def measured(self) -> bool:
        """Has drafted at least once (the estimate is no longer the prior alone)."""
        return self.trials > 2.0

    def observe(self, k: int, accepted: int) -> None:
        if k > 0:
            decay = 1.0 - EMA_WEIGHT
            self.successes = decay * self.successes + accepted
            self.trials = decay * self.trials + accepted + (1 if accepted < k else 0)


def choose_round_k(policies: list[AdaptiveK], costs: RoundCosts) -> int:
    """k* for a round of these requests (module doc), with a two-round full-k probe after
    ``costs.probe_every`` rounds that would otherwise not draft."""
    k = _best([(p.acceptance, p.max_k) for p in policies], costs.cost)
    top = max((p.max_k for p in policies), default=0)
    if k == 0 and top > 0:
        if costs.probe_rounds_left > 0:
            costs.probe_rounds_left -= 1
            return top
        costs.target_only_rounds += 1
        if costs.target_only_rounds >= costs.probe_every:
            costs.target_only_rounds = 0
            costs.probes_in_a_row += 1
            # NOTE: the probe drafts the full k (a k = 1 round's draft time is mostly the
            # exchange's fixed part, which charged per draft made every k look too dear), and
            # for two rounds: the first one's wide eager catch-up is not observed (module doc).
            costs.probe_rounds_left = 1
            return top
    else:
        costs.probe_rounds_left = 0
        # NOTE: the backoff ends only when measured acceptance says drafting pays, not when a
        # new request's prior does (it drafts its first rounds whatever the loop has learned).
        if k > 0 and _best([(p.acceptance, p.max_k) for p in policies if p.measured], costs.cost) > 0:
            costs.probes_in_a_row = 0
    return k
