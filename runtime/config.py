"""Configuration tree for specsplit: frozen dataclasses, validated on construction.

Owns: the shape of every setting (model architecture read from a Hugging Face
``config.json``, speculation, sampling, cache limits, backend/device choice)
and the rules for valid values. Invalid values raise ``ConfigError`` naming
the field and the allowed range.

Must not know: where values come from (flags, TOML, env vars are parsed only
in ``__main__`` modules) or any framework.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DTYPES = ("float32", "float16", "bfloat16")
BACKENDS = ("paddle", "torch")


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field."""


def _check(cond: bool, name: str, allowed: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"{name}={value!r} is invalid: must be {allowed}")


ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn")
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeScaling:
    """A scaled RoPE variant, with the parameters transformers reads for it.

    linear / dynamic: ``factor``; llama3: ``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``; yarn:
    ``factor`` (None: max_position_embeddings / original), ``attention_factor``,
    ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``,
    ``original_max_position_embeddings``, ``truncate``. The frequencies are
    computed in ``runtime/rope.py``.
    """

    rope_type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        t = self.rope_type
        _check(t in ROPE_TYPES, "model.rope_scaling.rope_type", f"one of {ROPE_TYPES} (or default)", t)
        if t != "yarn" or self.factor is not None:
            _check(isinstance(self.factor, (int, float)) and self.factor >= 1.0, "model.rope_scaling.factor",
                   f"a number >= 1 for rope_type {t!r}", self.factor)
        if t in ("llama3", "yarn"):
            o = self.original_max_position_embeddings
            _check(isinstance(o, int) and o >= 1, "model.rope_scaling.original_max_position_embeddings",
                   "an integer >= 1", o)
        if t == "llama3":
            for name in ("low_freq_factor", "high_freq_factor"):
                v = getattr(self, name)
                _check(isinstance(v, (int, float)) and v > 0, f"model.rope_scaling.{name}", "a number > 0", v)
            _check(self.high_freq_factor > self.low_freq_factor, "model.rope_scaling.high_freq_factor",
                   f"> low_freq_factor={self.low_freq_factor}", self.high_freq_factor)


@dataclass(frozen=True)
class ModelConfig:
    """Llama-family target (and the MTP layer that shares its sizes).

    ``model_type`` picks the per-architecture details of the one model
    definition: qwen2 has q/k/v biases; qwen3 normalises q and k per head
    (RMSNorm over head_dim) before RoPE; llama may have ``attention_bias``
    (q/k/v/o) and ``mlp_bias``; mistral is llama without biases (no sliding
    window: refused when reading config.json).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | None = None      # the first of eos_token_ids (what single-EOS callers use)
    model_type: str = "llama"
    head_dim: int = 0                    # 0: hidden_size // num_attention_heads
    attention_bias: bool = False         # llama / qwen3: biases on q, k, v and o
    mlp_bias: bool = False               # llama: biases on gate, up and down
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    eos_token_ids: tuple[int, ...] = ()  # every EOS id (config.json may hold a list); () with eos_token_id set: (it,)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v >= 1, f"model.{name}", "an integer >= 1", v)
        _check(self.model_type in MODEL_TYPES, "model.model_type", f"one of {MODEL_TYPES}", self.model_type)
        _check(isinstance(self.head_dim, int) and self.head_dim >= 0, "model.head_dim",
               "an integer >= 1 (0 = hidden_size // num_attention_heads)", self.head_dim)
        if self.head_dim == 0:
            _check(self.hidden_size % self.num_attention_heads == 0, "model.hidden_size",
                   f"divisible by num_attention_heads={self.num_attention_heads}", self.hidden_size)
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        _check(self.num_attention_heads % self.num_key_value_heads == 0, "model.num_key_value_heads",
               f"a divisor of num_attention_heads={self.num_attention_heads}", self.num_key_value_heads)
        _check(self.head_dim % 2 == 0, "model.head_dim", "even (RoPE rotates pairs)", self.head_dim)
        _check(0 < self.rms_norm_eps < 1, "model.rms_norm_eps", "in (0, 1)", self.rms_norm_eps)
        _check(self.rope_theta > 0, "model.rope_theta", "> 0", self.rope_theta)
        _check(self.torch_dtype in DTYPES, "model.torch_dtype", f"one of {DTYPES}", self.torch_dtype)
        _check(self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling), "model.rope_scaling",
               "None or a RopeScaling", self.rope_scaling)
        if not self.eos_token_ids and self.eos_token_id is not None:
            object.__setattr__(self, "eos_token_ids", (self.eos_token_id,))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        _check(self.eos_token_id is None or (self.eos_token_ids and self.eos_token_ids[0] == self.eos_token_id),
               "model.eos_token_id", f"the first of eos_token_ids={self.eos_token_ids}", self.eos_token_id)
        if self.eos_token_id is None and self.eos_token_ids:
            object.__setattr__(self, "eos_token_id", self.eos_token_ids[0])
        for name, v in [("bos_token_id", self.bos_token_id)] + [("eos_token_ids", e) for e in self.eos_token_ids]:
            _check(v is None or (isinstance(v, int) and 0 <= v < self.vocab_size), f"model.{name}",
                   f"None or in [0, {self.vocab_size})", v)

    # --- per-architecture details of the one model definition ------------------------------
    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Read a Hugging Face ``config.json`` (see ``runtime/hf_config.py``): every key that
        changes the math is read, or refused with a ``ConfigError`` naming it."""
        from runtime.hf_config import parse_hf_config
        return parse_hf_config(cls, raw)

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read model config {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"cannot read model config {path}: not a JSON object")
        return cls.from_hf_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        from runtime.hf_config import to_hf_dict
        return to_hf_dict(self)

    def compatible_with(self, other: "ModelConfig") -> list[str]:
        """Field names whose values differ (used to refuse incompatible reloads)."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings of a worker: the largest k any request may use."""

    max_k: int = 3
    default_k: int = 3
    adaptive_k: bool = False             # per request, k in [0, the request's k] follows its acceptance and the
                                         # measured round costs (runtime/adaptive_k.py); target round loop only
    ahead_drafting: bool = False         # while the target verifies, the draft drafts past d_k (used when all k are
                                         # accepted and the bonus matches); set on both workers

    def __post_init__(self) -> None:
        _check(isinstance(self.max_k, int) and 0 <= self.max_k <= 16, "spec.max_k", "an integer in [0, 16]", self.max_k)
        _check(isinstance(self.default_k, int) and 0 <= self.default_k <= self.max_k, "spec.default_k",
               f"an integer in [0, max_k={self.max_k}]", self.default_k)


SAMPLING_MODES = ("rejection", "coupled")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature 0 means greedy."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    draft_sampling: bool = False  # True: the draft samples from q and sends q (probabilistic draft)
    # How a sampled (temperature > 0) request speculates: "rejection" (Leviathan: best acceptance,
    # a seed's tokens depend on the drafts) or "coupled" (Gumbel-max with shared counter-based noise:
    # a seed's tokens equal target-only decoding's). Greedy requests ignore it.
    sampling_mode: str = "rejection"

    def __post_init__(self) -> None:
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1", self.max_tokens)
        _check(math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature", "in [0, 100]", self.temperature)
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0 = off)", self.top_k)
        _check(math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "in (0, 1] (1 = off)", self.top_p)
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63), "seed", "None or in [0, 2^63)", self.seed)
        _check(self.sampling_mode in SAMPLING_MODES, "sampling_mode", f"one of {', '.join(SAMPLING_MODES)}",
               self.sampling_mode)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def coupled(self) -> bool:
        """Sampled with the coupled (exact-match) rule; False for greedy requests."""
        return self.sampling_mode == "coupled" and not self.greedy


@dataclass(frozen=True)
class CacheConfig:
    """Static KV-cache capacity: ``max_slots`` requests of up to ``max_len`` positions."""

    max_slots: int = 32
    max_len: int = 1024

    def __post_init__(self) -> None:
        _check(isinstance(self.max_slots, int) and 1 <= self.max_slots <= 4096, "cache.max_slots", "an integer in [1, 4096]", self.max_slots)
        _check(isinstance(self.max_len, int) and 8 <= self.max_len <= 1 << 20, "cache.max_len", "an integer in [8, 1048576]", self.max_len)


@dataclass(frozen=True)
class GraphConfig:
    """CUDA-graph settings: batch buckets (ascending) and whether to capture at all."""

    enabled: bool = True
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)

    def __post_init__(self) -> None:
        b = self.batch_buckets
        _check(len(b) >= 1 and all(isinstance(x, int) and x >= 1 for x in b) and list(b) == sorted(set(b)),
               "graphs.batch_buckets", "a non-empty strictly ascending tuple of integers >= 1", b)


@dataclass(frozen=True)
class RuntimeConfig:
    """Where and how a worker computes."""

    backend: str = "paddle"
    device: str = "cpu"
    dtype: str = "float32"
    # Intra-op CPU threads per process. 1 by default: the services run as
    # several processes on one host, and spinning OpenMP threads of one
    # process starve the others (seen: 20-100x slower Torch steps on 2 cores).
    cpu_threads: int = 1
    # torch.compile the step functions before graph capture (Torch on CUDA; ignored
    # elsewhere). Measured in `bench attention --compile`: the ~1B verify step 2.74 ->
    # 1.43 ms under a graph, same argmax; costs ~45 s of compile at start. Off by default.
    compile: bool = False

    def __post_init__(self) -> None:
        _check(isinstance(self.cpu_threads, int) and 1 <= self.cpu_threads <= 1024, "runtime.cpu_threads",
               "an integer in [1, 1024]", self.cpu_threads)
        _check(self.backend in BACKENDS, "runtime.backend", f"one of {BACKENDS}", self.backend)
        _check(self.device == "cpu" or (self.device.startswith("cuda:") and self.device[5:].isdigit()),
               "runtime.device", "'cpu' or 'cuda:N'", self.device)
        _check(self.dtype in DTYPES, "runtime.dtype", f"one of {DTYPES}", self.dtype)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an in-process engine (target + draft) needs."""

    target_path: str
    draft_path: str | None = None
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    graphs: GraphConfig = field(default_factory=GraphConfig)


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
        _check((self.tls_cert is None) == (self.tls_key is None), "security.tls_cert/tls_key",
               "both set or both unset", (self.tls_cert, self.tls_key))
        _check(self.tls_client_ca is None or self.tls_cert is not None, "security.tls_client_ca",
               "used only together with tls_cert/tls_key", self.tls_client_ca)
        _check(not self.admin_client_cns or self.tls_client_ca is not None, "security.admin_client_cns",
               "used only with mutual TLS (tls_client_ca set): a common name is only trusted when the "
               "certificate was verified", self.admin_client_cns)
        _check(not self.generate_token or self.generate_token != self.admin_token,
               "security.generate_token", "different from the admin token", "***")
        _check(isinstance(self.max_tensor_bytes, int) and 1 <= self.max_tensor_bytes <= 2**31 - 1,
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
        _check(isinstance(self.port, int) and 0 <= self.port <= 65535, "server.port", "an integer in [0, 65535]", self.port)
        _check(self.metrics_port is None or 0 <= self.metrics_port <= 65535, "server.metrics_port",
               "None or an integer in [0, 65535]", self.metrics_port)
        _check(1024 <= self.max_message_bytes <= 2**31 - 1, "server.max_message_bytes", "in [1024, 2^31-1]", self.max_message_bytes)
        _check(1 <= self.max_workers <= 1024, "server.max_workers", "in [1, 1024]", self.max_workers)


@dataclass(frozen=True)
class WorkerConfig:
    """A draft or target worker service."""

    role: str                            # "draft" | "target"
    target_path: str | None              # load at start when set (else start EMPTY)
    draft_path: str | None = None
    weights_version: str = ""
    capture_on_start: bool = False       # capture graphs after the start-up load
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    graphs: GraphConfig = field(default_factory=GraphConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    # --- target only: how the round loop reaches the draft service (address: ControlRounds CONFIGURE) ---
    draft_tls_ca: str | None = None      # CA to verify the draft's certificate (TLS to the draft); unset with
                                         # mTLS serving: security.tls_client_ca, showing security.tls_cert
    draft_client_cert: str | None = None  # client certificate shown to an mTLS draft
    draft_client_key: str | None = None

    def __post_init__(self) -> None:
        _check(self.role in ("draft", "target"), "role", "'draft' or 'target'", self.role)
        _check((self.draft_client_cert is None) == (self.draft_client_key is None),
               "draft_client_cert/draft_client_key", "both set or both unset",
               (self.draft_client_cert, self.draft_client_key))
        _check(self.draft_client_cert is None or self.draft_tls_ca is not None, "draft_client_cert",
               "used only together with draft_tls_ca", self.draft_client_cert)


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
    # --- failures and shutdown (orchestrator.draft_health, graceful shutdown) ---
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
