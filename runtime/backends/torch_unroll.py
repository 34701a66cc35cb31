"""The unrolled MTP loss: the draft head trained for k-step use, with Torch autograd.

Owns: the causal and unrolled attention layouts of training, the frozen
target's hidden states and logits over a batch, and the MTP loss unrolled on
the head's own output hidden states, mixing the data token with the target's
distribution. Used by ``specsplit train`` (``torch_train``) and ``specsplit
train-mtp`` (``torch_mtp_distill``). Every forward goes through
``runtime/model.py`` over ``TorchOps``: what is trained is what is served.

Must not know: optimisers, checkpoints, corpora, gRPC, Paddle.

The unrolled MTP loss (DESIGN § Training the MTP for k substeps). Tokens
``t_0..t_T``, frozen target hidden ``h_0..h_{T-1}``. Pass s = 1..N over
anchors j = 0..M-1 (M = T - N):

    pass 1:  (h_j,         t_{j+1})   at position j        predicts t_{j+2}
    pass s:  (g^{(s-1)}_j, t_{j+s})   at position j+s-1    predicts t_{j+s+1}

where ``g^{(s)}`` is the MTP's own output hidden state (pre-final-norm). The
attention of pass s >= 2 matches inference exactly: at anchor j the draft
cache holds *true* pairs at positions 0..j (pass 1) and the guessed pairs of
this round at positions j+1..j+s-1 (passes 2..s at the same anchor). So pass
s runs over the concatenation [pass 1; ...; pass s] (length s*M) with the mask

    query (s, j) sees key (1, i) for i <= j, and key (s', j) for 2 <= s' <= s

(the first s-1 segments reproduce the earlier passes bit for bit), and the
loss is taken on the last, N-segment forward. N = 1 is the naive one-step head.
Each pass's label is mixed from the data token (hard) and the target's own
next-token distribution at that position (soft, ``--mtp-distill``): greedy
acceptance rewards agreeing with the target, not with the data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.backends.torch_ops import TorchOps
from runtime.config import ModelConfig
from runtime.model import Rope, lm_head, mtp_forward, target_forward


def causal_mask(t: int, device: torch.device | str) -> torch.Tensor:
    """bool [1, T, T]: key j visible to query i iff j <= i."""
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()[None]


def unroll_layout(n: int, m: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask bool [1, n*m, n*m] and positions int64 [1, n*m] of ``n`` concatenated
    passes over ``m`` anchors (see the module docstring). Segment order makes the
    top-left (s*m x s*m) block the layout of the first s passes."""
    s = torch.arange(n, device=device).repeat_interleave(m)          # 0-based pass of each row
    j = torch.arange(m, device=device).repeat(n)                     # anchor of each row
    qs, qj, ks, kj = s[:, None], j[:, None], s[None, :], j[None, :]
    mask = ((ks == 0) & (kj <= qj)) | ((ks >= 1) & (kj == qj) & (ks <= qs))
    return mask[None], (j + s)[None].to(torch.int64)


@torch.no_grad()
def target_hidden(ops: TorchOps, p: dict[str, torch.Tensor], cfg: ModelConfig, rope: Rope,
                  tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Frozen target over tokens int64 [B, T] -> h [B, T, d] (pre-norm), logits [B, T, V]."""
    b, t = tokens.shape
    cos_sin = rope.tables(ops, torch.arange(t, device=tokens.device)[None])
    h = target_forward(ops, p, cfg, tokens, None, None, train_mask=causal_mask(t, tokens.device).expand(b, t, t),
                       cos_sin=cos_sin)
    return h, lm_head(ops, p, cfg, h)


@dataclass
class MtpLoss:
    loss: torch.Tensor          # scalar, differentiable: mean over passes of the mixed loss
    hard: torch.Tensor          # [N] cross-entropy against the data token per pass (detached)
    agree: torch.Tensor         # [N] fraction where argmax equals the target's argmax, per pass


def mtp_unrolled_logits(ops: TorchOps, p: dict[str, torch.Tensor], cfg: ModelConfig, rope: Rope,
                        tokens: torch.Tensor, hidden: torch.Tensor, unroll: int) -> torch.Tensor:
    """tokens int64 [B, T+1] (t_0..t_T), hidden [B, T, d] = h_0..h_{T-1} of the frozen
    target -> logits [B, N, M, V]: pass s (index s-1) at anchor j predicts t_{j+s+1}.

    ``p`` holds the MTP tensors and the target's embedding / final norm / head.
    """
    n = unroll
    b, t = hidden.shape[:2]
    m = t - n
    if n < 1 or m < 1:
        raise ValueError(f"mtp unroll {n} needs 1 <= unroll < seq_len, got seq_len {t}")
    mask, pos = unroll_layout(n, m, hidden.device)
    cos, sin = rope.tables(ops, pos)
    prev = [hidden[:, :m]]                                      # g^{(0)} = h, anchors 0..M-1
    toks = [tokens[:, 1:1 + m]]                                 # t_{j+1}
    g = None
    for s in range(1, n + 1):
        ln = s * m
        g = mtp_forward(ops, p, cfg, torch.cat(prev, 1), torch.cat(toks, 1), None, None,
                        train_mask=mask[:, :ln, :ln].expand(b, ln, ln),
                        cos_sin=(cos[:, :ln], sin[:, :ln]))                               # [B, s*M, d]
        if s < n:
            prev.append(g[:, (s - 1) * m:s * m])                # g^{(s)}_j feeds pass s+1
            toks.append(tokens[:, 1 + s:1 + s + m])             # t_{j+s+1}
    return lm_head(ops, p, cfg, g).reshape(b, n, m, -1)        # [B, N, M, V]


def mtp_unrolled_loss(ops: TorchOps, p: dict[str, torch.Tensor], cfg: ModelConfig, rope: Rope,
                      tokens: torch.Tensor, hidden: torch.Tensor, target_logits: torch.Tensor | None,
                      unroll: int, distill: float = 0.0) -> MtpLoss:
    """The loss of ``mtp_unrolled_logits``; ``target_logits`` [B, T, V] (the frozen
    target's, position i predicting t_{i+1}) are needed for ``distill`` > 0 and ``agree``."""
    n = unroll
    logits = mtp_unrolled_logits(ops, p, cfg, rope, tokens, hidden, n)
    m = logits.shape[2]
    labels = torch.stack([tokens[:, s + 1:s + 1 + m] for s in range(1, n + 1)], 1)   # t_{j+s+1}: [B, N, M]
    logp = F.log_softmax(logits, -1)
    hard = -logp.gather(-1, labels[..., None])[..., 0].mean(dim=(0, 2))                # [N]
    per_pass = hard
    agree = torch.zeros(n, device=hidden.device)
    if target_logits is not None:
        tl = torch.stack([target_logits[:, s:s + m] for s in range(1, n + 1)], 1)      # [B, N, M, V]
        agree = (logits.detach().argmax(-1) == tl.argmax(-1)).float().mean(dim=(0, 2))
        if distill > 0:
            soft = -(F.softmax(tl, -1) * logp).sum(-1).mean(dim=(0, 2))               # [N]
            per_pass = (1.0 - distill) * hard + distill * soft
    elif distill > 0:
        raise ValueError("distill > 0 needs target_logits")
    return MtpLoss(per_pass.mean(), hard.detach(), agree)
