"""Weight reload across both workers (DESIGN § Worker lifecycle, "Orchestrator reload").

Owns: the reload sequence and its order, one reload at a time, the in-flight
policies (WAIT / ABORT / RECOMPUTE, applied by the target's round loop at a
round boundary through ``RemoteRounds``), rollback of both workers to the previous version
when any phase fails, the progress events (phase, service, seconds), the
"reloading" gate that Generate calls wait on, and reload metrics.

    validate (both, nothing live changes) -> pause admission -> settle the
    in-flight round + policy -> RECAPTURE: clear graphs (both) -> release
    (both) -> load (both) -> capture (where graphs were live) | IN_PLACE: copy
    into the existing tensors (both) -> resume (re-admit parked requests with
    the new version) -> done

Must not know: gRPC servicers, request messages, tensors, frameworks, how
rounds run. It drives the worker clients' lifecycle calls (which return
``WorkerStatus`` messages and raise ``RequestError``) and the scheduler's
``pause_admission`` / ``abort_running`` / ``park_running`` / ``resume_parked``.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram

from orchestrator.round_client import RemoteRounds
from orchestrator.config import OrchestratorConfig
from rounds.scheduler_types import RequestError
from runtime import host_memory
from specsplit.v1 import common_pb2

log = structlog.get_logger("orchestrator.reload")

RECAPTURE, IN_PLACE = "recapture", "in_place"
WAIT, ABORT, RECOMPUTE = "wait", "abort", "recompute"
ORCH = "orchestrator"
_SERVING = (common_pb2.LIFECYCLE_STATE_LOADED, common_pb2.LIFECYCLE_STATE_READY)
_READY = common_pb2.LIFECYCLE_STATE_READY
_POLL_S = 0.02
_RETRY_POLL_S = 0.2


class ReloadError(Exception):
    """A reload did not happen (or was rolled back). ``code``: a gRPC status code name."""

    def __init__(self, code: str, message: str, rolled_back: bool = False, rollback_failed: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message
        self.rolled_back = rolled_back           # workers were changed, then restored
        self.rollback_failed = rollback_failed   # workers were changed and could not be restored


@dataclass(frozen=True)
class ReloadSpec:
    target_path: str
    version: str
    mode: str = RECAPTURE            # RECAPTURE | IN_PLACE
    inflight: str = WAIT             # WAIT | ABORT | RECOMPUTE
    draft_path: str = ""             # empty: mtp.safetensors inside target_path

    def check(self) -> None:
        if not self.target_path:
            raise ReloadError("INVALID_ARGUMENT", "target_path: required (empty)")
        if not self.version:
            raise ReloadError("INVALID_ARGUMENT", "version: required (empty); tag the new weights")
        if self.mode not in (RECAPTURE, IN_PLACE):
            raise ReloadError("INVALID_ARGUMENT", f"mode: {self.mode!r} is not one of RECAPTURE, IN_PLACE")
        if self.inflight not in (WAIT, ABORT, RECOMPUTE):
            raise ReloadError("INVALID_ARGUMENT", f"inflight: {self.inflight!r} is not one of WAIT, ABORT, RECOMPUTE")


@dataclass(frozen=True)
class ReloadEvent:
    phase: str
    service: str                     # "draft" | "target" | "orchestrator"
    seconds: float
    message: str = ""
    done: bool = False
    weights_version: str = ""        # serving on ``service`` after this event
    error_code: str = ""             # set when this phase failed on this service
    error_message: str = ""


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


class ReloadMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.seconds = Histogram("specsplit_reload_seconds", "Weight reload duration by outcome", ["mode", "outcome"],
                                 buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600), registry=r)
        self.phase = Histogram("specsplit_reload_phase_seconds", "Weight reload phase duration per worker",
                               ["phase", "service"], buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300),
                               registry=r)
        self.total = Counter("specsplit_reloads", "Weight reloads by mode and outcome (ok|failed|rolled_back)",
                             ["mode", "outcome"], registry=r)


class ReloadCoordinator:
    """Drives reloads; one at a time. ``reload`` blocks the calling thread until done."""

    def __init__(self, scheduler: RemoteRounds, clients: Callable[[], dict[str, Any]], cfg: OrchestratorConfig,
                 refresh: Callable[[], None] = lambda: None, registry: CollectorRegistry | None = None) -> None:
        # clients() -> {"target": client, "draft": client}: looked up per reload (the draft's
        # client changes when it moves to a new address); no "draft" key = target-only.
        self.scheduler, self.clients, self.cfg = scheduler, clients, cfg
        self.refresh = refresh                   # re-reads worker facts (the server's poll)
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
        try:
            self._started_at, self._running_version = t0, spec.version
            self.epoch += 1
            self._running = True
            self._idle.clear()
            self._refresh()                      # health NOT_SERVING, status "reloading" at once
            log.info("reload_started", weights_version=spec.version, mode=spec.mode, inflight=spec.inflight,
                     target_path=spec.target_path)
            version = _Run(self, spec, emit).execute()
            outcome = "ok"
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
            self._refresh()
            self._idle.set()
            self._lock.release()
            log.info("reload_finished", weights_version=spec.version, outcome=outcome, seconds=round(seconds, 3))

    def _refresh(self) -> None:
        try:
            self.refresh()
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

    # --- helpers ---------------------------------------------------------------------------
    def _event(self, phase: str, service: str, t0: float, message: str = "", version: str = "",
               error: RequestError | None = None, done: bool = False) -> None:
        self.emit(ReloadEvent(phase, service, time.monotonic() - t0, message, done, version,
                              error.code if error else "", error.message if error else ""))

    def _on_workers(self, phase: str, calls: dict[str, Callable[[Any], Any]], touch: bool = True) -> dict[str, Any]:
        """Run ``calls[role](client)`` on the workers concurrently (they are separate
        machines); one event per worker; raises _PhaseFailed after all have answered."""
        if not calls:
            return {}
        if touch:
            self.touched.update(calls)
        results: dict[str, Any] = {}
        failures: dict[str, RequestError] = {}

        def one(role: str) -> None:
            t0 = time.monotonic()
            try:
                st = calls[role](self.workers[role])
                results[role] = st
                valid = "checkpoint valid, " if phase == "validate" else ""
                self._event(phase, role, t0, f"{valid}state {common_pb2.LifecycleState.Name(st.state)}"
                            if st is not None else "", st.weights_version if st is not None else "")
            except Exception as exc:  # noqa: BLE001 - every failure is reported, then rolled back
                err = exc if isinstance(exc, RequestError) else RequestError("INTERNAL", f"{type(exc).__name__}: {exc}")
                failures[role] = err
                self._event(phase, role, t0, f"{phase} failed", error=err)

        with ThreadPoolExecutor(len(calls), thread_name_prefix=f"reload-{phase}") as pool:
            list(pool.map(one, list(calls)))
        if failures:
            raise _PhaseFailed(phase, failures)
        return results

    def _boundary(self, action: Callable[..., Any], what: str, *args: Any) -> Any:
        """Run a round-loop action in the target, between two rounds (bounded wait: a round is
        bounded by the worker timeouts)."""
        bound = 3 * self.cfg.worker_timeout_s + 10
        phase = "resume" if what == "resume" else "inflight"
        try:
            return action(*args, timeout=bound)
        except RequestError as exc:                 # a timeout, the target gone, shutting down
            raise _PhaseFailed(phase, {ORCH: RequestError(
                exc.code, f"the round loop did not reach a round boundary ({what}): {exc.message}")}) from None

    # --- the sequence ------------------------------------------------------------------------
    def execute(self) -> str:
        spec = self.spec
        t0 = time.monotonic()
        self._snapshot()
        self._validate()
        phase_t = time.monotonic()
        try:
            self.sched.pause_admission()
        except RequestError as exc:
            raise ReloadError(exc.code, f"cannot pause admission in the target's round loop, nothing changed: "
                                        f"{exc.message}") from None
        self._event("pause", ORCH, phase_t, "admission paused")
        try:
            self._inflight()
            if spec.mode == IN_PLACE:
                # NOTE: IN_PLACE copies into the tensors the graphs read (addresses kept):
                # no clear, no release, no recapture; validation already checked the shapes.
                self._on_workers("load", {r: self._load(r, in_place=True) for r in self.workers})
            else:
                self._recapture()
            self._check_serving(spec.version)
        except _PhaseFailed as failed:
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

    def _snapshot(self) -> None:
        t0 = time.monotonic()
        for role, client in self.workers.items():
            try:
                st = client.get_status(timeout=min(self.timeout, self.cfg.worker_timeout_s))
            except RequestError as exc:
                self._event("validate", role, t0, "unreachable", error=exc)
                raise ReloadError(exc.code, f"{role} is unreachable, nothing changed: {exc.message}") from None
            self.before[role] = _Before(st.state, st.weights_version if st.state in _SERVING else "",
                                        st.state == _READY)
            if st.state in _SERVING and st.weights_version == self.spec.version:
                raise ReloadError("INVALID_ARGUMENT", f"version: {self.spec.version!r} is already serving on {role}; "
                                                      "tag the new weights with a new version")
            if self.spec.mode == IN_PLACE and st.state not in _SERVING:
                raise ReloadError("FAILED_PRECONDITION", f"mode IN_PLACE needs loaded weights to copy into; {role} "
                                                         "holds none (state EMPTY): use RECAPTURE")

    def _validate(self) -> None:
        # NOTE: both checkpoints are validated completely (every name, shape, dtype, the
        # config; the draft against the NEW target's sizes and embedding/head) before
        # anything live changes: a bad checkpoint leaves serving untouched.
        spec = self.spec
        calls = {r: (lambda c, r=r: c.load_weights(spec.target_path, spec.draft_path if r == "draft" else "",
                                                   spec.version, validate_only=True, timeout=self.timeout))
                 for r in self.workers}
        try:
            self._on_workers("validate", calls, touch=False)
            if spec.mode == IN_PLACE:
                calls = {r: (lambda c, r=r: c.load_weights(spec.target_path, spec.draft_path if r == "draft" else "",
                                                           spec.version, in_place=True, validate_only=True,
                                                           timeout=self.timeout)) for r in self.workers}
                try:
                    self._on_workers("validate", calls, touch=False)
                except _PhaseFailed as failed:
                    role, err = next(iter(failed.failures.items()))
                    raise ReloadError("FAILED_PRECONDITION", f"mode IN_PLACE refused on {role}: the new checkpoint "
                                                             f"does not fit the running tensors ({err.message}); "
                                                             "use mode RECAPTURE") from None
        except _PhaseFailed as failed:
            where = ", ".join(f"{r}: {e.message}" for r, e in failed.failures.items())
            raise ReloadError(failed.code, f"validation of {spec.version!r} failed, nothing changed ({where})") from None

    def _inflight(self) -> None:
        t0 = time.monotonic()
        policy = self.spec.inflight
        if policy == WAIT:
            bound = self.cfg.reload_wait_timeout_s
            deadline = time.monotonic() + bound
            while (active := self._active()) > 0:
                if time.monotonic() > deadline:
                    raise _PhaseFailed("inflight", {ORCH: RequestError(
                        "FAILED_PRECONDITION", f"WAIT: {active} requests still running after {bound:g}s "
                                               "(reload_wait_timeout_s); retry, or use ABORT or RECOMPUTE")})
                time.sleep(_POLL_S)
            # NOTE: a barrier even with nothing running: no round may be in flight when
            # graphs or weights change.
            self._boundary(self.sched.settle, "settle")
            message = "in-flight requests finished (WAIT)"
        elif policy == ABORT:
            message = f"{self._boundary(self.sched.abort_running, 'abort')} requests aborted with their partial output"
        else:
            try:
                n = self._boundary(self.sched.park_running, "park")
            except _PhaseFailed:
                # The park may still run later: queue its undo behind it (best effort; the
                # rollback's resume below tries again).
                threading.Thread(target=self._resume_quietly, name="reload-unpark", daemon=True).start()
                raise
            message = f"{n} requests paused, caches released (RECOMPUTE re-prefills them)"
        self._event("inflight", ORCH, t0, message)

    def _load(self, role: str, in_place: bool) -> Callable[[Any], Any]:
        spec = self.spec
        draft_path = spec.draft_path if role == "draft" else ""
        return lambda client: client.load_weights(spec.target_path, draft_path, spec.version, in_place=in_place,
                                                  timeout=self.timeout)

    def _recapture(self) -> None:
        graphs = [r for r, b in self.before.items() if b.graphs]
        # NOTE: every worker's graphs are cleared before any worker's weights are
        # released: a graph replays over the exact weight and cache addresses it was
        # captured with, so freeing them under live graphs reads freed memory. The
        # phases are barriers (all clears answered before the first release).
        self._on_workers("clear_graphs", {r: lambda c: c.clear_graphs(timeout=self.timeout) for r in graphs})
        self._on_workers("release", {r: lambda c: c.release_weights(timeout=self.timeout) for r in self.workers})
        # NOTE: the draft loads its embedding, final norm and head from the NEW target
        # checkpoint (same target_path), never keeps the old copy.
        self._on_workers("load", {r: self._load(r, in_place=False) for r in self.workers})
        # NOTE: capture only after the load: graphs record the new tensors' addresses.
        self._on_workers("capture", {r: lambda c: c.capture_graphs(timeout=self.timeout) for r in graphs})

    def _check_serving(self, version: str) -> None:
        bad = {}
        for role, client in self.workers.items():
            try:
                st = client.get_status(timeout=self.cfg.worker_timeout_s)
            except RequestError as exc:
                bad[role] = exc
                continue
            if st.state not in _SERVING or st.weights_version != version:
                bad[role] = RequestError("INTERNAL", f"{role} reports state {common_pb2.LifecycleState.Name(st.state)}"
                                                     f" version {st.weights_version!r}, expected {version!r}")
        if bad:
            raise _PhaseFailed("load", bad)

    def _resume(self, version: str | None) -> None:
        t0 = time.monotonic()

        try:
            # NOTE: the target opens a fresh draft stream before the first round
            # (reset_streams): the draft may have been restarted during the reload.
            n = self._boundary(self.sched.resume_parked, "resume", version)
            message = f"admission resumed; {n} paused requests re-prefilled and continuing"
        except _PhaseFailed as failed:
            message = f"admission resumed; {failed}"
        finally:
            try:
                self.sched.resume_admission()
            except RequestError as exc:
                message = f"{message}; resuming admission failed: {exc.message}"
                log.error("resume_admission_failed", error=exc.message)
        self._event("resume", ORCH, t0, message, version or "")

    def _active(self) -> int:
        try:
            return self.sched.snapshot()[0]
        except RequestError as exc:
            raise _PhaseFailed("inflight", {ORCH: exc}) from None

    def _resume_quietly(self) -> None:
        try:
            self.sched.resume_parked(None, timeout=3 * self.cfg.worker_timeout_s + 10)
        except RequestError as exc:
            log.warning("unpark_failed", error=exc.message)

    # --- rollback ------------------------------------------------------------------------------
    def _rollback(self) -> tuple[bool, str]:
        """Both workers back on their previous version (and graphs): (succeeded, summary)."""
        if not self.touched:
            return True, "nothing had changed on the workers"
        calls = {r: (lambda c, r=r: self._restore(r, c)) for r in self.workers}
        try:
            self._on_workers("rollback", calls, touch=False)
        except _PhaseFailed as rb:
            where = ", ".join(f"{r}: {e.message}" for r, e in rb.failures.items())
            return False, f"ROLLBACK FAILED ({where})"
        versions = ", ".join(f"{r} {b.version!r}" for r, b in self.before.items())
        return True, f"rolled back: serving the previous version again ({versions})"

    def _status_when_reachable(self, role: str, client: Any) -> Any:
        """GetStatus, retried while the worker is unreachable (restarting), up to the bound."""
        deadline = time.monotonic() + self.cfg.reload_rollback_wait_s
        while True:
            try:
                return client.get_status(timeout=min(self.cfg.worker_timeout_s, 5.0))
            except RequestError as exc:
                if exc.code != "UNAVAILABLE" or time.monotonic() > deadline:
                    raise
                time.sleep(_RETRY_POLL_S)

    def _restore(self, role: str, client: Any, attempts: int = 3) -> Any:
        """One worker back to its previous version. Retried (bounded): a load that timed
        out on our side may still finish on the worker and race the rollback's own load."""
        prev, t = self.before[role], self.timeout
        for attempt in range(1, attempts + 1):
            try:
                st = self._status_when_reachable(role, client)
                if prev.version == "":               # held nothing before: hold nothing again
                    client.clear_graphs(timeout=t)
                    return client.release_weights(timeout=t)
                if self.spec.mode == IN_PLACE and role in self.touched and st.state in _SERVING:
                    # NOTE: a failed copy may have changed some tensors already: copy the previous
                    # version back in place (graphs stay valid), whatever the version label says.
                    st = client.load_weights("", "", prev.version, in_place=True, timeout=t)
                elif not (st.state in _SERVING and st.weights_version == prev.version):
                    # NOTE: same order as a reload: graphs cleared before weights are released.
                    client.clear_graphs(timeout=t)
                    client.release_weights(timeout=t)
                    st = client.load_weights("", "", prev.version, timeout=t)   # the worker knows the paths
                if prev.graphs and st.state != _READY:
                    st = client.capture_graphs(timeout=t)
                if st.state in _SERVING and st.weights_version == prev.version:
                    return st
                raise RequestError("INTERNAL", f"{role} is at version {st.weights_version!r} after the rollback, "
                                               f"expected {prev.version!r}")
            except RequestError as exc:
                if attempt == attempts:
                    raise
                log.warning("rollback_retry", service=role, attempt=attempt, error=exc.message)
                time.sleep(_RETRY_POLL_S)
        raise AssertionError("unreachable")
