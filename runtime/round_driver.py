"""The speculative round, independent of where the workers run.

Owns: per-sequence decoding state on the scheduler side (prompt, emitted
tokens, the draft's pending catch-up pairs, stop conditions, statistics) and
the order of one round: propose -> verify -> accept/commit -> stop checks.
The in-process engine drives it with the engines themselves; the orchestrator
drives it with gRPC stream clients. Both satisfy ``DraftPort``/``TargetPort``.

Must not know: frameworks, gRPC, tensors beyond numpy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from runtime import random_stream
from runtime.acceptance import truncate_at_stop
from runtime.adaptive_k import AdaptiveK, AdaptiveLoop
from runtime.adaptive_plan import request_ks, round_plan
from core.params import SamplingParams
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
    ahead_asked: int = 0                           # rounds that asked the draft to draft ahead
    ahead_used: int = 0                            # rounds whose drafts came from an ahead call
    watch_probes: int = 0                          # adaptive k's watch probes: rounds the draft drafted unverified
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
        drafted, accepted = self.pos_drafted, self.pos_accepted
        if len(drafted) < k:
            drafted.extend([0] * (k - len(drafted)))
            accepted.extend([0] * (k - len(accepted)))
        for j in range(k):
            drafted[j] += 1
        for j in range(min(a, k)):
            accepted[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per speculative round (accepted drafts + the bonus)."""
        return self.emitted_in_rounds / self.spec_rounds if self.spec_rounds else 0.0

    def merge(self, other: "SeqStats") -> None:
        for name in ("rounds", "drafted", "accepted", "emitted_in_rounds", "spec_rounds", "ahead_asked", "ahead_used",
                     "watch_probes"):
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
    # The draft's next catch-up: pairs (hidden row, token) not yet sent to it, as the chunks the
    # rounds committed, joined when read (``pending_tokens`` / ``pending_hidden``).
    _pending_t: list[np.ndarray] = field(default_factory=list, repr=False)
    _pending_h: list[np.ndarray] = field(default_factory=list, repr=False)
    draft_pairs: int = 0               # pairs the draft holds (start_position of the next Propose)
    drafting: bool = False             # whether the draft holds this request
    adaptive: AdaptiveK | None = None  # adaptive speculation length (None: always k)
    ready_drafts: np.ndarray | None = None  # drafts for the next round from ahead drafting (int64 [k])
    next_proposal: Proposal | None = None   # this sequence's next-round proposal, made while the target
                                            # verified the other micro-batch (runtime.micro_batch)
    watched: np.ndarray | None = None  # a watch probe's drafts (int64 [k]), until the target's tokens judge them
    watch_seen: list[int] = field(default_factory=list, repr=False)   # the target's tokens since that probe
    eos_token_ids: tuple[int, ...] = ()  # every EOS id of the model (config / generation_config list)
    _stop_cache: tuple | None = field(default=None, repr=False, compare=False)  # (params, EOS ids, stop_ids)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output)

    # NOTE: the pending pairs are chunks until read: a drafting request that sits out rounds
    # (adaptive k's target-only stretches) adds one per round, and joining them every round
    # copied the whole stretch again each time (np.concatenate of a growing [n, d]).
    @property
    def pending_tokens(self) -> np.ndarray:
        """int64 [n]: the tokens of the pairs not yet sent to the draft."""
        if len(self._pending_t) > 1:
            self._pending_t = [np.concatenate(self._pending_t)]
        return self._pending_t[0] if self._pending_t else np.zeros(0, dtype=np.int64)

    @pending_tokens.setter
    def pending_tokens(self, tokens: np.ndarray) -> None:
        self._pending_t = [tokens] if len(tokens) else []

    @property
    def pending_hidden(self) -> np.ndarray | None:
        """[n, d] (float32 or bf16 bits): their hidden rows; None when none are pending."""
        if len(self._pending_h) > 1:
            self._pending_h = [np.concatenate(self._pending_h)]
        return self._pending_h[0] if self._pending_h else None

    @pending_hidden.setter
    def pending_hidden(self, hidden: np.ndarray | None) -> None:
        self._pending_h = [] if hidden is None else [hidden]

    def append_pending(self, tokens: np.ndarray, hidden: np.ndarray) -> None:
        """A round's committed pairs join the draft's next catch-up."""
        if not self._pending_h or not self._pending_t:
            self._pending_t, self._pending_h = [tokens], [hidden]
        else:
            self._pending_t.append(tokens)
            self._pending_h.append(hidden)

    @property
    def stop_ids(self) -> set[int]:
        ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            # NOTE: any of the model's EOS ids stops a request, not only the first: models list
            # several (eos_token_id as a list, e.g. Llama-3 instruct's end-of-turn ids).
            ids.update(self.eos_token_ids)
            if self.eos_token_id is not None:
                ids.add(self.eos_token_id)
        return ids

    def _stops(self) -> set[int]:
        """``stop_ids``, built again only when what it is made of changed (a round emits for
        every request: building the set each time was a set and two updates per request)."""
        c = self._stop_cache
        if c is None or c[0] is not self.params or c[1] != self.eos_token_id or c[2] is not self.eos_token_ids:
            c = self._stop_cache = (self.params, self.eos_token_id, self.eos_token_ids, self.stop_ids)
        return c[3]

    def emit(self, tokens: tuple[int, ...] | list[int]) -> list[int]:
        """Append tokens up to max_tokens / the first stop token; returns those kept."""
        kept, stopped = truncate_at_stop(tokens, self._stops(), self.remaining)
        self.output.extend(kept)
        if stopped:
            self.finish_reason = FINISH_STOP
        elif self.remaining <= 0:
            self.finish_reason = FINISH_LENGTH
        return list(kept)


def prefill_request(s: Sequence, resume: bool, request_id: str | None = None) -> PrefillRequest:
    """The target prefill of ``s`` (under ``request_id``, default its own). ``resume`` with output
    so far: prompt + output[:-1] with ``resume_token`` = output[-1] (nothing is sampled), which
    rebuilds the cache and the hidden states the request had; else the prompt."""
    rid = s.request_id if request_id is None else request_id
    if resume and s.output:
        body = np.concatenate([s.prompt, np.asarray(s.output[:-1], dtype=np.int64)])        # [n]
        return PrefillRequest(rid, body, s.params, resume_token=s.output[-1])
    return PrefillRequest(rid, s.prompt, s.params)


def set_prompt_pairs(s: Sequence, req: PrefillRequest, res: PrefillResult) -> None:
    """The draft's pairs (h_i, t_{i+1}) over the whole prefilled body, from the target's prefill
    result; the last pair waits for the first Propose (``attach_draft`` sends the others)."""
    s.pending_tokens = np.concatenate([req.prompt[1:], [res.first_token]]).astype(np.int64)
    s.pending_hidden = res.hidden                                                            # [n, d]


def admit(target: TargetPort, draft: DraftPort | None, seqs: list[Sequence],
          resume: bool = False) -> dict[str, list[int]]:
    """Prefill new sequences on both workers. Returns newly emitted tokens per request.

    With ``resume`` the sequences already hold output (re-prefill after a
    reload or a draft restart): the target re-runs prompt + output[:-1] and
    keeps output[-1] as its last token; nothing new is emitted.
    """
    for s in seqs:
        if s.params.seed is None:
            # NOTE: before the first prefill: an unseeded request gets its seed once, here, so
            # the draft and the target key the same draws (coupled mode) and a resume after a
            # reload or a draft restart continues the same stream.
            s.params = dataclasses.replace(s.params, seed=random_stream.fresh_seed())
    reqs = [prefill_request(s, resume) for s in seqs]
    results = target.prefill(reqs)
    emitted: dict[str, list[int]] = {}
    for s, req, res in zip(seqs, reqs, results):
        if not (resume and s.output):
            emitted[s.request_id] = s.emit([res.first_token])
        set_prompt_pairs(s, req, res)
        s.draft_pairs, s.drafting = 0, False
        forget_drafts(s)
    if draft is not None:
        attach_draft(draft, [s for s in seqs if s.k > 0 and s.finish_reason is None])
    return emitted


def forget_drafts(s: Sequence) -> None:
    """Drop drafts made for a next round (ahead, micro-batch): the draft's state they came from
    is gone (a re-prefill, a lost draft)."""
    s.ready_drafts, s.next_proposal = None, None
    forget_watch(s)


def detach_draft(s: Sequence) -> None:
    """The draft holds nothing of ``s`` any more (it was lost): no pairs, nothing pending."""
    s.drafting, s.draft_pairs = False, 0
    s.pending_tokens, s.pending_hidden = np.zeros(0, dtype=np.int64), None
    forget_drafts(s)


def propose_requests(seqs: list[Sequence], ks: dict[str, int], keep_tail: dict[str, bool] | None = None,
                     on_device: bool = False) -> list[ProposeRequest]:
    """Each sequence's Propose: its pending catch-up pairs, then ``ks`` drafts. ``on_device``: a
    greedy sequence's drafts may stay on the device (the draft's port says it can,
    ``drafts_on_device``: the verify reads them there)."""
    return [ProposeRequest(s.request_id, s.draft_pairs, s.pending_tokens, s.pending_hidden, ks[s.request_id],
                           keep_tail=bool(keep_tail and keep_tail[s.request_id]),
                           on_device=on_device and s.params.greedy) for s in seqs]


def took_proposal(s: Sequence) -> None:
    """The draft now holds ``s``'s pending pairs (its Propose answered)."""
    # NOTE: the chunks counted, not joined, and emptied in place: what the properties' setters
    # do with an empty array, without building one per request per round.
    s.draft_pairs += sum(len(t) for t in s._pending_t)
    s._pending_t, s._pending_h = [], []


def commit_result(s: Sequence, k: int, res: VerifyResult) -> list[int]:
    """Record a verified round of ``s`` (``k`` drafts) and emit its tokens; returns those kept.
    The committed tokens and their hidden rows become the draft's next catch-up."""
    s.stats.record(k, res.num_accepted)
    if s.adaptive is not None:
        s.adaptive.observe(k, res.num_accepted)
    if s.watched is not None:
        judge_watch(s, res.tokens)
    out = s.emit(res.tokens)
    if s.drafting:
        if res.hidden is None:
            raise RuntimeError(f"verify result of {s.request_id!r} has no hidden rows for the draft")
        s.append_pending(np.asarray(res.tokens, dtype=np.int64), res.hidden)
    return out


def judge_watch(s: Sequence, tokens: tuple[int, ...] | list[int]) -> None:
    """A watch probe's drafts d_1..d_k against the target's tokens since (``tokens``: a round's
    committed ones): once the first mismatch or the k-th token is in, the matching prefix is
    reported to the request's policy as that many accepted of k (runtime.adaptive_k, watch
    probes) and the watch ends."""
    drafts, seen = s.watched, s.watch_seen
    seen.extend(int(t) for t in tokens[: len(drafts) - len(seen)])
    matched = 0
    while matched < len(seen) and int(drafts[matched]) == seen[matched]:
        matched += 1
    if matched < len(seen) or len(seen) == len(drafts):
        if s.adaptive is not None:
            s.adaptive.observe(len(drafts), matched)
        forget_watch(s)


def forget_watch(s: Sequence) -> None:
    """Drop a watch probe not judged yet."""
    s.watched, s.watch_seen = None, []


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


def round_ks(seqs: list[Sequence], draft: DraftPort | None, costs: AdaptiveLoop | None) -> dict[str, int]:
    """Drafts per request this round: its k, or with adaptive k what ``request_ks`` gives it (the
    round's k*, or its own k in a newcomer probe; runtime.adaptive_k)."""
    return plan_round(seqs, draft, costs, watch=False)[0]


def plan_round(seqs: list[Sequence], draft: DraftPort | None, costs: AdaptiveLoop | None, watch: bool = True
               ) -> tuple[dict[str, int], dict[str, int]]:
    """(drafts per request this round, drafts per request in a watch probe this round). With
    ``watch`` and a loop that watches (``costs.watch``), probes are watch probes where every
    adaptive request's drafts are greedy or coupled (``round_plan``); else none is watched."""
    # One pass (this runs every round): a request the draft does not hold drafts 0, one without a
    # policy its k, an adaptive one what the policy plans (at most its k); all at most remaining - 1.
    out: dict[str, int] = {}
    adaptive: list[Sequence] = []
    for s in seqs:
        if draft is None or not s.drafting:
            out[s.request_id] = 0
        elif s.adaptive is None or costs is None:
            out[s.request_id] = max(0, min(s.k, s.remaining - 1))
        else:
            out[s.request_id] = 0
            adaptive.append(s)
    if not adaptive:
        return out, {}
    policies = [s.adaptive for s in adaptive]
    watched: dict[str, int] = {}
    if watch and costs.watch and not any(s.params.draft_sampling and not s.params.greedy for s in adaptive):
        ks, wks = round_plan(policies, costs, [s.watched is None for s in adaptive])
    else:
        ks, wks = request_ks(policies, costs), None
    for i, s in enumerate(adaptive):
        k = out[s.request_id] = max(0, min(ks[i], s.k, s.remaining - 1))
        if wks is not None and wks[i] > 0 and k == 0 and s.remaining > 1:
            watched[s.request_id] = min(wks[i], s.remaining - 1)
    return out, watched


def run_round(target: TargetPort, draft: DraftPort | None, seqs: list[Sequence],
              costs: AdaptiveLoop | None = None, ahead: bool = False) -> dict[str, list[int]]:
    """One speculative round over live sequences; returns tokens emitted per request.

    With ``costs`` (the loop's round-cost estimates), sequences that carry an
    ``adaptive`` policy choose their k for this round (``runtime.adaptive_k``).

    With ``ahead`` (post-verify drafting, in the spirit of PEARL and SwiftSpec):
    while the target verifies this round's drafts d_1..d_k, the draft goes on
    from d_k on its own hidden states and proposes k+1 more, a_1..a_{k+1}, as if
    all of d_1..d_k were accepted. If the target accepts all k and its bonus
    token equals a_1, then a_2..a_{k+1} are drafts conditioned on exactly the
    committed prefix, so the next round verifies them without a draft call;
    otherwise they are dropped. Either way the target verifies every token it
    commits, so the output is unchanged (greedy: identical tokens). Greedy
    drafts only.

    A watch probe (adaptive k, ``plan_round``): in a round where request s drafts
    nothing, the draft drafts its k anyway while the target runs its step, and
    the round loop compares those drafts with the target's next tokens
    (``judge_watch``); nothing of them is verified or committed.
    """
    ks, wks = plan_round(seqs, draft, costs)
    proposals: dict[str, Proposal] = {}
    for s in seqs:
        if s.ready_drafts is not None:
            k = ks[s.request_id]
            if k > 0:
                proposals[s.request_id] = Proposal(s.request_id, s.ready_drafts[:k], None)
                s.stats.ahead_used += 1
            s.ready_drafts = None
    greedy_drafts = ({s.request_id: not (s.params.coupled or (s.params.draft_sampling and not s.params.greedy))
                      for s in seqs} if ahead else {})
    to_propose = [s for s in seqs if ks[s.request_id] > 0 and s.request_id not in proposals]
    if to_propose:
        # NOTE: drafts left on the device are read by this round's verify, queued right after
        # the propose; never with ahead drafting (its call and its drafts are the host's).
        on_device = not ahead and getattr(draft, "drafts_on_device", False)
        for s, p in zip(to_propose, draft.propose(propose_requests(to_propose, ks, greedy_drafts if ahead else None,
                                                                   on_device))):
            proposals[s.request_id] = p
            took_proposal(s)
    # NOTE: the ahead call goes out before the verify so the draft works while the target
    # does. Only right after a catch-up (nothing pending): the next catch-up then carries
    # at most two rounds of pairs, a width the draft has captured.
    aheads = [s for s in seqs if ahead and s.request_id in proposals and greedy_drafts[s.request_id]
              and len(s.pending_tokens) == 0 and len(proposals[s.request_id].drafts) == ks[s.request_id]
              and s.remaining > ks[s.request_id] + 2] if draft is not None else []
    collect = _send_ahead(draft, aheads, ks) if aheads else None
    # NOTE: watch probes go out before the verify too (the draft drafts while the target
    # steps); their catch-up pairs are the draft's once it answers (``_take_watch``).
    watching = [s for s in seqs if s.request_id in wks]
    collect_watch = _send(draft, propose_requests(watching, wks)) if watching else None
    empty = np.zeros(0, dtype=np.int64)
    # Hidden rows only for the requests the draft holds (its next catch-up): a target-only
    # request's (k = 0, no draft, the draft lost) are not fetched at all.
    # NOTE: a round queues the next one ahead (runtime/round_ahead.py; a target-only step:
    # runtime/decode_ahead.py) only where that one most likely drafts the same k for the same
    # requests: a queued round the next verify does not take still runs on the device before it.
    # Not after a probe (adaptive k drafting where k* = 0), nor where a request may end or draft
    # fewer next round: after a + 1 tokens its k is capped at remaining - a - 2, so only
    # remaining >= 2k + 2 keeps it whatever it accepts (k = 0: one token left ends it).
    chain = (costs is None or not costs.probing) and all(s.remaining >= 2 * ks[s.request_id] + 2 for s in seqs)
    vreqs = [VerifyRequest(s.request_id, p.drafts, p.draft_probs, hidden=s.drafting, device=p.device, chain=chain)
             if (p := proposals.get(s.request_id)) is not None
             else VerifyRequest(s.request_id, empty, None, s.drafting, chain=chain) for s in seqs]
    results = target.verify(vreqs)
    ahead_out = _collect_ahead(collect, aheads)
    if watching:
        _take_watch(draft, collect_watch, watching)
    out: dict[str, list[int]] = {}
    for s, res in zip(seqs, results):
        k = ks[s.request_id]
        out[s.request_id] = commit_result(s, k, res)
        more = ahead_out.get(s.request_id)
        if more is not None and res.num_accepted == k and len(more) == k + 1 and int(more[0]) == res.tokens[-1]:
            s.ready_drafts = np.asarray(more[1:], dtype=np.int64)
    return out


def _send_ahead(draft: DraftPort, seqs: list[Sequence], ks: dict[str, int]):
    """Ask the draft for k+1 drafts past each sequence's proposal; returns the collector."""
    reqs = [ProposeRequest(s.request_id, 0, np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.float32),
                           ks[s.request_id] + 1, ahead=True, keep_tail=True) for s in seqs]
    for s in seqs:
        s.stats.ahead_asked += 1
    return _send(draft, reqs)


def _send(draft: DraftPort, reqs: list[ProposeRequest]):
    """A Propose whose answer the round collects after the verify (the draft's ``propose_async``;
    an in-process draft answers at once: no overlap, same drafts). Returns the collector."""
    send = getattr(draft, "propose_async", None)
    if send is None:                                  # an in-process draft: no overlap, same tokens
        try:
            done = draft.propose(reqs)
        except Exception:  # noqa: BLE001 - ahead drafts are optional
            done = [None] * len(reqs)
        return lambda: done
    return send(reqs)


def _take_watch(draft: DraftPort, collect, seqs: list[Sequence]) -> None:
    """The watch probes' drafts: each answered sequence's pairs are now the draft's and its
    drafts wait for the target's tokens. A sequence whose item failed leaves the draft (it is
    not known whether the draft took its pairs) and goes on target-only; a failed call is the
    port's to report (``GuardedDraft.deferred``), and the loop's draft handling follows."""
    try:
        got = collect()
    except Exception as exc:  # noqa: BLE001 - as _collect_ahead
        got = getattr(exc, "results", None) or [None] * len(seqs)
    for s, p in zip(seqs, got):
        if p is not None and len(p.drafts):
            took_proposal(s)
            s.watched, s.watch_seen = np.asarray(p.drafts, dtype=np.int64), []
            s.stats.watch_probes += 1
        elif p is None:
            try:
                draft.release(s.request_id)
            except Exception:  # noqa: BLE001 - a draft that cannot take a release is the port's to report
                pass
            detach_draft(s)


def _collect_ahead(collect, seqs: list[Sequence]) -> dict[str, np.ndarray]:
    """The ahead drafts by request id; failed items (or a failed call) simply give none."""
    if collect is None:
        return {}
    try:
        got = collect()
    except Exception as exc:  # noqa: BLE001 - ahead drafts are optional; the port records call failures
        got = getattr(exc, "results", None) or [None] * len(seqs)
    return {s.request_id: p.drafts for s, p in zip(seqs, got) if p is not None}


def release(target: TargetPort, draft: DraftPort | None, seq: Sequence) -> None:
    """Free a finished (or cancelled) sequence's caches on both workers."""
    target.release(seq.request_id)
    if draft is not None and seq.drafting:
        draft.release(seq.request_id)
        seq.drafting = False
