"""Continuous batching of generation requests over the speculative round.

Owns: the bounded admission queue, the live batch, the one scheduler thread,
each request's event queue, cancellation at round boundaries, per-request
failures, and the per-round time split (draft compute, target compute,
everything else). The round itself is ``runtime.round_driver`` (admit,
run_round, release), the prefills of joining requests ``rounds.admission``;
this module decides *who* is in each round and when.

Worker failures: with ``on_draft_lost`` set (``rounds.draft_health``), a
failed draft call never ends a request: the round re-runs target-only and
every request goes on without drafts until the handler re-attaches a draft.
A failed target call ends the requests of that call with UNAVAILABLE at once;
their target caches are freed when the target answers again, before anyone
joins (``_flush_unreleased``), so no stream waits on a dead target.

Must not know: gRPC, protobuf, tensor frameworks. It drives any
``TargetPort``/``DraftPort``: the gRPC stream clients in the service, the
in-process engines in tests. Ports report failures through the small error
contract below (``RequestError``, ``WorkerUnavailable``, ``ItemFailures``).

Threads: ``submit``/``cancel``/``snapshot`` are called from gRPC handler
threads; everything else (ports, sequences) is touched only by the
scheduler thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import structlog

from rounds.admission import Admission, _Live
from rounds.guards import GuardedDraft, GuardedTarget
from runtime.adaptive_k import AdaptiveLoop
from runtime.micro_batch import run_round_micro
from runtime.round_driver import DraftPort, SeqStats, Sequence, TargetPort, detach_draft, run_round
from rounds.scheduler_types import (  # noqa: F401 (the names callers import from here, re-exported)
    ErrorEvent, Event, EventOutbox, FinalEvent, GenerationRequest, ItemFailures, NullObserver, Observer, QueueFull,
    RequestError, RequestHandle, RoundTiming, TimingTotals, TokensEvent, WorkerUnavailable, error_of)

log = structlog.get_logger("rounds.scheduler")

FINISH_CANCELLED = "cancelled"
FINISH_ABORTED = "aborted"           # ended by a weight reload with policy ABORT (partial output kept)


# --- the scheduler -----------------------------------------------------------------
class Scheduler(Admission):
    """One thread running rounds over up to ``max_batch`` live sequences."""

    def __init__(self, target: TargetPort, draft: DraftPort | None, *, max_batch: int, max_queue: int,
                 eos_token_id: int | None, weights_version: str = "", observer: Observer | None = None,
                 adaptive_k: bool = False, ahead: bool = False, micro_batches: bool = False,
                 eos_token_ids: tuple[int, ...] = (), watch_probes: bool = True) -> None:
        self.target, self.draft = target, draft
        self.max_batch, self.max_queue = max_batch, max_queue
        self.eos_token_id = eos_token_id
        self.eos_token_ids = tuple(eos_token_ids)    # all of the model's EOS ids (the first is eos_token_id)
        self.weights_version = weights_version
        self.observer: Observer = observer or NullObserver()
        self.timing = TimingTotals()
        # Adaptive speculation length: per-request policies share the loop's round-cost estimates.
        self.costs: AdaptiveLoop | None = AdaptiveLoop(watch=watch_probes) if adaptive_k else None
        self.ahead = ahead                           # ahead drafting (runtime.round_driver.run_round)
        self.micro_batches = micro_batches           # two micro-batches overlapped (runtime.micro_batch)
        self.round = 0
        self._cv = threading.Condition()
        self._waiting: list[RequestHandle] = []
        self._running: list[_Live] = []
        self._n_running = 0                          # len(_running), readable under _cv
        self._controls: list[tuple[Callable[[], Any], Future]] = []
        self._stopping = False
        self._paused = False                         # admission paused (weight reload); see pause_admission
        self._parked: list[_Live] = []               # RECOMPUTE: out of the batch, caches released, to resume
        # Draft failures (rounds.draft_health sets this): with a handler, a failed draft
        # call degrades every request to target-only decoding instead of ending any of them.
        self.on_draft_lost: Callable[[RequestError], None] | None = None
        self._unreleased: set[str] = set()           # target caches of requests a failed target call ended
        self._dirty: set[EventOutbox] = set()        # outboxes holding events not flushed yet
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="specsplit-scheduler", daemon=True)

    # --- called from handler threads ---------------------------------------------
    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    @property
    def speculation_available(self) -> bool:
        return self.draft is not None

    def submit(self, req: GenerationRequest, outbox: EventOutbox | None = None) -> RequestHandle:
        """Queue a request; raises ``QueueFull`` when max_batch live + max_queue waiting are taken.
        ``outbox``: its events go there, flushed at round boundaries (``EventOutbox``)."""
        handle = RequestHandle(req, self._wake, outbox)
        with self._cv:
            if self._stopping:
                raise WorkerUnavailable("the orchestrator is shutting down")
            if len(self._waiting) + self._n_running >= self.max_batch + self.max_queue:
                raise QueueFull(f"admission queue full: {self._n_running} requests running, "
                                f"{len(self._waiting)} waiting (max_queue={self.max_queue})")
            self._waiting.append(handle)
            self._cv.notify()
        return handle

    @property
    def admission_paused(self) -> bool:
        return self._paused

    @property
    def stopping(self) -> bool:
        """``stop`` was called: nothing joins any more."""
        return self._stopping

    def snapshot(self) -> tuple[int, int]:
        """(active, queued) request counts."""
        with self._cv:
            return self._n_running, len(self._waiting)

    def at_round_boundary(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the scheduler thread between two rounds (no round in flight);
        the future holds its result. Lifecycle work (reload, recovery) goes through here."""
        fut: Future = Future()
        with self._cv:
            if self._stopping:
                fut.set_exception(WorkerUnavailable("the orchestrator is shutting down"))
                return fut
            self._controls.append((fn, fut))
            self._cv.notify()
        return fut

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; waiting and live requests end with UNAVAILABLE and are released."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.ident is None:           # never started: end what is queued here
            self._shutdown()
        else:
            self._thread.join(timeout)

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    # --- weight reload hooks (orchestrator.reload drives them) ------------------------
    def pause_admission(self) -> None:
        """No waiting request joins the batch until ``resume_admission``; running ones go on."""
        with self._cv:
            self._paused = True

    def resume_admission(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify()

    def abort_running(self) -> int:
        """Scheduler thread only (``at_round_boundary``): end every running request with
        finish reason "aborted" and its partial output (slots freed). Returns how many."""
        lives = list(self._running)
        for live in lives:
            s = live.seq
            self._end(live, FinalEvent(FINISH_ABORTED, tuple(s.output), len(s.prompt), s.stats,
                                       self.weights_version), code="OK")
        return len(lives)

    def park_running(self) -> int:
        """Scheduler thread only: take every running request out of the batch and free its
        caches on both workers (they are rebuilt by ``resume_parked``). Returns how many."""
        parked, self._running = self._running, []
        for live in parked:
            self._release(live)
        self._parked.extend(parked)
        return len(parked)

    def resume_parked(self, weights_version: str | None = None) -> int:
        """Scheduler thread only: set the serving version, then re-prefill each parked request
        (prompt + output so far, ``admit(resume=True)``) and put it back in the batch.
        Returns how many resumed; a request a worker refuses ends with that error."""
        if weights_version is not None:
            self.weights_version = weights_version
        parked, self._parked = self._parked, []
        lives = [x for x in parked if not x.handle.cancelled]
        for live in [x for x in parked if x.handle.cancelled]:
            self._end(live, FinalEvent(FINISH_CANCELLED, tuple(live.seq.output), len(live.seq.prompt),
                                       live.seq.stats, self.weights_version), code="CANCELLED")
        if not lives:
            return 0
        self._running.extend(lives)
        failed: dict[str, RequestError] = {}
        try:
            # NOTE: the draft's pairs are the target's hidden states, which must come from the
            # weights now serving (the target re-prefills first; see _prefill_both).
            emitted = self._prefill_both(lives, failed, draft_loss_ends_them=True)
        except Exception as exc:  # noqa: BLE001 - the whole re-prefill failed: they all end
            failed.update({x.seq.request_id: error_of(exc) for x in lives})
            emitted = {}
        self._join(lives, emitted, failed, "resumed")
        return len(lives) - len(failed)

    # --- the scheduler thread ------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or (self._waiting and not self._paused) or self._running
                           or self._controls):
                    self._cv.wait()
                if self._stopping:
                    break
                controls, self._controls = self._controls, []
            # NOTE: control work first: it must see no round in flight and may
            # change the ports or the live set before anyone new joins.
            for fn, fut in controls:
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
            try:
                self._step()
            except Exception as exc:  # noqa: BLE001 - the thread must survive anything
                log.exception("scheduler_step_failed", round=self.round)
                for live in list(self._running):
                    self._end_error(live, error_of(exc))
            # NOTE: once per boundary, after the round's events and the finished requests'
            # final events: their readers wake once for all of them.
            self._flush()
        self._shutdown()

    def _put(self, handle: RequestHandle, ev: Event) -> None:
        box = handle.push(ev)
        if box is not None:
            self._dirty.add(box)

    def _flush(self) -> None:
        for box in self._dirty:
            box.flush()
        self._dirty.clear()

    def _step(self) -> None:
        # NOTE: cancellations are honoured before admission so a cancelled
        # request's slots are free for the requests joining this boundary.
        for live in [x for x in self._running if x.handle.cancelled]:
            self._end(live, FinalEvent(FINISH_CANCELLED, tuple(live.seq.output), len(live.seq.prompt),
                                       live.seq.stats, self.weights_version), code="CANCELLED")
        with self._cv:
            dropped = [h for h in self._waiting if h.cancelled]
            self._waiting = [h for h in self._waiting if not h.cancelled]
            room = 0 if self._paused else max(self.max_batch - len(self._running), 0)
            joining, self._waiting = self._waiting[:room], self._waiting[room:]
            self._n_running = len(self._running) + len(joining) + len(self._parked)
        for h in dropped:
            self._put(h, FinalEvent(FINISH_CANCELLED, (), len(h.request.prompt), SeqStats(), self.weights_version))
            self.observer.on_outcome(FINISH_CANCELLED, "CANCELLED")
        if joining:
            self._admit(joining)
        live = [x for x in self._running if x.seq.finish_reason is None]
        if live:
            self._run_round(live)
        self._retire()
        with self._cv:
            self._n_running = len(self._running) + len(self._parked)
            active, queued = self._n_running, len(self._waiting)
        self.observer.on_load(active, queued)

    def _run_round(self, live: list[_Live]) -> None:
        self.round += 1
        failed: dict[str, RequestError] = {}
        target = GuardedTarget(self.target, failed)
        draft = GuardedDraft(self.draft, failed) if self.draft is not None else None
        before = {x.seq.request_id: (x.seq.stats.drafted, x.seq.stats.accepted, x.seq.stats.watch_probes)
                  for x in live}
        t0 = time.perf_counter()
        try:
            seqs = [x.seq for x in live]
            emitted = (run_round_micro(target, draft, seqs, self.costs) if self.micro_batches
                       else run_round(target, draft, seqs, self.costs, self.ahead))
        except Exception as exc:  # noqa: BLE001
            err = error_of(exc)
            # NOTE: Propose runs before Verify and the round driver changes no sequence
            # until Propose returns; so a failed Propose leaves every sequence as it was
            # and only the ones the draft holds end (their draft state is unknown). A
            # failed Verify leaves the target's state unknown for everyone in the round.
            propose_failed = draft is not None and draft.raised
            if propose_failed and self.on_draft_lost is not None:
                # Fallback: the same round again, target-only, for everyone (nothing changed yet).
                self.draft_failed(err)
                self.round -= 1
                return self._run_round(live)
            victims = [x for x in live if x.seq.drafting] if propose_failed else live
            log.warning("round_failed", round=self.round, error=str(err), batch=len(live), failed=len(victims))
            if not propose_failed and isinstance(exc, WorkerUnavailable):
                # NOTE: a dead or stalled target: tell the clients now and free its caches once
                # it answers again (_flush_unreleased), so no stream waits on a release timeout.
                self._unreleased.update(x.seq.request_id for x in victims)
            for x in victims:
                self._end_error(x, err)
            return
        wall = time.perf_counter() - t0
        if draft is not None and draft.deferred is not None:
            # NOTE: the round itself committed (the verify ran); only the ahead call failed.
            # The draft is treated as lost from the next round on, like a failed Propose.
            err = error_of(draft.deferred)
            if self.on_draft_lost is not None:
                self.draft_failed(err)
            else:
                log.warning("ahead_failed", round=self.round, error=err.message)
        draft_s = draft.compute_s if draft is not None else 0.0
        timing = RoundTiming(self.round, len(live), draft_s, target.compute_s,
                             max(wall - draft_s - target.compute_s, 0.0), wall)
        self.timing.add(timing)
        if self.costs is not None:
            k_max = max((x.seq.stats.drafted - before[x.seq.request_id][0] for x in live), default=0)
            self.costs.observe(k_max, draft_s, target.compute_s, timing.overhead_s, t0,
                               frozenset(x.seq.request_id for x in live),
                               watched=any(x.seq.stats.watch_probes > before[x.seq.request_id][2] for x in live))
        ks_acc = []
        for x in live:
            rid = x.seq.request_id
            if rid in failed:
                self._end_error(x, failed[rid])
                continue
            d0, a0, _ = before[rid]
            nd, na = x.seq.stats.drafted - d0, x.seq.stats.accepted - a0
            ks_acc.append((nd, na))
            self._push_tokens(x, emitted.get(rid, []), na, nd, timing, last=x.seq.finish_reason is not None)
        self.observer.on_round(timing, ks_acc)

    def _push_tokens(self, live: _Live, tokens: list[int], accepted: int, drafted: int,
                     timing: RoundTiming | None = None, last: bool = False) -> None:
        """``last``: the request finished in this round (``_retire`` ends it after the round), so a
        stream may carry these tokens with the final event instead of on their own."""
        if tokens:
            live.streamed.extend(tokens)
            self._put(live.handle, TokensEvent(tuple(tokens), self.round, accepted, drafted, self.weights_version,
                                               timing, last))

    def _retire(self) -> None:
        for live in [x for x in self._running if x.seq.finish_reason is not None]:
            s = live.seq
            self._end(live, FinalEvent(s.finish_reason, tuple(s.output), len(s.prompt), s.stats,
                                       self.weights_version), code="OK")

    # --- leaving the batch ---------------------------------------------------------------
    def _release(self, live: _Live) -> None:
        seq = live.seq
        # A request ended by a failed target call is freed there by _flush_unreleased once the
        # target answers again; each worker's release is tried on its own.
        if seq.request_id not in self._unreleased:
            try:
                self.target.release(seq.request_id)
            except Exception as exc:  # noqa: BLE001 - a dead worker's slots are gone anyway
                log.warning("release_failed", request_id=seq.request_id, round=self.round, error=str(exc))
        if self.draft is not None and seq.drafting:
            try:
                self.draft.release(seq.request_id)
            except Exception as exc:  # noqa: BLE001
                log.warning("release_failed", request_id=seq.request_id, round=self.round, worker="draft",
                            error=str(exc))
                if self.on_draft_lost is not None:
                    self.draft_failed(error_of(exc))
        seq.drafting = False

    def _flush_draft_releases(self) -> None:
        """The loop is going idle (``_end`` of the last request running): send the draft releases
        that would otherwise wait for the next round message."""
        flush = getattr(self.draft, "flush_releases", None)
        if flush is None:
            return
        try:
            flush()
        except Exception as exc:  # noqa: BLE001 - a dead draft's slots are gone anyway
            log.warning("release_failed", round=self.round, worker="draft", error=str(exc))
            if self.on_draft_lost is not None:
                self.draft_failed(error_of(exc))

    def _flush_unreleased(self) -> None:
        """Free the target caches of requests ended by a failed target call (raises if it still fails)."""
        if not self._unreleased:
            return
        ids = sorted(self._unreleased)
        many = getattr(self.target, "release_many", None)
        if many is not None:
            many(ids)                                # one call: one deadline, however many ids
        else:
            for rid in ids:
                self.target.release(rid)
        self._unreleased.difference_update(ids)

    # --- draft fallback and recovery (driven by rounds.draft_health) -------------------
    def draft_failed(self, err: RequestError) -> None:
        """Scheduler thread only: the draft is gone (a whole call failed, or its address changed):
        every request goes on target-only and the handler (``on_draft_lost``) reconnects."""
        if self.draft is None:
            return
        log.warning("draft_lost", round=self.round, error=err.message, live=len(self._running))
        self.draft = None
        for x in self._running:
            detach_draft(x.seq)
        if self.on_draft_lost is not None:
            self.on_draft_lost(err)

    def live_sequences(self) -> list[tuple[GenerationRequest, Sequence]]:
        """Scheduler thread only: (request, sequence) of every request still decoding."""
        return [(x.handle.request, x.seq) for x in self._running
                if x.seq.finish_reason is None and not x.handle.cancelled]

    def set_draft(self, draft: DraftPort | None) -> None:
        """Scheduler thread only: the draft port rounds use from now on (None: target-only)."""
        self.draft = draft

    def fail_request(self, request_id: str, err: RequestError) -> None:
        """Scheduler thread only: end a running request with ``err`` (its slots are released)."""
        for x in list(self._running):
            if x.seq.request_id == request_id:
                self._end_error(x, err)

    def _end(self, live: _Live, event: Event, code: str) -> None:
        # NOTE: free the workers' slots before telling the client. The target's release is a
        # call; the draft's rides on its next round message, so when this was the last request
        # running (no message follows soon) it is flushed here, first: a client that sees the
        # last stream end finds every slot free. With others still running, the draft frees
        # it with the next round's message, a round later. Regression: CI saw a draft slot
        # still held right after a batch-1 request ended (the flush came after the event).
        self._release(live)
        if live in self._running:
            self._running.remove(live)
            with self._cv:
                self._n_running -= 1
        if not self._running and not self._stopping:
            self._flush_draft_releases()
        self._put(live.handle, event)
        reason = event.finish_reason if isinstance(event, FinalEvent) else None
        self.observer.on_outcome(reason, code)
        log.info("finished", request_id=live.seq.request_id, round=self.round, finish_reason=reason, code=code,
                 completion_tokens=len(live.seq.output), rounds=live.seq.stats.rounds)

    def _end_error(self, live: _Live, err: RequestError) -> None:
        log.warning("request_failed", request_id=live.seq.request_id, round=self.round, code=err.code,
                    error=err.message)
        self._end(live, ErrorEvent(err.code, err.message, tuple(live.streamed)), code=err.code)

    def _shutdown(self) -> None:
        err = WorkerUnavailable("the orchestrator is shutting down")
        parked, self._parked = self._parked, []
        for live in list(self._running) + parked:
            self._end_error(live, err)
        with self._cv:
            waiting, self._waiting = self._waiting, []
            controls, self._controls = self._controls, []
            self._n_running = 0
        for h in waiting:
            self._put(h, ErrorEvent(err.code, err.message, ()))
        self._flush()
        for _fn, fut in controls:
            fut.set_exception(err)
