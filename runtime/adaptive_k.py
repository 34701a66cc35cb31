"""Adaptive speculation length: how many drafts a request asks for in its next round.

Owns: the per-request acceptance estimate, the round-cost model and the
choice of k that maximizes expected committed tokens per second. Pure
Python, no frameworks: the round driver asks ``choose_k`` before each round
and reports each round back with ``observe``.

Must not know: workers, gRPC, tensors.

The model (the usual one for speculative decoding, e.g. Leviathan et al.
2023, § 3.3): if each draft is accepted independently with probability a,
a round with k drafts commits on average

    E[tokens | k] = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens (the accepted prefix plus one target token). Its cost is

    T(k) = t_verify + [k > 0] * (t_exchange + k * t_draft)

(t_verify barely grows with k at these widths: the verify is memory-bound;
a round with k = 0 skips the draft exchange altogether). The best k in
[0, max_k] maximizes E[tokens | k] / T(k).

The acceptance estimate counts trials, not drafts: a round that accepts a of
k drafts tested a + 1 of them when it rejected one (a < k) and k when it
accepted all (later drafts were never tested), so a = successes / trials
over exponentially weighted sums, started at a prior. A request that settles on k = 0
observes nothing more, so every ``PROBE_EVERY`` target-only rounds it drafts
one token (k = 1) to see whether drafting pays again.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_ACCEPTANCE = 0.6       # before a request has drafted anything
EMA_WEIGHT = 0.3             # weight of the newest round in the acceptance estimate
PROBE_EVERY = 16             # target-only rounds between two k = 1 probes


def expected_tokens(a: float, k: int) -> float:
    """E[tokens committed | k drafts, acceptance a] = sum_{j=0..k} a^j."""
    return float(sum(a ** j for j in range(k + 1)))


def round_cost(k: int, t_verify: float, t_draft: float, t_exchange: float) -> float:
    """T(k): a verify, plus (when k > 0) one draft exchange and k draft substeps."""
    return t_verify + (t_exchange + k * t_draft if k > 0 else 0.0)


def best_k(a: float, max_k: int, t_verify: float, t_draft: float, t_exchange: float) -> int:
    """argmax_k E[tokens | k] / T(k) over k in [0, max_k] (the smallest k on ties)."""
    best, best_rate = 0, -1.0
    for k in range(max_k + 1):
        rate = expected_tokens(a, k) / max(round_cost(k, t_verify, t_draft, t_exchange), 1e-9)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best


@dataclass
class RoundCosts:
    """Running estimates of the round's parts (seconds), shared by every request of a loop."""

    t_verify: float = 1e-3
    t_draft: float = 1e-4          # one draft substep
    t_exchange: float = 3e-4       # the draft call's fixed cost (transport, catch-up, host work)
    weight: float = 0.1

    def observe(self, k_max: int, draft_s: float, verify_s: float, overhead_s: float) -> None:
        """One round: its largest k, draft compute, verify compute and everything else."""
        w = self.weight
        self.t_verify += w * (verify_s - self.t_verify)
        if k_max > 0:
            # NOTE: a round's draft time is one catch-up pass plus k-1 substeps; charge it per
            # draft, and the round's overhead (which includes the exchange) to the exchange.
            self.t_draft += w * (draft_s / k_max - self.t_draft)
            self.t_exchange += w * (overhead_s - self.t_exchange)


@dataclass
class AdaptiveK:
    """One request's speculation length, within [0, max_k] (max_k = what the request asked for)."""

    max_k: int
    successes: float = PRIOR_ACCEPTANCE * 2    # the prior counts as two trials
    trials: float = 2.0
    target_only_rounds: int = 0

    @property
    def acceptance(self) -> float:
        return self.successes / self.trials

    def choose(self, costs: RoundCosts) -> int:
        if self.max_k == 0:
            return 0
        k = best_k(self.acceptance, self.max_k, costs.t_verify, costs.t_draft, costs.t_exchange)
        if k == 0:
            self.target_only_rounds += 1
            if self.target_only_rounds >= PROBE_EVERY:
                self.target_only_rounds = 0
                return 1
        return k

    def observe(self, k: int, accepted: int) -> None:
        if k > 0:
            decay = 1.0 - EMA_WEIGHT
            self.successes = decay * self.successes + accepted
            self.trials = decay * self.trials + accepted + (1 if accepted < k else 0)
