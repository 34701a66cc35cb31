"""The target worker: lifecycle + prefill and batched verification.

Owns: a ``TargetEngine`` behind the lifecycle (``worker.base.WorkerBase``:
load / in-place update / release of weights, graph capture and clear,
status), the target's checkpoint rules (a Hugging Face Llama directory),
per-item validation of Prefill and Verify batches, and the target's metrics.

Must not know: protobuf messages, servicers, the draft or the round
scheduling. Inputs are ``runtime.types`` records (or an ``ItemError`` for an
item the servicer could not decode); outputs are records or ``ItemError`` in
the same order. One bad item never fails the others: invalid items are
answered with an error and the valid ones still run as one batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from runtime.config import ModelConfig
from worker.config import WorkerConfig
from runtime.kv_cache import CapacityError, UnknownRequestError
from worker.base import WorkerBase, check_request_id, check_token_range, repeated_ids
from runtime.target_engine import TargetEngine
from runtime.types import PrefillRequest, PrefillResult, VerifyRequest, VerifyResult
from runtime.weights import CheckedCheckpoint, check_target
from core.serving import check_checkpoint_path
from core.wire import ItemError, item_error_for
from target_service.metrics import TargetMetrics

PREFILL, VERIFY = "prefill", "verify"


class TargetWorker(WorkerBase):
    role = "target"

    error_type = ItemError                        # WorkerBase hooks: per-item error records
    error_for = staticmethod(item_error_for)

    def __init__(self, cfg: WorkerConfig, log: Any = None) -> None:
        self.metrics = TargetMetrics()
        super().__init__(cfg, check_path=lambda p: check_checkpoint_path(p, cfg.security.checkpoint_roots), log=log)

    # --- WorkerBase hooks ------------------------------------------------------
    def _checkpoint(self, target: Path, draft_path: str, running: ModelConfig | None) -> CheckedCheckpoint:
        return check_target(target, running)             # draft_path is the draft's business

    def _new_engine(self, model_cfg: ModelConfig, params: dict[str, Any]) -> TargetEngine:
        return TargetEngine(self.ops, model_cfg, params, self.cfg.cache, self.cfg.spec.max_k, self.registry)

    # --- batched work --------------------------------------------------------------
    def prefill(self, items: list[PrefillRequest | ItemError]) -> list[PrefillResult | ItemError]:
        """Run each prompt and pick its first token; one batch for all valid items.

        Raises LifecycleError (whole batch) when no weights are loaded.
        """
        def validate(engine: TargetEngine, ok: list[tuple[int, PrefillRequest]],
                     out: list[Any]) -> list[tuple[int, PrefillRequest]]:
            vocab, dups = engine.cfg.vocab_size, repeated_ids([it.request_id for _, it in ok])
            good = []
            for i, it in ok:
                try:
                    check_request_id(it.request_id, f"items[{i}].request_id")
                    if it.request_id in dups:
                        raise ValueError(f"items[{i}].request_id: {it.request_id!r} appears more than once in the batch")
                    if engine.cache.has(it.request_id):
                        raise ValueError(f"items[{i}].request_id: {it.request_id!r} is already active here")
                    n = len(it.prompt)
                    if n == 0:
                        raise ValueError(f"items[{i}].prompt: must hold at least one token (empty)")
                    check_token_range(it.prompt, vocab, f"items[{i}].prompt")
                    if it.resume_token is not None and not 0 <= it.resume_token < vocab:
                        raise ValueError(f"items[{i}].resume_token: {it.resume_token} is out of range [0, {vocab})")
                    if n + 1 > engine.cache.max_len:
                        raise CapacityError(f"items[{i}].prompt: {n} tokens need {n + 1} cache positions; "
                                            f"cache.max_len is {engine.cache.max_len}")
                    if len(good) >= engine.cache.free_slots:
                        raise CapacityError(f"items[{i}]: no free KV cache slot "
                                            f"({engine.cache.max_slots} slots, all in use)")
                    good.append((i, it))
                except Exception as exc:  # noqa: BLE001 - becomes the item's error
                    out[i] = self.error_for(exc)
            return good

        def run(engine: TargetEngine, good: list[tuple[int, PrefillRequest]], out: list[Any]) -> None:
            for (i, _), res in zip(good, engine.prefill([it for _, it in good])):
                out[i] = res

        return self._batch(PREFILL, items, validate, run)

    def verify(self, items: list[VerifyRequest | ItemError], round_: int = 0) -> list[VerifyResult | ItemError]:
        """One forward over [t_n, d_1..d_k] per request, then acceptance; one batch for all valid items.

        Raises LifecycleError (whole batch) when no weights are loaded.
        """
        def validate(engine: TargetEngine, ok: list[tuple[int, VerifyRequest]],
                     out: list[Any]) -> list[tuple[int, VerifyRequest]]:
            vocab, dups = engine.cfg.vocab_size, repeated_ids([it.request_id for _, it in ok])
            good = []
            for i, it in ok:
                try:
                    check_request_id(it.request_id, f"items[{i}].request_id")
                    if it.request_id in dups:
                        raise ValueError(f"items[{i}].request_id: {it.request_id!r} appears more than once in the batch")
                    if not engine.cache.has(it.request_id):
                        raise UnknownRequestError(f"items[{i}].request_id: {it.request_id!r} is unknown here "
                                                  "(never prefilled, or already released)")
                    length = engine.cache.get(it.request_id).length
                    k = len(it.drafts)
                    if k > engine.max_k:
                        raise ValueError(f"items[{i}].drafts: {k} drafts exceed max_k={engine.max_k}")
                    check_token_range(it.drafts, vocab, f"items[{i}].drafts")
                    if it.draft_probs is not None:
                        _check_probs(it.draft_probs, k, vocab, f"items[{i}].draft_probs")
                    if length + k + 1 > engine.cache.max_len:
                        raise CapacityError(f"items[{i}]: request {it.request_id!r} needs {length + k + 1} cache "
                                            f"positions; cache.max_len is {engine.cache.max_len}")
                    good.append((i, it))
                except Exception as exc:  # noqa: BLE001 - becomes the item's error
                    out[i] = self.error_for(exc)
            return good

        def run(engine: TargetEngine, good: list[tuple[int, VerifyRequest]], out: list[Any]) -> None:
            results = engine.verify([it for _, it in good])
            for (i, _), res in zip(good, results):
                out[i] = res
            self.metrics.verified(sum(len(it.drafts) for _, it in good), sum(r.num_accepted for r in results))

        return self._batch(VERIFY, items, validate, run, round_)


def _check_probs(q: np.ndarray, k: int, vocab: int, field: str) -> None:
    """Draft distributions: float [k, vocab], finite, non-negative."""
    if q.dtype.kind != "f":
        raise ValueError(f"{field}: dtype {q.dtype} is not a float type")
    if q.shape != (k, vocab):
        raise ValueError(f"{field}: shape {list(q.shape)}, expected [{k}, {vocab}] (one row per draft)")
    if not np.isfinite(q).all() or (q < 0).any():
        raise ValueError(f"{field}: must be finite and non-negative")
