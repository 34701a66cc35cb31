"""Orchestrator.close waits for the poller's poll under way before closing the channels, and a
poll that fails because close() is under way logs nothing (it used to log "poll_failed")."""

from __future__ import annotations

import threading

import structlog

from orchestrator import server
from orchestrator.config import OrchestratorConfig
from orchestrator.metrics import OrchestratorMetrics


def test_close_waits_for_the_poll_and_a_poll_cut_by_close_is_quiet(monkeypatch):
    monkeypatch.setattr(server, "POLL_S", 0.001)
    core = server.Orchestrator(OrchestratorConfig(draft_address=None, target_address="127.0.0.1:9",
                                                  worker_timeout_s=2.0), OrchestratorMetrics())
    entered, finished = threading.Event(), threading.Event()

    def poll(known=None):
        entered.set()
        core._stop.wait(5.0)                       # in a call when close() starts ...
        finished.set()
        raise RuntimeError("Cannot invoke RPC on closed channel!")      # ... which the closing ends

    monkeypatch.setattr(core, "poll", poll)
    with structlog.testing.capture_logs() as logs:
        core._poller.start()
        assert entered.wait(5.0)
        core.close()
        assert finished.is_set()                   # close() waited for the poll before the channels
        core._poller.join(5.0)
    assert not core._poller.is_alive()
    assert not [e for e in logs if e.get("event") == "poll_failed"], logs
