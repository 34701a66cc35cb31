"""Shared gRPC server plumbing of the specsplit services.

Owns: building a ``grpc.Server`` from ``ServerConfig``/``SecurityConfig``
(thread pool, message-size limits, TLS / mTLS, grpc.health.v1, server
reflection v1 + v1alpha), the secure-by-default start-up policy (plaintext
only on loopback unless ``allow_insecure``; an admin token generated and
written to a user-only file when none is configured), installing on every
method of every server the auth + audit interceptor (``core.auth``) and
the undecodable-request guard (``core.request_guard``), so RPCs added
later get both without code of their own, the checkpoint-path policy
(``check_checkpoint_path``). The workers' shared RPC handlers and start-up
live a layer up, in ``worker.service``.

Must not know: models, tensors, frameworks, scheduling, workers.

Secrets: tokens are compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import errno
import socket
from concurrent import futures
from pathlib import Path
from typing import Callable, Iterable

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from core.config import SecurityConfig, ServerConfig
# Who may call what (admin token, generation token, mTLS common names) lives in core.auth.
from core.auth import ADMIN_METHODS, AUTH_HEADER, AuthInterceptor, admin_metadata  # noqa: F401 (re-exported)
from core.admin_token import default_token_path, is_loopback_host, process_token, serve_generated, write_token_file
from core.audit import AdminAudit
from core.reflection import enable_reflection
from core.request_guard import RequestGuard
from core.startup import StartupError


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


_log = structlog.get_logger("core.serving")


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
    serve_generated(port, written)
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
