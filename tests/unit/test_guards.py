"""The ports' guards (rounds/guards.py): ahead-drafting calls never end a request or a round."""

from __future__ import annotations

import numpy as np

from rounds.guards import GuardedDraft
from rounds.scheduler_types import ItemFailures, RequestError, WorkerUnavailable
from runtime.types import Proposal, ProposeRequest


def _reqs(n: int) -> list[ProposeRequest]:
    return [ProposeRequest(f"r{i}", 0, np.zeros(0, np.int64), np.zeros((0, 0), np.float32), 4, ahead=True)
            for i in range(n)]


class SyncPort:
    """An in-process draft: no propose_async, per-item failures raised at once."""

    def propose(self, reqs):
        raise ItemFailures([Proposal("r0", np.array([1, 2, 3, 4]), None), None],
                           {"r1": RequestError("INVALID_ARGUMENT", "no kept end")})


class BrokenStream:
    def propose_async(self, reqs):
        def collect():
            raise WorkerUnavailable("draft Propose: the worker closed the stream")
        return collect


def test_item_failures_raised_at_send_give_no_drafts_for_those_items_only():
    """Regression: the collector closed over the except block's ``exc``, unbound once the block ended."""
    failed: dict = {}
    guard = GuardedDraft(SyncPort(), failed)
    got = guard.propose_async(_reqs(2))()
    assert list(got[0].drafts) == [1, 2, 3, 4] and got[1] is None
    assert failed == {} and guard.deferred is None          # no request ends over an ahead call


def test_a_failed_ahead_call_is_deferred_not_raised():
    guard = GuardedDraft(BrokenStream(), {})
    assert guard.propose_async(_reqs(3))() == [None, None, None]
    assert isinstance(guard.deferred, WorkerUnavailable) and not guard.raised
