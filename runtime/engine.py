"""In-process speculative engine: target + draft in one process, no gRPC.

Owns: building both engines from an ``EngineConfig`` and running a batch of
requests to completion with continuous batching (sequences leave when they
finish). It is the reference the services are compared against, the
``specsplit bench engine`` subject and the quickest way to use the model.

Must not know: gRPC, lifecycle, CUDA-graph internals (it only asks the
registry to capture when told to).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.backends import make_ops
from core.params import SamplingParams
from runtime.config import EngineConfig, ModelConfig
from runtime.draft_engine import DraftEngine
from runtime.graphs import GraphRegistry
from runtime.round_driver import SeqStats, Sequence, admit, release, run_round
from runtime.target_engine import TargetEngine
from runtime.weights import check_draft, check_target, read_arrays, resolve_draft_path, to_device


@dataclass(frozen=True)
class GenRequest:
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    k: int | None = None             # None: the engine's default k; 0: target-only


@dataclass(frozen=True)
class GenResult:
    request_id: str
    tokens: tuple[int, ...]
    finish_reason: str
    stats: SeqStats


class SpecEngine:
    def __init__(self, cfg: EngineConfig, use_draft: bool = True, fused_propose: bool = True,
                 device_drafts: bool = True) -> None:
        """``device_drafts``: greedy drafts go from the propose to the verify on the device
        (``runtime.device_drafts``; both engines share one device here)."""
        self.cfg = cfg
        self.ops = make_ops(cfg.runtime)
        target_ck = check_target(cfg.target_path)
        self.model_cfg: ModelConfig = target_ck.cfg
        self.target_registry = GraphRegistry(self.ops, cfg.graphs.batch_buckets)
        self.target = TargetEngine(self.ops, self.model_cfg, to_device(self.ops, read_arrays(target_ck, bf16_bits=True)),
                                   cfg.cache, cfg.spec.max_k, self.target_registry,
                                   decode_ahead=None if cfg.graphs.decode_ahead else False,
                                   round_ahead=cfg.graphs.round_ahead_on(cfg.runtime.device),
                                   prefill_widths=cfg.graphs.prefill_widths_on(cfg.runtime.device),
                                   prefill_tokens=cfg.graphs.prefill_tokens)
        self.draft: DraftEngine | None = None
        if use_draft and cfg.spec.max_k > 0:
            draft_ck = check_draft(target_ck, resolve_draft_path(cfg.target_path, cfg.draft_path))
            self.draft_registry = GraphRegistry(self.ops, cfg.graphs.batch_buckets)
            self.draft = DraftEngine(self.ops, self.model_cfg, to_device(self.ops, read_arrays(draft_ck, bf16_bits=True)),
                                     cfg.cache, cfg.spec.max_k, self.draft_registry, fused_propose=fused_propose,
                                     prefill_widths=cfg.graphs.prefill_widths_on(cfg.runtime.device),
                                     prefill_tokens=cfg.graphs.prefill_tokens,
                                     round_ahead=device_drafts and cfg.graphs.round_ahead_on(cfg.runtime.device))
            self.draft.drafts_on_device = device_drafts

    def capture_graphs(self) -> None:
        self.target_registry.capture_all()
        if self.draft is not None:
            self.draft_registry.capture_all()

    def generate(self, requests: list[GenRequest], max_batch: int | None = None) -> list[GenResult]:
        """Run every request to completion; up to ``max_batch`` run at once (default: cache slots)."""
        max_batch = max_batch or self.cfg.cache.max_slots
        waiting = [Sequence(r.request_id, np.asarray(r.prompt, dtype=np.int64), r.params,
                            self.cfg.spec.default_k if r.k is None else r.k, self.model_cfg.eos_token_id,
                            eos_token_ids=self.model_cfg.eos_token_ids)
                   for r in requests]
        limit = self.model_cfg.max_position_embeddings
        for s in waiting:
            if len(s.prompt) > limit:
                raise ValueError(f"prompt: {len(s.prompt)} tokens exceed the model's max_position_embeddings={limit}")
            if s.k > self.cfg.spec.max_k:
                raise ValueError(f"k: {s.k} is out of range [0, {self.cfg.spec.max_k}]")
            if s.k > 0 and self.draft is None:
                s.k = 0
        running: list[Sequence] = []
        done: dict[str, Sequence] = {}
        while waiting or running:
            room = max_batch - len(running)
            if room > 0 and waiting:
                joining, waiting = waiting[:room], waiting[room:]
                admit(self.target, self.draft, joining)
                running.extend(joining)
            live = [s for s in running if s.finish_reason is None]
            if live:
                run_round(self.target, self.draft, live)
            for s in list(running):
                if s.finish_reason is not None:
                    release(self.target, self.draft, s)
                    running.remove(s)
                    done[s.request_id] = s
        return [GenResult(r.request_id, tuple(done[r.request_id].output), done[r.request_id].finish_reason,
                          done[r.request_id].stats) for r in requests]
