"""Prometheus metrics of the target service (prefix ``specsplit_target_``).

Owns: the target's own counters (drafts verified and accepted; steps and rounds queued
ahead, read when scraped) and ``TargetMetrics``; the families every worker shares come from
``core.worker_metrics``. Served by
``core.observability.start_metrics_server`` when ``server.metrics_port``
is set.

Must not know: gRPC, models, frameworks.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Iterator

from prometheus_client import REGISTRY, Counter
from prometheus_client.core import CounterMetricFamily

from core.worker_metrics import WorkerMetrics, families

FAMILIES = families("target", "Target steps (verify) run by CUDA-graph replay vs eagerly.", "target KV cache")
VERIFIED_DRAFTS = Counter("specsplit_target_verified_drafts_total", "Draft tokens verified.")
ACCEPTED_DRAFTS = Counter("specsplit_target_accepted_drafts_total", "Draft tokens accepted by verification.")
OUTCOMES = ("launched", "used", "dropped")


class QueuedAhead:
    """``specsplit_target_queued_ahead_total{kind, outcome}``, read from the engines' own counts
    when scraped: target-only steps (``kind="step"``, runtime/decode_ahead.py) and speculative
    rounds (``kind="round"``, runtime/round_ahead.py) queued on the device before the host read
    the one before, and whether the next call used or dropped them. Read at scrape time, not
    counted per round: the round loop's host time is what these features save."""

    # What a scrape and the metrics reference (specsplit/metrics_reference.py) read.
    _name, _type, _labelnames = "specsplit_target_queued_ahead", "counter", ("kind", "outcome")
    _documentation = ("Target-only steps (kind=step) and speculative rounds (kind=round) queued on the device "
                      "ahead of the host, by outcome: launched, used by the next call, dropped.")

    def __init__(self) -> None:
        self.workers: weakref.WeakSet[TargetMetrics] = weakref.WeakSet()

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
        totals: dict[tuple[str, str], int] = {}
        for m in list(self.workers):
            for key, n in m.ahead_totals().items():
                totals[key] = totals.get(key, 0) + n
        for kind in ("step", "round"):
            for outcome in OUTCOMES:
                fam.add_metric([kind, outcome], totals.get((kind, outcome), 0))
        yield fam


QUEUED_AHEAD = QueuedAhead()
REGISTRY.register(QUEUED_AHEAD)


class TargetMetrics(WorkerMetrics):
    def __init__(self) -> None:
        super().__init__(FAMILIES)
        # (the serving engine or None, kind -> its AheadStats: launched / used / dropped); set by the worker.
        self.ahead_source: Callable[[], tuple[Any, dict[str, Any]]] = lambda: (None, {})
        self._retired: dict[tuple[str, str], int] = {}     # the counts of engines gone (reloads)
        self._counted: Any = None                          # weakref to the engine they include last
        self._lock = threading.Lock()                      # scrapes (their thread) against a retirement
        QUEUED_AHEAD.workers.add(self)

    def ahead_totals(self) -> dict[tuple[str, str], int]:
        """(kind, outcome) -> count, over this worker's engines so far."""
        with self._lock:
            return self._totals()

    def engine_retired(self) -> None:
        """The engine is going (release, reload): its counts stay in the totals.
        NOTE: the worker still holds it until just after this call: a scrape in between must not
        count it twice (``_counted``, a weak reference: a released engine is freed)."""
        with self._lock:
            self._retired = self._totals()
            engine, _ = self.ahead_source()
            self._counted = None if engine is None else weakref.ref(engine)

    def _totals(self) -> dict[tuple[str, str], int]:
        out = dict(self._retired)
        engine, by_kind = self.ahead_source()
        if engine is None or (self._counted is not None and self._counted() is engine):
            return out
        for kind, stats in by_kind.items():
            for outcome in OUTCOMES:
                out[(kind, outcome)] = out.get((kind, outcome), 0) + getattr(stats, outcome)
        return out

    def verified(self, drafted: int, accepted: int) -> None:
        VERIFIED_DRAFTS.inc(drafted)
        ACCEPTED_DRAFTS.inc(accepted)

    def results(self, step: str, items: list, results: list) -> None:
        """After a batch ran: count the drafts a Verify batch checked and accepted."""
        if step == "verify":
            self.verified(sum(len(it.drafts) for it in items), sum(r.num_accepted for r in results))
