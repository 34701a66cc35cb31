"""bench services reads the target's rounds queued ahead from its /metrics text (the family
``target_service.metrics.QueuedAhead`` writes) and prints a run's used/launched."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from bench.services import _ahead_delta, queued_ahead
from runtime.decode_ahead import AheadStats
from target_service.metrics import QueuedAhead, TargetMetrics


def test_a_runs_rounds_queued_ahead_come_from_the_targets_metrics_text():
    family, registry = QueuedAhead(), CollectorRegistry()
    registry.register(family)
    metrics, engine, stats = TargetMetrics(), object(), AheadStats()
    metrics.ahead_source = lambda: (engine, {"round": stats, "step": AheadStats(launched=9)})
    family.workers.add(metrics)

    before = queued_ahead(generate_latest(registry).decode())
    stats.launched, stats.used, stats.dropped = 12, 10, 2
    after = queued_ahead(generate_latest(registry).decode())
    assert before == {"launched": 0.0, "used": 0.0, "dropped": 0.0}
    assert _ahead_delta(before, after) == "10/12 (2 dropped)"
