"""Unit tests for runtime/acceptance.py.

Besides the case tests, the statistical tests check the property speculative decoding exists for:
emitted tokens have exactly the target's distribution. A tiny synthetic "language model" (V = 8,
next-token distribution keyed by the last token, from a seeded random table) plays target p and a
different draft q; whole rounds are simulated (draft k tokens autoregressively from q, verify with
p, emit, continue from the new context) until two tokens exist, and the first / second emitted
tokens are compared with p's marginals by a chi-square test with fixed seeds (deterministic). Buggy
acceptance rules run through the same harness must fail the same test, showing it has power.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from scipy.stats import binomtest, chisquare

from runtime.acceptance import Acceptance, accept_greedy, accept_rejection, truncate_at_stop
from runtime.sampling import process_logits, sample_token


class CountingRng:
    """Wraps a Generator and counts random() draws."""

    def __init__(self, seed: int):
        self.gen = np.random.default_rng(seed)
        self.draws = 0

    def random(self) -> float:
        self.draws += 1
        return self.gen.random()


class FixedRng:
    """Returns the given u values in order."""

    def __init__(self, *us: float):
        self.us = list(us)

    def random(self) -> float:
        return self.us.pop(0)


def one_hot(i: int, V: int) -> np.ndarray:
    x = np.zeros(V)
    x[i] = 1.0
    return x


# ---------------------------------------------------------------- accept_greedy


def greedy_rows(best: Sequence[int], V: int = 6) -> np.ndarray:
    # [len(best), V] logits whose argmax in row j is best[j] (with a runner-up to make it non-trivial).
    rows = np.tile(np.linspace(0.0, 1.0, V), (len(best), 1))
    for j, b in enumerate(best):
        rows[j, b] = 5.0
    return rows


def test_greedy_full_accept_emits_bonus():
    res = accept_greedy([3, 1, 4], greedy_rows([3, 1, 4, 2]))
    assert res == Acceptance(num_accepted=3, tokens=(3, 1, 4, 2))


def test_greedy_first_position_reject():
    res = accept_greedy([0, 1, 4], greedy_rows([3, 1, 4, 2]))
    assert res == Acceptance(num_accepted=0, tokens=(3,))


def test_greedy_middle_reject():
    res = accept_greedy([3, 1, 5, 2], greedy_rows([3, 1, 4, 2, 0]))
    assert res == Acceptance(num_accepted=2, tokens=(3, 1, 4))
    # Rows after the first mismatch are ignored (they scored a context that is now discarded).
    res = accept_greedy([3, 0, 5, 2], greedy_rows([3, 1, 4, 2, 0]))
    assert res == Acceptance(num_accepted=1, tokens=(3, 1))


def test_greedy_k0_is_target_only_decoding():
    res = accept_greedy([], greedy_rows([4]))
    assert res == Acceptance(num_accepted=0, tokens=(4,))


def test_greedy_ties_take_lowest_index_and_tokens_are_ints():
    logits = np.array([[1.0, 2.0, 2.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    res = accept_greedy(np.array([2]), logits)
    assert res == Acceptance(num_accepted=0, tokens=(1,))
    res = accept_greedy(np.array([1]), logits)
    assert res == Acceptance(num_accepted=1, tokens=(1, 0))
    assert all(type(t) is int for t in res.tokens)


@pytest.mark.parametrize(
    ("drafts", "logits"),
    [([1, 2], np.zeros((2, 4))), ([1], np.zeros((2, 4, 1))), ([7], np.zeros((2, 4))), ([1], np.array([[0.0, np.nan], [0.0, 1.0]]))],
)
def test_greedy_invalid(drafts, logits):
    with pytest.raises(ValueError):
        accept_greedy(drafts, logits)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("draft_kind", ["model", "random"])
def test_greedy_speculative_decoding_equals_target_only_decoding(k, draft_kind):
    # Markov "model": logits for the next token are a row of a table keyed by the last token.
    V, n = 16, 200
    rng = np.random.default_rng(11)
    target = rng.normal(size=(V, V))  # [V, V]
    draft = target + rng.normal(size=(V, V))  # [V, V]: agrees with target's argmax only sometimes
    ref = [0]
    while len(ref) < n + 1:
        ref.append(int(target[ref[-1]].argmax()))

    out, accepted = [0], []
    while len(out) < n + 1:
        drafts = []
        for _ in range(k):
            ctx = drafts[-1] if drafts else out[-1]
            drafts.append(int(draft[ctx].argmax()) if draft_kind == "model" else int(rng.integers(V)))
        res = accept_greedy(drafts, target[[out[-1], *drafts]])  # rows score [t_n, d_1..d_k]
        out.extend(res.tokens)
        accepted.append(res.num_accepted)
    assert out[: n + 1] == ref
    if draft_kind == "model":
        assert 0 < sum(accepted)  # some drafts were accepted, so the test exercises acceptance


# ---------------------------------------------------------------- accept_rejection cases


def test_rejection_identical_distributions_accept_everything():
    V, k = 5, 4
    rng = np.random.default_rng(3)
    p = process_logits(rng.normal(size=(k + 1, V)), 1.0, 0, 1.0)  # [k+1, V]
    for seed in range(50):
        r = np.random.default_rng(seed)
        drafts = [sample_token(row, r) for row in p[:k]]
        res = accept_rejection(drafts, p[:k], p, r)
        assert res.num_accepted == k and res.tokens[:k] == tuple(drafts)


def test_rejection_greedy_draft_one_hot_target_accepts_and_bonus_from_last_row():
    V = 6
    p = np.stack([one_hot(2, V), one_hot(5, V), one_hot(1, V)])  # [3, V]
    res = accept_rejection([2, 5], None, p, np.random.default_rng(0))
    assert res == Acceptance(num_accepted=2, tokens=(2, 5, 1))


@pytest.mark.parametrize("greedy_draft", [True, False])
def test_rejection_of_zero_target_prob_draft(greedy_draft):
    V = 4
    p = np.array([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])  # [2, V]; p_1(0) = 0
    q = None if greedy_draft else np.array([[0.7, 0.1, 0.1, 0.1]])
    for seed in range(50):
        res = accept_rejection([0], q, p, np.random.default_rng(seed))
        assert res.num_accepted == 0 and res.tokens[0] in (1, 2)


def test_rejection_middle_reject_keeps_accepted_prefix():
    V = 3
    p = np.stack([one_hot(1, V), one_hot(2, V), np.array([0.0, 0.0, 1.0]), one_hot(0, V)])
    # d_1 = 1 accepted (p = 1), d_2 = 0 rejected (p = 0), correction from residual = one_hot(2).
    res = accept_rejection([1, 0, 2], None, p, np.random.default_rng(0))
    assert res == Acceptance(num_accepted=1, tokens=(1, 2))
    assert all(type(t) is int for t in res.tokens)


def test_rejection_k0_samples_from_first_row():
    p = np.array([[0.0, 0.0, 1.0]])
    rng = CountingRng(0)
    assert accept_rejection([], None, p, rng) == Acceptance(num_accepted=0, tokens=(2,))
    assert rng.draws == 1


def test_rejection_residual_all_zero_falls_back_to_p():
    # q puts slightly more mass on every token than p (rounding), so max(0, p - q) == 0. With u
    # just below 1 the draft is rejected (u * q > p) and the correction must come from p.
    p = np.array([[0.5, 0.5], [0.5, 0.5]])
    q = np.array([[0.5 + 1e-12, 0.5 + 1e-12]])
    res = accept_rejection([1], q, p, FixedRng(1.0 - 1e-15, 0.3))
    assert res == Acceptance(num_accepted=0, tokens=(0,))


@pytest.mark.parametrize("greedy_draft", [True, False])
def test_rejection_fixed_draw_count_and_reproducible(greedy_draft):
    V, k = 6, 3
    tables = np.random.default_rng(5)
    outcomes = set()
    for seed in range(200):
        p = process_logits(tables.normal(size=(k + 1, V)), 1.0, 0, 1.0)  # [k+1, V]
        q = process_logits(tables.normal(size=(k, V)), 1.0, 0, 1.0)  # [k, V]
        drafts = [int(x) for x in tables.integers(V, size=k)]
        qq = None if greedy_draft else q
        rng = CountingRng(seed)
        res = accept_rejection(drafts, qq, p, rng)
        # a accept decisions + (1 reject decision + 1 residual draw) or (1 bonus draw).
        assert rng.draws == (k + 1 if res.num_accepted == k else res.num_accepted + 2)
        assert len(res.tokens) == res.num_accepted + 1
        assert res.tokens[: res.num_accepted] == tuple(drafts[: res.num_accepted])
        assert accept_rejection(drafts, qq, p, np.random.default_rng(seed)) == res
        outcomes.add(res.num_accepted)
    assert outcomes == set(range(k + 1))


@pytest.mark.parametrize(
    ("drafts", "draft_probs", "target_probs"),
    [
        ([0, 1], None, np.full((2, 3), 1 / 3)),  # target needs k+1 rows
        ([0], np.full((2, 3), 1 / 3), np.full((2, 3), 1 / 3)),  # draft needs k rows
        ([0], np.full((1, 4), 1 / 4), np.full((2, 3), 1 / 3)),  # V mismatch
        ([3], None, np.full((2, 3), 1 / 3)),  # token out of range
    ],
)
def test_rejection_invalid(drafts, draft_probs, target_probs):
    with pytest.raises(ValueError):
        accept_rejection(drafts, draft_probs, target_probs, np.random.default_rng(0))


# ---------------------------------------------------------------- distribution preservation

V = 8
START = 0  # last committed token before the first round
N = 20_000

PROCESSING = {  # name -> (temperature, top_k, top_p), applied to both target and draft
    "temp0.7": (0.7, 0, 1.0),
    "topk3_topp0.8": (1.0, 3, 0.8),
}

AcceptFn = Callable[..., Acceptance]  # same signature as accept_rejection


@functools.cache
def tables(processing: str) -> tuple[np.ndarray, np.ndarray]:
    """(P, Q): [V, V] each; row c is target / draft next-token distribution after token c."""
    rng = np.random.default_rng(33)
    target_logits = rng.normal(0.0, 1.5, size=(V, V))
    draft_logits = target_logits + rng.normal(0.0, 1.0, size=(V, V))  # correlated, but different
    T, top_k, top_p = PROCESSING[processing]
    return process_logits(target_logits, T, top_k, top_p), process_logits(draft_logits, T, top_k, top_p)


def always_accept(drafts, draft_probs, target_probs, rng) -> Acceptance:
    """Negative control: trusts the draft blindly (output ~ q, not p)."""
    k = len(drafts)
    return Acceptance(k, tuple(int(d) for d in drafts) + (sample_token(target_probs[k], rng),))


def resample_from_target(drafts, draft_probs, target_probs, rng) -> Acceptance:
    """Negative control: correct accept test, but a rejection resamples from p instead of the residual."""
    for j, d in enumerate(drafts):
        q_d = 1.0 if draft_probs is None else draft_probs[j, d]
        if rng.random() * q_d >= target_probs[j, d]:
            return Acceptance(j, tuple(int(t) for t in drafts[:j]) + (sample_token(target_probs[j], rng),))
    return Acceptance(len(drafts), tuple(int(t) for t in drafts) + (sample_token(target_probs[-1], rng),))


RULES: dict[str, AcceptFn] = {
    "leviathan": accept_rejection,
    "always_accept": always_accept,
    "resample_from_target": resample_from_target,
}


@functools.cache
def simulate(rule: str, processing: str, k: int, greedy_draft: bool) -> tuple[np.ndarray, np.ndarray]:
    """Run N independent generations of 2 tokens from START with speculative rounds.

    Returns (tokens [N, 2], num_accepted of each generation's first round [N]).
    """
    P, Q = tables(processing)
    accept = RULES[rule]
    rng = np.random.default_rng(zlib.crc32(f"{rule}/{processing}/{k}/{greedy_draft}".encode()))  # fixed per config
    tokens = np.empty((N, 2), dtype=np.int64)
    first_a = np.empty(N, dtype=np.int64)
    for i in range(N):
        out: list[int] = []
        last = START
        while len(out) < 2:
            # Draft k tokens autoregressively from q, each conditioned on the previous one.
            drafts: list[int] = []
            for _ in range(k):
                ctx = drafts[-1] if drafts else last
                drafts.append(int(Q[ctx].argmax()) if greedy_draft else sample_token(Q[ctx], rng))
            contexts = [last, *drafts]  # target row j scores the token after contexts[j]
            res = accept(drafts, None if greedy_draft else Q[contexts[:k]], P[contexts], rng)
            if not out:
                first_a[i] = res.num_accepted
            out.extend(res.tokens)
            last = out[-1]
        tokens[i] = out[:2]
    return tokens, first_a


def chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of integer samples to probs; bins with expected < 5 are merged.

    Any sample outside the support of probs is an infinitely bad fit: p-value 0.
    """
    n = len(samples)
    counts = np.bincount(samples, minlength=len(probs))
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    obs, exp = counts[support].astype(np.float64), n * probs[support]
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    if len(obs) < 2:
        return 1.0
    return float(chisquare(obs, exp).pvalue)


def first_marginal(processing: str) -> np.ndarray:
    P, _ = tables(processing)
    return P[START]  # [V]: p(t1 | START)


def second_marginal(processing: str) -> np.ndarray:
    P, _ = tables(processing)
    return P[START] @ P  # [V]: sum_t1 p(t1 | START) p(t2 | t1)


CONFIGS = [
    pytest.param(processing, k, greedy_draft, id=f"{processing}-k{k}-{'greedy' if greedy_draft else 'sampled'}_draft")
    for processing in PROCESSING
    for k in (1, 3)
    for greedy_draft in (True, False)
]


def test_synthetic_model_is_a_meaningful_check():
    # Draft and target must differ enough that a rule ignoring p is caught, neither may be close to
    # one-hot at START (a sampled draft must differ from a greedy one), and top-k/top-p must cut the
    # vocabulary so that q proposes tokens outside p's support and p has tokens q never proposes.
    for processing in PROCESSING:
        P, Q = tables(processing)
        p, q = P[START], Q[START]
        assert 0.25 < 0.5 * np.abs(p - q).sum() < 0.75  # total variation distance
        assert p.max() < 0.7 and q.max() < 0.7
    P, Q = tables("topk3_topp0.8")
    assert ((P > 0).sum(axis=1) <= 3).all() and ((Q > 0).sum(axis=1) <= 3).all()
    assert ((Q[START] > 0) & (P[START] == 0)).any() and ((P[START] > 0) & (Q[START] == 0)).any()


@pytest.mark.parametrize(("processing", "k", "greedy_draft"), CONFIGS)
def test_first_token_has_target_distribution(processing, k, greedy_draft):
    tokens, first_a = simulate("leviathan", processing, k, greedy_draft)
    assert chi2_pvalue(tokens[:, 0], first_marginal(processing)) > 1e-3


@pytest.mark.parametrize(("processing", "k", "greedy_draft"), CONFIGS)
def test_second_token_has_target_distribution(processing, k, greedy_draft):
    tokens, first_a = simulate("leviathan", processing, k, greedy_draft)
    assert chi2_pvalue(tokens[:, 1], second_marginal(processing)) > 1e-3
    # Joint of (t1, t2) too: p(t1 | START) p(t2 | t1) over V*V bins.
    P, _ = tables(processing)
    joint = (P[START][:, None] * P).ravel()  # [V*V]
    assert chi2_pvalue(tokens[:, 0] * V + tokens[:, 1], joint) > 1e-3


@pytest.mark.parametrize(("processing", "k", "greedy_draft"), CONFIGS)
def test_first_draft_acceptance_rate(processing, k, greedy_draft):
    # P(accept d_1) = sum_x min(p(x), q(x)) for a sampled draft, p(argmax q) for a greedy one.
    # Also guards the harness: the rounds must exercise both rejection and acceptance.
    P, Q = tables(processing)
    p, q = P[START], Q[START]
    rate = p[q.argmax()] if greedy_draft else np.minimum(p, q).sum()
    _, first_a = simulate("leviathan", processing, k, greedy_draft)
    assert 0.1 < rate < 0.9
    assert binomtest(int((first_a >= 1).sum()), N, rate).pvalue > 1e-3
    assert set(first_a.tolist()) == set(range(k + 1))  # every outcome a = 0..k occurs


@pytest.mark.parametrize(
    ("rule", "processing", "k", "greedy_draft"),
    [
        ("always_accept", "temp0.7", 3, False),
        ("always_accept", "topk3_topp0.8", 1, True),
        ("resample_from_target", "temp0.7", 1, False),
        ("resample_from_target", "topk3_topp0.8", 3, False),
    ],
)
def test_negative_control_wrong_rules_are_rejected(rule, processing, k, greedy_draft):
    tokens, _ = simulate(rule, processing, k, greedy_draft)
    assert chi2_pvalue(tokens[:, 0], first_marginal(processing)) < 1e-3


# ---------------------------------------------------------------- truncate_at_stop


@pytest.mark.parametrize(
    ("tokens", "stop", "remaining", "expect"),
    [
        ((5, 6, 7), set(), 10, ((5, 6, 7), False)),  # nothing to cut
        ((5, 6, 7), {9}, 3, ((5, 6, 7), False)),  # budget exactly used, no stop
        ((5, 6, 7), {6}, 10, ((5, 6), True)),  # stop token is included
        ((5, 6, 7), {5}, 10, ((5,), True)),  # stop first
        ((5, 6, 7), {7}, 3, ((5, 6, 7), True)),  # stop last, within budget
        ((5, 6, 7), {7, 6}, 10, ((5, 6), True)),  # first stop wins
        ((5, 6, 7), {7}, 2, ((5, 6), False)),  # stop beyond budget does not count
        ((5, 6, 7), {6}, 2, ((5, 6), True)),  # stop at the budget edge counts
        ((5, 6, 7), {5}, 0, ((), False)),  # no budget left
        ((), {5}, 4, ((), False)),
        ([5, 6, 6], frozenset({6}), 10, ((5, 6), True)),
    ],
)
def test_truncate_at_stop(tokens, stop, remaining, expect):
    assert truncate_at_stop(tokens, stop, remaining) == expect


def test_truncate_at_stop_ints_and_invalid():
    kept, stopped = truncate_at_stop(np.array([3, 4, 2]), [2], 5)
    assert kept == (3, 4, 2) and stopped and all(type(t) is int for t in kept)
    with pytest.raises(ValueError):
        truncate_at_stop((1, 2), {2}, -1)
