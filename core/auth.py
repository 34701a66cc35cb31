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

Admin RPCs are never open: with neither an admin token nor admin common
names configured, the server generates a token at start
(``core.admin_token``; ``set_admin_token``) and writes it to a file
only its user can read. Every admin call, allowed or refused, goes to the
audit trail (``core.audit``) with its final status.

Must not know: what the methods do. Tokens are compared in constant time
and never logged (only fingerprints) or echoed in a status message.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any, Callable

import grpc

from core.config import SecurityConfig
from core.admin_token import fingerprint
from core.audit import AdminAudit, request_fields

ADMIN_METHODS = frozenset({"LoadWeights", "ReleaseWeights", "CaptureGraphs", "ClearGraphs", "PrepareWeights",
                           "CommitWeights", "AbortWeights", "ReloadWeights", "PushWeights", "ControlRounds"})
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
                 generate_methods: frozenset[str] = GENERATE_METHODS, audit: AdminAudit | None = None) -> None:
        self._admin = _bearer(security.admin_token)
        self._generate = _bearer(security.generate_token)
        self._admin_cns = frozenset(security.admin_client_cns)
        self._admin_methods, self._generate_methods = admin_methods, generate_methods
        self._audit = audit

    @staticmethod
    def needs_generated_token(security: SecurityConfig) -> bool:
        """Neither an admin token nor admin certificates: admin RPCs need a generated token."""
        return not (security.admin_token or security.admin_client_cns)

    def set_admin_token(self, token: str) -> None:
        """The admin token (a generated one); call before the server starts."""
        self._admin = _bearer(token)

    def _token_role(self, supplied: bytes | None) -> str | None:
        """ADMIN / GENERATE for a valid token, "" for a wrong one, None for none."""
        if supplied is None:
            return None
        value = supplied
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
        supplied = _supplied_token(details.invocation_metadata)
        role = self._token_role(supplied)
        audit = None
        if need == ADMIN and self._audit is not None:
            audit = _CallAudit(self._audit, method, _token_fingerprint(supplied) if supplied else None, self)
        if role == ADMIN or (need == GENERATE and role == GENERATE):
            return _wrap(handler, lambda _ctx: None, audit)
        denial = self._denial(method, need, role)
        if not self._admin_cns:
            return _wrap(handler, lambda _ctx: denial, audit)
        # The certificate is only visible per call (context.auth_context()), so decide there.
        return _wrap(handler, lambda ctx: None if self._cert_is_admin(ctx) else self._with_cert(ctx, denial), audit)

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

    @staticmethod
    def _common_names(context: grpc.ServicerContext) -> list[str]:
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


def _supplied_token(metadata: Any) -> bytes | None:
    """The value of the first ``authorization`` entry (``Bearer <token>``), or None."""
    supplied = [v for k, v in (metadata or ()) if k == AUTH_HEADER]
    if not supplied:
        return None
    return supplied[0].encode() if isinstance(supplied[0], str) else bytes(supplied[0])


def _token_fingerprint(value: bytes) -> str:
    return fingerprint(value[len(b"Bearer "):] if value.startswith(b"Bearer ") else value)


class _CallAudit:
    """The audit record of one admin call, completed when the call ends."""

    def __init__(self, audit: AdminAudit, method: str, token: str | None, auth: AuthInterceptor) -> None:
        self.audit, self.method, self.token, self.auth = audit, method, token, auth
        self.fields: dict[str, str] = {}
        self.authorized = False

    def see(self, request: Any) -> None:
        for k, v in request_fields(request).items():
            self.fields.setdefault(k, v)

    def requests(self, it: Any) -> Any:
        for request in it:
            self.see(request)
            yield request

    def done(self, context: grpc.ServicerContext, failed: bool) -> None:
        code = _code_of(context)
        if code is not None:
            outcome = code.name
        elif not failed:
            outcome = "OK"
        else:
            outcome = "UNKNOWN" if context.is_active() else "CANCELLED"
        cns = self.auth._common_names(context)
        try:
            peer = context.peer()
        except Exception:  # noqa: BLE001 - the audit line must not fail the call
            peer = "?"
        self.audit.record(method=self.method, outcome=outcome, authorized=self.authorized, token=self.token,
                          cert_cn=cns[0] if cns else None, peer=peer, fields=self.fields)


def _code_of(context: grpc.ServicerContext) -> grpc.StatusCode | None:
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - older grpc: no code()
        return None
    if isinstance(code, int):
        code = next((c for c in grpc.StatusCode if c.value[0] == code), None)
    return code


def _wrap(handler: grpc.RpcMethodHandler, check: Callable[[grpc.ServicerContext], Denial | None],
          audit: _CallAudit | None = None) -> grpc.RpcMethodHandler:
    """``handler`` with ``check(context)`` run first; a Denial aborts the call with its status.
    With ``audit``, the call's requests and final status go to the audit trail."""
    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)

    def gate(context: grpc.ServicerContext) -> None:
        denial = check(context)
        if denial is not None:
            context.abort(denial.code, denial.message)
        if audit is not None:
            audit.authorized = True

    def finish(context: grpc.ServicerContext, failed: bool) -> None:
        if audit is not None:
            audit.done(context, failed)

    see = audit.see if audit is not None else (lambda _r: None)
    feed = audit.requests if audit is not None else (lambda it: it)

    if handler.request_streaming and handler.response_streaming:
        def stream_stream(it: Any, context: grpc.ServicerContext) -> Any:
            failed = True
            try:
                gate(context)
                yield from handler.stream_stream(feed(it), context)
                failed = False
            finally:
                finish(context, failed)
        return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)
    if handler.request_streaming:
        def stream_unary(it: Any, context: grpc.ServicerContext) -> Any:
            failed = True
            try:
                gate(context)
                out = handler.stream_unary(feed(it), context)
                failed = False
                return out
            finally:
                finish(context, failed)
        return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)
    if handler.response_streaming:
        def unary_stream(request: Any, context: grpc.ServicerContext) -> Any:
            failed = True
            see(request)
            try:
                gate(context)
                yield from handler.unary_stream(request, context)
                failed = False
            finally:
                finish(context, failed)
        return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)

    def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
        failed = True
        see(request)
        try:
            gate(context)
            out = handler.unary_unary(request, context)
            failed = False
            return out
        finally:
            finish(context, failed)
    return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)


def admin_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata a client sends to pass the token check (empty without a token)."""
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()
