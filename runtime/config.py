"""Model and engine configuration: frozen dataclasses, validated on construction.

Owns: the model architecture (read from a Hugging Face ``config.json``) and the
engine's settings (speculation, cache limits, graphs, backend/device choice)
and the rules for valid values. The services' own settings live with them
(``worker.config``, ``orchestrator.config``; server/security in ``core.config``);
a request's decoding parameters in ``core.params``. Invalid values raise ``ConfigError`` naming
the field and the allowed range.

Must not know: where values come from (flags, TOML, env vars are parsed only
in ``__main__`` modules) or any framework.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.config import ConfigError
from core.config import check as _check

DTYPES = ("float32", "float16", "bfloat16")
BACKENDS = ("paddle", "torch")


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
                                         # round costs (runtime/adaptive_k.py, round_costs.py); target round loop only
    ahead_drafting: bool = False         # while the target verifies, the draft drafts past d_k (used when all k are
                                         # accepted and the bonus matches); set on both workers
    micro_batches: bool = False          # target round loop: two micro-batches, the draft drafting one while the
                                         # target verifies the other (runtime/micro_batch.py); not with ahead_drafting
    watch_probes: bool = True            # with adaptive_k: a probe drafts beside a target-only step and its drafts
                                         # are judged against the target's next tokens, never verified

    def __post_init__(self) -> None:
        _check(isinstance(self.max_k, int) and 0 <= self.max_k <= 16, "spec.max_k", "an integer in [0, 16]", self.max_k)
        _check(isinstance(self.default_k, int) and 0 <= self.default_k <= self.max_k, "spec.default_k",
               f"an integer in [0, max_k={self.max_k}]", self.default_k)
        _check(not (self.micro_batches and self.ahead_drafting), "spec.micro_batches",
               "off when spec.ahead_drafting is on (both use the draft while the target verifies: choose one)",
               self.micro_batches)




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
    # The draft captures a whole greedy Propose (catch-up + k-1 substeps) as one graph per
    # k (runtime/fused_propose.py): one replay and one host sync per Propose instead of k.
    # It multiplies the draft's capture time (a RECAPTURE reload pays it); off keeps the
    # catch-up and substep graphs only.
    fused_propose: bool = True
    # Target-only greedy rounds queue their next step on the device before the host reads
    # this one's tokens (runtime/decode_ahead.py); on CUDA only (no effect on a CPU, where
    # nothing would overlap) and never on a tensor-parallel target.
    decode_ahead: bool = True
    # Greedy speculative rounds whose drafts stay on the device (a draft in the target's process,
    # on its device) queue their next round, propose and verify, before the host reads this
    # one's tokens (runtime/round_ahead.py); the draft captures a ``chain{k}`` kind per k for
    # it. None: on CUDA only (on a CPU nothing would overlap); True: on every device (how CI
    # tests the path); False: off.
    round_ahead: bool | None = None
    # Prefills replay a graph captured per (prompt width, batch bucket), the prompt padded to
    # the smallest width that holds it: an eager prefill runs every op of every layer from
    # Python (6.7 ms for an 8-token prompt of the bundled model on an H200, 0.7 ms from a
    # graph: `bench prefill`, docs/performance.md § Session 9). None: on CUDA only
    # (on a CPU the "graph" is the step itself, so padding would only add work); True: on
    # every device (how CI tests the path); False: off. Longer prompts, and batches above
    # the buckets that fit ``prefill_tokens``, run eagerly.
    prefill_graphs: bool | None = None
    prefill_widths: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    # The rows (batch bucket x width) of the largest prefill graph: each width is captured
    # at the buckets with bucket * width <= this.
    prefill_tokens: int = 1024

    def __post_init__(self) -> None:
        b = self.batch_buckets
        _check(len(b) >= 1 and all(isinstance(x, int) and x >= 1 for x in b) and list(b) == sorted(set(b)),
               "graphs.batch_buckets", "a non-empty strictly ascending tuple of integers >= 1", b)
        w = self.prefill_widths
        _check(len(w) >= 1 and all(isinstance(x, int) and x >= 1 for x in w) and list(w) == sorted(set(w)),
               "graphs.prefill_widths", "a non-empty strictly ascending tuple of integers >= 1", w)
        _check(isinstance(self.prefill_tokens, int) and self.prefill_tokens >= 1, "graphs.prefill_tokens",
               "an integer >= 1", self.prefill_tokens)

    def round_ahead_on(self, device: str) -> bool:
        """Whether workers on ``device`` queue greedy rounds ahead (``round_ahead``)."""
        return device.startswith("cuda") if self.round_ahead is None else self.round_ahead

    def prefill_widths_on(self, device: str) -> tuple[int, ...]:
        """The prompt widths a worker on ``device`` captures prefill graphs at (() = none)."""
        on = device.startswith("cuda") if self.prefill_graphs is None else self.prefill_graphs
        return self.prefill_widths if on and self.enabled else ()


def is_device(name: str) -> bool:
    """A device name the backends take: 'cpu' or 'cuda:N'."""
    return name == "cpu" or (name.startswith("cuda:") and name[5:].isdigit())


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
    # The decoder layer's fused Triton kernels (runtime/backends/torch_kernels.py: residual
    # add + RMSNorm, SiLU*up, RoPE + KV-cache write, attention over the cache in place), for
    # Torch on CUDA with Triton installed; ignored elsewhere. Same math as the plain ops up
    # to rounding; off runs the plain ops (the reference).
    fused_kernels: bool = True
    # The target's decode and verify steps batch-invariant (runtime/backends/torch_kernels.py
    # ``Kernels.invariant``): a row's bits do not depend on the other rows of its step or on
    # their number, so greedy speculation gives target-only's tokens in half precision too,
    # and a request gets the tokens it gets alone; prefills run one request at a time.
    # Torch on CUDA with the fused kernels (not with runtime.compile), one device (tp 1), a
    # model the fused decoder layer takes (no per-head q/k norms). Off: each kernel picks its
    # launch from the row count, exact in float32 in every test and bench row here, but a bf16
    # greedy near-tie can go another way in a verify of 32 rows than in a decode of 8
    # (docs/performance.md § Session 19).
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        _check(isinstance(self.cpu_threads, int) and 1 <= self.cpu_threads <= 1024, "runtime.cpu_threads",
               "an integer in [1, 1024]", self.cpu_threads)
        _check(self.backend in BACKENDS, "runtime.backend", f"one of {BACKENDS}", self.backend)
        _check(is_device(self.device), "runtime.device", "'cpu' or 'cuda:N'", self.device)
        _check(self.dtype in DTYPES, "runtime.dtype", f"one of {DTYPES}", self.dtype)
        _check(not self.batch_invariant or (self.backend == "torch" and self.device.startswith("cuda:")
                                            and self.fused_kernels and not self.compile),
               "runtime.batch_invariant", "false unless runtime.backend is 'torch' on a 'cuda:N' device with "
               "runtime.fused_kernels on and runtime.compile off (its kernels are the fused Triton ones)",
               self.batch_invariant)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an in-process engine (target + draft) needs."""

    target_path: str
    draft_path: str | None = None
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    graphs: GraphConfig = field(default_factory=GraphConfig)
