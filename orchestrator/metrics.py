"""Prometheus metrics of the orchestrator (names start with ``specsplit_``).

Owns: the metric definitions and how scheduler observations map onto them
(it implements ``rounds.scheduler.Observer``). Each orchestrator gets
its own ``CollectorRegistry`` so several can live in one process (tests);
``core.observability.start_metrics_server`` serves it.

Must not know: gRPC, models, frameworks.

Metrics:
    specsplit_drafted_tokens_total                       drafts proposed
    specsplit_accepted_tokens_total                      drafts accepted
    specsplit_position_drafted_total{position}           drafts proposed at draft position 1..k
    specsplit_position_accepted_total{position}          drafts accepted at draft position 1..k
    specsplit_accepted_length                            histogram: tokens committed per speculative round
    specsplit_round_seconds{part}                        histogram: round time, part = draft|target|overhead|total
    specsplit_round_batch_size                           histogram: sequences per round
    specsplit_active_requests                            gauge: requests in the batch
    specsplit_queued_requests                            gauge: requests waiting for a batch slot
    specsplit_requests_total{finish_reason, code}        finished requests by finish reason and status code
    specsplit_time_to_first_token_seconds                histogram: a Generate's arrival to its first token
    specsplit_request_seconds                            histogram: a finished Generate's arrival to its end
    specsplit_time_per_output_token_seconds              histogram: a finished request's mean time per token
                                                         after its first
    specsplit_speculation_available                      gauge: 1 when a draft is configured and reachable
    specsplit_draft_in_process                           gauge: 1 when the attached draft runs in the target's process
    specsplit_worker_up{worker}                          gauge: 1 when the worker answered its last status poll
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rounds.scheduler import RoundTiming

_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_LENGTH_BUCKETS = tuple(float(i) for i in range(1, 18))
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class OrchestratorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.drafted = Counter("specsplit_drafted_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("specsplit_accepted_tokens", "Draft tokens accepted by the target", registry=r)
        self.pos_drafted = Counter("specsplit_position_drafted", "Drafts proposed at draft position (1-based)",
                                   ["position"], registry=r)
        self.pos_accepted = Counter("specsplit_position_accepted", "Drafts accepted at draft position (1-based)",
                                    ["position"], registry=r)
        self.accepted_length = Histogram("specsplit_accepted_length",
                                         "Tokens committed per speculative round (accepted + bonus)",
                                         buckets=_LENGTH_BUCKETS, registry=r)
        self.round_seconds = Histogram("specsplit_round_seconds", "Round time split: draft compute, target "
                                       "compute, overhead (everything else), total", ["part"],
                                       buckets=_SECONDS_BUCKETS, registry=r)
        self.batch = Histogram("specsplit_round_batch_size", "Sequences per round", buckets=_BATCH_BUCKETS,
                               registry=r)
        self.active = Gauge("specsplit_active_requests", "Requests in the running batch", registry=r)
        # The labelled children updated every round, made once (``labels()`` locks the
        # family and builds a key on every call: ~5 us on the 2-core CPU, ~50 a batch-8 round).
        self._parts = {part: self.round_seconds.labels(part) for part in ("draft", "target", "overhead", "total")}
        self._positions: list[tuple] = []
        self.queued = Gauge("specsplit_queued_requests", "Requests waiting for a batch slot", registry=r)
        self.requests = Counter("specsplit_requests", "Finished requests by finish reason and status code",
                                ["finish_reason", "code"], registry=r)
        self.first_token = Histogram("specsplit_time_to_first_token_seconds", "From a Generate call's arrival "
                                     "to its first streamed token", buckets=_LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram("specsplit_request_seconds", "From a Generate call's arrival to its final "
                                         "message (requests that finished: stop or length)",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.per_token = Histogram("specsplit_time_per_output_token_seconds", "A finished request's time from its "
                                   "first token to its end over the tokens after the first", buckets=_SECONDS_BUCKETS,
                                   registry=r)
        self.speculation = Gauge("specsplit_speculation_available",
                                 "1 when a draft is configured and reachable", registry=r)
        self.draft_in_process = Gauge("specsplit_draft_in_process",
                                      "1 when the attached draft runs in the target's process (colocated_draft)",
                                      registry=r)
        self.worker_up = Gauge("specsplit_worker_up", "1 when the worker answered its last status poll",
                               ["worker"], registry=r)

    # --- scheduler.Observer ---------------------------------------------------------
    def on_round(self, timing: RoundTiming | None, ks_and_accepts: list[tuple[int, int]]) -> None:
        """``timing`` once per round (None: acceptance only, e.g. a second request of a round)."""
        if timing is not None:
            parts = self._parts
            parts["draft"].observe(timing.draft_s)
            parts["target"].observe(timing.target_s)
            parts["overhead"].observe(timing.overhead_s)
            parts["total"].observe(timing.wall_s)
            self.batch.observe(timing.batch)
        for k, a in ks_and_accepts:
            if k == 0:
                continue
            self.drafted.inc(k)
            self.accepted.inc(a)
            self.accepted_length.observe(a + 1)
            positions = self._positions
            while len(positions) < k:
                j = str(len(positions) + 1)
                positions.append((self.pos_drafted.labels(j), self.pos_accepted.labels(j)))
            for j in range(k):
                drafted, accepted = positions[j]
                drafted.inc()
                if j < a:
                    accepted.inc()

    def on_outcome(self, finish_reason: str | None, code: str) -> None:
        self.requests.labels(finish_reason or "none", code).inc()

    def on_first_token(self, seconds: float) -> None:
        self.first_token.observe(seconds)

    def on_finished(self, seconds: float, after_first: float, tokens: int) -> None:
        """A request that finished (stop or length): ``seconds`` since its arrival, ``after_first``
        since its first token, ``tokens`` streamed in all."""
        self.request_seconds.observe(seconds)
        if tokens > 1:
            self.per_token.observe(after_first / (tokens - 1))

    def on_load(self, active: int, queued: int) -> None:
        self.active.set(active)
        self.queued.set(queued)

    # --- health poller ------------------------------------------------------------------
    def on_workers(self, target_up: bool, draft_up: bool | None) -> None:
        self.worker_up.labels("target").set(int(target_up))
        if draft_up is not None:
            self.worker_up.labels("draft").set(int(draft_up))
        self.speculation.set(int(bool(draft_up)))
