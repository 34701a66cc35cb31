"""The draft worker: the generic ``worker.base.Worker`` around a ``DraftEngine``.

Owns: only what is draft-specific: the draft's checkpoint rules (the MTP file
plus the embedding, final norm and head copied from the target checkpoint),
constructing the ``DraftEngine``, the draft's metrics, and the names of its
batched steps (Prefill, Propose). What a valid Prefill / Propose item is
belongs to the engine (``DraftEngine.check_prefill`` / ``check_propose``);
running a batch (refused items answered, the rest as one batch) to ``Worker.run``.

Must not know: protobuf messages, servicers, the target's internals or the
round scheduling. Inputs are ``runtime.types`` records (or an ``ItemError``
for an item the servicer could not decode); outputs are records or
``ItemError`` in the same order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from core.wire import ItemError
from draft_service.metrics import DraftMetrics
from runtime.config import ModelConfig
from runtime.draft_engine import DraftEngine
from runtime.types import Proposal, ProposeRequest
from runtime.weights import CheckedCheckpoint, check_draft, check_target, resolve_draft_path
from worker.base import Worker

PROPOSE = "propose"


def chains_rounds(target_cfg: Any) -> bool:
    """Whether the draft a target of ``target_cfg`` hosts (``colocated_draft``) captures the
    ``chain{k}`` kinds: on the target's device, its drafts left there, rounds queued ahead."""
    draft = target_cfg.colocated_draft_config()
    return (draft.runtime.device == target_cfg.runtime.device and target_cfg.colocated_device_drafts
            and target_cfg.graphs.round_ahead_on(target_cfg.runtime.device))


class DraftWorker(Worker):
    role, metrics_cls = "draft", DraftMetrics
    inline_steps = (PROPOSE,)       # on the Propose stream's handler thread when the device is idle
    # Whether the engine captures the ``chain{k}`` kinds (runtime/round_ahead.py): set by the target
    # that hosts this draft on its own device (``draft_service.server.colocated``).
    chain_rounds = False

    # --- Worker hooks ----------------------------------------------------------
    def validate_checkpoint(self, target: Path, draft_path: str, running: ModelConfig | None) -> CheckedCheckpoint:
        target_ck = check_target(target, running)
        # The MTP file (default: mtp.safetensors next to the target) must also lie
        # under the checkpoint roots, wherever its symlinks point.
        mtp = self.check_path(str(resolve_draft_path(target, draft_path or None)))
        return check_draft(target_ck, mtp)

    def _new_engine(self, model_cfg: ModelConfig, params: dict[str, Any]) -> DraftEngine:
        g = self.cfg.graphs
        eng = DraftEngine(self.ops, model_cfg, params, self.cfg.cache, self.cfg.spec.max_k, self.registry,
                          ahead_drafting=self.cfg.spec.ahead_drafting, fused_propose=g.fused_propose,
                          prefill_widths=g.prefill_widths_on(self.cfg.runtime.device), prefill_tokens=g.prefill_tokens,
                          round_ahead=self.chain_rounds)
        if eng.chain is not None:
            eng.chain.guard = self._next_guard(eng)
        return eng

    def _next_guard(self, eng: DraftEngine) -> Callable[[Callable[[], Any]], Any]:
        """How a target in this process queues the next round's propose on ``eng``
        (runtime/round_ahead.py): on the caller's thread while this worker's device thread is
        idle and ``eng`` still serves here; otherwise not at all (None).
        NOTE: never beside this worker's own device work: a reload tears the graphs down on the
        device thread, and a replay from another thread then would read what it frees."""
        def guard(fn: Callable[[], Any]) -> Any:
            def work() -> Any:
                return fn() if self.engine is eng and self.lifecycle.serving else None
            return self.device.try_run(work)
        return guard

    # --- batched steps (prefill: Worker.prefill) -----------------------------------
    def propose(self, items: list[ProposeRequest | ItemError], round_: int = 0,
                inline: bool | None = None) -> list[Proposal | ItemError]:
        """Catch-up over each request's new pairs, then k-1 substeps; one batch for all valid items.
        Raises LifecycleError (whole batch) when no weights are loaded. ``inline``: ``Worker.run``'s."""
        return self.run(PROPOSE, items, round_, inline=inline)

    def propose_async(self, items: list[ProposeRequest | ItemError], round_: int = 0) -> Callable[[], list[Any]]:
        """``propose`` queued on the device thread; the returned function waits for its answers
        (a target that hosts this draft verifies meanwhile: ``rounds.local_draft``)."""
        return self.run_async(PROPOSE, items, round_)
