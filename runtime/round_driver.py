"""The speculative round, independent of where the workers run.

Owns: per-sequence decoding state on the scheduler side (prompt, emitted
tokens, the draft's pending catch-up pairs, stop conditions, statistics) and
the order of one round: propose -> verify -> accept/commit -> stop checks.
The in-process engine drives it with the engines themselves; the orchestrator
drives it with gRPC stream clients. Both satisfy ``DraftPort``/``TargetPort``.

Must not know: frameworks, gRPC, tensors beyond numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from runtime.acceptance import truncate_at_stop
from runtime.adaptive_k import AdaptiveK, RoundCosts
from runtime.config import SamplingParams
from runtime.types import (DraftPrefillRequest, PrefillRequest, PrefillResult, Proposal, ProposeRequest,
                           VerifyRequest, VerifyResult)


class DraftPort(Protocol):
    def prefill(self, reqs: list[DraftPrefillRequest]) -> None: ...
    def propose(self, reqs: list[ProposeRequest]) -> list[Proposal]: ...
    def release(self, request_id: str) -> bool: ...


class TargetPort(Protocol):
    def prefill(self, reqs: list[PrefillRequest]) -> list[PrefillResult]: ...
    def verify(self, reqs: list[VerifyRequest]) -> list[VerifyResult]: ...
    def release(self, request_id: str) -> bool: ...


FINISH_STOP, FINISH_LENGTH = "stop", "length"


@dataclass
class SeqStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted_in_rounds: int = 0                     # accepted + bonus, summed over spec rounds
    spec_rounds: int = 0
    pos_drafted: list[int] = field(default_factory=list)
    pos_accepted: list[int] = field(default_factory=list)

    def record(self, k: int, a: int) -> None:
        self.rounds += 1
        if k == 0:
            return
        self.spec_rounds += 1
        self.drafted += k
        self.accepted += a
        self.emitted_in_rounds += a + 1
        while len(self.pos_drafted) < k:
            self.pos_drafted.append(0)
            self.pos_accepted.append(0)
        for j in range(k):
            self.pos_drafted[j] += 1
            self.pos_accepted[j] += int(j < a)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per speculative round (accepted drafts + the bonus)."""
        return self.emitted_in_rounds / self.spec_rounds if self.spec_rounds else 0.0

    def merge(self, other: "SeqStats") -> None:
        for name in ("rounds", "drafted", "accepted", "emitted_in_rounds", "spec_rounds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for j in range(len(other.pos_drafted)):
            if j >= len(self.pos_drafted):
                self.pos_drafted.append(0)
                self.pos_accepted.append(0)
            self.pos_drafted[j] += other.pos_drafted[j]
            self.pos_accepted[j] += other.pos_accepted[j]

    def per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.pos_accepted, self.pos_drafted)]


@dataclass
class Sequence:
    request_id: str
    prompt: np.ndarray                 # int64 [n]
    params: SamplingParams
    k: int                             # drafts per round asked for (0 = target-only)
    eos_token_id: int | None = None
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: SeqStats = field(default_factory=SeqStats)
    # The draft's next catch-up: pairs (hidden row, token) not yet sent to it.
    pending_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pending_hidden: np.ndarray | None = None
    draft_pairs: int = 0               # pairs the draft holds (start_position of the next Propose)
    drafting: bool = False             # whether the draft holds this request
    adaptive: AdaptiveK | None = None  # adaptive speculation length (None: always k)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output)

    @property
    def stop_ids(self) -> set[int]:
        ids = set(self.params.stop_token_ids)
        if self.eos_token_id is not None and not self.params.ignore_eos:
            ids.add(self.eos_token_id)
        return ids

    def emit(self, tokens: tuple[int, ...] | list[int]) -> list[int]:
        """Append tokens up to max_tokens / the first stop token; returns those kept."""
        kept, stopped = truncate_at_stop(list(tokens), self.stop_ids, self.remaining)
        self.output.extend(kept)
        if stopped:
            self.finish_reason = FINISH_STOP
        elif self.remaining <= 0:
            self.finish_reason = FINISH_LENGTH
        return list(kept)


def _append_pending(seq: Sequence, tokens: np.ndarray, hidden: np.ndarray) -> None:
    if seq.pending_hidden is None or len(seq.pending_tokens) == 0:
        seq.pending_tokens, seq.pending_hidden = tokens, hidden
    else:
        seq.pending_tokens = np.concatenate([seq.pending_tokens, tokens])
        seq.pending_hidden = np.concatenate([seq.pending_hidden, hidden])


def admit(target: TargetPort, draft: DraftPort | None, seqs: list[Sequence],
          resume: bool = False) -> dict[str, list[int]]:
    """Prefill new sequences on both workers. Returns newly emitted tokens per request.

    With ``resume`` the sequences already hold output (re-prefill after a
    reload or a draft restart): the target re-runs prompt + output[:-1] and
    keeps output[-1] as its last token; nothing new is emitted.
    """
    reqs = []
    for s in seqs:
        if resume and s.output:
            body = np.concatenate([s.prompt, np.asarray(s.output[:-1], dtype=np.int64)])
            reqs.append(PrefillRequest(s.request_id, body, s.params, resume_token=s.output[-1]))
        else:
            reqs.append(PrefillRequest(s.request_id, s.prompt, s.params))
    results = target.prefill(reqs)
    emitted: dict[str, list[int]] = {}
    for s, req, res in zip(seqs, reqs, results):
        if not (resume and s.output):
            emitted[s.request_id] = s.emit([res.first_token])
        # Pairs (h_i, t_{i+1}) for the whole body; the last one waits for the first Propose.
        tokens = np.concatenate([req.prompt[1:], [res.first_token]]).astype(np.int64)
        s.pending_tokens, s.pending_hidden = tokens, res.hidden
        s.draft_pairs, s.drafting = 0, False
    if draft is not None:
        attach_draft(draft, [s for s in seqs if s.k > 0 and s.finish_reason is None])
    return emitted


def attach_draft(draft: DraftPort, seqs: list[Sequence]) -> None:
    """Give the draft every pending pair but the last (which seeds the next Propose)."""
    if not seqs:
        return
    reqs = [DraftPrefillRequest(s.request_id, s.pending_tokens[:-1], s.pending_hidden[:-1], s.params) for s in seqs]
    draft.prefill(reqs)
    for s in seqs:
        s.draft_pairs = len(s.pending_tokens) - 1
        s.pending_tokens, s.pending_hidden = s.pending_tokens[-1:], s.pending_hidden[-1:]
        s.drafting = True


def _round_k(s: Sequence, costs: RoundCosts | None) -> int:
    k = s.adaptive.choose(costs) if (s.adaptive is not None and costs is not None) else s.k
    return min(k, s.k, s.remaining - 1)


def run_round(target: TargetPort, draft: DraftPort | None, seqs: list[Sequence],
              costs: RoundCosts | None = None) -> dict[str, list[int]]:
    """One speculative round over live sequences; returns tokens emitted per request.

    With ``costs`` (the loop's round-cost estimates), sequences that carry an
    ``adaptive`` policy choose their k for this round (``runtime.adaptive_k``).
    """
    ks = {s.request_id: (_round_k(s, costs) if (draft is not None and s.drafting) else 0) for s in seqs}
    proposals: dict[str, Proposal] = {}
    to_propose = [s for s in seqs if ks[s.request_id] > 0]
    if to_propose:
        reqs = [ProposeRequest(s.request_id, s.draft_pairs, s.pending_tokens, s.pending_hidden, ks[s.request_id])
                for s in to_propose]
        for s, p in zip(to_propose, draft.propose(reqs)):
            proposals[s.request_id] = p
            s.draft_pairs += len(s.pending_tokens)
            s.pending_tokens, s.pending_hidden = np.zeros(0, dtype=np.int64), None
    empty = np.zeros(0, dtype=np.int64)
    vreqs = [VerifyRequest(s.request_id, proposals[s.request_id].drafts if s.request_id in proposals else empty,
                           proposals[s.request_id].draft_probs if s.request_id in proposals else None)
             for s in seqs]
    out: dict[str, list[int]] = {}
    for s, res in zip(seqs, target.verify(vreqs)):
        s.stats.record(ks[s.request_id], res.num_accepted)
        if s.adaptive is not None:
            s.adaptive.observe(ks[s.request_id], res.num_accepted)
        out[s.request_id] = s.emit(res.tokens)
        if s.drafting:
            _append_pending(s, np.asarray(res.tokens, dtype=np.int64), res.hidden)
    return out


def release(target: TargetPort, draft: DraftPort | None, seq: Sequence) -> None:
    """Free a finished (or cancelled) sequence's caches on both workers."""
    target.release(seq.request_id)
    if draft is not None and seq.drafting:
        draft.release(seq.request_id)
        seq.drafting = False
