"""The configuration of the client-facing orchestrator service.

Owns: ``OrchestratorConfig``: where the workers are, request limits, reload and push
settings, the HTTP API.
Must not know: how values are read (``core.config_loader``) or the workers' settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.config import SecurityConfig, ServerConfig
from core.config import check as _check
from core.params import SAMPLING_MODES


@dataclass(frozen=True)
class OrchestratorConfig:
    """The client-facing orchestrator."""

    draft_address: str | None            # host:port; None = target-only serving
    target_address: str = "127.0.0.1:50052"
    default_k: int = 3
    max_k: int = 3
    default_sampling_mode: str = "rejection"  # sampled requests that leave sampling_mode unset: "rejection"
                                              # (Leviathan) or "coupled" (same tokens as target-only)
    max_batch: int = 16                  # sequences per round
    max_queue: int = 64                  # waiting requests before RESOURCE_EXHAUSTED
    stream_interval: int = 1             # tokens a stream holds back before sending them (1: every round)
    max_tokens_limit: int = 1024         # largest max_tokens a request may ask for
    max_prompt_tokens: int = 4096
    worker_timeout_s: float = 30.0       # deadline of every call to a worker
    tokenizer: str = "byte"              # "byte" (bundled model) or a model directory with tokenizer.json
    server: ServerConfig = field(default_factory=ServerConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    tls_ca: str | None = None            # CA to verify the workers' certificates (TLS to workers)
    worker_admin_token: str | None = None  # token the orchestrator presents to the workers' admin RPCs
    tls_client_cert: str | None = None   # client certificate shown to mTLS workers (default: security.tls_cert)
    tls_client_key: str | None = None
    # --- failures and shutdown (rounds.draft_health, graceful shutdown) ---
    draft_address_file: str | None = None  # file holding the draft's host:port, re-read every second; a new
                                           # address there moves the orchestrator to that draft
    shutdown_grace_s: float = 10.0       # SIGTERM: in-flight requests may finish for this long, then exit
    # --- weight reload (ReloadWeights / PushWeights) ---
    reload_call_timeout_s: float = 600.0  # deadline of each worker lifecycle call of a reload (loads are slow)
    reload_wait_timeout_s: float = 60.0   # WAIT policy: longest drain of in-flight requests, then the reload fails
    reload_rollback_wait_s: float = 60.0  # rollback: how long to wait for an unreachable (restarting) worker
    generate_wait_during_reload_s: float = 30.0  # a Generate during a reload waits this long, then UNAVAILABLE; 0 = at once
    push_staging_dir: str | None = None   # PushWeights staging root (workers must read it at the same path); None = off
    push_max_bytes: int = 64 * 1024**3    # largest PushWeights payload (tensor bytes)
    push_keep_versions: int = 3           # staged pushes kept on disk (the serving one and its predecessors)
    # --- OpenAI-compatible HTTP API (orchestrator.http_api) ---
    http_port: int | None = None          # None = off, 0 = pick; served on server.host next to the gRPC port
    http_model_name: str = "specsplit"    # the model id of /v1/models and the `model` field requests must name

    def __post_init__(self) -> None:
        _check(1.0 <= self.reload_call_timeout_s <= 86400, "reload_call_timeout_s", "in [1, 86400]",
               self.reload_call_timeout_s)
        _check(0.0 <= self.reload_wait_timeout_s <= 86400, "reload_wait_timeout_s", "in [0, 86400]",
               self.reload_wait_timeout_s)
        _check(0.0 <= self.reload_rollback_wait_s <= 86400, "reload_rollback_wait_s", "in [0, 86400]",
               self.reload_rollback_wait_s)
        _check(0.0 <= self.generate_wait_during_reload_s <= 3600, "generate_wait_during_reload_s", "in [0, 3600]",
               self.generate_wait_during_reload_s)
        _check(self.push_staging_dir is None or bool(self.push_staging_dir.strip()), "push_staging_dir",
               "None or a non-empty directory path", self.push_staging_dir)
        _check(1 <= self.push_max_bytes <= 1 << 50, "push_max_bytes", "in [1, 2^50]", self.push_max_bytes)
        _check(2 <= self.push_keep_versions <= 100, "push_keep_versions", "in [2, 100] (the serving version and "
               "the one a rollback returns to)", self.push_keep_versions)
        _check(0 <= self.max_k <= 16, "max_k", "in [0, 16]", self.max_k)
        _check(0 <= self.default_k <= self.max_k, "default_k", f"in [0, max_k={self.max_k}]", self.default_k)
        _check(self.default_sampling_mode in SAMPLING_MODES, "default_sampling_mode",
               f"one of {', '.join(SAMPLING_MODES)}", self.default_sampling_mode)
        _check(1 <= self.max_batch <= 1024, "max_batch", "in [1, 1024]", self.max_batch)
        _check(0 <= self.max_queue <= 100000, "max_queue", "in [0, 100000]", self.max_queue)
        _check(1 <= self.stream_interval <= 4096, "stream_interval", "in [1, 4096]", self.stream_interval)
        _check(1 <= self.max_tokens_limit <= 1 << 20, "max_tokens_limit", "in [1, 1048576]", self.max_tokens_limit)
        _check(1 <= self.max_prompt_tokens <= 1 << 20, "max_prompt_tokens", "in [1, 1048576]", self.max_prompt_tokens)
        _check(0.1 <= self.worker_timeout_s <= 3600, "worker_timeout_s", "in [0.1, 3600]", self.worker_timeout_s)
        _check(self.tokenizer == "byte" or bool(self.tokenizer.strip()), "tokenizer",
               "'byte' or a model directory holding tokenizer.json", self.tokenizer)
        _check((self.tls_client_cert is None) == (self.tls_client_key is None), "tls_client_cert/tls_client_key",
               "both set or both unset", (self.tls_client_cert, self.tls_client_key))
        _check(0.0 <= self.shutdown_grace_s <= 3600, "shutdown_grace_s", "in [0, 3600]", self.shutdown_grace_s)
        _check(self.http_port is None or 0 <= self.http_port <= 65535, "http_port", "None or an integer in "
               "[0, 65535]", self.http_port)
        _check(bool(self.http_model_name.strip()), "http_model_name", "a non-empty model id", self.http_model_name)
        # NOTE: the HTTP API calls Generate over plaintext loopback and serves plaintext itself,
        # so it is refused beside a TLS gRPC port rather than silently downgrading security.
        _check(self.http_port is None or not self.security.tls_cert, "http_port", "unset when security.tls_cert "
               "is set (the HTTP API serves plaintext: put a TLS-terminating proxy in front of it)", self.http_port)
