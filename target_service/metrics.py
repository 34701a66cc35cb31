"""Prometheus metrics of the target service (prefix ``specsplit_target_``).

Owns: the metric definitions the target worker updates and the small
``TargetMetrics`` adapter that turns worker events into metric updates.
Served by ``runtime.observability.start_metrics_server`` when
``server.metrics_port`` is set.

Must not know: gRPC, models, frameworks. Module-level metrics are shared by
every target worker in a process (tests start several); gauges then show the
most recent worker's values.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)

LIFECYCLE_TRANSITIONS = Counter(
    "specsplit_target_lifecycle_transitions_total",
    "Lifecycle transition attempts by action and outcome (ok, noop, refused, failed).",
    ["action", "outcome"])
GRAPH_STEPS = Counter(
    "specsplit_target_graph_steps_total",
    "Target steps (verify) run by CUDA-graph replay vs eagerly.", ["mode"])
ACTIVE_REQUESTS = Gauge("specsplit_target_active_requests", "Requests holding a target KV cache slot.")
FREE_SLOTS = Gauge("specsplit_target_free_slots", "Free target KV cache slots (0 when no weights are loaded).")
COMPUTE_SECONDS = Histogram(
    "specsplit_target_compute_seconds", "Worker compute time of one batch, by step.", ["step"],
    buckets=_STEP_BUCKETS)
BATCH_ITEMS = Histogram(
    "specsplit_target_batch_items", "Items per batch, by step.", ["step"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
ITEM_ERRORS = Counter(
    "specsplit_target_item_errors_total", "Batch items answered with an error, by step and status code.",
    ["step", "code"])
VERIFIED_DRAFTS = Counter("specsplit_target_verified_drafts_total", "Draft tokens verified.")
ACCEPTED_DRAFTS = Counter("specsplit_target_accepted_drafts_total", "Draft tokens accepted by verification.")


class TargetMetrics:
    """Per-worker adapter: remembers the registry counters it already exported."""

    def __init__(self) -> None:
        self._replays = 0
        self._eager = 0

    def on_transition(self, action: str, outcome: str, *_: object) -> None:
        LIFECYCLE_TRANSITIONS.labels(action, outcome).inc()

    def step(self, step: str, seconds: float, items: int, error_codes: list[str]) -> None:
        COMPUTE_SECONDS.labels(step).observe(seconds)
        BATCH_ITEMS.labels(step).observe(items)
        for code in error_codes:
            ITEM_ERRORS.labels(step, code).inc()

    def graphs(self, replays: int, eager_runs: int) -> None:
        """Export the registry's cumulative counters as increments."""
        if replays > self._replays:
            GRAPH_STEPS.labels("replay").inc(replays - self._replays)
        if eager_runs > self._eager:
            GRAPH_STEPS.labels("eager").inc(eager_runs - self._eager)
        self._replays, self._eager = replays, eager_runs

    def slots(self, used: int, free: int) -> None:
        ACTIVE_REQUESTS.set(used)
        FREE_SLOTS.set(free)

    def verified(self, drafted: int, accepted: int) -> None:
        VERIFIED_DRAFTS.inc(drafted)
        ACCEPTED_DRAFTS.inc(accepted)
