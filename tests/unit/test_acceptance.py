"""Unit tests for runtime/acceptance.py.

Besides the case tests, the statistical tests check the property speculative decoding exists for:
emitted tokens have exactly the target's distribution. A tiny synthetic "language model" (V = 8,
next-token distribution keyed by the last token, from a seeded random table) plays target p and a
different draft q; whole rounds are simulated (draft k tokens autoregressively from q, verify with
p, emit, continue from the new context) until two tokens exist, and the first / second emitted
tokens are compared with p's marginals by a chi-square test with fixed seeds (deterministic). Buggy
acceptance rules run through the same harness must fail the same test, showing it has power.

The harness draws its randomness the way the engines do (runtime.random_stream): generation i has
seed i, and every draw is keyed by the absolute position of the token it decides, so a position a
round re-drafts after a rejection reuses its draft draw. Both speculative sampling modes run
through it: rejection (Leviathan) and coupled (Gumbel-max with the draft's noise shared).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from scipy.stats import binomtest, chisquare

from runtime import random_stream as rs
from runtime.acceptance import (Acceptance, accept_coupled, accept_greedy, accept_greedy_ids, accept_rejection,
                                accepted_greedy_rows, truncate_at_stop)
from runtime.sampling import coupled_token, process_logits, sample_token


def draws(seed: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(u_accept [k], u_token [k+1]) of a round whose row 0 decides position 1."""
    pos = 1 + np.arange(k + 1)
    return rs.uniforms(seed, pos[:k], rs.PURPOSE_ACCEPT), rs.uniforms(seed, pos, rs.PURPOSE_SAMPLE)


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


@pytest.mark.parametrize("seed", range(8))
def test_greedy_rows_of_a_batch_accept_what_each_row_accepts_alone(seed):
    """``accepted_greedy_rows`` (the target's batched rule) against ``accept_greedy_ids`` per row:
    ragged k (0 included), drafts that mostly match, junk past each row's k."""
    rng = np.random.default_rng(seed)
    b, kmax, v = int(rng.integers(1, 10)), int(rng.integers(0, 5)), 6
    best = rng.integers(0, v, (b, kmax + 1 + int(rng.integers(0, 2))))      # [B, W >= K+1]
    ks = rng.integers(0, kmax + 1, b)
    drafts = rng.integers(0, v, (b, kmax))
    agree = rng.random((b, kmax)) < 0.7
    drafts[agree] = best[:, :kmax][agree]                                  # mostly accepted prefixes
    a = accepted_greedy_rows(drafts, ks, best)
    for i in range(b):
        want = accept_greedy_ids(drafts[i, : ks[i]].tolist(), best[i, : ks[i] + 1])
        assert int(a[i]) == want.num_accepted
        assert tuple(best[i, : a[i] + 1].tolist()) == want.tokens
    assert a.dtype == np.int64 and a.shape == (b,)


# ---------------------------------------------------------------- accept_rejection cases


def test_rejection_identical_distributions_accept_everything():
    V, k = 5, 4
    rng = np.random.default_rng(3)
    p = process_logits(rng.normal(size=(k + 1, V)), 1.0, 0, 1.0)  # [k+1, V]
    for seed in range(50):
        drafts = [sample_token(row, rs.uniform(seed, 1 + j, rs.PURPOSE_DRAFT)) for j, row in enumerate(p[:k])]
        res = accept_rejection(drafts, p[:k], p, *draws(seed, k))
        assert res.num_accepted == k and res.tokens[:k] == tuple(drafts)


def test_rejection_greedy_draft_one_hot_target_accepts_and_bonus_from_last_row():
    V = 6
    p = np.stack([one_hot(2, V), one_hot(5, V), one_hot(1, V)])  # [3, V]
    res = accept_rejection([2, 5], None, p, *draws(0, 2))
    assert res == Acceptance(num_accepted=2, tokens=(2, 5, 1))


@pytest.mark.parametrize("greedy_draft", [True, False])
def test_rejection_of_zero_target_prob_draft(greedy_draft):
    V = 4
    p = np.array([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])  # [2, V]; p_1(0) = 0
    q = None if greedy_draft else np.array([[0.7, 0.1, 0.1, 0.1]])
    for seed in range(50):
        res = accept_rejection([0], q, p, *draws(seed, 1))
        assert res.num_accepted == 0 and res.tokens[0] in (1, 2)


def test_rejection_middle_reject_keeps_accepted_prefix():
    V = 3
    p = np.stack([one_hot(1, V), one_hot(2, V), np.array([0.0, 0.0, 1.0]), one_hot(0, V)])
    # d_1 = 1 accepted (p = 1), d_2 = 0 rejected (p = 0), correction from residual = one_hot(2).
    res = accept_rejection([1, 0, 2], None, p, *draws(0, 3))
    assert res == Acceptance(num_accepted=1, tokens=(1, 2))
    assert all(type(t) is int for t in res.tokens)


def test_rejection_k0_samples_from_first_row():
    p = np.array([[0.0, 0.0, 1.0]])
    assert accept_rejection([], None, p, [], [0.3]) == Acceptance(num_accepted=0, tokens=(2,))
    p = np.array([[0.5, 0.0, 0.5]])
    assert accept_rejection([], None, p, [], [0.3]).tokens == (0,)
    assert accept_rejection([], None, p, [], [0.7]).tokens == (2,)


def test_rejection_residual_all_zero_falls_back_to_p():
    # q puts slightly more mass on every token than p (rounding), so max(0, p - q) == 0. With u
    # just below 1 the draft is rejected (u * q > p) and the correction must come from p.
    p = np.array([[0.5, 0.5], [0.5, 0.5]])
    q = np.array([[0.5 + 1e-12, 0.5 + 1e-12]])
    res = accept_rejection([1], q, p, [1.0 - 1e-15], [0.3, 0.9])
    assert res == Acceptance(num_accepted=0, tokens=(0,))


@pytest.mark.parametrize("greedy_draft", [True, False])
def test_rejection_uses_its_rows_draws_only_and_is_reproducible(greedy_draft):
    V, k = 6, 3
    tables = np.random.default_rng(5)
    outcomes = set()
    for seed in range(200):
        p = process_logits(tables.normal(size=(k + 1, V)), 1.0, 0, 1.0)  # [k+1, V]
        q = process_logits(tables.normal(size=(k, V)), 1.0, 0, 1.0)  # [k, V]
        drafts = [int(x) for x in tables.integers(V, size=k)]
        qq = None if greedy_draft else q
        ua, ut = draws(seed, k)
        res = accept_rejection(drafts, qq, p, ua, ut)
        a = res.num_accepted
        assert len(res.tokens) == a + 1
        assert res.tokens[:a] == tuple(drafts[:a])
        assert accept_rejection(drafts, qq, p, ua.copy(), ut.copy()) == res
        # Draws of rows past the deciding one (decisions after a rejection, tokens of other rows)
        # cannot matter: replace them and the result stays.
        ua2, ut2 = ua.copy(), np.full_like(ut, 0.999)
        ua2[a + 1:] = 0.0
        ut2[a] = ut[a]
        assert accept_rejection(drafts, qq, p, ua2, ut2) == res
        outcomes.add(a)
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
        accept_rejection(drafts, draft_probs, target_probs, *draws(0, len(drafts)))
    with pytest.raises(ValueError):  # uniforms of the wrong shape
        accept_rejection([0], None, np.full((2, 3), 1 / 3), [0.5, 0.5], [0.5, 0.5])


# ---------------------------------------------------------------- accept_coupled cases


def test_coupled_emits_the_targets_choices_whatever_the_draft():
    V, k = 7, 4
    rng = np.random.default_rng(8)
    for seed in range(100):
        p = process_logits(rng.normal(size=(k + 1, V)), 1.0, 0, 1.0)  # [k+1, V]
        noise = np.stack([rs.gumbel(seed, 1 + j, V) for j in range(k + 1)])
        choice = [int(np.argmax(np.log(p[j]) + noise[j])) for j in range(k + 1)]
        drafts = [c if rng.random() < 0.7 else int(rng.integers(V)) for c in choice[:k]]
        res = accept_coupled(drafts, p, noise)
        a = res.num_accepted
        assert res.tokens == tuple(choice[: a + 1])                 # always the target's own choices
        assert a == k or drafts[a] != choice[a]
        assert drafts[:a] == choice[:a]
        # Target-only (k = 0) at each position gives the same token.
        assert all(accept_coupled([], p[j: j + 1], noise[j: j + 1]).tokens == (choice[j],) for j in range(a + 1))


def test_coupled_never_picks_a_cut_token():
    p = np.array([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    for seed in range(50):
        noise = np.stack([rs.gumbel(seed, 1 + j, 3) for j in range(2)])
        res = accept_coupled([0], p, noise)
        assert res.num_accepted == 0 and res.tokens == (1,)
        assert accept_coupled([1], p, noise).tokens[1] in (0, 2)


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


def always_accept(drafts, draft_probs, target_probs, u_accept, u_token) -> Acceptance:
    """Negative control: trusts the draft blindly (output ~ q, not p)."""
    k = len(drafts)
    return Acceptance(k, tuple(int(d) for d in drafts) + (sample_token(target_probs[k], u_token[k]),))


def resample_from_target(drafts, draft_probs, target_probs, u_accept, u_token) -> Acceptance:
    """Negative control: correct accept test, but a rejection resamples from p instead of the residual."""
    for j, d in enumerate(drafts):
        q_d = 1.0 if draft_probs is None else draft_probs[j, d]
        if u_accept[j] * q_d >= target_probs[j, d]:
            return Acceptance(j, tuple(int(t) for t in drafts[:j]) + (sample_token(target_probs[j], u_token[j]),))
    return Acceptance(len(drafts), tuple(int(t) for t in drafts) + (sample_token(target_probs[-1], u_token[-1]),))


def coupled_draft_decides(drafts, draft_probs, target_probs, u_accept, u_token, noise=None) -> Acceptance:
    """Negative control (coupled): accepts the draft's noisy choice without comparing it with the
    target's (output ~ q, not p); the bonus is the target's choice."""
    k = len(drafts)
    return Acceptance(k, tuple(int(d) for d in drafts) + (coupled_token(target_probs[k], noise[k]),))


RULES: dict[str, AcceptFn] = {
    "leviathan": accept_rejection,
    "always_accept": always_accept,
    "resample_from_target": resample_from_target,
    "coupled": lambda drafts, q, p, ua, ut, noise=None: accept_coupled(drafts, p, noise),
    "coupled_draft_decides": coupled_draft_decides,
}
COUPLED_RULES = ("coupled", "coupled_draft_decides")


@functools.cache
def simulate(rule: str, processing: str, k: int, greedy_draft: bool) -> tuple[np.ndarray, np.ndarray]:
    """Run N independent generations of 2 tokens from START with speculative rounds.

    Returns (tokens [N, 2], num_accepted of each generation's first round [N]).
    """
    P, Q = tables(processing)
    accept = RULES[rule]
    coupled = rule in COUPLED_RULES
    base = zlib.crc32(f"{rule}/{processing}/{k}/{greedy_draft}".encode()) << 20  # fixed per config
    # Every draw a generation can use, computed up front (generation i has seed base + i; a round
    # starting with m tokens out decides positions m+1..m+1+k, m <= 1): [N, k+3] (noise [N, k+3, V]).
    seeds, all_pos = base + np.arange(N)[:, None], np.arange(k + 3)[None, :]
    UA, UT, UD = (rs.uniforms(seeds, all_pos, purpose) for purpose in (rs.PURPOSE_ACCEPT, rs.PURPOSE_SAMPLE,
                                                                      rs.PURPOSE_DRAFT))
    G = rs.gumbel(seeds, all_pos, V) if coupled else None
    tokens = np.empty((N, 2), dtype=np.int64)
    first_a = np.empty(N, dtype=np.int64)
    for i in range(N):
        out: list[int] = []
        last = START                                      # at position 0; out[m] is at position m + 1
        while len(out) < 2:
            pos = slice(len(out) + 1, len(out) + 2 + k)   # positions the round's rows decide
            noise = G[i, pos] if coupled else None
            # Draft k tokens autoregressively from q, each conditioned on the previous one, with the
            # draws of its own position (coupled: the target's noise there).
            drafts: list[int] = []
            for j in range(k):
                ctx = drafts[-1] if drafts else last
                if coupled:
                    drafts.append(coupled_token(Q[ctx], noise[j]))
                elif greedy_draft:
                    drafts.append(int(Q[ctx].argmax()))
                else:
                    drafts.append(sample_token(Q[ctx], UD[i, len(out) + 1 + j]))
            contexts = [last, *drafts]  # target row j scores the token after contexts[j]
            ua, ut = UA[i, pos][:k], UT[i, pos]
            q_rows = None if (greedy_draft or coupled) else Q[contexts[:k]]
            if coupled:
                res = accept(drafts, q_rows, P[contexts], ua, ut, noise=noise)
            else:
                res = accept(drafts, q_rows, P[contexts], ua, ut)
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


COUPLED_CONFIGS = [pytest.param(processing, k, id=f"{processing}-k{k}") for processing in PROCESSING for k in (1, 3)]


@pytest.mark.parametrize(("processing", "k"), COUPLED_CONFIGS)
def test_coupled_tokens_have_target_distribution(processing, k):
    tokens, first_a = simulate("coupled", processing, k, False)
    P, _ = tables(processing)
    assert chi2_pvalue(tokens[:, 0], first_marginal(processing)) > 1e-3
    assert chi2_pvalue(tokens[:, 1], second_marginal(processing)) > 1e-3
    assert chi2_pvalue(tokens[:, 0] * V + tokens[:, 1], (P[START][:, None] * P).ravel()) > 1e-3
    assert set(first_a.tolist()) == set(range(k + 1))  # the draft is exercised: every a = 0..k occurs


@pytest.mark.parametrize("processing", list(PROCESSING))
def test_coupled_tokens_equal_target_only_tokens(processing):
    # Same seeds: k = 0 (target-only: every round decides one position), k = 1 and k = 3 give
    # the very same tokens, though the draft (which differs from the target) is often rejected.
    alone, k1, k3 = _same_seed_runs(processing, (0, 1, 3))
    assert np.array_equal(alone, k1) and np.array_equal(alone, k3)
    assert len({tuple(r) for r in alone}) >= 6                     # and they are random, not fixed


def _same_seed_runs(processing: str, ks: tuple[int, ...]) -> list[np.ndarray]:
    """Two-token coupled generations with seeds 0..999 for each k in ks -> [1000, 2] each."""
    P, Q = tables(processing)
    noise_all = rs.gumbel(np.arange(1000)[:, None], np.arange(max(ks) + 3)[None, :], V)   # [1000, pos, V]
    runs = []
    for k in ks:
        out_k = np.empty((1000, 2), dtype=np.int64)
        for seed in range(1000):
            out: list[int] = []
            while len(out) < 2:
                noise = noise_all[seed, len(out) + 1: len(out) + 2 + k]
                last = out[-1] if out else START
                drafts: list[int] = []
                for j in range(k):
                    drafts.append(coupled_token(Q[drafts[-1] if drafts else last], noise[j]))
                out.extend(accept_coupled(drafts, P[[last, *drafts]], noise).tokens)
            out_k[seed] = out[:2]
        runs.append(out_k)
    return runs


def test_coupled_acceptance_rate_matches_the_gumbel_coupling():
    # P(accept d_1) = P(argmax(log q + g) == argmax(log p + g)): at least sum_x min(p, q)'s
    # maximal-coupling bound is not promised, but it must be well inside (0, 1) and far above the
    # independent-draw rate sum_x p(x) q(x).
    P, Q = tables("temp0.7")
    _, first_a = simulate("coupled", "temp0.7", 1, False)
    rate = (first_a >= 1).mean()
    assert 0.1 < rate < 0.95
    assert rate > float(P[START] @ Q[START]) + 0.05


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
        ("coupled_draft_decides", "temp0.7", 1, False),
        ("coupled_draft_decides", "topk3_topp0.8", 3, False),
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
