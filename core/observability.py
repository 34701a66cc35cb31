"""Logging and metrics plumbing shared by every service.

Owns: structlog JSON configuration (stdlib logging routed through it, so
grpc/paddle messages come out as JSON too, one line each, on stderr) and
starting the Prometheus HTTP endpoint. Metric *definitions* live with the
service that updates them (``*/metrics.py``); this module only serves them.

Must not know: models, gRPC servicers. Never logs secrets: callers pass
config objects through ``redact`` before logging them.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

import structlog

# Structured tracebacks WITHOUT local variables: locals can hold tensors
# (megabytes of text per line) and secrets (tokens, keys) that must never be logged.
_TRACEBACKS = structlog.processors.ExceptionRenderer(
    structlog.tracebacks.ExceptionDictTransformer(show_locals=False))

_SECRET_FIELDS = ("admin_token", "worker_admin_token", "generate_token", "tls_key", "tls_client_key")


def configure_logging(service: str, level: str = "INFO") -> structlog.stdlib.BoundLogger:
    """JSON logs with timestamp, level, service; returns the service's logger."""
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, _TRACEBACKS, structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processor=structlog.processors.JSONRenderer(), foreign_pre_chain=shared))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    return structlog.get_logger(service=service)


def redact(obj: Any) -> Any:
    """A dict view of a (nested) config dataclass with secrets replaced by '***'."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            out[f.name] = "***" if (f.name in _SECRET_FIELDS and v) else redact(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [redact(v) for v in obj]
    return obj


def start_metrics_server(port: int | None, host: str = "127.0.0.1", registry: Any = None) -> int | None:
    """Serve Prometheus metrics on ``port`` (0 picks one); returns the bound port or None."""
    if port is None:
        return None
    from prometheus_client import REGISTRY, start_http_server

    server, _thread = start_http_server(port, addr=host, registry=registry or REGISTRY)
    return int(server.server_port)
