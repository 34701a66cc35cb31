"""Who may call what: the bearer-token and client-certificate checks of every service.

Owns: classifying a method as admin (lifecycle, reload, push), generation
(``Generate``) or open (everything else: data-path RPCs between the
services, GetStatus, health, reflection), and deciding a call from its
``authorization: Bearer <token>`` metadata and, under mutual TLS, the
verified client certificate's common name:

    admin RPC        admin token, or a client cert whose CN is in admin_client_cns -> runs
                     the generation-only token                                    -> PERMISSION_DENIED
                     no token / a wrong token (whatever other certificate)        -> UNAUTHENTICATED
    Generate         open unless generate_token is set; then the generation or the admin
                     token (or an allowed admin cert) -> runs; else UNAUTHENTICATED

With neither an admin token nor admin common names configured, admin RPCs
are open (the single-machine demo); ``specsplit`` logs that at start.

Must not know: what the methods do. Tokens are compared in constant time
and never logged or echoed in a status message.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any, Callable

import grpc

from runtime.config import SecurityConfig

ADMIN_METHODS = frozenset({"LoadWeights", "ReleaseWeights", "CaptureGraphs", "ClearGraphs",
                           "ReloadWeights", "PushWeights", "ControlRounds"})
GENERATE_METHODS = frozenset({"Generate"})
AUTH_HEADER = "authorization"

ADMIN, GENERATE = "admin", "generate"


@dataclass(frozen=True)
class Denial:
    code: grpc.StatusCode
    message: str


def _bearer(token: str | None) -> bytes | None:
    return f"Bearer {token}".encode() if token else None


class AuthInterceptor(grpc.ServerInterceptor):
    """Applies the table in the module docstring to every call of one server."""

    def __init__(self, security: SecurityConfig, admin_methods: frozenset[str] = ADMIN_METHODS,
                 generate_methods: frozenset[str] = GENERATE_METHODS) -> None:
        self._admin = _bearer(security.admin_token)
        self._generate = _bearer(security.generate_token)
        self._admin_cns = frozenset(security.admin_client_cns)
        self._admin_methods, self._generate_methods = admin_methods, generate_methods

    @staticmethod
    def needed(security: SecurityConfig) -> bool:
        return bool(security.admin_token or security.generate_token or security.admin_client_cns)

    def _token_role(self, metadata: Any) -> str | None:
        """ADMIN / GENERATE for a valid token, "" for a wrong one, None for none."""
        supplied = [v for k, v in (metadata or ()) if k == AUTH_HEADER]
        if not supplied:
            return None
        value = supplied[0].encode() if isinstance(supplied[0], str) else bytes(supplied[0])
        # NOTE: both comparisons always run, in constant time, so timing says nothing about either token.
        is_admin = self._admin is not None and hmac.compare_digest(value, self._admin)
        is_generate = self._generate is not None and hmac.compare_digest(value, self._generate)
        return ADMIN if is_admin else GENERATE if is_generate else ""

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        method = details.method.rsplit("/", 1)[-1]
        if method in self._admin_methods:
            need = ADMIN
        elif method in self._generate_methods and self._generate is not None:
            need = GENERATE
        else:
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        role = self._token_role(details.invocation_metadata)
        if role == ADMIN or (need == GENERATE and role == GENERATE):
            return handler
        denial = self._denial(method, need, role)
        if not self._admin_cns:
            return _wrap(handler, lambda _ctx: denial)
        # The certificate is only visible per call (context.auth_context()), so decide there.
        return _wrap(handler, lambda ctx: None if self._cert_is_admin(ctx) else self._with_cert(ctx, denial))

    def _denial(self, method: str, need: str, role: str | None) -> Denial:
        what = "an admin RPC" if need == ADMIN else "a generation RPC"
        certs = " or an allowed client certificate" if self._admin_cns else ""
        if need == ADMIN and role == GENERATE:
            return Denial(grpc.StatusCode.PERMISSION_DENIED,
                          f"{method} is {what}: the generation token does not grant it (use the admin token{certs})")
        if role == "":
            return Denial(grpc.StatusCode.UNAUTHENTICATED, f"{method} is {what}: the token is wrong")
        return Denial(grpc.StatusCode.UNAUTHENTICATED,
                      f"{method} is {what}: send metadata '{AUTH_HEADER}: Bearer <token>'{certs}")

    def _common_names(self, context: grpc.ServicerContext) -> list[str]:
        try:
            names = (context.auth_context() or {}).get("x509_common_name", [])
        except Exception:  # noqa: BLE001 - no TLS: no certificate
            return []
        return [n.decode(errors="replace") if isinstance(n, bytes) else str(n) for n in names]

    def _cert_is_admin(self, context: grpc.ServicerContext) -> bool:
        # NOTE: the server requests and verifies client certificates only under mTLS
        # (tls_client_ca; the config refuses admin_client_cns without it), so a common
        # name seen here was signed by the configured CA.
        return any(cn in self._admin_cns for cn in self._common_names(context))

    def _with_cert(self, context: grpc.ServicerContext, denial: Denial) -> Denial:
        cns = self._common_names(context)
        if not cns:
            return denial
        return Denial(denial.code, f"{denial.message} (client certificate {cns[0]!r} is not one of the admin "
                                   f"certificates)")


def _wrap(handler: grpc.RpcMethodHandler, check: Callable[[grpc.ServicerContext], Denial | None]
          ) -> grpc.RpcMethodHandler:
    """``handler`` with ``check(context)`` run first; a Denial aborts the call with its status."""
    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)

    def gate(context: grpc.ServicerContext) -> None:
        denial = check(context)
        if denial is not None:
            context.abort(denial.code, denial.message)

    if handler.request_streaming and handler.response_streaming:
        def stream_stream(it: Any, context: grpc.ServicerContext) -> Any:
            gate(context)
            yield from handler.stream_stream(it, context)
        return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)
    if handler.request_streaming:
        def stream_unary(it: Any, context: grpc.ServicerContext) -> Any:
            gate(context)
            return handler.stream_unary(it, context)
        return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)
    if handler.response_streaming:
        def unary_stream(request: Any, context: grpc.ServicerContext) -> Any:
            gate(context)
            yield from handler.unary_stream(request, context)
        return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)

    def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
        gate(context)
        return handler.unary_unary(request, context)
    return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)


def admin_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata a client sends to pass the token check (empty without a token)."""
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()
