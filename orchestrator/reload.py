"""Weight reload across both workers (DESIGN § Worker lifecycle, "Orchestrator reload").

Owns: the reload sequence and its order, one reload at a time, the in-flight
policies (WAIT / ABORT / RECOMPUTE, applied by the target's round loop at a
round boundary through ``RemoteRounds``), the cross-worker hold of a RECAPTURE
(every worker's graphs cleared before any worker releases weights), rollback of
both workers to the previous version when any phase fails, the progress events
(phase, service, seconds), the "reloading" gate that Generate calls wait on, and
reload metrics.

    prepare (both: validate + stage, nothing live changes) -> drain (pause
    admission, settle the in-flight requests by policy) -> commit (both, one
    stream each; inside each worker: RECAPTURE = clear graphs -> hold -> release
    -> load -> capture, IN_PLACE = copy into the live tensors) -> resume
    (re-admit parked requests with the new version) -> done

Six RPCs for two workers; a rollback is a worker-local commit of the previous
version (the worker knows where it came from).

Must not know: gRPC servicers, request messages, tensors, frameworks, how
rounds run, the order of a worker's own steps (``worker.swap`` and the
lifecycle state machine enforce it). It drives the worker clients' swap calls
(which return ``WorkerStatus`` messages and raise ``RequestError`` /
``CommitFailed``) and the round loop's ``drain`` / ``resume_all``.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import structlog
from prometheus_client import CollectorRegistry

from orchestrator.reload_spec import (ABORT, IN_PLACE, RECAPTURE, RECOMPUTE, WAIT, ReloadError, ReloadEvent,
                                      ReloadMetrics, ReloadSpec)
from orchestrator.round_client import RemoteRounds
from orchestrator.config import OrchestratorConfig
from rounds.scheduler_types import RequestError
from rounds.worker_clients import CommitFailed
from runtime import host_memory
from specsplit.v1 import common_pb2

log = structlog.get_logger("orchestrator.reload")

ORCH = "orchestrator"
_SERVING = (common_pb2.LIFECYCLE_STATE_LOADED, common_pb2.LIFECYCLE_STATE_READY)
_READY = common_pb2.LIFECYCLE_STATE_READY
_RETRY_POLL_S = 0.2


@dataclass(frozen=True)
class _Before:
    state: int
    version: str
    graphs: bool                     # graphs were live (READY): recapture them after the load


class _PhaseFailed(Exception):
    def __init__(self, phase: str, failures: dict[str, RequestError]) -> None:
        self.phase, self.failures = phase, failures
        role, err = next(iter(failures.items()))
        super().__init__(f"{phase} failed on {role}: {err.message}")
        self.code = err.code


class ReloadCoordinator:
    """Drives reloads; one at a time. ``reload`` blocks the calling thread until done."""

    def __init__(self, scheduler: RemoteRounds, clients: Callable[[], dict[str, Any]], cfg: OrchestratorConfig,
                 refresh: Callable[[dict[str, Any] | None], None] = lambda known: None,
                 gate: Callable[[], None] = lambda: None, registry: CollectorRegistry | None = None) -> None:
        # clients() -> {"target": client, "draft": client}: looked up per reload (the draft's
        # client changes when it moves to a new address); no "draft" key = target-only.
        self.scheduler, self.clients, self.cfg = scheduler, clients, cfg
        # refresh(known): re-read the worker facts (the server's poll); ``known`` holds the
        # statuses the reload already has ("target", "draft": WorkerStatus; "rounds":
        # RoundsStatus), so no call is needed for them; None: ask the workers.
        # gate(): publish health / "reloading" from what is known (no call).
        self.refresh, self.gate = refresh, gate
        self.metrics = ReloadMetrics(registry)
        self.epoch = 0                           # +1 at each start and end (pollers detect overlap)
        self._lock = threading.Lock()            # held for a whole reload
        self._idle = threading.Event()
        self._idle.set()
        self._emit_lock = threading.Lock()
        self._running = False                    # a reload is running (the gate may still be closed)
        self._started_at = 0.0
        self._running_version = ""
        self._last_seconds = 5.0                 # retry hint before the first reload finishes

    # --- what Generate handlers and pollers read ---------------------------------
    @property
    def active(self) -> bool:
        return self._running

    def wait_idle(self, timeout: float) -> bool:
        """Block until no reload runs and facts are fresh (True), or ``timeout`` passed (False)."""
        return self._idle.wait(timeout)

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait: the last reload's length minus the time spent."""
        left = self._last_seconds - (time.monotonic() - self._started_at) if self.active else 1.0
        return max(1, math.ceil(left))

    # --- the reload ----------------------------------------------------------------------
    def reload(self, spec: ReloadSpec, emit: Callable[[ReloadEvent], None] = lambda ev: None) -> str:
        """Run the whole sequence; returns the version serving afterwards.

        Raises ReloadError: before anything changed (bad request, busy, validation),
        or after a failed phase with both workers rolled back (the message says so).
        """
        spec.check()
        if not self._lock.acquire(blocking=False):
            raise ReloadError("FAILED_PRECONDITION",
                              f"a reload to version {self._running_version!r} is already running (one at a time; "
                              f"started {time.monotonic() - self._started_at:.1f}s ago): retry when it has finished")
        t0 = time.monotonic()
        outcome = "failed"
        known: dict[str, Any] | None = None
        try:
            self._started_at, self._running_version = t0, spec.version
            self.epoch += 1
            self._running = True
            self._idle.clear()
            self._call(self.gate)                # health NOT_SERVING, status "reloading" at once
            log.info("reload_started", weights_version=spec.version, mode=spec.mode, inflight=spec.inflight,
                     target_path=spec.target_path)
            run = _Run(self, spec, emit)
            version = run.execute()
            outcome = "ok"
            known = run.known if {"target", "rounds"} <= set(run.known) else None
            return version
        except ReloadError as exc:
            outcome = "rolled_back" if exc.rolled_back else "failed"
            log.warning("reload_failed", weights_version=spec.version, code=exc.code, error=exc.message)
            raise
        finally:
            seconds = time.monotonic() - t0
            self.metrics.seconds.labels(spec.mode, outcome).observe(seconds)
            self.metrics.total.labels(spec.mode, outcome).inc()
            if outcome == "ok":
                self._last_seconds = seconds
            self.epoch += 1
            self._running = False
            # NOTE: facts (vocab, cache length, version) are re-read before the gate opens,
            # so the first Generate after a reload is validated against the new model.
            self._call(lambda: self.refresh(known))
            self._idle.set()
            self._lock.release()
            log.info("reload_finished", weights_version=spec.version, outcome=outcome, seconds=round(seconds, 3))

    @staticmethod
    def _call(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a failed status poll must not fail or wedge a reload
            log.exception("refresh_failed")

    def _emit(self, emit: Callable[[ReloadEvent], None], ev: ReloadEvent) -> None:
        if ev.service != ORCH or ev.phase not in ("done",):
            self.metrics.phase.labels(ev.phase, ev.service).observe(ev.seconds)
        with self._emit_lock:
            try:
                emit(ev)
            except Exception:  # noqa: BLE001 - a gone client must not break the reload
                log.warning("reload_event_not_delivered", phase=ev.phase, service=ev.service)


class _Holds:
    """The cross-worker barriers of a RECAPTURE commit: each worker's stream stops after its
    graphs are cleared, after its weights are released and after the new ones are loaded,
    until every worker got there (``arrive``); one worker failing stops them all (``fail``)."""

    def __init__(self, n: int, timeout: float) -> None:
        self._n, self._timeout = n, timeout
        self._arrived: dict[str, int] = {}
        self.failed = False
        self._cv = threading.Condition()

    def arrive(self, after: str) -> bool:
        """True: every worker got past ``after``, go on; False: stop (another failed, or timeout)."""
        with self._cv:
            self._arrived[after] = self._arrived.get(after, 0) + 1
            self._cv.notify_all()
            done = self._cv.wait_for(lambda: self.failed or self._arrived[after] >= self._n, self._timeout)
            return bool(done) and not self.failed

    def fail(self) -> None:
        with self._cv:
            self.failed = True
            self._cv.notify_all()


# The phase a RECAPTURE commit was in when its stream broke, from the last phase that ended.
_NEXT_PHASE = {"": "clear_graphs", "clear_graphs": "release", "release": "load", "load": "capture",
               "capture": "capture"}


class _Run:
    """One reload: the phases, in order, and the rollback."""

    def __init__(self, co: ReloadCoordinator, spec: ReloadSpec, emit: Callable[[ReloadEvent], None]) -> None:
        self.co, self.spec, self.cfg = co, spec, co.cfg
        self.sched = co.scheduler
        self.emit = lambda ev: co._emit(emit, ev)
        self.workers = dict(co.clients())
        self.before: dict[str, _Before] = {}
        self.touched: set[str] = set()           # workers whose live weights/graphs a call may have changed
        self.timeout = self.cfg.reload_call_timeout_s
        self.known: dict[str, Any] = {}          # statuses after the reload: the facts the gate opens with

    # --- helpers ---------------------------------------------------------------------------
    def _event(self, phase: str, service: str, t0: float, message: str = "", version: str = "",
               error: RequestError | None = None, done: bool = False, seconds: float | None = None) -> None:
        self.emit(ReloadEvent(phase, service, time.monotonic() - t0 if seconds is None else seconds, message, done,
                              version, error.code if error else "", error.message if error else ""))

    def _on_workers(self, phase: str, calls: dict[str, Callable[[Any], Any]]) -> dict[str, Any]:
        """Run ``calls[role](client)`` on the workers concurrently (they are separate
        machines); one event per worker; raises _PhaseFailed after all have answered."""
        results: dict[str, Any] = {}
        failures: dict[str, RequestError] = {}

        def one(role: str) -> None:
            t0 = time.monotonic()
            try:
                st = calls[role](self.workers[role])
                results[role] = st
                valid = "checkpoint valid, " if phase == "validate" else ""
                self._event(phase, role, t0, f"{valid}state {common_pb2.LifecycleState.Name(st.state)}",
                            st.weights_version)
            except Exception as exc:  # noqa: BLE001 - every failure is reported, then rolled back
                err = exc if isinstance(exc, RequestError) else RequestError("INTERNAL", f"{type(exc).__name__}: {exc}")
                failures[role] = err
                self._event(phase, role, t0, f"{phase} failed", error=err)

        _each(list(calls), one, phase)
        if failures:
            raise _PhaseFailed(phase, failures)
        return results

    def _boundary(self, action: Callable[..., Any], what: str, *args: Any, extra_s: float = 0.0) -> Any:
        """Run a round-loop action in the target, between two rounds (bounded wait: a round is
        bounded by the worker timeouts)."""
        bound = 3 * self.cfg.worker_timeout_s + 10 + extra_s
        phase = "resume" if what == "resume" else "inflight"
        try:
            return action(*args, timeout=bound)
        except RequestError as exc:                 # a timeout, the target gone, shutting down
            if exc.code == "FAILED_PRECONDITION" and what == "wait":
                raise _PhaseFailed(phase, {ORCH: RequestError(
                    exc.code, f"{exc.message} (reload_wait_timeout_s); retry, or use ABORT or RECOMPUTE")}) from None
            raise _PhaseFailed(phase, {ORCH: RequestError(
                exc.code, f"the round loop did not reach a round boundary ({what}): {exc.message}")}) from None

    # --- the sequence ------------------------------------------------------------------------
    def execute(self) -> str:
        spec = self.spec
        t0 = time.monotonic()
        # NOTE: the RPCs of a reload, in order: PrepareWeights (each worker), ControlRounds DRAIN,
        # CommitWeights (each worker; one stream each), ControlRounds RESUME_ALL. Everything a
        # worker does in between (clear, release, load, capture) happens inside it.
        self._prepare()
        try:
            self._drain()
            self._commit()
        except _PhaseFailed as failed:
            self._abort_staged()
            ok, rolled = self._rollback()
            self._resume(None)
            where = ", ".join(f"{r}: {e.message}" for r, e in failed.failures.items())
            raise ReloadError(failed.code, f"reload to {spec.version!r} failed at {failed.phase} ({where}); "
                                           f"{rolled}", rolled_back=ok and bool(self.touched),
                              rollback_failed=not ok) from None
        except BaseException:
            self._resume(None)
            raise
        self._resume(spec.version)
        host_memory.trim()          # the reload's transient host memory back to the OS (runtime/host_memory.py)
        self._event("done", ORCH, t0, f"serving {spec.version!r} ({spec.mode}, {spec.inflight})", spec.version,
                    done=True)
        return spec.version

    def _prepare(self) -> None:
        # NOTE: both checkpoints are validated completely (every name, shape, dtype, the
        # config; the draft against the NEW target's sizes and embedding/head) before
        # anything live changes: a bad checkpoint leaves serving untouched. The answers are
        # also the "before" picture a rollback returns to.
        spec = self.spec
        calls = {r: (lambda c, r=r: c.prepare_weights(spec.target_path, spec.draft_path if r == "draft" else "",
                                                      spec.version, spec.mode, spec.preload, timeout=self.timeout))
                 for r in self.workers}
        try:
            results = self._on_workers("validate", calls)
        except _PhaseFailed as failed:
            self._abort_staged()
            role, err = next(iter(failed.failures.items()))
            if spec.mode == IN_PLACE and err.code == "FAILED_PRECONDITION":
                raise ReloadError("FAILED_PRECONDITION", f"mode IN_PLACE refused on {role}: {err.message}; "
                                                         "use mode RECAPTURE") from None
            where = ", ".join(f"{r}: {e.message}" for r, e in failed.failures.items())
            raise ReloadError(failed.code,
                              f"validation of {spec.version!r} failed, nothing changed ({where})") from None
        self.before = {r: _Before(st.state, st.weights_version if st.state in _SERVING else "", st.state == _READY)
                       for r, st in results.items()}

    def _drain(self) -> None:
        t0 = time.monotonic()
        policy = self.spec.inflight
        what = {WAIT: "wait", ABORT: "abort", RECOMPUTE: "park"}[policy]
        extra = self.cfg.reload_wait_timeout_s if policy == WAIT else 0.0
        try:
            resp = self._boundary(self.sched.drain, what, what, self.cfg.reload_wait_timeout_s, extra_s=extra)
        except _PhaseFailed:
            if policy == RECOMPUTE:
                # The park may still run later: queue its undo behind it (best effort; the
                # rollback's resume below tries again).
                threading.Thread(target=self._resume_quietly, name="reload-unpark", daemon=True).start()
            raise
        message = {WAIT: "in-flight requests finished (WAIT)",
                   ABORT: f"{resp.count} requests aborted with their partial output",
                   RECOMPUTE: f"{resp.count} requests paused, caches released (RECOMPUTE re-prefills them)"}[policy]
        self._event("inflight", ORCH, t0, f"admission paused; {message}")

    def _commit(self) -> None:
        spec = self.spec
        # NOTE: every worker's graphs are cleared before any worker's weights are released,
        # every release happens before any load and every load before any capture (the
        # holds): a graph replays over the exact weight and cache addresses it was captured
        # with, and workers sharing a GPU never hold two versions at once nor allocate for a
        # load while another captures. Inside each worker the lifecycle refuses a release
        # under live graphs.
        holds = _Holds(len(self.workers), self.timeout) if spec.mode == RECAPTURE else None
        self.touched.update(self.workers)
        results: dict[str, Any] = {}
        failures: dict[str, _WorkerFailed] = {}

        def one(role: str) -> None:
            try:
                results[role] = self._commit_one(role, self.workers[role], holds)
            except _WorkerFailed as exc:
                failures[role] = exc
                if holds is not None:
                    holds.fail()

        _each(list(self.workers), one, "commit")
        if failures:
            raise _PhaseFailed(next(iter(failures.values())).phase, {r: e.error for r, e in failures.items()})
        self.known.update({r: st for r, st in results.items() if st is not None})

    def _commit_one(self, role: str, client: Any, holds: _Holds | None) -> Any:
        spec = self.spec
        t_phase = [time.monotonic()]

        def on_phase(ev: common_pb2.CommitWeightsEvent) -> None:
            if ev.phase not in ("held", "done"):
                self._event(ev.phase, role, t_phase[0], f"state {common_pb2.LifecycleState.Name(ev.status.state)}",
                            ev.status.weights_version, seconds=ev.seconds)
            t_phase[0] = time.monotonic()

        try:
            st = client.commit_weights(spec.version, spec.mode, hold=holds.arrive if holds is not None else None,
                                       on_phase=on_phase, timeout=self.timeout)
        except CommitFailed as exc:
            phase = exc.phase if exc.reported else (_NEXT_PHASE.get(exc.phase, exc.phase)
                                                    if spec.mode == RECAPTURE else "load")
            self._event(phase, role, t_phase[0], f"{phase} failed", error=exc.error)
            raise _WorkerFailed(phase, exc.error) from None
        if st.state in _SERVING and st.weights_version == spec.version:
            return st
        if holds is not None and holds.failed:
            return None            # stopped at a hold because another worker failed: that one's error says why
        err = RequestError("DEADLINE_EXCEEDED" if holds is not None else "INTERNAL",
                           f"{role} stopped at version {st.weights_version!r} (state "
                           f"{common_pb2.LifecycleState.Name(st.state)}): the workers did not all reach the same "
                           f"step within reload_call_timeout_s")
        self._event("load", role, t_phase[0], "commit stopped", error=err)
        raise _WorkerFailed("load", err)

    def _abort_staged(self) -> None:
        """Drop what the workers staged (frees preloaded host memory); best effort, failure path only."""
        for role, client in self.workers.items():
            try:
                client.abort_weights(self.spec.version, timeout=min(self.timeout, self.cfg.worker_timeout_s))
            except RequestError as exc:
                log.warning("abort_weights_failed", service=role, error=exc.message)

    def _resume(self, version: str | None) -> None:
        t0 = time.monotonic()
        try:
            # NOTE: the target opens a fresh draft stream before the first round
            # (reset_streams): the draft may have been restarted during the reload.
            resp = self._boundary(self.sched.resume_all, "resume", version)
            self.known["rounds"] = resp.status
            message = f"admission resumed; {resp.count} paused requests re-prefilled and continuing"
        except _PhaseFailed as failed:
            message = f"admission resumed; {failed}"
            try:
                self.sched.resume_admission()        # the one-call resume failed: at least admission
            except RequestError as exc:
                message = f"{message}; resuming admission failed: {exc.message}"
                log.error("resume_admission_failed", error=exc.message)
        self._event("resume", ORCH, t0, message, version or "")

    def _resume_quietly(self) -> None:
        try:
            self.sched.resume_parked(None, timeout=3 * self.cfg.worker_timeout_s + 10)
        except RequestError as exc:
            log.warning("unpark_failed", error=exc.message)

    # --- rollback ------------------------------------------------------------------------------
    def _rollback(self) -> tuple[bool, str]:
        """Both workers back on their previous version (and graphs): (succeeded, summary)."""
        self.known.clear()                       # statuses changed again: the gate re-reads them
        if not self.touched:
            return True, "nothing had changed on the workers"
        calls = {r: (lambda c, r=r: self._restore(r, c)) for r in self.workers}
        try:
            self._on_workers("rollback", calls)
        except _PhaseFailed as rb:
            where = ", ".join(f"{r}: {e.message}" for r, e in rb.failures.items())
            return False, f"ROLLBACK FAILED ({where})"
        versions = ", ".join(f"{r} {b.version!r}" for r, b in self.before.items())
        return True, f"rolled back: serving the previous version again ({versions})"

    def _restore(self, role: str, client: Any, attempts: int = 3) -> Any:
        """One worker back to its previous version: a worker-local commit of that version (it
        knows where it came from). Retried while the worker is unreachable (restarting, up to
        reload_rollback_wait_s) and up to ``attempts`` times otherwise: a load that timed out
        on our side may still finish on the worker and race the rollback's own commit."""
        prev = self.before[role]
        # NOTE: a failed IN_PLACE copy may have changed some tensors already: the previous
        # version is copied back in place (graphs stay valid), whatever the version label says.
        mode = IN_PLACE if self.spec.mode == IN_PLACE and prev.version else RECAPTURE
        deadline = time.monotonic() + self.cfg.reload_rollback_wait_s
        attempt = 0
        while True:
            try:
                st = client.commit_weights(prev.version, mode, capture=prev.graphs, timeout=self.timeout)
                if (st.weights_version == prev.version
                        and (st.state in _SERVING if prev.version else st.state == common_pb2.LIFECYCLE_STATE_EMPTY)):
                    return st
                raise _WorkerFailed("rollback", RequestError(
                    "INTERNAL", f"{role} is at version {st.weights_version!r} after the rollback, "
                                f"expected {prev.version!r}"))
            except (CommitFailed, _WorkerFailed) as exc:
                err = exc.error
                unreachable = err.code == "UNAVAILABLE" and time.monotonic() < deadline
                if not unreachable:
                    attempt += 1
                    if attempt >= attempts:
                        raise err from None
                log.warning("rollback_retry", service=role, attempt=attempt, error=err.message)
                time.sleep(_RETRY_POLL_S)


def _each(roles: list[str], fn: Callable[[str], None], name: str) -> None:
    """``fn(role)`` for every worker at once (they are separate machines), back when all are."""
    with ThreadPoolExecutor(len(roles), thread_name_prefix=f"reload-{name}") as pool:
        list(pool.map(fn, roles))


class _WorkerFailed(Exception):
    def __init__(self, phase: str, error: RequestError) -> None:
        super().__init__(error.message)
        self.phase, self.error = phase, error
