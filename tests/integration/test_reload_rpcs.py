"""How many RPCs a weight reload costs the orchestrator, and that it needs no extra poll.

A reload is six calls from the orchestrator for two workers (issue: worker-owned
weight swaps), with or without a preload: PrepareWeights on each worker, one ControlRounds DRAIN, one
CommitWeights stream per worker (the worker clears, releases, loads and captures
inside it) and one ControlRounds RESUME_ALL. The calls are counted at the
orchestrator's stubs, on the reload's own threads (the background status poller
is not part of a reload). With no draft configured, the same sequence is four calls.
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



def test_a_target_only_stack_reloads_in_four_rpcs(models):
    """No draft configured: prepare, drain, commit, resume on the target alone; then serving B."""
    from orchestrator.server import create_server
    from core.config import SecurityConfig, ServerConfig
    from orchestrator.config import OrchestratorConfig
    from target_service.server import start as start_target
    from tests.integration.inproc_stack import GEN, MAX_LEN, _worker

    target = start_target(_worker("target", models["A"]))
    server, port = create_server(OrchestratorConfig(
        draft_address="", target_address=f"127.0.0.1:{target.port}", max_tokens_limit=MAX_LEN - 8, worker_timeout_s=TIMEOUT,
        reload_call_timeout_s=TIMEOUT, server=ServerConfig(port=0), worker_admin_token=ADMIN,
        security=SecurityConfig(admin_token=ADMIN, generate_token=GEN)))
    core = server.core
    calls: list[tuple[str, str]] = []
    core.target.stub = _CountingStub(core.target.stub, "target", calls)
    try:
        with SpecsplitClient(f"127.0.0.1:{port}", timeout=TIMEOUT, token=ADMIN) as client:
            events = client.reload(str(models["B"]), "B", mode="recapture", inflight="wait")
            assert events[-1].done and events[-1].weights_version == "B"
            assert {e.service for e in events} == {"target", "orchestrator"}
            assert [m for _, m in calls] == ["PrepareWeights", "ControlRounds", "CommitWeights", "ControlRounds"]
            assert client.status()["target"]["weights_version"] == "B" and core.facts.weights_version == "B"
    finally:
        server.stop(0).wait(5)
        target.stop(grace=None)
