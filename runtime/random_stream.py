"""Counter-based randomness: every draw is a pure function of (seed, position, purpose, index).

Owns: the one definition of a request's random numbers. A uniform is not the
next value of a generator that advances as the request runs; it is a hash of
what it is for:

    u(seed, position, purpose, index) in (0, 1)

  * ``seed``     the request's seed, an integer in [0, 2^63);
  * ``position`` the absolute index, in prompt + output, of the token the draw
                 decides (the prompt's n tokens are positions 0..n-1; the first
                 generated token is position n);
  * ``purpose``  which decision at that position (the PURPOSE_* constants);
  * ``index``    0 for a scalar draw, the vocabulary id v for the per-token
                 Gumbel noise of the coupled mode.

So a seeded request gets the same numbers whatever it is batched with, however
many rounds or drafts decided the earlier tokens, and after a RECOMPUTE resume
that re-runs prefill (no generator state to lose or to replay).

Must not know: models, engines, tensor frameworks. The Torch twin
(``runtime.backends.torch_sampling.gumbel_rows``) repeats the same integer
operations on int64 tensors; ``tests/unit/test_random_stream.py`` requires the
two to give bit-identical uniforms.

The hash (all arithmetic mod 2^64; `>>` is the logical shift):

    mix(x)  = splitmix64's finaliser:  x ^= x >> 30; x *= M1; x ^= x >> 27; x *= M2; x ^= x >> 31
    h_seed  = mix(seed + G)
    h_draw  = mix(h_seed ^ (position * 8 + purpose))
    bits    = mix(h_draw + (index + 1) * G)
    u       = ((bits >> 12) + 0.5) * 2^-52

with G = 0x9E3779B97F4A7C15 (odd), M1 = 0xBF58476D1CE4E5B9, M2 = 0x94D049BB133111EB.
``mix`` is a bijection on 64-bit integers (xor-shifts and multiplications by
odd constants are invertible), so distinct (position, purpose) give distinct
h_draw for one seed, and distinct indices distinct bits for one h_draw; its
avalanche makes the uniforms statistically independent for our purposes
(splitmix64 passes BigCrush). ``u`` uses the top 52 bits: ``m + 0.5`` with
m < 2^52 is exact in float64, so u is exactly representable, lies strictly in
(0, 1) (never 0, so -log(u) is finite and positive), and numpy and Torch
compute the same double.
"""

from __future__ import annotations

import secrets

import numpy as np

G = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
PURPOSE_BITS = 3                         # position * 8 + purpose: purposes are 0..7
SCALE = 2.0 ** -52

# Purposes. A position is emitted once, so each (position, purpose) draw is used at most once
# for an emitted token; the draft's own draws have a purpose of their own.
PURPOSE_SAMPLE = 0    # the target's inverse-CDF draw of the token at a position (target-only, prefill,
                      # bonus, and the correction after a rejection: one of them per emitted position)
PURPOSE_ACCEPT = 1    # rejection sampling's accept/reject decision of the draft token at a position
PURPOSE_DRAFT = 2     # the draft's inverse-CDF draw of its proposal at a position (draft_sampling)
PURPOSE_GUMBEL = 3    # coupled mode: Gumbel noise g(v) = -log(-log u(.., v)) over the vocabulary,
                      # the same for the draft and the target

MAX_POSITION = 1 << 40   # positions are far below this; position * 8 + purpose stays < 2^43


def fresh_seed() -> int:
    """A random seed in [0, 2^63) for a request that gave none (chosen once per request)."""
    return secrets.randbits(63)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 [...] (numpy wraps uint64 arithmetic mod 2^64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(M1)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(M2)
    return x ^ (x >> np.uint64(31))


def draw_keys(seed, position, purpose: int) -> np.ndarray:
    """h_draw for seeds / positions (broadcast together) -> uint64 [...]."""
    s = np.atleast_1d(np.asarray(seed, dtype=np.int64)).astype(np.uint64)
    p = np.atleast_1d(np.asarray(position, dtype=np.int64))
    if (p < 0).any() or (p >= MAX_POSITION).any():
        raise ValueError(f"position must be in [0, 2^40), got {p}")
    if not 0 <= purpose < (1 << PURPOSE_BITS):
        raise ValueError(f"purpose must be in [0, 8), got {purpose}")
    with np.errstate(over="ignore"):
        h = _mix(s + np.uint64(G))
        return _mix(h ^ ((p.astype(np.uint64) << np.uint64(PURPOSE_BITS)) | np.uint64(purpose)))


def _to_unit(bits: np.ndarray) -> np.ndarray:
    return ((bits >> np.uint64(12)).astype(np.float64) + 0.5) * SCALE


def uniforms(seed, positions, purpose: int) -> np.ndarray:
    """Scalar draws (index 0): seeds and positions broadcast together -> float64 [...] in (0, 1)."""
    keys = draw_keys(seed, positions, purpose)
    with np.errstate(over="ignore"):
        bits = _mix(keys + np.uint64(G))                                  # index 0: (0 + 1) * G
    return _to_unit(bits).reshape(np.broadcast_shapes(np.shape(seed), np.shape(positions)))


def uniform(seed: int, position: int, purpose: int) -> float:
    """One scalar draw."""
    return float(uniforms(seed, position, purpose))


def gumbel_uniforms(seed, position, vocab_size: int) -> np.ndarray:
    """u(seed, position, PURPOSE_GUMBEL, v) for v in [0, V); seeds and positions broadcast together
    -> float64 [..., V] in (0, 1)."""
    shape = np.broadcast_shapes(np.shape(seed), np.shape(position))
    key = draw_keys(seed, position, PURPOSE_GUMBEL).reshape(shape + (1,))  # [..., 1]
    idx = np.arange(1, vocab_size + 1, dtype=np.uint64)                  # index + 1
    with np.errstate(over="ignore"):
        bits = _mix(key + idx * np.uint64(G))                            # [..., V]
    return _to_unit(bits)


def gumbel(seed, position, vocab_size: int) -> np.ndarray:
    """The coupled mode's noise: g [..., V] float64, g(v) = -log(-log u(seed, position,
    PURPOSE_GUMBEL, v)), i.i.d. standard Gumbel over v (u uniform in (0, 1) gives P(g <= x) =
    P(u <= exp(-exp(-x))) = exp(-exp(-x)), the Gumbel CDF). The uniforms are bit-identical on
    every backend; the two logs may differ in the last ulp between libraries, which can change
    an argmax only at a near-tie of ~1e-16 relative size."""
    return -np.log(-np.log(gumbel_uniforms(seed, position, vocab_size)))
