"""The round loop, hosted next to the target (DESIGN § Topology).

Owns: the target process's scheduler (continuous batching over the
speculative round, ``rounds.scheduler``) with the in-process target
worker as its target port and the draft service as its draft port (one
persistent stream, target -> draft, one exchange per round), the draft link
(fallback to target-only and re-attach, ``rounds.draft_health``), the
Decode requests joining it, and the control actions the orchestrator's
lifecycle work needs (pause / settle / abort / park / resume, configure).

Why here: a round used to cross the orchestrator twice (Propose, then
Verify, hidden states decoded and re-encoded in between). With the loop next
to the target, a round is one local verify plus one draft exchange, and the
orchestrator only sees committed tokens, off the critical path.

Must not know: protobuf messages or servicers (``target_service/server.py``
converts), frameworks, models. Device work goes through the ``TargetWorker``.

Threads: ``submit`` / ``control`` / ``status`` run on gRPC handler threads;
the scheduler thread runs rounds; the draft link's thread reconnects.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import structlog

from rounds.draft_health import DraftLink
from rounds.scheduler import (EventOutbox, GenerationRequest, NullObserver, RequestError, RequestHandle,
                                    Scheduler)
from rounds.draft_client import DraftClient
from rounds.local_draft import LocalDraft
from rounds.scheduler_types import local_results
from worker.config import WorkerConfig, poll_seconds
from worker.service import status_to_proto
from runtime.types import PrefillRequest, PrefillResult, VerifyRequest, VerifyResult
from core.errors import FailedPrecondition
from target_service.worker import TargetWorker

log = structlog.get_logger("target.rounds")

STATUS, PAUSE, RESUME, SETTLE, ABORT, PARK, RESUME_PARKED, CONFIGURE, DRAIN, RESUME_ALL = (
    "status", "pause_admission", "resume_admission", "settle", "abort_running", "park_running", "resume_parked",
    "configure", "drain", "resume_all")
DRAIN_WAIT, DRAIN_ABORT, DRAIN_PARK = "wait", "abort", "park"
_WAIT_POLL_S = 0.01                 # DRAIN WAIT: how often the running count is looked at
DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE = 16, 64
BOUNDARY_TIMEOUT_S = 600.0          # a control action waits this long for a round boundary at most


class LocalTarget:
    """``TargetPort`` over the in-process worker: per-item errors become ``ItemFailures``."""

    def __init__(self, worker: TargetWorker) -> None:
        self.worker = worker
        self.last_compute_seconds: float | None = None
        self._round = 0

    # NOTE: the round loop's thread runs prefill, verify and release inline when the device
    # thread is idle (``DeviceThread.run``): each hop to the device thread and back is two
    # thread wake-ups, ~0.3 ms a request on a 2-core host (bench services' per-request cost).
    def prefill(self, reqs: list[PrefillRequest]) -> list[PrefillResult]:
        t0 = time.perf_counter()
        try:
            return local_results("target", reqs, self.worker.prefill(list(reqs), inline=True))
        finally:
            self.last_compute_seconds = time.perf_counter() - t0

    def verify(self, reqs: list[VerifyRequest]) -> list[VerifyResult]:
        self._round += 1
        t0 = time.perf_counter()
        try:
            return local_results("target", reqs, self.worker.verify(list(reqs), self._round))
        finally:
            self.last_compute_seconds = time.perf_counter() - t0

    def release(self, request_id: str) -> bool:
        return request_id in self.worker.release([request_id], inline=True)

    def release_many(self, request_ids: list[str]) -> list[str]:
        return self.worker.release(list(request_ids), inline=True)


def local_draft(worker: Any, target_device: str) -> LocalDraft:
    """The round loop's port to a draft worker in this process (``colocated_draft``)."""
    # NOTE: inline only on the target's device: the round loop's thread keeps one current device.
    return LocalDraft(worker, lambda: status_to_proto(worker.status()), "in-process",
                      inline=worker.cfg.runtime.device == target_device,
                      drafts_on_device=worker.cfg.colocated_device_drafts)


@dataclass(frozen=True)
class RoundsState:
    """What ControlRounds reports (fields: ``target.proto`` RoundsStatus)."""

    active_requests: int
    queued_requests: int
    speculation_available: bool
    draft_address: str
    draft_error: str
    draft_reconnects: int
    round: int
    configured: bool
    admission_paused: bool
    draft_in_process: bool = False


class RoundHost:
    """The target process's round loop: a scheduler over the local target and the remote draft."""

    def __init__(self, worker: TargetWorker, cfg: WorkerConfig, observer: Any = None,
                 local_draft: LocalDraft | None = None) -> None:
        self.worker, self.cfg, self.local_draft = worker, cfg, local_draft
        self.target = LocalTarget(worker)
        self.scheduler = Scheduler(self.target, None, max_batch=DEFAULT_MAX_BATCH, max_queue=DEFAULT_MAX_QUEUE,
                                   eos_token_id=None, observer=observer or NullObserver(),
                                   adaptive_k=cfg.spec.adaptive_k, ahead=cfg.spec.ahead_drafting,
                                   micro_batches=cfg.spec.micro_batches, watch_probes=cfg.spec.watch_probes)
        self.draft_link: DraftLink | None = None
        self.draft_timeout_s = 30.0
        self.configured = False
        self._max_batch = DEFAULT_MAX_BATCH
        self._lock = threading.Lock()            # configure vs configure
        self.scheduler.start()

    # --- requests ---------------------------------------------------------------------
    def submit(self, req: GenerationRequest, outbox: EventOutbox | None = None) -> RequestHandle:
        """Queue a request (raises ``QueueFull``); its events stream from the handle (or, with
        ``outbox``, from that: a DecodeStream's requests share one)."""
        mc = self.worker.model_cfg
        sched = self.scheduler
        sched.eos_token_id = mc.eos_token_id if mc is not None else None
        sched.eos_token_ids = mc.eos_token_ids if mc is not None else ()
        if not self.paused:
            # NOTE: while a reload holds admission, the version is the reload's to set
            # (RESUME_PARKED); otherwise rounds report what the worker serves.
            sched.weights_version = self.worker.weights_version
        self._clamp_batch()
        return sched.submit(req, outbox)

    @property
    def paused(self) -> bool:
        return self.scheduler.admission_paused

    def _clamp_batch(self) -> None:
        eng = self.worker.engine
        slots = eng.cache.max_slots if eng is not None else self._max_batch
        # NOTE: never more live sequences than the cache has slots (a resync needs a spare
        # one now and then; requests that find none finish target-only).
        self.scheduler.max_batch = max(1, min(self._max_batch, slots))

    # --- control ----------------------------------------------------------------------------
    def _boundary(self, fn: Callable[[], Any], timeout: float) -> Any:
        return self.scheduler.at_round_boundary(fn).result(timeout=timeout)

    def control(self, action: str, *, weights_version: str = "", draft_address: str = "", max_batch: int = 0,
                max_queue: int = -1, draft_timeout_s: float = 0.0, reset_streams: bool = False,
                drain: str = "", wait_timeout_s: float = 0.0, timeout: float = BOUNDARY_TIMEOUT_S) -> int:
        """Run one control action; returns how many requests it touched (0 for the others)."""
        sched = self.scheduler
        if action == STATUS:
            return 0
        if action == PAUSE:
            sched.pause_admission()
            return 0
        if action == RESUME:
            sched.resume_admission()
            return 0
        if action == SETTLE:
            self._boundary(lambda: None, timeout)
            return 0
        if action == ABORT:
            return int(self._boundary(sched.abort_running, timeout))
        if action == PARK:
            return int(self._boundary(sched.park_running, timeout))
        if action == RESUME_PARKED:
            def resume() -> int:
                # NOTE: a fresh draft stream before the first round after a reload: the
                # draft may have been restarted, and its old stream would fail that round.
                if reset_streams and sched.draft is not None:
                    getattr(sched.draft, "reset_streams", lambda: None)()
                return sched.resume_parked(weights_version or None)
            return int(self._boundary(resume, timeout))
        if action == CONFIGURE:
            self.configure(draft_address, max_batch, max_queue, draft_timeout_s, timeout)
            return 0
        if action == DRAIN:
            return self._drain(drain, wait_timeout_s, timeout)
        if action == RESUME_ALL:
            try:
                return self.control(RESUME_PARKED, weights_version=weights_version, reset_streams=reset_streams,
                                    timeout=timeout)
            finally:
                # NOTE: admission resumes even when the re-prefill failed: a reload never
                # leaves the loop refusing work.
                sched.resume_admission()
        raise ValueError(f"action: {action!r} is not a known rounds action")

    def _drain(self, policy: str, wait_timeout_s: float, timeout: float) -> int:
        """A reload's pause: admission paused, then the running requests settled by ``policy``
        at a round boundary. Returns how many were aborted or parked."""
        if policy not in (DRAIN_WAIT, DRAIN_ABORT, DRAIN_PARK):
            raise ValueError(f"drain: {policy!r} is not one of WAIT, ABORT, PARK (required with DRAIN)")
        if not 0.0 <= wait_timeout_s <= 86400:
            raise ValueError(f"wait_timeout_s: {wait_timeout_s:g} is not in [0, 86400]")
        sched = self.scheduler
        sched.pause_admission()
        if policy == DRAIN_ABORT:
            return int(self._boundary(sched.abort_running, timeout))
        if policy == DRAIN_PARK:
            return int(self._boundary(sched.park_running, timeout))
        deadline = time.monotonic() + wait_timeout_s
        while (active := sched.snapshot()[0]) > 0:
            if time.monotonic() > deadline:
                raise FailedPrecondition(f"WAIT: {active} requests still running after {wait_timeout_s:g}s")
            time.sleep(_WAIT_POLL_S)
        # NOTE: a barrier even with nothing running: no round may be in flight when
        # graphs or weights change.
        self._boundary(lambda: None, timeout)
        return 0

    def configure(self, draft_address: str, max_batch: int, max_queue: int, draft_timeout_s: float,
                  timeout: float = BOUNDARY_TIMEOUT_S) -> None:
        """Set the batch limits and the draft address (empty: target-only)."""
        if max_batch < 0 or max_batch > 1024:
            raise ValueError(f"max_batch: {max_batch} is out of range [0, 1024] (0 keeps the current value)")
        if max_queue > 100000:
            raise ValueError(f"max_queue: {max_queue} is out of range [0, 100000]")
        if draft_timeout_s < 0 or draft_timeout_s > 3600:
            raise ValueError(f"draft_timeout_s: {draft_timeout_s} is out of range [0, 3600] (0 keeps the current)")
        with self._lock:
            if max_batch:
                self._max_batch = max_batch
            if max_queue >= 0:
                self.scheduler.max_queue = max_queue
            if draft_timeout_s:
                self.draft_timeout_s = draft_timeout_s
            self._clamp_batch()
            link = self.draft_link
            if draft_address and link is None:
                link = DraftLink(self.scheduler, self._draft_client, draft_address,
                                 probe_timeout_s=min(self.draft_timeout_s, 5.0), target_status=self._target_status)
                self.draft_link = link
                # NOTE: the first attach runs between two rounds: the scheduler is already
                # running here, and its draft port must not change under a round.
                self._boundary(lambda: self._first_attach(link), timeout)
            elif draft_address and link is not None and draft_address != link.address:
                link.set_address(draft_address)
                link.attach_now(timeout)
            elif not draft_address and link is not None:
                self.draft_link = None

                def detach() -> None:
                    if self.scheduler.draft is not None:
                        self.scheduler.draft_failed(RequestError("UNAVAILABLE", "draft removed by CONFIGURE"))
                self.scheduler.on_draft_lost = None
                self._boundary(detach, timeout)
                link.close()
            self.configured = True
        log.info("rounds_configured", draft_address=draft_address or None, max_batch=self.scheduler.max_batch,
                 max_queue=self.scheduler.max_queue)

    def _first_attach(self, link: DraftLink) -> None:
        """Scheduler thread: attach the draft, then free whatever it still holds. This process
        is the draft's only client and no request drafted here before, so every id it holds
        belongs to a previous life of this target (killed mid-stream) and is freed now."""
        link.start()
        if link.available and link.client is not None:
            try:
                held = list(link.client.get_status(timeout=self.draft_timeout_s).active_request_ids)
                if held:
                    link.client.release_many(held)
                    log.info("draft_stale_requests_released", count=len(held))
            except RequestError as exc:
                log.warning("draft_stale_release_failed", error=exc.message)

    def _draft_client(self, address: str) -> DraftClient | LocalDraft:
        """The client of the draft at ``address``: the in-process draft when the address answers
        with its instance id (however the address is spelled: loopback, a service name), else
        the draft across the network."""
        remote = self._remote_draft(address)
        local = self.local_draft
        if local is not None:
            try:
                same = remote.get_status(timeout=min(self.draft_timeout_s, 5.0)).instance_id == \
                    local.get_status().instance_id
            except RequestError as exc:
                same = False
                log.warning("colocated_draft_probe_failed", address=address, error=exc.message)
            if same:
                remote.close()
                return local
        return remote

    def _remote_draft(self, address: str) -> DraftClient:
        c, sec = self.cfg, self.cfg.security
        ca, cert, key = c.draft_tls_ca, c.draft_client_cert, c.draft_client_key
        if ca is None and sec.tls_cert and sec.tls_client_ca:
            # A target serving mTLS reaches the draft the same way by default: it trusts its own
            # client CA and shows its own certificate (one CA for the whole deployment).
            ca, cert, key = sec.tls_client_ca, sec.tls_cert, sec.tls_key
        return DraftClient(address, timeout_s=self.draft_timeout_s, max_message_bytes=c.server.max_message_bytes,
                           tls_ca=ca, client_cert=cert, client_key=key, data_plane_poll_s=poll_seconds(c.data_plane_poll_us))

    def _target_status(self) -> Any:
        st = self.worker.status()
        return st if st.vocab_size else None

    # --- status / teardown ----------------------------------------------------------------------
    def state(self) -> RoundsState:
        active, queued = self.scheduler.snapshot()
        link = self.draft_link
        return RoundsState(active, queued, link is not None and link.available,
                           link.address or "" if link is not None else "",
                           "" if link is None or link.available else link.last_error,
                           link.reconnects if link is not None else 0, self.scheduler.round, self.configured,
                           self.paused, link is not None and link.available and self.local_draft is not None
                           and link.client is self.local_draft)

    @property
    def closed(self) -> bool:
        """``close`` was called: the loop takes no request any more."""
        return self.scheduler.stopping

    def close(self) -> None:
        """End every request (UNAVAILABLE, slots released), stop reconnecting."""
        self.scheduler.stop()
        if self.draft_link is not None:
            self.draft_link.close()
