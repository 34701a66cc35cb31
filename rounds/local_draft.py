"""The draft port over a draft worker in this process (a target started with ``colocated_draft``).

Owns: ``LocalDraft``: what ``rounds.draft_client.DraftClient`` does for a draft across the
network — prefill, propose, deferred releases, status — as direct calls on the draft worker
that shares this process, with the same error contract (per-item errors -> ``ItemFailures``,
a failed whole call -> an exception the scheduler treats as a lost draft). The draft link
(``rounds.draft_health``) attaches, loses and re-attaches it exactly as it does a remote one.

Why: with both workers on one GPU, two processes take turns on the device (their contexts
time-slice), and every round pays an exchange between them: encoding the hidden rows, a
socket round trip, two interpreters' wake-ups. In one process the round calls the draft
engine as the in-process engine does; hidden rows stay the numpy arrays the target returned.

Must not know: gRPC stubs, the draft worker's class (duck-typed: ``prefill``, ``propose``,
``release``, ``status``; ``rounds`` may not import ``worker``), frameworks, scheduling.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from rounds.scheduler_types import RequestError, error_of, local_results
from runtime.types import DraftPrefillRequest, Proposal, ProposeRequest


class LocalDraft:
    """``DraftPort`` (and what the draft link asks of a client) over an in-process draft worker.

    ``status`` gives the worker's status as the wire's ``WorkerStatus`` (the draft link reads
    that message from any client). ``inline``: run the draft's steps on the round loop's thread
    when the draft's device thread is idle; off when the draft is on another device than the
    target (the loop's thread has one current device, the target's). ``drafts_on_device``
    (inline only): greedy drafts stay on the device for the verify (``ProposeRequest.on_device``,
    ``runtime.device_drafts``).
    """

    def __init__(self, worker: Any, status: Callable[[], Any], address: str, *, inline: bool = True,
                 drafts_on_device: bool = False) -> None:
        self.worker, self._status, self.address, self.inline = worker, status, address, inline
        self.drafts_on_device = inline and drafts_on_device
        self.last_compute_seconds: float | None = None
        self._pending_release: list[str] = []
        self._round = 0

    # --- what the draft link asks ------------------------------------------------------------
    def get_status(self, timeout: float | None = None) -> Any:
        """The draft worker's status (never waits for its device work; ``timeout`` unused)."""
        return self._status()

    def release_many(self, request_ids: list[str]) -> list[str]:
        return self._whole("Release", lambda: self.worker.release(list(request_ids), inline=self.inline))

    def reset_streams(self) -> None:
        """Nothing to reset: no stream."""

    def close(self) -> None:
        """Nothing to close: the worker belongs to the service that hosts it."""

    # --- port ---------------------------------------------------------------------------------
    def release(self, request_id: str) -> bool:
        """Free a request's draft cache before the next prefill or propose (as a remote draft's
        releases ride on the next message); ``flush_releases`` frees what is left."""
        self._pending_release.append(request_id)
        return True

    def flush_releases(self) -> None:
        ids, self._pending_release = self._pending_release, []
        if ids:
            self.release_many(ids)

    def prefill(self, reqs: list[DraftPrefillRequest]) -> None:
        # NOTE: releases first: a finished request id that joins again must find its old cache gone.
        self.flush_releases()
        self.last_compute_seconds = None                      # a prefill reports no round compute
        local_results("draft", reqs, self._whole(
            "Prefill", lambda: self.worker.prefill(list(reqs), inline=self.inline)))

    def propose(self, reqs: list[ProposeRequest]) -> list[Proposal]:
        self.flush_releases()
        self._round += 1
        t0 = time.perf_counter()
        try:
            return local_results("draft", reqs, self._whole(
                "Propose", lambda: self.worker.propose(list(reqs), self._round, inline=self.inline)))
        finally:
            self.last_compute_seconds = time.perf_counter() - t0

    def propose_async(self, reqs: list[ProposeRequest]) -> Callable[[], list[Proposal]]:
        """The Propose queued on the draft's device thread; the returned function waits for the
        proposals. What the round does meanwhile (the target's verify: ahead drafting, the other
        micro-batch, a watch probe's step) runs beside it, on this thread.

        With the draft on the target's device (``inline``) it runs now instead, and the function
        returns its proposals: one device runs the two steps' kernels in turn anyway, and two
        threads of one process overlapping their host work contend for the interpreter (2-core
        CPU: the verify beside a queued ahead Propose took 8.7 ms against 6.1 alone,
        docs/performance.md § Session 26)."""
        if self.inline:
            proposals = self.propose(reqs)
            return lambda: proposals
        self.flush_releases()
        self._round += 1
        self.last_compute_seconds = None                     # an overlapped call is not a round part
        wait = self._whole("Propose", lambda: self.worker.propose_async(list(reqs), self._round))
        return lambda: local_results("draft", reqs, self._whole("Propose", wait))

    # --- errors ----------------------------------------------------------------------------------
    @staticmethod
    def _whole(what: str, call: Callable[[], Any]) -> Any:
        """``call()``; a whole call's failure (no weights loaded, say) raised as the RequestError a
        remote draft's status would give (the scheduler then runs on without the draft)."""
        try:
            return call()
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure of the call is the draft's
            err = error_of(exc)
            raise RequestError(err.code, f"draft {what}: {err.message}") from exc
