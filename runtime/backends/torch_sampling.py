"""Batched sampling and speculative acceptance on the device (Torch).

Owns: the device twins of ``runtime.sampling.process_logits`` /
``sample_token`` and ``runtime.acceptance.accept_rejection``, batched over
requests with per-row temperature / top-k / top-p. The numpy functions are
the oracle: ``tests/unit/test_device_sampling.py`` feeds both the same
uniforms and requires the same tokens and acceptance counts.

Must not know: models, KV caches, requests' ids, gRPC.

Randomness: the caller draws uniforms on the host from each request's
seeded ``np.random.Generator`` and passes them in, so a seeded request
replays identically and the device version can be compared with the oracle
draw for draw. A verify row uses k+1 uniforms ``u[0..k]``: decision j uses
``u[j]``; the correction after a rejection at j = a uses ``u[a+1]``; the
bonus after k acceptances uses ``u[k]`` — exactly the draws the oracle makes,
in its order (the oracle stops drawing after the correction; this version
always consumes k+1 per round).

All math is float64, as in the oracle. Invalid logits (NaN, +inf, all -inf)
are not checked here (that would need a host sync); the engines' inputs
come from the model.
"""

from __future__ import annotations

import numpy as np
import torch


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


def accept_rows(p: torch.Tensor, drafts: torch.Tensor, ks: torch.Tensor, q: torch.Tensor | None,
                u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan acceptance for B rows at once (see ``runtime.acceptance.accept_rejection``).

    p [B, K+1, V] target probs; drafts int64 [B, K] (row b uses its first ks[b]);
    q [B, K, V] draft probs (a greedy draft's row is one_hot(d)) or None when K = 0;
    u float64 [B, K+1]. Returns (a int64 [B], token int64 [B]): the accepted count
    and the correction (a < k) or bonus (a = k) token.
    """
    b, k1, _ = p.shape
    kmax = k1 - 1
    rows = torch.arange(b, device=p.device)
    if kmax == 0:
        return torch.zeros(b, dtype=torch.int64, device=p.device), sample_rows(p[:, 0], u[:, 0])
    p_d = p[:, :kmax].gather(-1, drafts[..., None])[..., 0]               # [B, K] p_j(d_j)
    q_d = q.gather(-1, drafts[..., None])[..., 0]                         # [B, K] q_j(d_j)
    live = torch.arange(kmax, device=p.device)[None, :] < ks[:, None]
    # Accept iff u * q < p (the oracle's division-free form of u < p/q).
    acc = (u[:, :kmax] * q_d < p_d) & live                                 # [B, K]
    a = torch.cumprod(acc.to(torch.int64), dim=-1).sum(dim=-1)             # [B] leading accepts
    rejected = a < ks
    j = torch.clamp(a, max=kmax - 1)
    p_j, q_j = p[rows, j], q[rows, j]                                      # [B, V]
    residual = torch.clamp(p_j - q_j, min=0.0)
    residual = torch.where((residual.sum(dim=-1) > 0.0)[:, None], residual, p_j)
    dist = torch.where(rejected[:, None], residual, p[rows, ks])
    ui = torch.where(rejected, a + 1, ks)
    return a, sample_rows(dist, u[rows, ui])


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

    def verify(self, logits, drafts: np.ndarray, ks: np.ndarray, draft_probs: list[np.ndarray | None],
               temperature, top_k, top_p, u: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, K+1, V] (device); drafts int64 [B, K] (padded), ks [B], draft_probs per row
        ([k_b, V] or None = greedy draft), params [B], u [B, K+1] -> (a [B], token [B]) on the device."""
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
        return accept_rows(p, d, ks_t, q, torch.as_tensor(np.asarray(u, dtype=np.float64), device=self.device))
