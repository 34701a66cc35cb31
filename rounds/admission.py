"""Admission into the scheduler's live batch: both workers' prefills and who joins.

Owns: a request's ``Sequence`` (with adaptive k, its policy from the loop's prior
unless it asked for a fixed k), the live-batch record ``_Live``, the target's
prefill of joining and resumed requests, the draft's prefill of those that draft,
and each request's outcome of them: it joins the batch and streams what its prefill
emitted, or ends with its item's error. ``Admission`` is a part of
``rounds.scheduler.Scheduler`` (its mixin), run on the scheduler thread between rounds.

Must not know: the round itself, streaming beyond the prefill's tokens, reload
policies (the scheduler decides when requests are parked and resumed), gRPC,
tensor frameworks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import structlog

from rounds.guards import GuardedDraft, GuardedTarget
from rounds.scheduler_types import RequestError, RequestHandle, WorkerUnavailable, error_of
from runtime.round_driver import Sequence, admit, attach_draft

log = structlog.get_logger("rounds.scheduler")


@dataclass
class _Live:
    handle: RequestHandle
    seq: Sequence
    streamed: list[int] = field(default_factory=list)


class Admission:
    """The scheduler's admission steps (``rounds.scheduler.Scheduler`` provides the state they use:
    ``target``, ``draft``, ``costs``, ``_running``, ``round`` and the event methods)."""

    def _new_sequence(self, h: RequestHandle) -> Sequence:
        r = h.request
        k = r.k if self.draft is not None else 0
        seq = Sequence(r.request_id, np.asarray(r.prompt, dtype=np.int64), r.params, k, self.eos_token_id,
                       output=list(r.resume_output), eos_token_ids=self.eos_token_ids)
        if self.costs is not None and not r.fixed_k:
            seq.adaptive = self.costs.loop.new_policy(r.k)    # the loop's prior (runtime.adaptive_k)
        return seq

    def _admit(self, joining: list[RequestHandle]) -> None:
        lives = [_Live(h, self._new_sequence(h)) for h in joining]
        failed: dict[str, RequestError] = {}
        try:
            # NOTE: caches of requests a failed target call ended are freed before anyone
            # joins: a retry under the same request id must not find its old cache there.
            self._flush_unreleased()
            emitted = self._prefill_target(lives, failed)
        except Exception as exc:  # noqa: BLE001 - the whole prefill call failed: only the joiners end
            err = error_of(exc)
            log.warning("prefill_failed", round=self.round, error=str(err), requests=len(lives))
            if isinstance(exc, WorkerUnavailable):   # the target may hold them after all (a stall)
                self._unreleased.update(x.seq.request_id for x in lives)
            for x in lives:
                self._running.append(x)
                self._end_error(x, err)
            return
        self._running.extend(lives)
        # NOTE: the prefill's token goes to its client before the draft's prefill runs: a
        # request's first token waits for the target alone (the draft's prefill took ~1 ms
        # of a short request's ~4 ms on the H200 host; docs/performance.md § Session 9). A
        # request whose draft prefill item then fails ends with that error after it.
        self._join(lives, emitted, failed, "admitted")
        self._flush()
        joined = [x for x in lives if x.seq.request_id not in failed]
        self._prefill_draft(joined, failed, draft_loss_ends_them=False)
        for x in joined:
            if x.seq.request_id in failed:
                self._end_error(x, failed[x.seq.request_id])

    def _prefill_both(self, lives: list[_Live], failed: dict[str, RequestError], *,
                      draft_loss_ends_them: bool) -> dict[str, list[int]]:
        """The target's prefill, then the draft's for those that draft (resumed requests after a
        reload: nothing is emitted before both hold them). Returns the tokens emitted per request;
        per-item failures land in ``failed``. Raises when the whole target call fails."""
        # NOTE: target first, then the draft: the draft's prompt pairs are the target's
        # prefill hidden states. Items the target failed never reach the draft.
        emitted = self._prefill_target(lives, failed)
        self._prefill_draft(lives, failed, draft_loss_ends_them=draft_loss_ends_them)
        return emitted

    def _prefill_target(self, lives: list[_Live], failed: dict[str, RequestError]) -> dict[str, list[int]]:
        """The target's prefill (resume=True re-prefills requests that hold output: prompt +
        output so far; new ones as usual) -> the tokens emitted per request."""
        return admit(GuardedTarget(self.target, failed), None, [x.seq for x in lives], resume=True)

    def _prefill_draft(self, lives: list[_Live], failed: dict[str, RequestError], *,
                       draft_loss_ends_them: bool) -> None:
        """The draft's prefill of the requests that draft (the target prefilled them). A failed
        whole draft call either ends them (``draft_loss_ends_them``) or, with a draft link, hands
        the loss to it (the requests go on target-only); per-item failures land in ``failed``."""
        if self.draft is None:
            return
        drafting = [x.seq for x in lives
                    if x.seq.k > 0 and x.seq.finish_reason is None and x.seq.request_id not in failed]
        try:
            attach_draft(GuardedDraft(self.draft, failed), drafting)
        except Exception as exc:  # noqa: BLE001 - those requests end, or go on target-only
            err = error_of(exc)
            if self.on_draft_lost is not None and not draft_loss_ends_them:
                self.draft_failed(err)
            else:
                for s in drafting:
                    failed.setdefault(s.request_id, err)

    def _join(self, lives: list[_Live], emitted: dict[str, list[int]], failed: dict[str, RequestError],
              what: str) -> None:
        """Each prefilled request either ends with its error or streams what its prefill emitted."""
        for x in lives:
            rid = x.seq.request_id
            if rid in failed:
                self._end_error(x, failed[rid])
            else:
                log.info(what, request_id=rid, round=self.round, prompt_tokens=len(x.seq.prompt), k=x.seq.k)
                self._push_tokens(x, emitted.get(rid, []), 0, 0)
