"""Two micro-batches: the draft drafts one while the target verifies the other.

Owns: one round of the batch as two micro-batches, pipelined across rounds:

    group 1: sequences whose drafts for this round were made during the last round
             (``Sequence.next_proposal``); on a first round, the first half, drafted now
    group 2: the others

    draft  | propose(group 2)                    | propose(group 1, next round)
    target | verify(group 1), commit group 1     | verify(group 2), commit group 2

so in steady state both workers are busy all the time (the draft on its own GPU,
the target on its). Each sequence still goes propose -> verify -> commit in its
own order, with the same drafts for the same committed prefix as a plain round,
so the output is the same (greedy and coupled sampling: token for token; rejection
sampling: the same distribution). It pays only where a draft call is long enough
to hide behind a half-batch verify and two half verifies cost little more than one
(docs/performance.md has the measurements); ``spec.micro_batches`` turns it on.

Must not know: frameworks, gRPC, scheduling (the scheduler calls ``run_round_micro``
where it would call ``run_round``).
"""

from __future__ import annotations

import numpy as np

from runtime.adaptive_k import AdaptiveLoop
from runtime.round_driver import (DraftPort, Sequence, TargetPort, commit_result, propose_requests, round_ks,
                                  run_round, took_proposal)
from runtime.types import Proposal, VerifyRequest

_EMPTY = np.zeros(0, dtype=np.int64)


def run_round_micro(target: TargetPort, draft: DraftPort | None, seqs: list[Sequence],
                    costs: AdaptiveLoop | None = None) -> dict[str, list[int]]:
    """One round over ``seqs`` as two micro-batches; returns tokens emitted per request.

    Falls back to one plain round when there is nothing to overlap (no draft, or fewer
    than two drafting sequences). The draft port's ``propose_async`` (send now, collect
    later) is what overlaps; a port without it runs the same calls one after the other.
    A proposal the draft did not deliver (an item it refused, or a failed call, which the
    port records for the scheduler) leaves that sequence a target-only step this round.
    """
    drafting = [s for s in seqs if draft is not None and s.drafting]
    if len(drafting) < 2:
        for s in seqs:
            s.next_proposal = None
        return run_round(target, draft, seqs, costs)
    ks = round_ks(seqs, draft, costs)
    first = [s for s in seqs if s.next_proposal is not None]
    if not first:
        # NOTE: a pipeline start: the first half is drafted now, the draft then drafts the
        # second half while the target verifies the first.
        first = seqs[: (len(seqs) + 1) // 2]
        _propose_now(draft, first, ks)
    in_first = {id(s) for s in first}
    second = [s for s in seqs if id(s) not in in_first]
    for s in first:
        if s.next_proposal is not None:
            ks[s.request_id] = len(s.next_proposal.drafts)
    # NOTE: sent before the verify of group 1, collected after it: the draft works while the
    # target does. Group 2's pending pairs are from its own last verify, already committed.
    collect = _propose_later(draft, second, ks)
    out = _verify_and_commit(target, first, ks)
    proposals = collect()
    for s in second:
        s.next_proposal = proposals.get(s.request_id)
        if s.next_proposal is None:
            ks[s.request_id] = 0                 # its draft call failed: a target-only step this round
    # Group 1's next round: drafted while the target verifies group 2.
    again = [s for s in first if s.finish_reason is None and s.drafting]
    next_ks = round_ks(again, draft, costs)
    collect_next = _propose_later(draft, again, next_ks)
    out.update(_verify_and_commit(target, second, ks))
    later = collect_next()
    for s in again:
        s.next_proposal = later.get(s.request_id)
    return out


def _propose_now(draft: DraftPort, seqs: list[Sequence], ks: dict[str, int]) -> None:
    """Drafts for ``seqs`` at once (a pipeline start), kept as their next proposals."""
    asking = [s for s in seqs if ks[s.request_id] > 0]
    if asking:
        for s, p in zip(asking, draft.propose(propose_requests(asking, ks))):
            took_proposal(s)
            s.next_proposal = p


def _propose_later(draft: DraftPort, seqs: list[Sequence], ks: dict[str, int]):
    """Send the Propose of ``seqs`` now; the returned collector waits for it and gives the
    proposals by request id (none for an item or a call that failed: the port records why)."""
    asking = [s for s in seqs if ks[s.request_id] > 0]
    if not asking:
        return lambda: {}
    send = getattr(draft, "propose_async", None)
    reqs = propose_requests(asking, ks)
    if send is None:                                  # an in-process draft: no overlap, same tokens
        done = draft.propose(reqs)
        collect = lambda: done                        # noqa: E731
    else:
        collect = send(reqs)

    def results() -> dict[str, Proposal]:
        got: dict[str, Proposal] = {}
        for s, p in zip(asking, collect()):
            if p is not None:
                took_proposal(s)
                got[s.request_id] = p
        return got
    return results


def _verify_and_commit(target: TargetPort, seqs: list[Sequence], ks: dict[str, int]) -> dict[str, list[int]]:
    """Verify ``seqs`` with their next proposals (consumed), commit; tokens emitted per request."""
    if not seqs:
        return {}
    reqs = []
    for s in seqs:
        p, s.next_proposal = s.next_proposal, None
        if p is None:
            ks[s.request_id] = 0
        reqs.append(VerifyRequest(s.request_id, p.drafts if p is not None else _EMPTY,
                                  p.draft_probs if p is not None else None, hidden=s.drafting))
    return {s.request_id: commit_result(s, ks[s.request_id], res) for s, res in zip(seqs, target.verify(reqs))}
