"""The client-facing orchestrator service: Generate, GetStatus, ReloadWeights, PushWeights, health, reflection.

Owns: request validation (every bad field -> INVALID_ARGUMENT naming it, too
long for the cache -> RESOURCE_EXHAUSTED), turning scheduler events into the
Generate stream (TokenChunk per round, then GenerateFinal), holding Generate
calls while weights reload (bounded, then UNAVAILABLE with RetryInfo), the
cluster status, the worker poller that keeps model facts (vocab, cache length,
EOS, slots) and health current, and ``create_server``. The reload RPCs (ReloadWeights,
PushWeights) live in ``orchestrator.reload_rpcs``.

Must not know: how rounds run (``scheduler``), how workers are called
(``worker_clients``), how a reload proceeds (``reload``) or a push is staged
(``push``), tensors, frameworks.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import grpc
import structlog
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2
from grpc_status import rpc_status

from rounds.draft_health import read_address_file
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.push import PushStaging
from orchestrator.reload import ReloadCoordinator
from orchestrator.reload_rpcs import ReloadServicerMixin
from orchestrator.round_client import RemoteRounds
from rounds.scheduler_types import (ErrorEvent, FinalEvent, GenerationRequest, QueueFull, RequestError,
                                          TokensEvent)
from orchestrator.validation import MAX_STOP_CHARS, MAX_STOP_STRINGS, ModelFacts, _bad, validate  # noqa: F401
from rounds.draft_client import DraftClient
from rounds.worker_clients import TargetClient
from orchestrator.config import OrchestratorConfig
from core.observability import start_metrics_server
from runtime.round_driver import SeqStats
from runtime.tokenizer import StopStrings, load_tokenizer
from core.admin_token import stop_serving, token_for_worker
from core.serving import build_server
from specsplit.v1 import common_pb2, orchestrator_pb2 as opb, orchestrator_pb2_grpc

log = structlog.get_logger("orchestrator")

SERVICE_NAME = "specsplit.v1.Orchestrator"
POLL_S = 1.0                       # worker status poll period (health, model facts)
EVENT_POLL_S = 0.25                # how often a waiting Generate handler checks its client is still there
_SERVING_STATES = (common_pb2.LIFECYCLE_STATE_LOADED, common_pb2.LIFECYCLE_STATE_READY)
_FINISH = {"stop": opb.FINISH_REASON_STOP, "length": opb.FINISH_REASON_LENGTH, "aborted": opb.FINISH_REASON_ABORTED}


class Orchestrator:
    """Clients + scheduler + worker poller; the servicer's back end."""

    def __init__(self, cfg: OrchestratorConfig, metrics: OrchestratorMetrics) -> None:
        self.cfg, self.metrics = cfg, metrics
        kw = dict(timeout_s=cfg.worker_timeout_s, max_message_bytes=cfg.server.max_message_bytes,
                  tls_ca=cfg.tls_ca, client_cert=(cfg.tls_client_cert or cfg.security.tls_cert) if cfg.tls_ca else None,
                  client_key=(cfg.tls_client_key or cfg.security.tls_key) if cfg.tls_ca else None,
                  admin_token=None)
        # One admin-token setting serves both ends; local workers' token files are found (core.admin_token).
        token = lambda address: token_for_worker(cfg.worker_admin_token, cfg.security.admin_token, address)  # noqa: E731
        self.target = TargetClient(cfg.target_address, **{**kw, "admin_token": token(cfg.target_address),
                                                          "token_source": lambda: token(cfg.target_address)})
        self.health = health.HealthServicer()
        self.facts: ModelFacts | None = None
        self.facts_error = "worker status not polled yet"
        self.draining = False
        self.target_up = True                        # last poll reached a serving target
        # The round loop runs in the target service (DESIGN § Topology): requests join it
        # with one Decode call each; it talks to the draft itself. The orchestrator keeps
        # admission checks, streaming to clients, lifecycle and the draft's address.
        self.scheduler = RemoteRounds(self.target, observer=metrics, control_timeout_s=cfg.worker_timeout_s,
                                      stream_interval=cfg.stream_interval)
        self.rounds: Any = None                      # last RoundsStatus polled from the target
        self._make_draft = lambda address: DraftClient(address, **{**kw, "admin_token": token(address),
                                                                  "token_source": lambda: token(address)})
        self.draft_configured = bool(cfg.draft_address or cfg.draft_address_file)
        self.draft_address = read_address_file(cfg.draft_address_file) or cfg.draft_address
        self._draft = self._make_draft(self.draft_address) if self.draft_address else None
        self._draft_lock = threading.Lock()
        self.reloader = ReloadCoordinator(self.scheduler, self._worker_clients, cfg, refresh=self.poll,
                                          gate=self.publish_health, registry=metrics.registry)
        self.scheduler.reloading = lambda: self.reloader.active
        self.scheduler.wait_reload = self.reloader.wait_idle
        self.scheduler.resume_wait_s = cfg.reload_rollback_wait_s + 3 * cfg.worker_timeout_s + 10
        self.scheduler.release_draft = lambda ids: self.draft.release_many(ids) if self.draft is not None else None
        self.push = PushStaging(cfg.push_staging_dir, cfg.push_max_bytes, cfg.push_keep_versions)
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="orchestrator-poller", daemon=True)

    @property
    def draft(self) -> DraftClient | None:
        """The client of the draft's current address, for lifecycle and status (None: no draft
        configured). The target's round loop keeps its own stream to the same address."""
        return self._draft

    def _worker_clients(self) -> dict[str, Any]:
        """The workers a reload drives: the target, and the draft at its current address."""
        draft = self.draft
        return {"target": self.target, **({"draft": draft} if draft is not None else {})}

    @property
    def speculation_available(self) -> bool:
        """A draft is attached to the target's round loop: rounds speculate."""
        return self.draft_configured and self.rounds is not None and self.rounds.speculation_available

    @property
    def draft_in_process(self) -> bool:
        """The attached draft runs in the target's process (the target's ``colocated_draft``)."""
        return self.speculation_available and self.rounds is not None and self.rounds.draft_in_process

    def set_draft_address(self, address: str) -> None:
        """Admin: move to the draft at ``address`` (the target re-attaches live requests there)."""
        if not self.draft_configured:
            raise RequestError("FAILED_PRECONDITION", "no draft configured (target-only serving)")
        with self._draft_lock:
            if address == self.draft_address:
                return
            old, self.draft_address, self._draft = self._draft, address, self._make_draft(address)
        log.info("draft_address_changed", address=address)
        if old is not None:
            old.close()
        self._configure_rounds()

    def _configure_rounds(self) -> None:
        """Tell the target's round loop where the draft is and the batch limits."""
        try:
            self.rounds = self.scheduler.configure(self.draft_address or "", self.cfg.max_batch, self.cfg.max_queue,
                                                   self.cfg.worker_timeout_s)
        except RequestError as exc:
            log.warning("configure_rounds_failed", error=exc.message)

    def start(self) -> None:
        self._configure_rounds()                     # this orchestrator's limits and draft, whatever was set before
        self.poll()                                  # facts and health before the first request
        self._poller.start()

    # --- worker poller ---------------------------------------------------------------
    def _status(self, client: Any) -> tuple[common_pb2.WorkerStatus | None, str]:
        try:
            return client.get_status(timeout=min(self.cfg.worker_timeout_s, 5.0)), ""
        except RequestError as exc:
            return None, exc.message

    def poll(self, known: dict[str, Any] | None = None) -> None:
        """Refresh model facts, scheduler limits, health and worker gauges from GetStatus.

        ``known``: statuses just received another way (a reload's last answers: "target",
        "draft" WorkerStatus, "rounds" RoundsStatus): used instead of asking again."""
        known = known or {}
        new = read_address_file(self.cfg.draft_address_file)
        if new and new != self.draft_address:        # draft_address_file names a new draft
            self.set_draft_address(new)
        t, t_err = (known["target"], "") if "target" in known else self._status(self.target)
        d, d_err = (None, "") if self.draft is None else (
            (known["draft"], "") if "draft" in known else self._status(self.draft))
        target_ok = t is not None and t.state in _SERVING_STATES and t.vocab_size > 0
        draft_ok = d is not None and d.state in _SERVING_STATES
        if target_ok:
            max_len, slots = t.max_len, t.free_slots + t.used_slots
            if draft_ok:
                max_len, slots = min(max_len, d.max_len), min(slots, d.free_slots + d.used_slots)
            self.facts = ModelFacts(t.vocab_size, max_len, t.eos_token_id if t.HasField("eos_token_id") else None,
                                    t.weights_version, slots, d.max_k if draft_ok else None,
                                    t.max_position_embeddings, tuple(t.eos_token_ids))
            try:
                self.rounds = known.get("rounds") or self.scheduler.status(timeout=min(self.cfg.worker_timeout_s,
                                                                                       5.0))
            except RequestError as exc:
                self.rounds = None
                log.warning("rounds_status_failed", error=exc.message)
            # NOTE: a target that restarted has forgotten the draft address and limits.
            if self.rounds is not None and (not self.rounds.configured
                                            or self.rounds.draft_address != (self.draft_address or "")):
                self._configure_rounds()
            if self.rounds is not None:
                self.metrics.on_load(self.rounds.active_requests, self.rounds.queued_requests)
        else:
            self.facts_error = t_err or f"target is not serving (state {t.state if t else '?'})"
        if t is None and self.scheduler.open_calls():
            # NOTE: a stalled target (no answer within the worker timeout) would hold every
            # stream until its deadline: end them now; the target frees their slots when it
            # answers again (cancellations are honoured before anyone joins).
            n = self.scheduler.fail_all(f"target stopped answering: {t_err}")
            log.warning("target_unresponsive", ended=n, error=t_err)
        if self.scheduler.orphaned and self.draft is not None:
            ids = sorted(self.scheduler.orphaned)
            try:
                self.draft.release_many(ids)
                self.scheduler.orphaned.difference_update(ids)
            except RequestError as exc:
                log.warning("orphan_release_failed", count=len(ids), error=exc.message)
        # NOTE: a missing draft does not make the orchestrator NOT_SERVING: requests go on
        # target-only (speculation_available / specsplit_speculation_available say so).
        self.target_up = target_ok
        self.publish_health()
        self.metrics.on_workers(t is not None, None if self.draft is None else d is not None)
        self.metrics.speculation.set(int(self.speculation_available))
        self.metrics.draft_in_process.set(int(self.draft_in_process))

    def publish_health(self) -> None:
        """Health from what is known now (no call): SERVING while the target serves and no
        reload or shutdown runs."""
        serving = self.target_up and not self.draining and not self.reloader.active
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def _poll_loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the poller must keep running
                if self._stop.is_set():
                    return                   # close() under way: its channels may already be closed
                log.exception("poll_failed")

    def cluster_status(self) -> opb.ClusterStatus:
        try:
            self.rounds = self.scheduler.status(timeout=min(self.cfg.worker_timeout_s, 5.0))
        except RequestError:
            pass                                     # the target's own status says why
        r = self.rounds
        self.metrics.speculation.set(int(self.speculation_available))
        self.metrics.draft_in_process.set(int(self.draft_in_process))
        active, queued = (r.active_requests, r.queued_requests) if r is not None else (0, 0)
        facts = self.facts
        out = opb.ClusterStatus(orchestrator=opb.OrchestratorStatus(
            active_requests=active, queued_requests=queued,
            speculation_available=self.speculation_available,
            weights_version=facts.weights_version if facts else "", default_k=self.cfg.default_k,
            max_k=self.cfg.max_k, reloading=self.reloader.active, draft_in_process=self.draft_in_process))
        t, t_err = self._status(self.target)
        if t is not None:
            out.target.CopyFrom(t)
        out.target_error = t_err
        if self.draft is None:
            out.draft_error = "no draft configured (target-only serving)"
        else:
            d, d_err = self._status(self.draft)
            if d is not None:
                out.draft.CopyFrom(d)
            why = r.draft_error if r is not None else "the target's round loop is unreachable"
            out.draft_error = d_err or ("" if self.speculation_available else f"target-only: {why}")
        return out

    def close(self) -> None:
        """Stop polling, end live requests (releasing their slots), close the channels."""
        self._stop.set()
        # NOTE: the poller's current poll ends before the channels close, waited for a few
        # seconds at most (a hung worker's call runs to its deadline; the poller then sees
        # _stop and stays quiet): a poll on a closed channel logged "poll_failed" at shutdown.
        if self._poller.is_alive() and self._poller is not threading.current_thread():
            self._poller.join(timeout=min(self.cfg.worker_timeout_s, 5.0))
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.scheduler.stop()
        self.target.close()
        if self._draft is not None:
            self._draft.close()


# --- the servicer -------------------------------------------------------------------------
def _stats_proto(s: SeqStats) -> opb.SpecStats:
    return opb.SpecStats(drafted=s.drafted, accepted=s.accepted, acceptance_rate=s.acceptance_rate,
                         mean_accepted_length=s.mean_accepted_length, acceptance_per_position=s.per_position(),
                         rounds=s.rounds, ahead_asked=s.ahead_asked, ahead_used=s.ahead_used,
                         watch_probes=s.watch_probes)


class OrchestratorServicer(ReloadServicerMixin, orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, core: Orchestrator) -> None:
        self.core = core
        self.tokenizer = load_tokenizer(core.cfg.tokenizer)
        self._active_ids: set[str] = set()
        self._ids_lock = threading.Lock()

    def _reject(self, context: grpc.ServicerContext, err: RequestError, rlog: Any) -> None:
        rlog.info("rejected", code=err.code, error=err.message)
        self.core.metrics.on_outcome(None, err.code)
        context.abort(grpc.StatusCode[err.code], err.message)

    def _reject_retry(self, context: grpc.ServicerContext, seconds: int, rlog: Any) -> None:
        """UNAVAILABLE with a google.rpc.RetryInfo detail (retry_delay = ``seconds``)."""
        message = (f"weights are reloading (waited {self.core.cfg.generate_wait_during_reload_s:g}s, "
                   f"generate_wait_during_reload_s); retry in about {seconds}s")
        rlog.info("rejected", code="UNAVAILABLE", error=message)
        self.core.metrics.on_outcome(None, "UNAVAILABLE")
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=seconds)))
        context.abort_with_status(rpc_status.to_status(status_pb2.Status(
            code=code_pb2.UNAVAILABLE, message=message, details=[detail])))

    def Generate(self, request: opb.GenerateRequest, context: grpc.ServicerContext):
        arrived = time.perf_counter()
        core = self.core
        rlog = log.bind(request_id=request.request_id or None)
        if core.draining:
            self._reject(context, RequestError("UNAVAILABLE", "the orchestrator is shutting down"), rlog)
        # NOTE: wait (bounded) for a running weight reload before validating: the
        # facts (vocab, cache length) are refreshed before the reload opens the gate.
        if not core.reloader.wait_idle(core.cfg.generate_wait_during_reload_s):
            self._reject_retry(context, core.reloader.retry_after_s(), rlog)
        facts = core.facts
        if facts is None or not core.target_up:
            self._reject(context, RequestError("UNAVAILABLE", f"target worker unavailable: {core.facts_error}"), rlog)
        try:
            greq = validate(request, core.cfg, facts, core.draft is not None, self.tokenizer)
        except RequestError as err:
            self._reject(context, err, rlog)
        rlog = log.bind(request_id=greq.request_id)
        with self._ids_lock:
            if greq.request_id in self._active_ids:
                self._reject(context, _bad(f"request_id: {greq.request_id!r} is already active"), rlog)
            self._active_ids.add(greq.request_id)
        try:
            yield from self._stream(greq, context, rlog, tuple(request.stop), arrived)
        finally:
            with self._ids_lock:
                self._active_ids.discard(greq.request_id)

    def _stream(self, greq: GenerationRequest, context: grpc.ServicerContext, rlog: Any, stops: tuple[str, ...],
                arrived: float):
        """The request's events as Generate messages; ``arrived``: when its call came (latency metrics)."""
        try:
            handle = self.core.scheduler.submit(greq)
        except QueueFull as exc:
            self._reject(context, RequestError("RESOURCE_EXHAUSTED", str(exc)), rlog)
        except RequestError as err:
            self._reject(context, err, rlog)
        # NOTE: registered after submit: a client that is already gone cancels at once,
        # and the scheduler frees the slots at its next round boundary.
        if not context.add_callback(handle.cancel):
            handle.cancel()
        decoder = self.tokenizer.stream()
        stop = StopStrings(stops)
        texts: list[str] = []
        version = ""
        n_out = 0
        first = 0.0                                         # when the first token went out
        while True:
            ev = handle.next_event(EVENT_POLL_S)
            if ev is None:
                if not context.is_active():
                    handle.cancel()
                    return
                continue
            if isinstance(ev, TokensEvent):
                # NOTE: the rounds that came in one message (the target's stream_interval) go
                # on in one chunk, never across a weight swap (a chunk has one weights_version);
                # each round is still checked for stop strings on its own, so the output is the
                # same whatever the interval.
                tokens: list[int] = []
                text, accepted, drafted = "", 0, 0
                ready = getattr(handle, "ready_tokens", None)
                for part in [ev, *(ready(ev.weights_version) if ready is not None else ())]:
                    if stop.stopped:
                        break                              # rounds finished after the stop string
                    text += stop.push(decoder.push(list(part.tokens)))
                    tokens.extend(part.tokens)
                    accepted, drafted = accepted + part.num_accepted, drafted + part.num_drafted
                    ev = part
                if not tokens:
                    continue
                texts.append(text)
                if not n_out:
                    first = time.perf_counter()
                    self.core.metrics.on_first_token(first - arrived)
                n_out += len(tokens)
                version = ev.weights_version
                yield opb.GenerateResponse(chunk=opb.TokenChunk(
                    token_ids=tokens, text=text, num_accepted=accepted, num_drafted=drafted,
                    round=ev.round, weights_version=ev.weights_version))
                if stop.stopped:
                    handle.cancel()                        # the final event comes as "cancelled"
            elif isinstance(ev, ErrorEvent):
                rlog.warning("generate_failed", code=ev.code, error=ev.message, streamed=len(ev.output))
                context.abort(grpc.StatusCode[ev.code], ev.message)
            elif isinstance(ev, FinalEvent):
                if stop.stopped:                           # we cancelled it at a stop string
                    ev = dataclasses.replace(ev, finish_reason="stop", output=ev.output[:n_out])
                elif ev.finish_reason not in _FINISH:     # cancelled: the client is gone
                    return
                tail = stop.push(decoder.flush()) + stop.flush()
                if tail:                                   # output ended inside a UTF-8 character
                    texts.append(tail)
                    yield opb.GenerateResponse(chunk=opb.TokenChunk(text=tail, weights_version=version))
                yield opb.GenerateResponse(final=opb.GenerateFinal(
                    finish_reason=_FINISH[ev.finish_reason],
                    usage=opb.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=len(ev.output)),
                    stats=_stats_proto(ev.stats), weights_version=ev.weights_version, text="".join(texts),
                    request_id=greq.request_id))
                end = time.perf_counter()
                self.core.metrics.on_finished(end - arrived, end - first if n_out else 0.0, n_out)
                return

    def GetStatus(self, request: common_pb2.GetStatusRequest, context: grpc.ServicerContext) -> opb.ClusterStatus:
        return self.core.cluster_status()


# --- the server ------------------------------------------------------------------------------
class OrchestratorServer:
    """A started orchestrator: the grpc.Server plus what it owns. Delegates the rest to grpc.Server."""

    def __init__(self, server: grpc.Server, port: int, core: Orchestrator, metrics_port: int | None) -> None:
        self.server, self.port, self.core, self.metrics_port = server, port, core, metrics_port

    def stop(self, grace: float | None = None) -> threading.Event:
        """Stop now: new calls are refused, live requests end with UNAVAILABLE (their slots
        released on both workers), channels close. ``graceful_shutdown`` lets them finish first."""
        self.core.draining = True
        stop_serving(self.port)            # NOTE: before the port is let go (see WorkerService.stop)
        done = self.server.stop(grace)
        self.core.close()
        return done

    def graceful_shutdown(self, grace: float) -> None:
        """Refuse new requests, let in-flight ones finish within ``grace`` seconds, then stop."""
        self.core.draining = True
        self.core.poll()                               # health -> NOT_SERVING now
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.core.scheduler.open_calls() > 0:
            time.sleep(0.05)
        # NOTE: what still runs after the grace period ends with UNAVAILABLE from the scheduler
        # (slots released), and the handlers get a moment to send that status before the
        # server cancels whatever is left.
        self.core.scheduler.stop()
        self.stop(grace=1.0).wait(2.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)


def create_server(cfg: OrchestratorConfig) -> tuple[OrchestratorServer, int]:
    """Build, start and return the orchestrator and its port (cfg.server.port 0 picks one)."""
    metrics = OrchestratorMetrics()
    core = Orchestrator(cfg, metrics)
    # NOTE: every Generate stream holds a handler thread for its whole life, so the
    # pool must cover the live batch plus the admission queue plus status calls.
    server_cfg = dataclasses.replace(cfg.server, max_workers=min(1024, max(
        cfg.server.max_workers, cfg.max_batch + cfg.max_queue + 8)))
    server, port = build_server(server_cfg, cfg.security,
                                [lambda s: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(
                                    OrchestratorServicer(core), s)], [SERVICE_NAME], core.health,
                                registry=metrics.registry)
    # NOTE: the scheduler and poller start before the port accepts calls, so the first
    # Generate sees model facts and a running scheduler.
    core.start()
    server.start()
    metrics_port = start_metrics_server(cfg.server.metrics_port, cfg.server.host, registry=metrics.registry)
    log.info("serving", service=SERVICE_NAME, address=f"{cfg.server.host}:{port}", metrics_port=metrics_port,
             target=cfg.target_address, draft=cfg.draft_address, facts=dataclasses.asdict(core.facts)
             if core.facts else core.facts_error)
    return OrchestratorServer(server, port, core, metrics_port), port
