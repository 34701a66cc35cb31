"""Prometheus metrics both workers define, once per role (``specsplit_<role>_...``).

Owns: the metric families every worker exports (lifecycle transitions, graph
replays vs eager steps, active requests, free slots, compute time and batch
size per step, item errors) and ``WorkerMetrics``, the adapter that turns
worker events into updates. Role modules (``draft_service/metrics.py``,
``target_service/metrics.py``) add their own counters on top.

Must not know: gRPC, models, frameworks. Families are module-level per role
(prometheus' default registry refuses duplicates), so every worker of a role
in one process shares them; gauges then show the most recent worker's values.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


@dataclass(frozen=True)
class WorkerFamilies:
    lifecycle_transitions: Counter
    graph_steps: Counter
    active_requests: Gauge
    free_slots: Gauge
    compute_seconds: Histogram
    batch_items: Histogram
    item_errors: Counter

    def all(self) -> list[MetricWrapperBase]:
        return list(vars(self).values())


_FAMILIES: dict[str, WorkerFamilies] = {}


def families(role: str, steps_help: str, cache_noun: str) -> WorkerFamilies:
    """The role's metric families, created on first use."""
    if role not in _FAMILIES:
        p = f"specsplit_{role}_"
        _FAMILIES[role] = WorkerFamilies(
            lifecycle_transitions=Counter(
                p + "lifecycle_transitions_total",
                "Lifecycle transition attempts by action and outcome (ok, noop, refused, failed).",
                ["action", "outcome"]),
            graph_steps=Counter(p + "graph_steps_total", steps_help, ["mode"]),
            active_requests=Gauge(p + "active_requests", f"Requests holding a {cache_noun} slot."),
            free_slots=Gauge(p + "free_slots", f"Free {cache_noun} slots (0 when no weights are loaded)."),
            compute_seconds=Histogram(p + "compute_seconds", "Worker compute time of one batch, by step.",
                                      ["step"], buckets=_STEP_BUCKETS),
            batch_items=Histogram(p + "batch_items", "Items per batch, by step.", ["step"],
                                  buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256)),
            item_errors=Counter(p + "item_errors_total",
                                "Batch items answered with an error, by step and status code.", ["step", "code"]),
        )
    return _FAMILIES[role]


class WorkerMetrics:
    """Per-worker adapter: remembers the registry counters it already exported, and the
    labelled children it updates every step (``labels()`` takes the family's lock and
    builds a key on each call: ~5 us a call on the 2-core CPU, three or more a round)."""

    def __init__(self, fams: WorkerFamilies) -> None:
        self.fams = fams
        self._replays = 0
        self._eager = 0
        self._children: dict[tuple, MetricWrapperBase] = {}

    def _child(self, family: MetricWrapperBase, *values: str) -> MetricWrapperBase:
        key = (id(family), *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*values)
        return child

    def on_transition(self, action: str, outcome: str, *_: object) -> None:
        self.fams.lifecycle_transitions.labels(action, outcome).inc()

    def step(self, step: str, seconds: float, items: int, error_codes: list[str]) -> None:
        self._child(self.fams.compute_seconds, step).observe(seconds)
        self._child(self.fams.batch_items, step).observe(items)
        for code in error_codes:
            self._child(self.fams.item_errors, step, code).inc()

    def graphs(self, replays: int, eager_runs: int) -> None:
        """Export the registry's cumulative counters as increments."""
        if replays > self._replays:
            self._child(self.fams.graph_steps, "replay").inc(replays - self._replays)
        if eager_runs > self._eager:
            self._child(self.fams.graph_steps, "eager").inc(eager_runs - self._eager)
        self._replays, self._eager = replays, eager_runs

    def engine_retired(self) -> None:
        """The worker drops its engine (release, reload): a role keeps what it counted from it."""

    def slots(self, used: int, free: int) -> None:
        self.fams.active_requests.set(used)
        self.fams.free_slots.set(free)
