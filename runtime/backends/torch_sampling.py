"""Batched sampling and speculative acceptance on the device (Torch).

Owns: the device twins of ``runtime.sampling.process_logits`` /
``sample_token`` / ``coupled_token``, ``runtime.acceptance.accept_rejection``
and ``runtime.random_stream.gumbel``, batched over requests with per-row
temperature / top-k / top-p / seed / position. The numpy functions are the
oracle: ``tests/unit/test_device_sampling.py`` feeds both the same inputs and
requires the same tokens and acceptance counts (and bit-identical noise).

Must not know: models, KV caches, requests' ids, gRPC.

Randomness: scalar uniforms (a handful per row) are counter-based draws the
caller computes on the host (``runtime.random_stream.uniforms``) and passes
in. A verify row gets ``u_acc[0..k-1]`` (decision j) and ``u_tok[0..k]``
(the token drawn at row j: the correction at the first rejection j = a, or
the bonus at j = k), as the oracle uses them. The coupled mode's Gumbel noise
is [V] per position, so it is made here, on the device, by the same integer
hash as the host (``gumbel_rows``), from per-row seeds and positions.

All math is float64, as in the oracle. Invalid logits (NaN, +inf, all -inf)
are not checked here (that would need a host sync); the engines' inputs
come from the model.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime import random_stream


def process_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  filtered: bool) -> torch.Tensor:
    """logits [N, V]; temperature/top_p float64 [N], top_k int64 [N] -> probs float64 [N, V].

    Row n follows ``process_logits(logits[n], temperature[n], top_k[n], top_p[n])``:
    temperature 0 = one-hot argmax; softmax(x / T); top-k (0 or >= V = off);
    top-p (>= 1 = off) on the renormalised top-k distribution; renormalise.
    ``filtered`` (host-known: some row has top-k or top-p on) selects the sorted path.
    """
    x = logits.double()                                                    # [N, V]
    n, v = x.shape
    greedy = temperature == 0.0                                            # [N]
    m = x.max(dim=-1, keepdim=True).values                                 # [N, 1]
    t = torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    e = torch.exp((x - m) / t)                                             # [N, V], all exponents <= 0
    if filtered:
        # Sorted order, best first; the stable sort of -z breaks logit ties by index (top-k rule).
        z = (x - m) / t
        order = torch.argsort(-z, dim=-1, stable=True)                     # [N, V] token ids
        ps = e.gather(-1, order)                                           # [N, V] descending
        rank = torch.arange(v, device=x.device)[None, :]
        use_k = (top_k > 0) & (top_k < v)
        kk = torch.where(use_k, top_k, torch.full_like(top_k, v))[:, None]
        ps = torch.where(rank < kk, ps, torch.zeros_like(ps))
        use_p = (top_p < 1.0)[:, None]
        psn = ps / ps.sum(dim=-1, keepdim=True)
        above = torch.cumsum(psn, dim=-1) - psn                            # exclusive cumulative prob
        ps = torch.where(use_p, torch.where(above < top_p[:, None], psn, torch.zeros_like(psn)), ps)
        probs = torch.zeros_like(ps).scatter_(-1, order, ps / ps.sum(dim=-1, keepdim=True))
    else:
        probs = e / e.sum(dim=-1, keepdim=True)
    onehot = torch.zeros_like(probs).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], onehot, probs)


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [N, V] (>= 0, rows not all zero), u float64 [N] in [0, 1) -> int64 [N].

    Inverse CDF as ``sample_token``: the first i with cdf[i] > u * cdf[-1]; if
    rounding pushes past the end, the last token with mass.
    """
    v = probs.shape[-1]
    cdf = torch.cumsum(probs, dim=-1)                                      # [N, V]
    i = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None].contiguous(), right=True)[:, 0]
    last = v - 1 - torch.argmax((probs > 0).flip(-1).to(torch.int8), dim=-1)
    return torch.where(i >= v, last, i)


def _signed(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (Torch has no general uint64 arithmetic)."""
    return c - (1 << 64) if c >= 1 << 63 else c


_G, _M1, _M2 = _signed(random_stream.G), _signed(random_stream.M1), _signed(random_stream.M2)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits: Torch's >> is arithmetic, so mask off the copied sign bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """``random_stream._mix`` on int64 tensors: int64 + - * wrap mod 2^64 (two's complement) and xor
    is bitwise, so every step has the same 64 bits as the uint64 numpy version."""
    x = x ^ _shr(x, 30)
    x = x * _M1
    x = x ^ _shr(x, 27)
    x = x * _M2
    return x ^ _shr(x, 31)


def gumbel_uniform_rows(seeds: torch.Tensor, positions: torch.Tensor, v: int) -> torch.Tensor:
    """seeds int64 [N] (in [0, 2^63)), positions int64 [N] -> float64 [N, V], bit-identical to
    ``random_stream.gumbel_uniforms(seeds[n], positions[n], V)`` row by row."""
    h = _mix(seeds + _G)
    key = _mix(h ^ ((positions << random_stream.PURPOSE_BITS) | random_stream.PURPOSE_GUMBEL))    # [N]
    idx = torch.arange(1, v + 1, dtype=torch.int64, device=seeds.device)                          # index + 1
    bits = _mix(key[:, None] + idx[None, :] * _G)                                                  # [N, V]
    return (_shr(bits, 12).double() + 0.5) * random_stream.SCALE                                   # (0, 1), exact


def gumbel_rows(seeds: torch.Tensor, positions: torch.Tensor, v: int) -> torch.Tensor:
    """Gumbel noise float64 [N, V]: ``random_stream.gumbel(seeds[n], positions[n], V)`` row by row."""
    return -torch.log(-torch.log(gumbel_uniform_rows(seeds, positions, v)))


def coupled_rows(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs [N, V], noise [N, V] -> argmax(log probs + noise) int64 [N] (``sampling.coupled_token``).
    log 0 = -inf: cut tokens never win."""
    return torch.argmax(torch.log(probs) + noise, dim=-1)


def accept_rows(p: torch.Tensor, drafts: torch.Tensor, ks: torch.Tensor, q: torch.Tensor | None,
                u_acc: torch.Tensor, u_tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan acceptance for B rows at once (see ``runtime.acceptance.accept_rejection``).

    p [B, K+1, V] target probs; drafts int64 [B, K] (row b uses its first ks[b]);
    q [B, K, V] draft probs (a greedy draft's row is one_hot(d)) or None when K = 0;
    u_acc float64 [B, K] (decisions), u_tok float64 [B, K+1] (the drawn token at each row).
    Returns (a int64 [B], token int64 [B]): the accepted count and the correction (a < k)
    or bonus (a = k) token.
    """
    b, k1, _ = p.shape
    kmax = k1 - 1
    rows = torch.arange(b, device=p.device)
    if kmax == 0:
        return torch.zeros(b, dtype=torch.int64, device=p.device), sample_rows(p[:, 0], u_tok[:, 0])
    p_d = p[:, :kmax].gather(-1, drafts[..., None])[..., 0]               # [B, K] p_j(d_j)
    q_d = q.gather(-1, drafts[..., None])[..., 0]                         # [B, K] q_j(d_j)
    live = torch.arange(kmax, device=p.device)[None, :] < ks[:, None]
    # Accept iff u * q < p (the oracle's division-free form of u < p/q).
    acc = (u_acc * q_d < p_d) & live                                 # [B, K]
    a = torch.cumprod(acc.to(torch.int64), dim=-1).sum(dim=-1)             # [B] leading accepts
    rejected = a < ks
    j = torch.clamp(a, max=kmax - 1)
    p_j, q_j = p[rows, j], q[rows, j]                                      # [B, V]
    residual = torch.clamp(p_j - q_j, min=0.0)
    residual = torch.where((residual.sum(dim=-1) > 0.0)[:, None], residual, p_j)
    dist = torch.where(rejected[:, None], residual, p[rows, ks])
    ui = torch.where(rejected, a, ks)
    return a, sample_rows(dist, u_tok[rows, ui])


class TorchSampler:
    """Host-facing wrapper: numpy parameters in, device tensors out (no sync here)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _params(self, temperature, top_k, top_p, v: int):
        t = torch.as_tensor(np.asarray(temperature, dtype=np.float64), device=self.device)
        kk = torch.as_tensor(np.asarray(top_k, dtype=np.int64), device=self.device)
        pp = torch.as_tensor(np.asarray(top_p, dtype=np.float64), device=self.device)
        filtered = bool(np.any((np.asarray(top_k) > 0) & (np.asarray(top_k) < v)) or np.any(np.asarray(top_p) < 1.0))
        return t, kk, pp, filtered

    def sample(self, logits, temperature, top_k, top_p, u) -> torch.Tensor:
        """logits [N, V]; per-row params and uniforms (numpy [N]) -> tokens int64 [N] (device)."""
        t, kk, pp, filtered = self._params(temperature, top_k, top_p, logits.shape[-1])
        probs = process_probs(logits, t, kk, pp, filtered)
        return sample_rows(probs, torch.as_tensor(np.asarray(u, dtype=np.float64), device=self.device))

    def coupled(self, logits, temperature, top_k, top_p, seeds, positions) -> torch.Tensor:
        """logits [N, V]; per-row params, seeds and positions (numpy [N]) -> the coupled choices
        argmax(log p + g) int64 [N] (device), g = the Gumbel noise of (seed, position)."""
        v = logits.shape[-1]
        t, kk, pp, filtered = self._params(temperature, top_k, top_p, v)
        probs = process_probs(logits, t, kk, pp, filtered)
        dev = lambda a: torch.as_tensor(np.asarray(a, dtype=np.int64), device=self.device)  # noqa: E731
        return coupled_rows(probs, gumbel_rows(dev(seeds), dev(positions), v))

    def verify(self, logits, drafts: np.ndarray, ks: np.ndarray, draft_probs: list[np.ndarray | None],
               temperature, top_k, top_p, u_acc: np.ndarray, u_tok: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, K+1, V] (device); drafts int64 [B, K] (padded), ks [B], draft_probs per row
        ([k_b, V] or None = greedy draft), params [B], u_acc [B, K], u_tok [B, K+1]
        -> (a [B], token [B]) on the device."""
        b, k1, v = logits.shape
        t, kk, pp, filtered = self._params(np.repeat(temperature, k1), np.repeat(top_k, k1),
                                           np.repeat(top_p, k1), v)
        p = process_probs(logits.reshape(b * k1, v), t, kk, pp, filtered).reshape(b, k1, v)
        d = torch.as_tensor(np.asarray(drafts, dtype=np.int64).reshape(b, k1 - 1), device=self.device)
        q = None
        if k1 > 1:
            q = torch.zeros((b, k1 - 1, v), dtype=torch.float64, device=self.device).scatter_(-1, d[..., None], 1.0)
            for i, dp in enumerate(draft_probs):
                if dp is not None:
                    q[i, : len(dp)] = torch.as_tensor(np.asarray(dp, dtype=np.float64), device=self.device)
        ks_t = torch.as_tensor(np.asarray(ks, dtype=np.int64), device=self.device)
        f64 = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float64), device=self.device)  # noqa: E731
        return accept_rows(p, d, ks_t, q, f64(u_acc).reshape(b, k1 - 1), f64(u_tok))
