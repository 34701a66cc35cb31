"""Prometheus metrics of the target service (prefix ``specsplit_target_``).

Owns: the target's own counters (drafts verified and accepted) and
``TargetMetrics``; the families every worker shares come from
``core.worker_metrics``. Served by
``core.observability.start_metrics_server`` when ``server.metrics_port``
is set.

Must not know: gRPC, models, frameworks.
"""

from __future__ import annotations

from prometheus_client import Counter

from core.worker_metrics import WorkerMetrics, families

FAMILIES = families("target", "Target steps (verify) run by CUDA-graph replay vs eagerly.", "target KV cache")
VERIFIED_DRAFTS = Counter("specsplit_target_verified_drafts_total", "Draft tokens verified.")
ACCEPTED_DRAFTS = Counter("specsplit_target_accepted_drafts_total", "Draft tokens accepted by verification.")


class TargetMetrics(WorkerMetrics):
    def __init__(self) -> None:
        super().__init__(FAMILIES)

    def verified(self, drafted: int, accepted: int) -> None:
        VERIFIED_DRAFTS.inc(drafted)
        ACCEPTED_DRAFTS.inc(accepted)

    def results(self, step: str, items: list, results: list) -> None:
        """After a batch ran: count the drafts a Verify batch checked and accepted."""
        if step == "verify":
            self.verified(sum(len(it.drafts) for it in items), sum(r.num_accepted for r in results))
