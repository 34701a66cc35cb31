"""Unit tests for runtime/sampling.py: logits processing and token draws."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from runtime.sampling import greedy_token, process_logits, sample_token


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ---------------------------------------------------------------- process_logits


def test_temperature_one_is_softmax():
    logits = np.array([1.0, 2.0, 0.5, -1.0])
    np.testing.assert_allclose(process_logits(logits, 1.0, 0, 1.0), softmax(logits), rtol=1e-12)


@pytest.mark.parametrize("temperature", [0.25, 0.7, 2.0])
def test_temperature_scales_logits(temperature):
    logits = np.array([1.0, 2.0, 0.5, -1.0, 3.0])
    probs = process_logits(logits, temperature, 0, 1.0)
    np.testing.assert_allclose(probs, softmax(logits / temperature), rtol=1e-12)
    # Lower temperature sharpens: the top token gains mass relative to T = 1.
    assert (probs[4] > softmax(logits)[4]) == (temperature < 1.0)


def test_extreme_logits_and_tiny_temperature_are_finite():
    logits = np.array([1e4, -1e4, 9999.0, 0.0])
    probs = process_logits(logits, 1.0, 0, 1.0)
    assert np.isfinite(probs).all()
    np.testing.assert_allclose(probs, softmax(logits), rtol=1e-12)
    # T -> 0+ approaches greedy without overflow (30 / 1e-308 alone would be inf, and inf - inf NaN).
    probs = process_logits(np.array([30.0, 10.0, 20.0]), 1e-308, 0, 1.0)
    np.testing.assert_array_equal(probs, [1.0, 0.0, 0.0])


def test_neg_inf_logits_are_masked_tokens():
    logits = np.array([1.0, -np.inf, 2.0, -np.inf])
    probs = process_logits(logits, 1.0, 0, 1.0)
    np.testing.assert_array_equal(probs[[1, 3]], 0.0)
    np.testing.assert_allclose(probs[[0, 2]], softmax(np.array([1.0, 2.0])), rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_any_float_dtype_gives_float64(dtype):
    logits = np.array([0.5, 1.5, -0.5], dtype=dtype)
    probs = process_logits(logits, 0.8, 0, 1.0)
    assert probs.dtype == np.float64
    np.testing.assert_allclose(probs, softmax(logits.astype(np.float64) / 0.8), rtol=1e-12)


def test_greedy_is_one_hot_at_argmax_lowest_index_on_ties():
    probs = process_logits(np.array([1.0, 3.0, 2.0, 3.0]), 0.0, 0, 1.0)
    np.testing.assert_array_equal(probs, [0.0, 1.0, 0.0, 0.0])
    # top-k / top-p do not change a one-hot.
    np.testing.assert_array_equal(process_logits(np.array([1.0, 3.0, 2.0, 3.0]), 0.0, 2, 0.5), probs)
    batch = process_logits(np.array([[5.0, 1.0, 5.0], [0.0, 0.0, 1.0]]), 0.0, 0, 1.0)
    np.testing.assert_array_equal(batch, [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])


def test_top_k_keeps_k_largest_renormalised():
    logits = np.array([0.1, 2.0, -1.0, 1.5, 0.7, 3.0])
    probs = process_logits(logits, 1.0, 3, 1.0)
    keep = [1, 3, 5]
    np.testing.assert_array_equal(np.flatnonzero(probs), keep)
    np.testing.assert_allclose(probs[keep], softmax(logits[keep]), rtol=1e-12)


def test_top_k_ties_at_boundary_keep_lowest_indices():
    logits = np.array([0.0, 2.0, 1.0, 2.0, 2.0])
    probs = process_logits(logits, 1.0, 2, 1.0)
    np.testing.assert_array_equal(np.flatnonzero(probs), [1, 3])
    np.testing.assert_allclose(probs[[1, 3]], [0.5, 0.5])
    # Same on a vocabulary large enough that an unstable sort would scramble equal entries.
    rng = np.random.default_rng(0)
    logits = np.zeros(300)
    idx = rng.permutation(300)
    logits[idx[:5]] = 2.0  # 5 clear winners
    logits[idx[5:105]] = 1.0  # 100 tied for the remaining 15 places
    probs = process_logits(np.stack([logits, logits]), 1.0, 20, 1.0)
    expect = np.sort(np.concatenate([idx[:5], np.sort(idx[5:105])[:15]]))
    np.testing.assert_array_equal(np.flatnonzero(probs[0]), expect)
    np.testing.assert_array_equal(probs[1], probs[0])
    # top-p over a flat distribution also keeps the lowest indices: 0.051 of 300 -> 16 tokens.
    probs = process_logits(np.zeros(300), 1.0, 0, 0.051)
    np.testing.assert_array_equal(np.flatnonzero(probs), np.arange(16))


@pytest.mark.parametrize("top_k", [0, -1, 5, 100])
def test_top_k_off(top_k):
    logits = np.array([0.1, 2.0, -1.0, 1.5, 0.7])
    np.testing.assert_allclose(process_logits(logits, 1.0, top_k, 1.0), softmax(logits), rtol=1e-12)


@pytest.mark.parametrize(
    ("top_p", "keep"),
    [
        (1e-9, [2]),  # always at least the top token
        (0.4, [2]),  # 0.5 >= 0.4
        (0.75, [2, 0]),  # 0.5 < 0.75 <= 0.8
        (0.9, [2, 0, 3]),  # 0.8 < 0.9 <= 0.95
        (0.99, [2, 0, 3, 1]),
        (1.0, [2, 0, 3, 1]),  # off
        (1.5, [2, 0, 3, 1]),  # off
    ],
)
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p, keep):
    base = np.array([0.3, 0.05, 0.5, 0.15])
    probs = process_logits(np.log(base), 1.0, 0, top_p)
    np.testing.assert_array_equal(np.flatnonzero(probs), sorted(keep))
    np.testing.assert_allclose(probs[keep], base[keep] / base[keep].sum(), rtol=1e-12)


def test_top_p_applies_to_distribution_left_by_top_k():
    # top-k = 2 leaves {0.5, 0.3} -> renormalised {0.625, 0.375}. top_p = 0.6 then keeps only the
    # first (0.625 >= 0.6); on the un-renormalised probs it would have needed two (0.5 < 0.6).
    base = np.array([0.3, 0.05, 0.5, 0.15])
    probs = process_logits(np.log(base), 1.0, 2, 0.6)
    np.testing.assert_array_equal(probs, [0.0, 0.0, 1.0, 0.0])
    probs = process_logits(np.log(base), 1.0, 2, 0.7)
    np.testing.assert_allclose(probs, [0.375, 0.0, 0.625, 0.0], rtol=1e-12)


def test_temperature_then_top_k_then_top_p():
    logits = np.array([2.0, 1.0, 0.0, -1.0, 0.5])
    t = 0.5
    full = softmax(logits / t)  # ordered by logits: 0, 1, 4, 2, 3
    topk = np.where(np.isin(np.arange(5), [0, 1, 4]), full, 0.0)
    topk /= topk.sum()
    top_p = topk[0] + 0.5 * topk[1]  # reached inside the second token -> keep {0, 1}
    expect = np.where(np.isin(np.arange(5), [0, 1]), topk, 0.0)
    np.testing.assert_allclose(process_logits(logits, t, 3, top_p), expect / expect.sum(), rtol=1e-12)


def test_batched_over_leading_dims_matches_rows():
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 2.0, size=(2, 3, 11)).astype(np.float32)
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.6), (0.9, 5, 0.8), (0.0, 0, 1.0)]:
        probs = process_logits(logits, temperature, top_k, top_p)
        assert probs.shape == (2, 3, 11) and probs.dtype == np.float64
        np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=0, atol=1e-12)
        assert (probs >= 0).all()
        for i in range(2):
            for j in range(3):
                np.testing.assert_array_equal(probs[i, j], process_logits(logits[i, j], temperature, top_k, top_p))
        if top_k > 0:
            assert ((probs > 0).sum(axis=-1) <= top_k).all()


def test_rows_sum_to_one_random_settings():
    rng = np.random.default_rng(1)
    for _ in range(50):
        V = int(rng.integers(1, 40))
        logits = rng.normal(0.0, 3.0, size=(4, V))
        probs = process_logits(logits, float(rng.uniform(0.05, 3.0)), int(rng.integers(-1, V + 2)), float(rng.uniform(0.01, 1.2)))
        np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=0, atol=1e-12)
        assert (probs >= 0).all() and ((probs > 0).sum(axis=-1) >= 1).all()
        # Filtering never keeps a token while dropping a more likely one.
        for row, lg in zip(probs, logits):
            kept = row > 0
            assert lg[kept].min() >= lg[~kept].max(initial=-np.inf)


@pytest.mark.parametrize(
    "logits",
    [
        np.array([0.0, np.nan, 1.0]),
        np.array([[0.0, 1.0], [np.nan, 0.0]]),
        np.array([0.0, np.inf, 1.0]),
        np.array([-np.inf, -np.inf]),
        np.array(1.0),
        np.zeros((3, 0)),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_invalid_logits_raise(logits, temperature):
    with pytest.raises(ValueError):
        process_logits(logits, temperature, 0, 1.0)


@pytest.mark.parametrize(("temperature", "top_p"), [(-0.1, 1.0), (np.nan, 1.0), (np.inf, 1.0), (1.0, 0.0), (1.0, -0.5), (1.0, np.nan)])
def test_invalid_params_raise(temperature, top_p):
    with pytest.raises(ValueError):
        process_logits(np.array([0.0, 1.0]), temperature, 0, top_p)


# ---------------------------------------------------------------- sample_token / greedy_token


def test_sample_token_matches_distribution():
    probs = np.array([0.1, 0.0, 0.4, 0.2, 0.0, 0.3])
    rng = np.random.default_rng(123)
    n = 20_000
    samples = np.array([sample_token(probs, u) for u in rng.random(n)])
    counts = np.bincount(samples, minlength=6)
    assert counts[[1, 4]].sum() == 0  # zero-prob tokens never drawn
    keep = probs > 0
    assert chisquare(counts[keep], n * probs[keep]).pvalue > 1e-3


def test_sample_token_with_counter_draws_matches_distribution():
    # The engines' draws: one request, one counter-based uniform per position.
    from runtime import random_stream as rs

    probs = np.array([0.1, 0.0, 0.4, 0.2, 0.0, 0.3])
    n = 20_000
    samples = np.array([sample_token(probs, u) for u in rs.uniforms(99, np.arange(n), rs.PURPOSE_SAMPLE)])
    counts = np.bincount(samples, minlength=6)
    assert counts[[1, 4]].sum() == 0
    keep = probs > 0
    assert chisquare(counts[keep], n * probs[keep]).pvalue > 1e-3


def test_coupled_token_matches_distribution_and_respects_support():
    from runtime import random_stream as rs
    from runtime.sampling import coupled_token

    probs = np.array([0.1, 0.0, 0.4, 0.2, 0.0, 0.3])
    n = 20_000
    noise = rs.gumbel(5, np.arange(n), 6)                                 # [n, V]
    samples = coupled_token(np.broadcast_to(probs, (n, 6)), noise)
    counts = np.bincount(samples, minlength=6)
    assert counts[[1, 4]].sum() == 0
    keep = probs > 0
    assert chisquare(counts[keep], n * probs[keep]).pvalue > 1e-3
    # Negative control: the noise of one position reused for every draw is no sample at all.
    assert len(set(coupled_token(np.broadcast_to(probs, (n, 6)), np.broadcast_to(noise[0], (n, 6))).tolist())) == 1
    with pytest.raises(ValueError):
        coupled_token(probs, noise[0, :5])


def test_sample_token_inverse_cdf_edges():
    probs = np.array([0.0, 0.25, 0.0, 0.75, 0.0, 0.0])
    assert sample_token(probs, 0.0) == 1
    assert sample_token(probs, 0.2499) == 1
    assert sample_token(probs, 0.25) == 3
    # u within an ulp of 1 never lands on the zero-prob tail.
    assert sample_token(probs, np.nextafter(1.0, 0.0)) == 3
    # Unnormalised rows are fine: u is scaled by the total.
    assert sample_token(np.array([2.0, 6.0]), 0.26) == 1
    assert sample_token(np.array([1.0]), 0.9) == 0


@pytest.mark.parametrize("probs", [np.zeros(3), np.array([0.5, -0.1, 0.6]), np.array([0.5, np.nan]), np.zeros((2, 2)), np.zeros(0)])
def test_sample_token_invalid(probs):
    with pytest.raises(ValueError):
        sample_token(probs, 0.5)
    with pytest.raises(ValueError):
        sample_token(np.array([0.5, 0.5]), 1.5)


def test_greedy_token():
    assert greedy_token(np.array([0.1, 3.0, -2.0, 3.0])) == 1
    assert isinstance(greedy_token(np.array([0.1, 3.0], dtype=np.float32)), int)
    with pytest.raises(ValueError):
        greedy_token(np.array([0.1, np.nan]))
    with pytest.raises(ValueError):
        greedy_token(np.zeros((2, 2)))
