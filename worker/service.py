"""The gRPC face both model workers share: health that follows the lifecycle, the
lifecycle / status / release RPC handlers, a worker's status as a proto, and starting a
worker service.

Owns: ``bind_health``, ``WorkerServicerMixin`` (LoadWeights, ReleaseWeights, CaptureGraphs,
ClearGraphs, PrepareWeights / CommitWeights / AbortWeights, GetStatus, Release, the error
handling of every worker RPC, and the answer to one round message (``_round_answer``, the
same whether the persistent gRPC stream or the data plane carried it)), per-item decoding and
result messages (``decode_items``, ``result_proto``), ``status_to_proto`` / ``state_to_proto``,
``new_worker``, ``WorkerService`` and ``start_worker_service`` (with the data plane beside the
gRPC server when the role has one: ``worker.data_plane``).

Must not know: which engine the worker runs (draft or target), scheduling, frameworks.
Errors become status codes through ``core.wire`` (the one map).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import grpc
import structlog
from grpc_health.v1 import health, health_pb2

from core import frames, wire
from core.admin_token import stop_serving
from core.observability import redact, start_metrics_server
from core.serving import build_server, refuse_insecure_bind
from core.startup import StartupError
from runtime.lifecycle import State
from specsplit.v1 import common_pb2 as pb
from worker.base import Worker, WorkerStatus
from worker.config import WorkerConfig, poll_seconds
from worker.data_plane import DataPlaneServer
from worker.swap import IN_PLACE, RECAPTURE


# --- health follows the lifecycle ---------------------------------------------------


def bind_health(worker: Worker, health_servicer: health.HealthServicer, service_name: str,
                overall: bool = True) -> None:
    """SERVING when LOADED/READY, NOT_SERVING when EMPTY, for ``service_name`` (and "", the
    server's, with ``overall``); kept current on every transition."""
    names = ("", service_name) if overall else (service_name,)

    def publish(*_args: Any) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if worker.lifecycle.state != State.EMPTY
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in names:
            health_servicer.set(name, status)

    publish()
    worker.lifecycle.add_observer(publish)


# --- proto items <-> records, per item -------------------------------------------------------


def decode_items(items: Iterable[Any], decode: Callable[[int, Any], Any]) -> list[Any]:
    """Each proto item -> its record via ``decode(i, item)``, or the ``ItemError`` saying why it
    could not be decoded: a bad item never ends the call, the others still run."""
    out: list[Any] = []
    for i, item in enumerate(items):
        try:
            out.append(decode(i, item))
        except Exception as exc:  # noqa: BLE001 - becomes the item's error
            out.append(wire.item_error_for(exc))
    return out


def result_proto(cls: Callable[..., Any], request_id: str, res: Any, encode: Callable[[Any], dict[str, Any]]) -> Any:
    """One per-item result message: ``cls(request_id, error=...)`` for an ``ItemError``, else
    ``cls(request_id, **encode(res))``."""
    if isinstance(res, wire.ItemError):
        return cls(request_id=request_id, error=wire.item_error_to_proto(res))
    return cls(request_id=request_id, **encode(res))


# --- RPC handlers both workers share --------------------------------------------------


class WorkerServicerMixin:
    """LoadWeights / ReleaseWeights / CaptureGraphs / ClearGraphs / GetStatus / Release.

    Put before the generated servicer base in the class bases. Needs ``self.worker``
    (a Worker) and ``self.log``.
    """

    worker: Worker
    log: Any
    data_plane: Any = None      # the worker's DataPlaneServer when it has one (its port is in the status)
    propose_hidden_rows = False  # the draft's servicer reads ProposeRequest.hidden_rows (said in the status)

    def _run(self, context: grpc.ServicerContext, rpc: str, fn: Callable[[], Any]) -> Any:
        """fn(), or abort the call with the status code its exception maps to."""
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status code
            code = wire.status_code_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                self.log.exception("rpc_failed", rpc=rpc, code=code.name)
            else:
                self.log.warning("rpc_refused", rpc=rpc, code=code.name, error=str(exc))
            context.abort(code, wire.error_message(exc))
        self.log.debug("rpc_done", rpc=rpc, seconds=round(time.perf_counter() - t0, 6))
        return out

    def _round_results(self, step: str, work: Callable[[], list[Any]], n_items: int,
                       round_: int) -> tuple[list[Any], float]:
        """One round message of a Propose/Verify stream: (per-item results, compute seconds).

        A failure of the whole batch (e.g. no weights) becomes that error for every
        item, so the persistent stream stays open for the next round.
        """
        t0 = time.perf_counter()
        try:
            results = work()
        except Exception as exc:  # noqa: BLE001 - the whole batch failed
            err = wire.item_error_for(exc)
            if err.code == grpc.StatusCode.INTERNAL:
                self.log.exception(f"{step}_failed", round=round_)
            results = [err] * n_items
        return results, time.perf_counter() - t0

    def _round_answer(self, msg: Any, step: str, decode: Callable[[int, Any], Any],
                      run: Callable[[list[Any], int], list[Any]], fill: Callable[[Any, str, Any], None],
                      response: Callable[..., Any]) -> Any:
        """One round message (Propose, Verify) -> its answer, whichever transport carried it (the
        gRPC stream or the data plane): decode its items (``decode_items``), run the batch, and
        return ``response(round, compute_seconds)`` with each item's result written into it by
        ``fill(resp.results.add, request_id, result)``.

        NOTE: written in place: per-item messages handed to the response's constructor are each
        copied once more into it (~1.8 us an item on the 2-core CPU; a round answers one per
        request)."""
        items = decode_items(msg.items, decode)
        results, seconds = self._round_results(step, lambda: run(items, msg.round), len(items), msg.round)
        resp = response(round=msg.round, compute_seconds=seconds)
        add = resp.results.add
        for it, res in zip(msg.items, results):
            fill(add, it.request_id, res)
        return resp

    def _round_stream(self, request_iterator: Iterable[Any], answer: Callable[[Any], Any]) -> Iterator[Any]:
        """A persistent batched stream (Propose, Verify): one ``answer(msg)`` per request message,
        in order; the stream ends when the client ends it."""
        for msg in request_iterator:
            yield answer(msg)

    def _status(self) -> pb.WorkerStatus:
        return status_to_proto(self.worker.status(), self.data_plane, self.propose_hidden_rows)

    def LoadWeights(self, request: pb.LoadWeightsRequest, context: grpc.ServicerContext) -> pb.LoadWeightsResponse:
        self._run(context, "LoadWeights", lambda: self.worker.load_weights(
            request.target_path, request.draft_path, request.version, request.in_place, request.validate_only))
        return pb.LoadWeightsResponse(status=self._status())

    def ReleaseWeights(self, request: pb.ReleaseWeightsRequest,
                       context: grpc.ServicerContext) -> pb.ReleaseWeightsResponse:
        self._run(context, "ReleaseWeights", self.worker.release_weights)
        return pb.ReleaseWeightsResponse(status=self._status())

    def CaptureGraphs(self, request: pb.CaptureGraphsRequest,
                      context: grpc.ServicerContext) -> pb.CaptureGraphsResponse:
        self._run(context, "CaptureGraphs", self.worker.capture_graphs)
        return pb.CaptureGraphsResponse(status=self._status())

    def ClearGraphs(self, request: pb.ClearGraphsRequest, context: grpc.ServicerContext) -> pb.ClearGraphsResponse:
        self._run(context, "ClearGraphs", self.worker.clear_graphs)
        return pb.ClearGraphsResponse(status=self._status())

    # --- weight swaps (the orchestrator's reload: prepare both, commit both) ---------------
    def PrepareWeights(self, request: pb.PrepareWeightsRequest,
                       context: grpc.ServicerContext) -> pb.PrepareWeightsResponse:
        self._run(context, "PrepareWeights", lambda: self.worker.swaps.prepare(
            request.target_path, request.draft_path, request.version, _weights_mode(request.mode), request.preload))
        return pb.PrepareWeightsResponse(status=self._status())

    def AbortWeights(self, request: pb.AbortWeightsRequest, context: grpc.ServicerContext) -> pb.AbortWeightsResponse:
        dropped = self._run(context, "AbortWeights", lambda: self.worker.swaps.abort(request.version))
        return pb.AbortWeightsResponse(dropped=dropped, status=self._status())

    def CommitWeights(self, request_iterator: Iterator[pb.CommitWeightsRequest],
                      context: grpc.ServicerContext) -> Iterator[pb.CommitWeightsEvent]:
        """One event per phase as it ends; a ``held`` event waits for the caller's ``resume``."""
        first = next(request_iterator, None)
        if first is None or not first.HasField("start"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first CommitWeights message must be `start`")
        st = first.start
        steps = self._run(context, "CommitWeights", lambda: self.worker.swaps.commit(
            st.version, _weights_mode(st.mode), st.capture_graphs if st.HasField("capture_graphs") else None,
            tuple(st.hold_after)))
        events: queue.SimpleQueue = queue.SimpleQueue()

        def drive() -> None:
            # NOTE: the phases run on this thread to the end whatever the caller does: a
            # commit never stops half-way because its caller left (a hold it no longer
            # answers means "stop", see worker.swap.Commit).
            answer = None
            try:
                while True:
                    phase = steps.send(answer)
                    answer = None
                    events.put((phase, self._status()))
                    if phase.held:
                        answer = _resume_answer(request_iterator)
            except StopIteration:
                pass
            except Exception as exc:  # noqa: BLE001 - reported as the stream's status
                events.put(exc)
            finally:
                events.put(None)

        threading.Thread(target=drive, name=f"{self.worker.role}-commit", daemon=True).start()
        while (item := events.get()) is not None:
            if isinstance(item, Exception):
                context.abort(wire.status_code_for(item), wire.error_message(item))
            phase, status = item
            ev = pb.CommitWeightsEvent(phase=phase.name, seconds=phase.seconds, status=status, held=phase.held,
                                       after=phase.after)
            if phase.error is not None:
                err = wire.item_error_for(phase.error)
                level = self.log.exception if err.code == grpc.StatusCode.INTERNAL else self.log.warning
                level("commit_phase_failed", phase=phase.name, code=err.code.name, error=err.message,
                      exc_info=phase.error)
                ev.error.CopyFrom(wire.item_error_to_proto(err))
            else:
                self.log.info("commit_phase", phase=phase.name, seconds=round(phase.seconds, 4),
                              weights_version=status.weights_version)
            yield ev

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.GetStatusResponse:
        return pb.GetStatusResponse(status=self._run(context, "GetStatus", self._status))

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        released = self._run(context, "Release", lambda: self.worker.release(list(request.request_ids)))
        if released:
            self.log.info("released", request_ids=released)
        return pb.ReleaseResponse(released=released)


_WEIGHTS_MODES = {pb.WEIGHTS_MODE_RECAPTURE: RECAPTURE, pb.WEIGHTS_MODE_IN_PLACE: IN_PLACE}


def _weights_mode(value: int) -> str:
    mode = _WEIGHTS_MODES.get(value)
    if mode is None:
        raise ValueError(f"mode: {value} is not RECAPTURE or IN_PLACE (required)")
    return mode


def _resume_answer(request_iterator: Iterator[pb.CommitWeightsRequest]) -> bool:
    """The caller's answer to a hold: True only for ``resume`` with ``proceed``; an ended or
    broken stream is "stop"."""
    try:
        msg = next(request_iterator, None)
    except Exception:  # noqa: BLE001 - the caller left (cancelled, deadline): stop
        return False
    return msg is not None and msg.HasField("resume") and msg.resume.proceed


# --- starting a worker service ------------------------------------------------------------


@dataclass(frozen=True)
class Hosted:
    """A second worker served from a worker service's gRPC server (a target's colocated draft):
    its servicer beside the service's own, its health under its service name, its start-up
    load with the service's, its teardown after the service's hosted loops end."""

    worker: Worker
    servicer: Any
    add_servicer: Callable[[Any, grpc.Server], None]
    service_name: str


@dataclass
class WorkerService:
    """A started worker service. ``stop`` ends the server, then tears the worker down in order."""

    server: grpc.Server
    port: int
    worker: Worker
    health: health.HealthServicer
    metrics_port: int | None = None
    before_close: list[Callable[[], None]] = field(default_factory=list)   # run after the server stops
    data_plane: DataPlaneServer | None = None
    hosted: Hosted | None = None

    def stop(self, grace: float | None = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        # NOTE: the generated token's registration and file go before the port is let go, so a
        # later server of this process on the same port is never taken for this one.
        stop_serving(self.port)
        stopped = self.server.stop(grace)
        # NOTE: the data plane closes with the gRPC server, before the worker tears down: a
        # round in flight on it ends (its client falls back) while the weights are still there.
        if self.data_plane is not None:
            self.data_plane.stop()
        # NOTE: hosted loops end first (their streams get their status while the server
        # drains), then the worker's ordered teardown (graphs, then weights).
        for fn in self.before_close:
            fn()
        stopped.wait()
        # NOTE: each worker's teardown is graphs, then weights; the two share no tensor, so the
        # hosted one (which no round calls any more) may go first.
        if self.hosted is not None:
            self.hosted.worker.close()
        self.worker.close()


def new_worker(cfg: WorkerConfig, role: str, worker_cls: Callable[..., Worker]) -> tuple[Worker, Any]:
    """(the role's worker, its logger) after checking ``cfg.role``; the worker loads nothing yet."""
    if cfg.role != role:
        raise ValueError(f"role={cfg.role!r}: the {role} service needs role {role!r}")
    log = structlog.get_logger(service=role)
    log.info("starting", config=redact(cfg))
    return worker_cls(cfg, log=log), log


def start_worker_service(cfg: WorkerConfig, worker: Worker, servicer: Any,
                         add_servicer: Callable[[Any, grpc.Server], None], service_name: str,
                         log: Any, data_plane: Callable[[bytes], bytes] | None = None,
                         hosted: Hosted | None = None) -> WorkerService:
    """Load at start if configured (and capture if asked), bind, start, serve metrics. With
    ``data_plane`` (a round frame -> its answer) and ``cfg.data_plane_port`` >= 0, also listen on
    the data plane (``worker.data_plane``); its port is in the status (``servicer.data_plane``).
    ``hosted``: a second worker served from the same server (loaded and captured the same way)."""
    # NOTE: the bind policy is checked before the (slow) start-up load, so a refused start is quick.
    refuse_insecure_bind(cfg.server, cfg.security, service_name)
    for w in [worker] + ([hosted.worker] if hosted is not None else []):
        if w.cfg.target_path:
            _load_at_start(w)
    health_servicer = health.HealthServicer()
    bind_health(worker, health_servicer, service_name)
    adders, names = [lambda s: add_servicer(servicer, s)], [service_name]
    if hosted is not None:
        bind_health(hosted.worker, health_servicer, hosted.service_name, overall=False)
        adders.append(lambda s: hosted.add_servicer(hosted.servicer, s))
        names.append(hosted.service_name)
    server, port = build_server(cfg.server, cfg.security, adders, names, health_servicer)
    dp = _start_data_plane(cfg, data_plane, log) if data_plane is not None and cfg.data_plane_port >= 0 else None
    # NOTE: the data plane is up before the server: the first GetStatus already advertises it.
    servicer.data_plane = dp
    server.start()
    metrics_port = start_metrics_server(cfg.server.metrics_port, cfg.server.host)
    log.info("serving", service=service_name, address=f"{cfg.server.host}:{port}", metrics_port=metrics_port,
             state=worker.lifecycle.state.value, weights_version=worker.weights_version,
             backend=worker.ops.name, device=worker.ops.device, graphs_mode=worker.graphs_mode,
             tls=bool(cfg.security.tls_cert), mtls=bool(cfg.security.tls_client_ca),
             admin_token=bool(cfg.security.admin_token), data_plane_port=dp.port if dp is not None else None)
    return WorkerService(server, port, worker, health_servicer, metrics_port, data_plane=dp, hosted=hosted)


def _load_at_start(worker: Worker) -> None:
    """The configured weights (and graphs, with ``capture_on_start``) before the server starts."""
    cfg = worker.cfg
    try:
        worker.load_weights(cfg.target_path, cfg.draft_path or "", cfg.weights_version)
    except (ValueError, OSError) as exc:
        raise StartupError("start-up weights", str(exc)) from exc
    if cfg.capture_on_start:
        worker.capture_graphs()


def _start_data_plane(cfg: WorkerConfig, handle: Callable[[bytes], bytes], log: Any) -> DataPlaneServer:
    """The data plane on the gRPC host, with the gRPC server's TLS (and mTLS) settings."""
    sec = cfg.security
    try:
        ctx = frames.server_context(sec.tls_cert, sec.tls_key, sec.tls_client_ca) if sec.tls_cert else None
        return DataPlaneServer(cfg.server.host, cfg.data_plane_port, handle,
                               max_frame_bytes=cfg.server.max_message_bytes, ssl_context=ctx, log=log,
                               name=f"{cfg.role}-data-plane", poll_s=poll_seconds(cfg.data_plane_poll_us)).start()
    except OSError as exc:      # ssl.SSLError is an OSError too
        raise StartupError("data plane", f"cannot listen on {cfg.server.host}:{cfg.data_plane_port}: "
                           f"{exc.strerror or exc}") from None


# --- status as a proto ------------------------------------------------------------------------

_STATES = {State.EMPTY: pb.LIFECYCLE_STATE_EMPTY, State.LOADED: pb.LIFECYCLE_STATE_LOADED,
           State.READY: pb.LIFECYCLE_STATE_READY}


def state_to_proto(state: State) -> int:
    return _STATES[state]


def status_to_proto(s: WorkerStatus, data_plane: Any = None, propose_hidden_rows: bool = False) -> pb.WorkerStatus:
    """The worker's status; with ``data_plane`` (its ``DataPlaneServer``), also its port and frame count;
    ``propose_hidden_rows``: the servicer reads ``ProposeRequest.hidden_rows`` (a draft's)."""
    out = pb.WorkerStatus(
        role=s.role, state=state_to_proto(s.state), weights_version=s.weights_version,
        graph_keys=list(s.graph_keys), graph_pool_bytes=s.graph_pool_bytes, graphs_mode=s.graphs_mode,
        max_k=s.max_k, backend=s.backend, device=s.device, free_slots=s.free_slots, used_slots=s.used_slots,
        graph_replays=s.graph_replays, eager_runs=s.eager_runs, device_memory_bytes=s.device_memory_bytes,
        active_request_ids=list(s.active_request_ids), vocab_size=s.vocab_size, hidden_size=s.hidden_size,
        max_len=s.max_len, lifecycle_events=list(s.lifecycle_events),
        max_position_embeddings=s.max_position_embeddings, eos_token_ids=list(s.eos_token_ids),
        instance_id=s.instance_id)
    if s.eos_token_id is not None:
        out.eos_token_id = s.eos_token_id
    if data_plane is not None:
        out.data_plane_port, out.data_plane_frames = data_plane.port, data_plane.frames
    out.propose_hidden_rows = propose_hidden_rows
    return out
