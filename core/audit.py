"""The audit trail of admin RPCs: one structured log line and one counter increment per call.

Owns: ``AdminAudit`` — the log line ``admin_rpc`` (method, outcome, whether
the caller was authorized, caller identity as a token fingerprint and/or the
verified client certificate's CN, peer address, and the requested version /
paths) and the Prometheus counter ``specsplit_admin_rpcs_total{method,
outcome}`` in the registry the service serves. ``outcome`` is the call's
final status code name (``OK``, ``UNAUTHENTICATED``, ``FAILED_PRECONDITION``…).

Must not know: what the RPCs do, token values (only fingerprints reach it).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import structlog
from prometheus_client import REGISTRY, CollectorRegistry, Counter

log = structlog.get_logger("core.audit")

REQUEST_FIELDS = ("version", "target_path", "draft_path")   # what an audit line repeats from a request
_counters: "weakref.WeakKeyDictionary[CollectorRegistry, Counter]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def admin_rpc_counter(registry: CollectorRegistry | None = None) -> Counter:
    """The counter in ``registry`` (default: the process registry), created once per registry."""
    registry = REGISTRY if registry is None else registry
    with _lock:
        counter = _counters.get(registry)
        if counter is None:
            counter = Counter("specsplit_admin_rpcs", "Admin RPCs by method and outcome (final status code name)",
                              ["method", "outcome"], registry=registry)
            _counters[registry] = counter
        return counter


def request_fields(request: Any) -> dict[str, str]:
    """The audit-relevant fields a request message carries (non-empty ones only)."""
    out = {}
    for name in REQUEST_FIELDS:
        value = getattr(request, name, None)
        if isinstance(value, str) and value:
            out[name] = value[:512]
    return out


class AdminAudit:
    """Records admin RPCs of one server."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        self.service = service
        self.counter = admin_rpc_counter(registry)

    def record(self, *, method: str, outcome: str, authorized: bool, token: str | None, cert_cn: str | None,
               peer: str, fields: dict[str, str]) -> None:
        self.counter.labels(method=method, outcome=outcome).inc()
        emit = log.info if authorized and outcome == "OK" else log.warning
        emit("admin_rpc", service=self.service, method=method, outcome=outcome, authorized=authorized,
             token=token, cert_cn=cert_cn, peer=peer, **fields)
