"""The draft worker: lifecycle + the MTP proposer's batched work.

Owns: a ``DraftEngine`` behind the lifecycle (``worker.base.WorkerBase``:
load / in-place update / release of weights, graph capture and clear, status),
the draft's checkpoint rules (the MTP file plus the embedding, final norm and
head copied from the target checkpoint), per-item validation of Prefill and
Propose batches, and the draft's metrics.

Must not know: protobuf messages, servicers, the target's internals or the
round scheduling. Inputs are ``runtime.types`` records (or an ``ItemError``
for an item the servicer could not decode); outputs are records or
``ItemError`` in the same order. One bad item never fails the others: invalid
items are answered with an error and the valid ones still run as one batch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from draft_service.metrics import DraftMetrics
from runtime.config import ModelConfig
from worker.config import WorkerConfig
from runtime.draft_engine import DraftEngine
from runtime.kv_cache import CapacityError, UnknownRequestError
from worker.base import (WorkerBase, check_hidden, check_request_id, check_token_range,
                               repeated_ids)
from runtime.types import DraftPrefillRequest, Proposal, ProposeRequest
from runtime.weights import CheckedCheckpoint, check_draft, check_target, resolve_draft_path
from core.serving import check_checkpoint_path
from core.wire import ItemError, item_error_for

PREFILL, PROPOSE = "prefill", "propose"


class DraftWorker(WorkerBase):
    role = "draft"

    error_type = ItemError                        # WorkerBase hooks: per-item error records
    error_for = staticmethod(item_error_for)

    def __init__(self, cfg: WorkerConfig, log: Any = None) -> None:
        self.metrics = DraftMetrics()
        super().__init__(cfg, check_path=lambda p: check_checkpoint_path(p, cfg.security.checkpoint_roots), log=log)

    # --- WorkerBase hooks ------------------------------------------------------
    def _checkpoint(self, target: Path, draft_path: str, running: ModelConfig | None) -> CheckedCheckpoint:
        target_ck = check_target(target, running)
        # The MTP file (default: mtp.safetensors next to the target) must also lie
        # under the checkpoint roots, wherever its symlinks point.
        mtp = self._check_path(str(resolve_draft_path(target, draft_path or None)))
        return check_draft(target_ck, mtp)

    def _new_engine(self, model_cfg: ModelConfig, params: dict[str, Any]) -> DraftEngine:
        return DraftEngine(self.ops, model_cfg, params, self.cfg.cache, self.cfg.spec.max_k, self.registry,
                           ahead_drafting=self.cfg.spec.ahead_drafting)

    # --- batched work --------------------------------------------------------------
    def prefill(self, items: list[DraftPrefillRequest | ItemError]) -> list[ItemError | None]:
        """Allocate each request's draft cache and write its prompt pairs. None = success.

        Raises LifecycleError (whole batch) when no weights are loaded.
        """
        def validate(engine: DraftEngine, ok: list[tuple[int, DraftPrefillRequest]],
                     out: list[Any]) -> list[tuple[int, DraftPrefillRequest]]:
            cfg, dups = engine.cfg, repeated_ids([it.request_id for _, it in ok])
            good = []
            for i, it in ok:
                try:
                    check_request_id(it.request_id, f"items[{i}].request_id")
                    if it.request_id in dups:
                        raise ValueError(f"items[{i}].request_id: {it.request_id!r} appears more than once in the batch")
                    if engine.cache.has(it.request_id):
                        raise ValueError(f"items[{i}].request_id: {it.request_id!r} is already active here")
                    check_token_range(it.tokens, cfg.vocab_size, f"items[{i}].tokens")
                    if len(it.tokens) == 0 and it.hidden.size == 0:   # one-token prompt: no pairs yet
                        it = dataclasses.replace(it, hidden=np.zeros((0, cfg.hidden_size), dtype=np.float32))
                    check_hidden(it.hidden, len(it.tokens), cfg.hidden_size, f"items[{i}].hidden")
                    need = len(it.tokens) + engine.max_k + 1
                    if need > engine.cache.max_len:
                        raise CapacityError(f"items[{i}].tokens: {len(it.tokens)} prompt pairs + max_k "
                                            f"{engine.max_k} + 1 need {need} draft cache positions; "
                                            f"cache.max_len is {engine.cache.max_len}")
                    if len(good) >= engine.cache.free_slots:
                        raise CapacityError(f"items[{i}]: no free draft cache slot "
                                            f"({engine.cache.max_slots} slots, all in use)")
                    good.append((i, it))
                except Exception as exc:  # noqa: BLE001 - becomes the item's error
                    out[i] = self.error_for(exc)
            return good

        def run(engine: DraftEngine, good: list[tuple[int, DraftPrefillRequest]], out: list[Any]) -> None:
            engine.prefill([it for _, it in good])
            for i, _ in good:
                out[i] = None

        return self._batch(PREFILL, items, validate, run)

    def propose(self, items: list[ProposeRequest | ItemError], round_: int = 0) -> list[Proposal | ItemError]:
        """Catch-up over each request's new pairs, then k-1 substeps; one batch for all valid items.

        Raises LifecycleError (whole batch) when no weights are loaded.
        """
        def validate(engine: DraftEngine, ok: list[tuple[int, ProposeRequest]],
                     out: list[Any]) -> list[tuple[int, ProposeRequest]]:
            cfg, dups = engine.cfg, repeated_ids([it.request_id for _, it in ok])
            good = []
            for i, it in ok:
                try:
                    check_request_id(it.request_id, f"items[{i}].request_id")
                    if it.request_id in dups:
                        raise ValueError(f"items[{i}].request_id: {it.request_id!r} appears more than once in the batch")
                    if not engine.cache.has(it.request_id):
                        raise UnknownRequestError(f"items[{i}].request_id: {it.request_id!r} is unknown here "
                                                  "(never prefilled, or already released)")
                    if it.ahead:                 # the engine owns the ahead rules (k up to max_k + 1)
                        engine.check_ahead(it.request_id, it.k, f"items[{i}]")
                        good.append((i, it))
                        continue
                    held = engine.cache.get(it.request_id).length
                    if it.start_position != held:
                        raise ValueError(f"items[{i}].start_position: {it.start_position} != {held} pairs held "
                                         f"for request {it.request_id!r} (lost or repeated round?)")
                    if not 1 <= it.k <= engine.max_k:
                        raise ValueError(f"items[{i}].k: {it.k} is out of range [1, {engine.max_k}]")
                    if len(it.tokens) < 1:
                        raise ValueError(f"items[{i}].tokens: at least one new pair is required")
                    check_token_range(it.tokens, cfg.vocab_size, f"items[{i}].tokens")
                    check_hidden(it.hidden, len(it.tokens), cfg.hidden_size, f"items[{i}].hidden")
                    need = held + len(it.tokens) + it.k
                    if need > engine.cache.max_len:
                        raise CapacityError(f"items[{i}]: request {it.request_id!r} needs {need} draft cache "
                                            f"positions; cache.max_len is {engine.cache.max_len}")
                    good.append((i, it))
                except Exception as exc:  # noqa: BLE001 - becomes the item's error
                    out[i] = self.error_for(exc)
            return good

        def run(engine: DraftEngine, good: list[tuple[int, ProposeRequest]], out: list[Any]) -> None:
            proposals = engine.propose([it for _, it in good])
            for (i, _), p in zip(good, proposals):
                out[i] = p
            self.metrics.proposed(sum(len(p.drafts) for p in proposals))

        return self._batch(PROPOSE, items, validate, run, round_)
