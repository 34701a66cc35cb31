"""Shared gRPC server plumbing of the specsplit services.

Owns: building a ``grpc.Server`` from ``ServerConfig``/``SecurityConfig``
(thread pool, message-size limits, TLS / mTLS, grpc.health.v1, server
reflection v1 + v1alpha), the secure-by-default start-up policy (plaintext
only on loopback unless ``allow_insecure``; an admin token generated and
written to a user-only file when none is configured), installing on every
method of every server the auth + audit interceptor (``specsplit.auth``) and
the undecodable-request guard (``specsplit.request_guard``), so RPCs added
later get both without code of their own, the checkpoint-path policy
(``check_checkpoint_path``), and the pieces both workers' servicers share:
the lifecycle / status / release RPC handlers (``WorkerServicerMixin``),
health that follows the lifecycle state, and ``start_worker_service``.

Must not know: models, tensors, frameworks, scheduling. Servicers hand their
work to a worker object; errors become status codes via ``specsplit.wire``.

Secrets: tokens are compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import errno
import socket
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from runtime.config import SecurityConfig, ServerConfig, WorkerConfig
from runtime.lifecycle import State
from runtime.worker_base import WorkerBase
from runtime.observability import start_metrics_server
from specsplit import wire
# Who may call what (admin token, generation token, mTLS common names) lives in specsplit.auth.
from specsplit.auth import ADMIN_METHODS, AUTH_HEADER, AuthInterceptor, admin_metadata  # noqa: F401 (re-exported)
from specsplit.admin_token import default_token_path, is_loopback_host, process_token, write_token_file
from specsplit.audit import AdminAudit
from specsplit.reflection import enable_reflection
from specsplit.request_guard import RequestGuard
from specsplit.startup import StartupError
from specsplit.v1 import common_pb2 as pb


# --- checkpoint paths ---------------------------------------------------------------


def check_checkpoint_path(path: str | Path, roots: Iterable[str] = ()) -> Path:
    """The resolved path (symlinks followed), or ValueError if it lies outside every root.

    Empty ``roots`` allows any path. ``..`` components, absolute paths and
    symlinks are judged by where they finally point.
    """
    raw = str(path)
    if not raw:
        raise ValueError("checkpoint path is empty")
    if "\x00" in raw:
        raise ValueError("checkpoint path contains a NUL byte")
    try:
        resolved = Path(raw).resolve()
    except (OSError, RuntimeError) as exc:  # symlink loops
        raise ValueError(f"checkpoint path {raw!r} cannot be resolved: {exc}") from None
    roots = [r for r in roots if r]
    if not roots:
        return resolved
    for root in roots:
        r = Path(root).resolve()
        if resolved == r or resolved.is_relative_to(r):
            return resolved
    raise ValueError(f"checkpoint path {raw!r} resolves to {str(resolved)!r}, outside the allowed "
                     f"checkpoint roots {list(roots)}")


# --- server -------------------------------------------------------------------------


_log = structlog.get_logger("specsplit.serving")


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise StartupError("TLS material", f"cannot read {what} {path}: {exc.strerror or exc}") from None


def refuse_insecure_bind(server_cfg: ServerConfig, security_cfg: SecurityConfig, service: str) -> None:
    """StartupError for plaintext on a non-loopback address without ``allow_insecure``."""
    if security_cfg.tls_cert or is_loopback_host(server_cfg.host) or security_cfg.allow_insecure:
        return
    raise StartupError("insecure bind", f"refusing to serve {service} in plaintext on non-loopback address "
                       f"{server_cfg.host}: configure TLS (--security-tls-cert/--security-tls-key) or pass "
                       f"--allow-insecure")


def check_bind_policy(server_cfg: ServerConfig, security_cfg: SecurityConfig, service: str) -> None:
    """Plaintext only on loopback; elsewhere TLS, or ``allow_insecure`` with a warning at every start."""
    refuse_insecure_bind(server_cfg, security_cfg, service)
    if not security_cfg.tls_cert and not is_loopback_host(server_cfg.host):
        _log.warning("insecure_bind", service=service, host=server_cfg.host,
                     message="serving plaintext on a non-loopback address (--allow-insecure): traffic and "
                             "tokens can be read and altered on the network")


def _install_generated_token(auth: AuthInterceptor, security_cfg: SecurityConfig, port: int, service: str) -> None:
    """No admin token or admin certificate configured: generate one, write it where local clients find it."""
    token = process_token()
    path = security_cfg.admin_token_file or default_token_path(port)
    try:
        written = write_token_file(path, token)
    except OSError as exc:
        raise StartupError("admin token file", f"cannot write {path}: {exc.strerror or exc} (set "
                           f"--security-admin-token-file or an admin token)") from None
    auth.set_admin_token(token)
    _log.warning("admin_token_generated", service=service, path=str(written),
                 message="no admin token configured: admin RPCs need the token in this file (the specsplit "
                         "CLI reads it for local addresses)")


def _check_port_free(host: str, port: int) -> None:
    """StartupError naming the port when a fixed port is taken (grpc would only log a C-core error)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise StartupError("listen address", f"{host}: {exc.strerror or exc}") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # NOTE: SO_REUSEADDR as gRPC's own bind has it: connections of a killed process in
        # TIME_WAIT must not make a restarted service on the same port look refused; a live
        # listener still gives EADDRINUSE.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StartupError("port", f"{host}:{port} is already in use") from None
            raise StartupError("port", f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def build_server(server_cfg: ServerConfig, security_cfg: SecurityConfig,
                 servicer_adders: list[Callable[[grpc.Server], None]], service_names: list[str],
                 health_servicer: health.HealthServicer,
                 admin_methods: frozenset[str] = ADMIN_METHODS,
                 registry: CollectorRegistry | None = None) -> tuple[grpc.Server, int]:
    """A bound (not started) server and its port. ``service_names`` are the full names
    (``specsplit.v1.DraftService``) listed by reflection next to health and reflection.
    ``registry``: where the admin-RPC counter goes (default: the process registry).
    Start-up problems raise ``StartupError``."""
    service = service_names[0] if service_names else "specsplit"
    check_bind_policy(server_cfg, security_cfg, service)
    auth = AuthInterceptor(security_cfg, admin_methods, audit=AdminAudit(service, registry))
    # NOTE: auth first (outermost): a refused admin call is audited and refused before its
    # body is looked at; the guard then turns undecodable bodies into INVALID_ARGUMENT.
    interceptors = [auth, RequestGuard()]
    options = [
        ("grpc.max_send_message_length", server_cfg.max_message_bytes),
        ("grpc.max_receive_message_length", server_cfg.max_message_bytes),
        # Refuse to share a fixed port with another live server (Linux allows it by default).
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=server_cfg.max_workers,
                                                    thread_name_prefix="grpc"),
                         interceptors=interceptors, options=options)
    for add in servicer_adders:
        add(server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection([*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], server)
    address = f"{server_cfg.host}:{server_cfg.port}"
    _check_port_free(server_cfg.host, server_cfg.port)
    try:
        if security_cfg.tls_cert:
            ca = _read(security_cfg.tls_client_ca, "client CA") if security_cfg.tls_client_ca else None
            creds = grpc.ssl_server_credentials(
                [(_read(security_cfg.tls_key, "TLS key"), _read(security_cfg.tls_cert, "TLS certificate"))],
                root_certificates=ca, require_client_auth=ca is not None)
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:
        raise StartupError("port", f"cannot listen on {address} (address not available here, or the TLS "
                           f"certificate/key do not load)") from None
    if not port:
        raise StartupError("port", f"cannot listen on {address}")
    if AuthInterceptor.needs_generated_token(security_cfg):
        _install_generated_token(auth, security_cfg, port, service)
    return server, port


# --- health follows the lifecycle ---------------------------------------------------


def bind_health(worker: WorkerBase, health_servicer: health.HealthServicer, service_name: str) -> None:
    """SERVING when LOADED/READY, NOT_SERVING when EMPTY, for "" and ``service_name``; kept
    current on every transition."""

    def publish(*_args: Any) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if worker.lifecycle.state != State.EMPTY
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", service_name):
            health_servicer.set(name, status)

    publish()
    worker.lifecycle.add_observer(publish)


# --- RPC handlers both workers share --------------------------------------------------


class WorkerServicerMixin:
    """LoadWeights / ReleaseWeights / CaptureGraphs / ClearGraphs / GetStatus / Release.

    Put before the generated servicer base in the class bases. Needs ``self.worker``
    (a WorkerBase) and ``self.log``.
    """

    worker: WorkerBase
    log: Any

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

    def _status(self) -> pb.WorkerStatus:
        return wire.status_to_proto(self.worker.status())

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

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.GetStatusResponse:
        return pb.GetStatusResponse(status=self._run(context, "GetStatus", self._status))

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        released = self._run(context, "Release", lambda: self.worker.release(list(request.request_ids)))
        if released:
            self.log.info("released", request_ids=released)
        return pb.ReleaseResponse(released=released)


# --- starting a worker service ------------------------------------------------------------


@dataclass
class WorkerService:
    """A started worker service. ``stop`` ends the server, then tears the worker down in order."""

    server: grpc.Server
    port: int
    worker: WorkerBase
    health: health.HealthServicer
    metrics_port: int | None = None
    before_close: list[Callable[[], None]] = field(default_factory=list)   # run after the server stops

    def stop(self, grace: float | None = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        stopped = self.server.stop(grace)
        # NOTE: hosted loops end first (their streams get their status while the server
        # drains), then the worker's ordered teardown (graphs, then weights).
        for fn in self.before_close:
            fn()
        stopped.wait()
        self.worker.close()


def start_worker_service(cfg: WorkerConfig, worker: WorkerBase, servicer: Any,
                         add_servicer: Callable[[Any, grpc.Server], None], service_name: str,
                         log: Any) -> WorkerService:
    """Load at start if configured (and capture if asked), bind, start, serve metrics."""
    # NOTE: the bind policy is checked before the (slow) start-up load, so a refused start is quick.
    refuse_insecure_bind(cfg.server, cfg.security, service_name)
    if cfg.target_path:
        try:
            worker.load_weights(cfg.target_path, cfg.draft_path or "", cfg.weights_version)
        except (ValueError, OSError) as exc:
            raise StartupError("start-up weights", str(exc)) from exc
        if cfg.capture_on_start:
            worker.capture_graphs()
    health_servicer = health.HealthServicer()
    bind_health(worker, health_servicer, service_name)
    server, port = build_server(cfg.server, cfg.security, [lambda s: add_servicer(servicer, s)],
                                [service_name], health_servicer)
    server.start()
    metrics_port = start_metrics_server(cfg.server.metrics_port, cfg.server.host)
    log.info("serving", service=service_name, address=f"{cfg.server.host}:{port}", metrics_port=metrics_port,
             state=worker.lifecycle.state.value, weights_version=worker.weights_version,
             backend=worker.ops.name, device=worker.ops.device, graphs_mode=worker.graphs_mode,
             tls=bool(cfg.security.tls_cert), mtls=bool(cfg.security.tls_client_ca),
             admin_token=bool(cfg.security.admin_token))
    return WorkerService(server, port, worker, health_servicer, metrics_port)
