"""Prometheus metrics of the draft service (prefix ``specsplit_draft_``).

Owns: the draft's own counter (proposed tokens) and ``DraftMetrics``; the
families every worker shares come from ``core.worker_metrics``. Served
by ``core.observability.start_metrics_server`` when
``server.metrics_port`` is set.

Must not know: gRPC, models, frameworks.
"""

from __future__ import annotations

from prometheus_client import Counter

from core.worker_metrics import WorkerMetrics, families

FAMILIES = families("draft", "Draft steps (catch-up and substeps) run by CUDA-graph replay vs eagerly.",
                    "draft cache")
PROPOSED_TOKENS = Counter("specsplit_draft_proposed_tokens_total", "Draft tokens proposed.")


class DraftMetrics(WorkerMetrics):
    def __init__(self) -> None:
        super().__init__(FAMILIES)

    def proposed(self, tokens: int) -> None:
        PROPOSED_TOKENS.inc(tokens)

    def results(self, step: str, items: list, results: list) -> None:
        """After a batch ran: count the drafts a Propose batch proposed."""
        if step == "propose":
            self.proposed(sum(len(p.drafts) for p in results))
