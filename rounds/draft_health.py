"""Draft failure -> target-only fallback, reconnect, and re-prefill of the draft.

Owns: whether speculation is available, where the draft lives (the
configured ``draft_address``, or the ``host:port`` in ``draft_address_file``,
re-read every poll: writing a new address there moves the orchestrator to
that draft), the reconnect loop, and re-attaching the live requests to a
draft that came back.

How it works:
- The scheduler calls ``lost`` (its ``on_draft_lost`` hook) when a whole
  draft call fails (broken stream, no answer within the worker timeout, a
  failed release). By then every request runs target-only: the round that
  failed is re-run without drafts, so no stream is interrupted and greedy
  output is unchanged (the target alone decides every token).
- A thread probes the draft's GetStatus with exponential backoff
  (``BACKOFF_S``). A draft that answers, serves (LOADED/READY) and matches the
  target's vocabulary and hidden size is attached at a round boundary:
    1. every request id the draft still holds is released (a stalled draft
       that recovers still has the caches of requests that went on without it);
    2. each live request's draft cache is rebuilt from the target's hidden
       states: the target prefills prompt + output[:-1] under a shadow id
       (``<id>~resync``, ``resume_token`` = the last output token, so nothing
       is sampled), the draft prefills those pairs exactly as at admission,
       and the shadow is released. The request's own target cache is never
       touched, so its output stays bit-identical to target-only decoding.
       A shadow needs a free target slot; requests that find none (a full
       target) finish target-only;
    3. the scheduler's draft port is set again: speculation resumes.
  (The target has no "give me hidden states" RPC: a shadow prefill computes
  them without disturbing the live cache.)

Threads: ``lost`` runs on the scheduler thread; ``check_address`` /
``set_address`` on any thread; re-attaching runs on the scheduler thread via
``Scheduler.at_round_boundary``.

Must not know: gRPC (clients come from ``make_client``), how rounds run.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import structlog

from rounds.guards import GuardedDraft
from rounds.scheduler import Scheduler
from rounds.scheduler_types import ItemFailures, RequestError
from runtime.round_driver import Sequence, attach_draft, prefill_request, set_prompt_pairs
from specsplit.v1 import common_pb2

log = structlog.get_logger("rounds.draft_health")

SHADOW_SUFFIX = "~resync"
BACKOFF_S = (0.1, 1.0)              # first retry delay, longest delay (doubling in between)
_SERVING = (common_pb2.LIFECYCLE_STATE_LOADED, common_pb2.LIFECYCLE_STATE_READY)


def read_address_file(path: str | None) -> str | None:
    """The first non-empty line of ``path`` (``host:port``), or None when unset, missing or empty."""
    if not path:
        return None
    try:
        for line in Path(path).read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                return line.strip()
    except OSError:
        return None
    return None


def resync(target: Any, draft: Any, seqs: list[Sequence]) -> int:
    """Rebuild the draft caches of live ``seqs`` from shadow target prefills; returns how many
    were attached. Raises when a whole call fails (the sequences then stay target-only)."""
    todo = [s for s in seqs if s.output and s.finish_reason is None]
    attached = 0
    while todo:
        reqs = [prefill_request(s, True, s.request_id + SHADOW_SUFFIX) for s in todo]
        errors: dict[str, RequestError] = {}
        try:
            results = target.prefill(reqs)
        except ItemFailures as exc:
            results, errors = exc.results, exc.errors
        ok = [(s, q, r) for s, q, r in zip(todo, reqs, results) if r is not None]
        try:
            for s, q, r in ok:
                set_prompt_pairs(s, q, r)              # the pairs exactly as at admission
            draft_errors: dict[str, RequestError] = {}
            attach_draft(GuardedDraft(draft, draft_errors), [s for s, _, _ in ok])
            for s, _, _ in ok:
                if s.request_id in draft_errors:
                    s.drafting = False
                    log.warning("resync_refused", request_id=s.request_id, error=draft_errors[s.request_id].message)
                else:
                    attached += 1
        finally:
            # NOTE: always free the shadows, also when the draft failed: they hold target slots.
            for _, q, _ in ok:
                try:
                    target.release(q.request_id)
                except Exception as exc:  # noqa: BLE001 - the next resync's flush cannot see it; log it
                    log.warning("shadow_release_failed", request_id=q.request_id, error=str(exc))
        # Requests that found no free target slot try again now that the shadows are freed.
        todo = [s for s, q in zip(todo, reqs) if q.request_id in errors and errors[q.request_id].code ==
                "RESOURCE_EXHAUSTED"] if ok else []
    return attached


class DraftLink:
    """The orchestrator's link to its draft: availability, address, reconnect, re-attach."""

    def __init__(self, scheduler: Scheduler, make_client: Callable[[str], Any], address: str | None,
                 address_file: str | None = None, probe_timeout_s: float = 2.0,
                 target_status: Callable[[], Any] = lambda: None,
                 on_change: Callable[[bool], None] = lambda available: None) -> None:
        self.scheduler, self._make_client = scheduler, make_client
        self.address_file, self.probe_timeout_s = address_file, probe_timeout_s
        self._target_status, self._on_change = target_status, on_change
        self.address = read_address_file(address_file) or address
        self.client: Any = make_client(self.address) if self.address else None
        self.available = False
        self.last_error = "not connected yet"
        self.reconnects = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draft-reconnect", daemon=True)
        scheduler.on_draft_lost = self.lost
        scheduler.set_draft(None)                    # until the first successful probe

    # --- lifetime -------------------------------------------------------------------------
    def start(self) -> None:
        """Connect now if the draft is there (before the scheduler runs), then keep watching."""
        client = self.client
        if client is not None and self._usable(client) is not None:
            self.scheduler.set_draft(client)         # scheduler not started: no round in flight
            self._set_available(True, "")
        self._thread.start()
        if not self.available:
            self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5.0)
        if self.client is not None:
            self.client.close()

    # --- events -----------------------------------------------------------------------------
    def lost(self, err: RequestError) -> None:
        """Scheduler hook: a draft call failed and every request now runs target-only."""
        log.warning("draft_unavailable", address=self.address, error=err.message)
        self._set_available(False, err.message)
        self._wake.set()

    def check_address(self) -> None:
        """Re-read ``draft_address_file`` (called by the orchestrator's poller)."""
        new = read_address_file(self.address_file)
        if new and new != self.address:
            self.set_address(new)

    def set_address(self, address: str) -> None:
        """Move to the draft at ``address``: detach from the old one at a round boundary, then attach."""
        with self._lock:
            if address == self.address:
                return
            old, self.address, self.client = self.client, address, self._make_client(address)
        log.info("draft_address_changed", address=address)

        def detach() -> None:
            sched = self.scheduler
            if sched.draft is not None:
                sched.draft_failed(RequestError("UNAVAILABLE", f"draft moved to {address}"))
            if old is not None:
                old.close()
        self.scheduler.at_round_boundary(detach)
        self._wake.set()

    def attach_now(self, timeout: float) -> bool:
        """Attach the draft at the current address at the next round boundary if it serves now
        (waits up to ``timeout``); False: the reconnect loop goes on trying. An address change
        (``set_address``) then takes effect before its caller answers, instead of a round or a
        backoff later, so requests admitted right after it draft."""
        client = self.client
        st = self._usable(client) if client is not None else None
        # NOTE: queued after set_address's detach: boundary calls run in order, so the old
        # draft is gone before this one attaches (``_attach`` is a no-op if the loop won).
        return st is not None and self._attach_at_boundary(client, st, timeout)

    def _set_available(self, available: bool, error: str) -> None:
        changed = available != self.available
        self.available, self.last_error = available, error
        if changed:
            self._on_change(available)

    # --- reconnecting -------------------------------------------------------------------------
    def _usable(self, client: Any) -> Any:
        """The draft's status if it can serve next to this target, else None (``last_error`` says why)."""
        try:
            st = client.get_status(timeout=self.probe_timeout_s)
        except RequestError as exc:
            self.last_error = exc.message
            return None
        if st.state not in _SERVING:
            self.last_error = f"draft at {self.address} is not serving (state {common_pb2.LifecycleState.Name(st.state)})"
            return None
        t = self._target_status()
        if t is not None and (t.vocab_size, t.hidden_size) != (st.vocab_size, st.hidden_size):
            self.last_error = (f"draft at {self.address} does not match the target: vocab/hidden "
                               f"{st.vocab_size}/{st.hidden_size} vs {t.vocab_size}/{t.hidden_size}")
            return None
        return st

    def _run(self) -> None:
        delay = BACKOFF_S[0]
        while not self._stop.is_set():
            self._wake.wait(None if self.available else delay)
            self._wake.clear()
            if self._stop.is_set():
                return
            if self.available:
                delay = BACKOFF_S[0]
                continue
            self.check_address()
            client = self.client
            st = self._usable(client) if client is not None else None
            if st is not None and self._attach_at_boundary(client, st):
                delay = BACKOFF_S[0]
                continue
            delay = min(delay * 2, BACKOFF_S[1])

    def _attach_at_boundary(self, client: Any, status: Any, timeout: float | None = None) -> bool:
        fut = self.scheduler.at_round_boundary(lambda: self._attach(client, status))
        deadline = None if timeout is None else time.monotonic() + timeout
        while not fut.done():
            if self._stop.wait(0.05) or (deadline is not None and time.monotonic() > deadline):
                return False
        try:
            return bool(fut.result())
        except Exception as exc:  # noqa: BLE001 - stay target-only, retry later
            self.last_error = f"re-attach failed: {exc}"
            log.warning("draft_reattach_failed", address=self.address, error=str(exc))
            return False

    def _attach(self, client: Any, status: Any) -> bool:
        """Scheduler thread (round boundary): release what the draft holds, resync live requests, resume."""
        sched = self.scheduler
        if client is not self.client or sched.draft is not None:
            return sched.draft is client
        t0 = time.perf_counter()
        held = list(client.get_status(timeout=self.probe_timeout_s).active_request_ids)
        if held:
            # NOTE: before any prefill: a draft that stalled and recovered still holds the caches
            # of requests that went on without it (this orchestrator is the draft's only client).
            client.release_many(held)
        live = [(req, seq) for req, seq in sched.live_sequences() if req.k > 0 and status.max_k > 0]
        for req, seq in live:
            seq.k = min(req.k, status.max_k)
        try:
            attached = resync(sched.target, client, [seq for _, seq in live])
        except Exception:
            for _, seq in live:                      # a partial resync: all stay target-only
                seq.drafting = False
            raise
        sched.set_draft(client)
        self.reconnects += 1
        self._set_available(True, "")
        log.info("draft_reattached", address=self.address, live=len(live), resynced=attached,
                 released=len(held), seconds=round(time.perf_counter() - t0, 4))
        return True
