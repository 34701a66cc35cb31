"""What every service's configuration shares: the error type, the range check, and the
transport settings of one server (listening address, limits, TLS / tokens).

Owns: ``ConfigError`` (an invalid value, naming the key), ``check`` (the one range-check
helper every config tree uses), ``ServerConfig`` and ``SecurityConfig``.

Must not know: any service's own settings (those live with the service: ``worker.config``,
``orchestrator.config``; the model/engine settings in ``runtime.config``), where values come
from (``core.config_loader``), or any framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field."""


def check(cond: bool, name: str, allowed: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"{name}={value!r} is invalid: must be {allowed}")


@dataclass(frozen=True)
class SecurityConfig:
    """TLS / admin-token settings of one service (all optional)."""

    tls_cert: str | None = None          # server certificate (PEM path); enables TLS
    tls_key: str | None = None
    tls_client_ca: str | None = None     # require client certificates signed by this CA (mTLS)
    admin_token: str | None = None       # required in `authorization: Bearer <token>` for admin RPCs
    checkpoint_roots: tuple[str, ...] = ()  # checkpoint paths must resolve under one of these (empty = any)
    generate_token: str | None = None    # generation-only token: Generate needs it (or the admin token) when set;
                                         # admin RPCs presented with it are PERMISSION_DENIED
    admin_client_cns: tuple[str, ...] = ()  # mTLS: client-certificate common names allowed to call admin RPCs
    max_tensor_bytes: int = 64 * 1024 * 1024  # largest tensor (data bytes) a request may carry
    admin_token_file: str | None = None  # where a generated admin token is written (default: the runtime dir)
    allow_insecure: bool = False         # serve plaintext on a non-loopback address (warned at every start)

    def __post_init__(self) -> None:
        check((self.tls_cert is None) == (self.tls_key is None), "security.tls_cert/tls_key",
               "both set or both unset", (self.tls_cert, self.tls_key))
        check(self.tls_client_ca is None or self.tls_cert is not None, "security.tls_client_ca",
               "used only together with tls_cert/tls_key", self.tls_client_ca)
        check(not self.admin_client_cns or self.tls_client_ca is not None, "security.admin_client_cns",
               "used only with mutual TLS (tls_client_ca set): a common name is only trusted when the "
               "certificate was verified", self.admin_client_cns)
        check(not self.generate_token or self.generate_token != self.admin_token,
               "security.generate_token", "different from the admin token", "***")
        check(isinstance(self.max_tensor_bytes, int) and 1 <= self.max_tensor_bytes <= 2**31 - 1,
               "security.max_tensor_bytes", "an integer in [1, 2^31-1]", self.max_tensor_bytes)


@dataclass(frozen=True)
class ServerConfig:
    """Where a service listens and its transport limits."""

    host: str = "127.0.0.1"
    port: int = 0                        # 0 = pick a free port
    metrics_port: int | None = None      # Prometheus HTTP port; None = no metrics endpoint, 0 = pick
    max_message_bytes: int = 64 * 1024 * 1024
    max_workers: int = 16                # gRPC thread pool size

    def __post_init__(self) -> None:
        check(isinstance(self.port, int) and 0 <= self.port <= 65535, "server.port", "an integer in [0, 65535]", self.port)
        check(self.metrics_port is None or 0 <= self.metrics_port <= 65535, "server.metrics_port",
               "None or an integer in [0, 65535]", self.metrics_port)
        check(1024 <= self.max_message_bytes <= 2**31 - 1, "server.max_message_bytes", "in [1024, 2^31-1]", self.max_message_bytes)
        check(1 <= self.max_workers <= 1024, "server.max_workers", "in [1, 1024]", self.max_workers)


