"""Step 4 of the speculative round: decide which drafts the target accepts.

This module owns the acceptance rules and the stop/budget cut of an emitted
run. Given the k draft tokens d_1..d_k and the target's verify output over
[t_n, d_1 .. d_k] (k+1 rows; row j scores the token after d_j, row 0 scores
d_1), it returns the a accepted drafts plus one token chosen by the target
(the correction at the first rejection, or the bonus after all k).

Which rule a request uses:
  * temperature == 0 (greedy requests): `accept_greedy` on the raw target
    logits. It uses no randomness and emits exactly the tokens target-only
    greedy decoding would, whatever the draft proposed.
  * temperature > 0: `accept_rejection` (Leviathan et al. 2023, "Fast Inference
    from Transformers via Speculative Decoding") on distributions processed by
    `runtime.sampling.process_logits` with the request's temperature / top-k /
    top-p, applied identically to target (p) and draft (q). Every emitted token
    is then distributed exactly as if sampled from p alone. This is the
    "rejection" sampling mode: the best acceptance, but a seed's tokens depend
    on what the draft proposed.
  * temperature > 0, "coupled" sampling mode: `accept_coupled`. The target's
    token at each position is the Gumbel-max choice argmax(log p + g) with the
    position's noise g (runtime.random_stream); the draft proposed with the
    same noise; a draft is accepted iff it equals the target's choice (greedy
    verification on perturbed log-probs). The emitted tokens are exactly the
    target-only tokens of the same seed, whatever the draft did.

It knows nothing about models, KV caches, batching, gRPC or tensor frameworks:
inputs are numpy arrays and token ids, and randomness comes only from the
uniforms / noise the caller passes: counter-based draws keyed by the request's
seed and the token's absolute position, so a seeded request replays
identically (runtime.random_stream).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from runtime.sampling import coupled_token, sample_token


@dataclass(slots=True)                 # per request per round, not frozen: runtime/types.py's module doc
class Acceptance:
    num_accepted: int  # a in [0, k]: drafts accepted
    tokens: tuple[int, ...]  # emitted tokens: the a accepted drafts then 1 bonus/correction token (length a+1)


def _check_rows(draft_tokens: Sequence[int], rows: np.ndarray, name: str) -> int:
    # rows must be [k+1, V] for k drafts; returns k.
    k = len(draft_tokens)
    if rows.ndim != 2 or rows.shape[0] != k + 1 or rows.shape[1] == 0:
        raise ValueError(f"{name} must have shape [k+1, V] = [{k + 1}, V], got {rows.shape}")
    V = rows.shape[1]
    for d in draft_tokens:
        if not 0 <= d < V:
            raise ValueError(f"draft token {d} out of range for vocabulary size {V}")
    return k


def accept_greedy(draft_tokens: Sequence[int], target_logits: np.ndarray) -> Acceptance:
    """target_logits [k+1, V] (row j = target's logits for the position after draft j-1; row 0 scores d_1).

    Accept d_j while d_j == argmax(row j-1); at the first mismatch emit the target argmax there;
    if all k are accepted the bonus is argmax(row k). k == 0 is target-only decoding: argmax(row 0).
    Ties go to the lowest index, as np.argmax (and torch/paddle argmax) break them.
    """
    logits = np.asarray(target_logits)  # [k+1, V]
    _check_rows(draft_tokens, logits, "target_logits")
    if np.isnan(logits).any():
        raise ValueError("target_logits contain NaN")
    return accept_greedy_ids(draft_tokens, logits.argmax(axis=-1))


def accept_greedy_ids(draft_tokens: Sequence[int], target_argmax: np.ndarray) -> Acceptance:
    """The greedy rule on the target's argmax ids [k+1] (computed on the device: no logits
    travel). Same result as ``accept_greedy`` on the logits those ids came from."""
    best = np.asarray(target_argmax)  # [k+1] target's greedy token at every position
    k = len(draft_tokens)
    if best.shape != (k + 1,):
        raise ValueError(f"target_argmax must have shape [k+1] = [{k + 1}], got {best.shape}")
    a = 0
    while a < k and int(draft_tokens[a]) == best[a]:
        a += 1
    # The a accepted drafts equal best[:a], so the emitted run is just the target's argmaxes
    # up to and including the first position that disagreed (or the bonus row k).
    return Acceptance(num_accepted=a, tokens=tuple(int(t) for t in best[: a + 1]))


def accepted_greedy_rows(drafts: np.ndarray, ks: np.ndarray, best: np.ndarray) -> np.ndarray:
    """``accept_greedy_ids``'s accepted count for a whole batch at once (no Python per row).

    drafts int64 [B, K]: row i's k_i drafts first, anything after; ks [B] (k_i <= K);
    best [B, W], W >= K + 1: the target's argmax ids. -> a [B] int64:

        a_i = min({j < k_i : drafts[i, j] != best[i, j]} ∪ {k_i})

    and row i emits best[i, : a_i + 1] (the accepted drafts equal the argmaxes before the
    first mismatch). Positions at or past k_i are marked as mismatches, so a_i <= k_i; a row
    with no mismatch in its K columns (k_i = K, all accepted) gets K.
    """
    k = drafts.shape[1]
    if k == 0:                                                       # target-only rows: a = 0
        return np.zeros(drafts.shape[0], dtype=np.int64)
    miss = drafts != best[:, :k]                                     # [B, K]
    miss |= np.arange(k) >= np.asarray(ks)[:, None]
    return np.where(miss.any(axis=1), miss.argmax(axis=1), k).astype(np.int64)


def accept_rejection(
    draft_tokens: Sequence[int],
    draft_probs: np.ndarray | None,
    target_probs: np.ndarray,
    u_accept: np.ndarray,
    u_token: np.ndarray,
) -> Acceptance:
    """Leviathan et al. speculative sampling.

    target_probs [k+1, V]: the target's processed distributions p_1..p_{k+1} (process_logits applied).
    draft_probs [k, V]: the processed distributions q_1..q_k the drafts were sampled from, or None for
    a greedy draft, meaning q_j = one_hot(d_j).
    u_accept [k], u_token [k+1]: uniforms in [0, 1). Row j's accept/reject decision uses u_accept[j];
    the token the target draws at row j (the correction after a rejection there, or the bonus at
    row k) uses u_token[j]. The engines pass the counter-based draws of the row's absolute position
    (PURPOSE_ACCEPT and PURPOSE_SAMPLE), so each emitted position consumes its own numbers.

    For j = 1..k: accept d_j with prob min(1, p_j(d_j) / q_j(d_j)); on rejection emit a sample from
    norm(max(0, p_j - q_j)) (p_j itself if that residual is all zero) and stop; if all k are accepted,
    emit a bonus sample from p_{k+1}.

    Why the output is distributed as p_j: P(emit x) = P(d = x, accepted) + P(rejected) * r(x)
      = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) * max(0, p(x) - q(x)) / Z
      = min(q(x), p(x)) + max(0, p(x) - q(x))       since Z = sum_y max(0, p(y) - q(y))
                                                       = 1 - sum_y min(p(y), q(y))
      = p(x).
    By induction over positions the whole emitted run has the target's joint distribution. The
    induction needs, at every position, fresh uniforms independent of the draft token and of all
    earlier positions' draws: a counter-based draw of (seed, position, purpose) is one, since an
    emitted position is decided once and earlier tokens depend only on earlier positions' draws.
    """
    p = np.asarray(target_probs, dtype=np.float64)  # [k+1, V]
    k = _check_rows(draft_tokens, p, "target_probs")
    if draft_probs is not None:
        q = np.asarray(draft_probs, dtype=np.float64)  # [k, V]
        if q.shape != (k, p.shape[1]):
            raise ValueError(f"draft_probs must have shape [k, V] = [{k}, {p.shape[1]}], got {q.shape}")
    ua = np.asarray(u_accept, dtype=np.float64).reshape(-1)  # [k]
    ut = np.asarray(u_token, dtype=np.float64).reshape(-1)   # [k+1]
    if ua.shape != (k,) or ut.shape != (k + 1,):
        raise ValueError(f"u_accept / u_token must have shapes [{k}] / [{k + 1}], got {ua.shape} / {ut.shape}")

    for j in range(k):
        d = int(draft_tokens[j])
        p_d = p[j, d]
        q_d = 1.0 if draft_probs is None else q[j, d]
        # Accept iff u < p/q, written u * q < p to avoid dividing: identical for q > 0, and for a
        # q that underflowed to 0 it is the q -> 0 limit (accept iff p > 0). p/q >= 1 always accepts
        # because u < 1; p(d) == 0 never accepts.
        if ua[j] * q_d < p_d:
            continue
        # Rejected: sample from the residual max(0, p - q). For a greedy draft q = one_hot(d), so the
        # residual is p with d zeroed out.
        if draft_probs is None:
            residual = p[j].copy()  # [V]
            residual[d] = 0.0
        else:
            residual = np.maximum(p[j] - q[j], 0.0)  # [V]
        if not residual.sum() > 0.0:
            # p <= q everywhere only when p == q up to rounding, where rejection has prob ~0;
            # sampling from p is the limit of the rule.
            residual = p[j]
        tokens = tuple(int(t) for t in draft_tokens[:j]) + (sample_token(residual, float(ut[j])),)
        return Acceptance(num_accepted=j, tokens=tokens)

    # All k accepted: the bonus token comes from the target's next distribution.
    tokens = tuple(int(t) for t in draft_tokens) + (sample_token(p[k], float(ut[k])),)
    return Acceptance(num_accepted=k, tokens=tokens)


def accept_coupled(draft_tokens: Sequence[int], target_probs: np.ndarray, noise: np.ndarray) -> Acceptance:
    """Coupled (exact-match) verification.

    target_probs [k+1, V]: the target's processed distributions at the k+1 verified positions;
    noise [k+1, V]: each position's Gumbel noise (runtime.random_stream.gumbel at that position).
    The target's token at row j is c_j = argmax(log p_j + g_j) (runtime.sampling.coupled_token),
    distributed exactly as p_j. Accept d_j while d_j == c_{j-1}; emit c at the first mismatch, or
    the bonus c_k after k accepts. The emitted run is c_0..c_a: every token is the target's own
    choice at its position, so the output equals target-only coupled sampling with the same seed
    token for token, whatever the draft proposed (it only decides how many are settled per round).
    """
    p = np.asarray(target_probs, dtype=np.float64)  # [k+1, V]
    _check_rows(draft_tokens, p, "target_probs")
    return accept_greedy_ids(draft_tokens, coupled_token(p, noise))


def truncate_at_stop(
    tokens: Sequence[int], stop_token_ids: Collection[int], remaining: int
) -> tuple[tuple[int, ...], bool]:
    """Cut an emitted run to what the request may still emit.

    Keep at most `remaining` tokens (the max_tokens budget left) and stop right after the first
    token that is in stop_token_ids (the stop token itself is included). Returns
    (kept_tokens, stopped_by_stop_token); a stop token beyond the budget does not count.
    """
    if remaining < 0:
        raise ValueError(f"remaining must be >= 0, got {remaining}")
    kept = tuple(int(t) for t in tokens[:remaining])
    for i, t in enumerate(kept):
        if t in stop_token_ids:
            return kept[: i + 1], True
    return kept, False
