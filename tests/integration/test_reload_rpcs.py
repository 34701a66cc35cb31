"""How many RPCs a weight reload costs the orchestrator, and that it needs no extra poll.

A reload is six calls from the orchestrator for two workers (issue: worker-owned
weight swaps), with or without a preload: PrepareWeights on each worker, one ControlRounds DRAIN, one
CommitWeights stream per worker (the worker clears, releases, loads and captures
inside it) and one ControlRounds RESUME_ALL. The calls are counted at the
orchestrator's stubs, on the reload's own threads (the background status poller
is not part of a reload).
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from orchestrator.client import SpecsplitClient
from tests.integration.inproc_stack import ADMIN, TIMEOUT, make_models, start_stack

pytestmark = pytest.mark.integration


class _CountingStub:
    """A stub whose every method call from a reload thread is recorded as (role, method)."""

    def __init__(self, stub, role: str, calls: list) -> None:
        self._stub, self._role, self._calls = stub, role, calls

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)

        def call(*a, **kw):
            if threading.current_thread().name.startswith("reload"):
                self._calls.append((self._role, name))
            return method(*a, **kw)
        return call


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("rpc_models"))


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory):
    s = start_stack(models, tmp_path_factory.mktemp("rpc_staging"))
    yield s
    s.close()


@pytest.mark.parametrize("mode,inflight,version,preload", [("recapture", "wait", "B", False),
                                                           ("in_place", "recompute", "A2", False),
                                                           ("recapture", "abort", "B2", True),
                                                           ("in_place", "wait", "A3", True)])
def test_a_reload_is_six_rpcs_from_the_orchestrator(stack, models, mode, inflight, version, preload):
    core = stack.server.core
    calls: list[tuple[str, str]] = []
    clients = {"target": core.target, "draft": core.draft}
    real = {role: c.stub for role, c in clients.items()}
    for role, c in clients.items():
        c.stub = _CountingStub(c.stub, role, calls)
    path = models["B" if version.startswith("B") else "A"]    # the stack starts on A
    try:
        with SpecsplitClient(stack.address, timeout=TIMEOUT, token=ADMIN) as client:
            events = client.reload(str(path), version, mode=mode, inflight=inflight, preload=preload)
    finally:
        for role, c in clients.items():
            c.stub = real[role]
    assert events[-1].done and events[-1].weights_version == version
    assert Counter(calls) == Counter({("target", "PrepareWeights"): 1, ("draft", "PrepareWeights"): 1,
                                      ("target", "ControlRounds"): 2, ("target", "CommitWeights"): 1,
                                      ("draft", "CommitWeights"): 1}), calls
    # In order: both prepares, the drain, both commits, the resume.
    assert [m for _, m in calls] == ["PrepareWeights"] * 2 + ["ControlRounds"] + ["CommitWeights"] * 2 + \
        ["ControlRounds"], calls
    # The facts the gate opened with came from the reload's own answers (no extra poll).
    assert core.facts.weights_version == version
    # Nothing stays staged on a worker after its commit (a preload's host copy is gone too).
    assert stack.target.worker.swaps.staged_version == stack.draft.worker.swaps.staged_version == ""

