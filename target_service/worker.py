"""The target worker: the generic ``worker.base.Worker`` around a ``TargetEngine``.

Owns: only what is target-specific: the target's checkpoint rules (a Hugging
Face Llama directory), constructing the ``TargetEngine``, the target's
metrics, and the names of its batched steps (Prefill, Verify). What a valid
Prefill / Verify item is belongs to the engine (``TargetEngine.check_prefill``
/ ``check_verify``); running a batch to ``Worker.run``.

Must not know: protobuf messages, servicers, the draft or the round
scheduling. Inputs are ``runtime.types`` records (or an ``ItemError`` for an
item the servicer could not decode); outputs are records or ``ItemError`` in
the same order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.wire import ItemError
from runtime.config import ModelConfig
from runtime.target_engine import TargetEngine
from runtime.types import VerifyRequest, VerifyResult
from runtime.weights import CheckedCheckpoint, check_target
from target_service.metrics import TargetMetrics
from worker.base import Worker
from worker.config import WorkerConfig

VERIFY = "verify"


class TargetWorker(Worker):
    role, metrics_cls = "target", TargetMetrics
    inline_steps = (VERIFY,)        # on the round loop's thread when the device is idle

    def __init__(self, cfg: WorkerConfig, log: Any = None) -> None:
        super().__init__(cfg, log)
        if self.metrics is not None:
            self.metrics.ahead_source = self._ahead_stats

    def _ahead_stats(self) -> tuple[Any, dict[str, Any]]:
        """The serving engine and its counts of steps and rounds queued ahead (read by a metrics scrape)."""
        eng = self.engine
        return eng, ({} if eng is None else {"step": eng.ahead_stats, "round": eng.round_stats})

    # --- Worker hooks ----------------------------------------------------------
    def validate_checkpoint(self, target: Path, draft_path: str, running: ModelConfig | None) -> CheckedCheckpoint:
        return check_target(target, running)             # draft_path is the draft's business

    def _new_engine(self, model_cfg: ModelConfig, params: dict[str, Any]) -> TargetEngine:
        g = self.cfg.graphs
        return TargetEngine(self.ops, model_cfg, params, self.cfg.cache, self.cfg.spec.max_k, self.registry,
                            decode_ahead=None if g.decode_ahead else False,
                            round_ahead=g.round_ahead_on(self.cfg.runtime.device),
                            prefill_widths=g.prefill_widths_on(self.cfg.runtime.device), prefill_tokens=g.prefill_tokens)

    # --- batched steps (prefill: Worker.prefill) -----------------------------------
    def verify(self, items: list[VerifyRequest | ItemError], round_: int = 0) -> list[VerifyResult | ItemError]:
        """One forward over [t_n, d_1..d_k] per request, then acceptance; one batch for all valid items.
        Raises LifecycleError (whole batch) when no weights are loaded."""
        return self.run(VERIFY, items, round_)
