"""Wrappers around the round driver's ports that keep one request's failure from ending the others.

Owns: timing each worker call of a round (worker-reported compute, else wall
time), turning ``ItemFailures`` into placeholder results plus entries in a
``failed`` dict so the round runs on for the other requests, recording
whether a whole call failed, and — for ahead drafting — keeping a failed
ahead call out of the round (``GuardedDraft.deferred``).

Must not know: scheduling, gRPC, frameworks.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from rounds.scheduler_types import ItemFailures, RequestError
from runtime.types import PrefillResult, Proposal, VerifyResult


class Guard:
    """Wraps a port: times each call and turns ``ItemFailures`` into placeholder
    results plus entries in ``failed`` so the round driver runs on for the others."""

    def __init__(self, port: Any, failed: dict[str, RequestError]) -> None:
        self.port, self.failed = port, failed
        self.compute_s = 0.0
        self.raised = False                      # a whole call failed (not just some items)

    def _call(self, fn: Callable[[list], Any], reqs: list, placeholder: Callable[[Any], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            out = fn(reqs)
        except ItemFailures as exc:
            self.failed.update(exc.errors)
            out = [r if r is not None else placeholder(q) for q, r in zip(reqs, exc.results)]
        except Exception:
            self.raised = True
            raise
        finally:
            reported = getattr(self.port, "last_compute_seconds", None)
            self.compute_s += reported if reported is not None else time.perf_counter() - t0
        return out

    def release(self, request_id: str) -> bool:
        return self.port.release(request_id)


class GuardedTarget(Guard):
    def prefill(self, reqs):
        # A failed item emits a dummy token into a sequence that is about to end with its error.
        return self._call(self.port.prefill, reqs,
                          lambda q: PrefillResult(q.request_id, 0, np.zeros((len(q.prompt), 0), np.float32)))

    def verify(self, reqs):
        return self._call(self.port.verify, reqs,
                          lambda q: VerifyResult(q.request_id, 0, (), np.zeros((0, 0), np.float32)))


class GuardedDraft(Guard):
    deferred: Exception | None = None            # an ahead call failed after the verify committed

    @property
    def drafts_on_device(self) -> bool:
        """The port's: its greedy drafts may stay on the device for the verify (``LocalDraft``)."""
        return bool(getattr(self.port, "drafts_on_device", False))

    def prefill(self, reqs):
        return self._call(self.port.prefill, reqs, lambda q: None)

    def propose_async(self, reqs):
        """Ahead drafting: per-item failures give no drafts (the request goes on); a failed call
        is kept in ``deferred`` for the scheduler to handle after the round, never raised into it."""
        send = getattr(self.port, "propose_async", None)
        try:
            collect = send(reqs) if send is not None else (lambda done=self.port.propose(reqs): done)
        except ItemFailures as exc:
            results = exc.results            # NOTE: bound now: ``exc`` is unbound after the except block
            return lambda: results
        except Exception as exc:  # noqa: BLE001
            self.deferred = exc
            return lambda: [None] * len(reqs)

        def wait():
            try:
                return collect()
            except ItemFailures as exc:
                return exc.results
            except Exception as exc:  # noqa: BLE001
                self.deferred = exc
                return [None] * len(reqs)
        return wait

    def propose(self, reqs):
        # A failed item verifies no drafts this round (a target-only step), then ends with its error.
        return self._call(self.port.propose, reqs,
                          lambda q: Proposal(q.request_id, np.zeros(0, np.int64), None))
