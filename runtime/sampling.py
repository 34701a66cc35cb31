"""Turning logits into a token: temperature, top-k, top-p and the draw itself.

This module owns the one definition of "the distribution a request samples
from". The draft and the target both call `process_logits` with the request's
sampling parameters, so the draft's q and the target's p used by speculative
acceptance (runtime/acceptance.py) are processed the same way.

It knows nothing about models, KV caches, gRPC or tensor frameworks: inputs
are numpy arrays (a worker converts its framework tensor with `.numpy()`),
all math is float64 numpy, and randomness comes only from the uniforms /
noise the caller passes in (``runtime.random_stream``: a pure function of the
request's seed, the token's position and the draw's purpose), never from
global state.

Shapes: V = vocabulary size; `[..., V]` means any number of leading dims.
"""

from __future__ import annotations

import math

import numpy as np


def process_logits(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """logits [..., V] (any float dtype) -> probs [..., V] float64, rows sum to 1.

    temperature == 0.0 means greedy: one-hot at argmax (ties -> lowest index, like np.argmax).
    Otherwise softmax(logits / temperature), then top-k (top_k <= 0 or >= V means off: keep the
    k largest, ties at the boundary keep by index order), then top-p (top_p >= 1.0 means off:
    keep the smallest set of highest-prob tokens whose cumulative prob >= top_p, always at least
    one), then renormalise. Vectorised over leading dims.

    -inf logits are allowed (masked tokens, prob 0). NaN or +inf logits, a row that is all -inf,
    temperature < 0 and top_p <= 0 raise ValueError.
    """
    x = np.asarray(logits, dtype=np.float64)  # [..., V]
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {x.shape}")
    if not (temperature >= 0.0 and math.isfinite(temperature)):  # also rejects NaN
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if not top_p > 0.0:  # also rejects NaN
        raise ValueError(f"top_p must be > 0 (>= 1 disables it), got {top_p}")
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError("logits contain NaN or +inf")
    m = x.max(axis=-1, keepdims=True)  # [..., 1]
    if np.isneginf(m).any():
        raise ValueError("a row of logits is all -inf: no token can be sampled")
    V = x.shape[-1]

    if temperature == 0.0:
        # Greedy: all mass on argmax (np.argmax returns the lowest index among ties).
        probs = np.zeros_like(x)  # [..., V]
        np.put_along_axis(probs, x.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return probs

    # softmax(x / T) = exp((x - max) / T) / sum(...). Subtracting the max *before* dividing keeps
    # every exponent <= 0 (the max itself gives exp(0) = 1), so nothing overflows even for tiny T
    # or huge logits, and the denominator is >= 1. Masked -inf logits give exp(-inf) = 0. For a
    # tiny T the division may overflow to -inf: that token's prob is 0 in float64 anyway.
    with np.errstate(over="ignore"):
        z = (x - m) / temperature  # [..., V], all <= 0
    e = np.exp(z)  # [..., V]

    if not (0 < top_k < V) and top_p >= 1.0:
        return e / e.sum(axis=-1, keepdims=True)

    # Work in sorted order: `order` lists token ids from most to least likely. Sorting the scaled
    # logits (not the probs) keeps full resolution for near-ties; the stable sort of -z puts equal
    # logits in index order, which is the tie-break top-k asks for.
    order = np.argsort(-z, axis=-1, kind="stable")  # [..., V] token ids, best first
    ps = np.take_along_axis(e, order, axis=-1)  # [..., V] unnormalised probs, descending

    if 0 < top_k < V:
        ps[..., top_k:] = 0.0  # top-k: keep ranks 0..k-1

    if top_p < 1.0:
        # top-p on the distribution left by top-k (renormalised, as in HF / vLLM). Token at rank i
        # is kept iff the mass strictly above it is < top_p: this keeps exactly the shortest prefix
        # whose cumulative prob reaches top_p, and rank 0 (mass above = 0 < top_p) always survives.
        ps = ps / ps.sum(axis=-1, keepdims=True)
        above = np.cumsum(ps, axis=-1) - ps  # [..., V] exclusive cumulative prob
        ps = np.where(above < top_p, ps, 0.0)

    probs = np.empty_like(ps)  # [..., V]
    np.put_along_axis(probs, order, ps / ps.sum(axis=-1, keepdims=True), axis=-1)  # unsort
    return probs


def sample_token(probs: np.ndarray, u: float) -> int:
    """probs [V] -> the token id that the uniform u in [0, 1) selects (inverse CDF).

    Return the first i with cdf[i] > u * cdf[-1]. Scaling u by the total makes rows that sum to 1
    only up to rounding exact, and tokens with prob 0 can never be returned (their cdf equals their
    predecessor's, which would have matched first). For u ~ U[0, 1) the result has distribution
    probs. The caller's u is one counter-based draw (``runtime.random_stream``), so the token is a
    pure function of (probs, seed, position, purpose).
    """
    p = np.asarray(probs, dtype=np.float64)  # [V]
    if p.ndim != 1 or p.shape[0] == 0:
        raise ValueError(f"probs must have shape [V] with V >= 1, got {p.shape}")
    if not 0.0 <= u <= 1.0:  # u == 1 (a float rounded up) is the last token with mass, as below
        raise ValueError(f"u must be in [0, 1], got {u}")
    cdf = np.cumsum(p)  # [V]
    total = cdf[-1]
    if not (np.isfinite(total) and total > 0.0) or (p < 0.0).any():
        raise ValueError("probs must be finite, non-negative and not all zero")
    i = int(np.searchsorted(cdf, u * total, side="right"))
    if i >= p.shape[0]:
        # u * total rounded up to total (u within an ulp of 1): take the last token with mass.
        i = int(np.flatnonzero(p)[-1])
    return i


def coupled_token(probs: np.ndarray, noise: np.ndarray) -> int:
    """probs [..., V], noise [..., V] (i.i.d. standard Gumbel) -> argmax(log probs + noise) ids [...].

    The Gumbel-max trick: for g(v) i.i.d. Gumbel(0, 1), P(argmax_v (log p(v) + g(v)) = x) = p(x)
    exactly. (Write g = -log E with E ~ Exp(1): the argmax is the argmin of E(v) / p(v), and
    E(v) / p(v) ~ Exp(p(v)) independently, so the smallest is x with prob p(x) / sum p = p(x).)
    Tokens with p = 0 (top-k / top-p cut, masked) have log p = -inf and are never chosen.
    Temperature / top-k / top-p are already in probs (``process_logits``), so the noise perturbs
    the request's own distribution. Coupled speculation feeds the same noise at a position to the
    draft (log q) and to the target (log p): the target's choice depends only on p and the noise,
    never on the draft, which is what makes speculative output equal target-only output.
    Ties (probability 0 for continuous noise) go to the lowest index, as np.argmax.
    Returns an int for 1-D input, an int64 array otherwise.
    """
    p = np.asarray(probs, dtype=np.float64)
    g = np.asarray(noise, dtype=np.float64)
    if p.shape != g.shape or p.ndim < 1 or p.shape[-1] == 0:
        raise ValueError(f"probs and noise must have one shape [..., V], got {p.shape} and {g.shape}")
    with np.errstate(divide="ignore"):
        score = np.log(p) + g  # [..., V]; -inf where p == 0
    best = score.argmax(axis=-1)
    return int(best) if p.ndim == 1 else best.astype(np.int64)


def greedy_token(logits: np.ndarray) -> int:
    """logits [V] -> argmax token id (ties -> lowest index)."""
    x = np.asarray(logits)  # [V]
    if x.ndim != 1 or x.shape[0] == 0:
        raise ValueError(f"logits must have shape [V] with V >= 1, got {x.shape}")
    if np.isnan(x).any():
        raise ValueError("logits contain NaN")
    return int(x.argmax())
