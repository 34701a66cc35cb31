"""What a weight reload is asked to do and what it reports: the request, its progress events,
its failure, its metrics.

Owns: ``ReloadSpec`` (target and draft paths, version, mode RECAPTURE / IN_PLACE,
in-flight policy WAIT / ABORT / RECOMPUTE, preload) and its checks, ``ReloadEvent``,
``ReloadError`` (a gRPC status code name and whether the workers were rolled back) and
the reload metric families.

Must not know: how a reload proceeds (``orchestrator.reload``), gRPC messages, workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

RECAPTURE, IN_PLACE = "recapture", "in_place"
WAIT, ABORT, RECOMPUTE = "wait", "abort", "recompute"


class ReloadError(Exception):
    """A reload did not happen (or was rolled back). ``code``: a gRPC status code name."""

    def __init__(self, code: str, message: str, rolled_back: bool = False, rollback_failed: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message
        self.rolled_back = rolled_back           # workers were changed, then restored
        self.rollback_failed = rollback_failed   # workers were changed and could not be restored


@dataclass(frozen=True)
class ReloadSpec:
    target_path: str
    version: str
    mode: str = RECAPTURE            # RECAPTURE | IN_PLACE
    inflight: str = WAIT             # WAIT | ABORT | RECOMPUTE
    draft_path: str = ""             # empty: mtp.safetensors inside target_path
    preload: bool = False            # workers read the tensors into host memory before the pause

    def check(self) -> None:
        if not self.target_path:
            raise ReloadError("INVALID_ARGUMENT", "target_path: required (empty)")
        if not self.version:
            raise ReloadError("INVALID_ARGUMENT", "version: required (empty); tag the new weights")
        if self.mode not in (RECAPTURE, IN_PLACE):
            raise ReloadError("INVALID_ARGUMENT", f"mode: {self.mode!r} is not one of RECAPTURE, IN_PLACE")
        if self.inflight not in (WAIT, ABORT, RECOMPUTE):
            raise ReloadError("INVALID_ARGUMENT", f"inflight: {self.inflight!r} is not one of WAIT, ABORT, RECOMPUTE")


@dataclass(frozen=True)
class ReloadEvent:
    phase: str
    service: str                     # "draft" | "target" | "orchestrator"
    seconds: float
    message: str = ""
    done: bool = False
    weights_version: str = ""        # serving on ``service`` after this event
    error_code: str = ""             # set when this phase failed on this service
    error_message: str = ""


class ReloadMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.seconds = Histogram("specsplit_reload_seconds", "Weight reload duration by outcome", ["mode", "outcome"],
                                 buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600), registry=r)
        self.phase = Histogram("specsplit_reload_phase_seconds", "Weight reload phase duration per worker",
                               ["phase", "service"], buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300),
                               registry=r)
        self.total = Counter("specsplit_reloads", "Weight reloads by mode and outcome (ok|failed|rolled_back)",
                             ["mode", "outcome"], registry=r)
