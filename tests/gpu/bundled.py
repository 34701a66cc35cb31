"""The bundled tiny model on cuda:0 for the GPU tests: its held-out prompts, and a speculative
engine (max_k 3) with its graphs captured. Imports torch only through ``runtime``."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.config import CacheConfig, EngineConfig, GraphConfig, RuntimeConfig, SpecConfig
from runtime.engine import SpecEngine
from runtime.tokenizer import ByteTokenizer

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"


def heldout_prompts(n: int) -> list[tuple[int, ...]]:
    """The first ``n`` held-out prompts of the bundled model, as byte token ids."""
    tok = ByteTokenizer()
    return [tuple(tok.encode(p)) for p in json.loads((TINY / "heldout_prompts.json").read_text())[:n]]


def captured_engine() -> SpecEngine:
    """The bundled model's speculative engine on cuda:0 (8 slots of 512 positions, buckets 1/4/8), captured."""
    engine = SpecEngine(EngineConfig(str(TINY), runtime=RuntimeConfig(backend="torch", device="cuda:0"),
                                     spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=8, max_len=512),
                                     graphs=GraphConfig(batch_buckets=(1, 4, 8))))
    engine.capture_graphs()
    return engine
