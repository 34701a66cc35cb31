"""The decoding parameters of one request: the record every layer shares (the wire format
carries it, the orchestrator validates it, the engines sample with it).

Owns: ``SamplingParams`` and its valid ranges.
Must not know: protos (``core.wire`` converts), engines, frameworks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.config import check as _check


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
