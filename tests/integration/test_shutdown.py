"""Graceful shutdown and clean restarts, with real processes.

- ``specsplit orchestrator`` + SIGTERM: new Generate calls get UNAVAILABLE at once, in-flight
  requests finish (exact tokens) within ``--shutdown-grace-s``, the process exits 0, and a new
  orchestrator binds the same port; past the grace period, what is left ends with UNAVAILABLE.
- ``specsplit up`` + SIGTERM (and kill -9): no child process survives, the ports are free, and
  ``up`` on the same port starts again.

The workers of the orchestrator tests run in this process; every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.server import start as start_draft
from orchestrator.client import SpecsplitClient, SpecsplitError
from core.config import ServerConfig
from runtime.config import CacheConfig, GraphConfig, RuntimeConfig, SpecConfig
from worker.config import WorkerConfig
from specsplit.launcher import Child
from target_service.server import start as start_target
from tests.integration.hardening_utils import (REPO, Reference, Stream, child_env, make_model, prompt_of,
                                               read_json_line, wait_until)

pytestmark = pytest.mark.integration

MAX_LEN = 2100
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("shutdown_model"), MAX_LEN)


@pytest.fixture(scope="module")
def reference(model) -> Reference:
    return Reference(model, MAX_LEN)


@pytest.fixture(scope="module")
def workers(model):
    def cfg(role: str) -> WorkerConfig:
        return WorkerConfig(role=role, target_path=str(model), weights_version="v1",
                            runtime=RuntimeConfig(backend="paddle"), spec=SpecConfig(max_k=3, default_k=3),
                            cache=CacheConfig(max_slots=8, max_len=MAX_LEN), graphs=GraphConfig(batch_buckets=(1, 4)),
                            server=ServerConfig(port=0, max_workers=8))
    t, d = start_target(cfg("target")), start_draft(cfg("draft"))
    yield t, d
    t.stop(grace=None)
    d.stop(grace=None)


def orchestrator(workers, port: int = 0, grace: float = 20.0) -> Child:
    t, d = workers
    argv = [sys.executable, "-m", "specsplit", "--log-level", "WARNING", "orchestrator",
            "--target-address", f"127.0.0.1:{t.port}", "--draft-address", f"127.0.0.1:{d.port}",
            "--server-port", str(port), "--max-tokens-limit", "2000", "--shutdown-grace-s", str(grace)]
    c = Child("orchestrator", argv, child_env())
    c.wait_listening(60)
    return c


def unavailable_now(client: SpecsplitClient) -> bool:
    try:
        client.generate_text(prompt_of(99, 3), 2, timeout=10)
    except SpecsplitError as exc:
        return exc.code == grpc.StatusCode.UNAVAILABLE
    return False


def target_slots_used(workers) -> int:
    return workers[0].worker.status().used_slots + workers[1].worker.status().used_slots


def test_sigterm_drains_in_flight_requests_then_exits_and_the_port_rebinds(workers, reference):
    orch = orchestrator(workers)
    port = int(orch.address.rsplit(":", 1)[1])
    with SpecsplitClient(orch.address, timeout=60) as client:
        a = Stream(client, prompt_of(1, 9), 900, dict(k=3, ignore_eos=True))
        b = Stream(client, prompt_of(2, 4), 600, dict(k=0, ignore_eos=True))
        wait_until(lambda: len(a.chunks) >= 3 and len(b.chunks) >= 3, "both requests to stream")
        orch.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: unavailable_now(client), "new requests to be refused with UNAVAILABLE", timeout=10)
        for s, (prompt, n) in ((a, (prompt_of(1, 9), 900)), (b, (prompt_of(2, 4), 600))):
            s.join(60)
            assert s.error is None and s.final is not None, s.error
            assert s.final.tokens == reference(prompt, n)
    assert orch.proc.wait(30) == 0
    assert target_slots_used(workers) == 0
    # A new orchestrator on the same port: no stale socket, nothing left behind.
    again = orchestrator(workers, port=port)
    try:
        with SpecsplitClient(again.address, timeout=60) as client:
            res = client.generate_text(prompt_of(3, 5), 30, k=3, ignore_eos=True)
            assert res.tokens == reference(prompt_of(3, 5), 30)
        again.proc.send_signal(signal.SIGTERM)
        assert again.proc.wait(15) == 0
    finally:
        again.stop(grace=5)


def test_sigterm_grace_period_over_ends_what_is_left_with_unavailable(workers):
    orch = orchestrator(workers, grace=1.0)
    with SpecsplitClient(orch.address, timeout=60) as client:
        long = Stream(client, prompt_of(4, 6), 2000, dict(k=0, ignore_eos=True))
        wait_until(lambda: len(long.chunks) >= 3, "the long request to stream")
        t0 = time.monotonic()
        orch.proc.send_signal(signal.SIGTERM)
        long.join(30)
        assert isinstance(long.error, SpecsplitError) and long.error.code == grpc.StatusCode.UNAVAILABLE, long.error
        assert "shutting down" in long.error.details
        assert orch.proc.wait(15) == 0 and time.monotonic() - t0 < 8
    wait_until(lambda: target_slots_used(workers) == 0, "the slots of the cut request to be released")


# --- specsplit up ------------------------------------------------------------------------------------------------
def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")          # a zombie has exited


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as a restarted server binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        s.listen()
    return True


def start_up(model: Path, port: int = 0) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-m", "specsplit", "--log-level", "WARNING", "up", "--model", str(model),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=child_env(), cwd=REPO)
    try:
        addresses = read_json_line(proc.stdout, 120)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc, addresses


def health_ok(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def test_specsplit_up_sigterm_leaves_no_orphans_and_restarts_on_the_same_port(model):
    proc, addresses = start_up(model)
    kids = children_of(proc.pid)
    try:
        assert len(kids) == 3, (kids, addresses)
        assert health_ok(addresses["orchestrator"])
        with SpecsplitClient(addresses["orchestrator"], timeout=60) as client:
            assert client.generate_text("up", 8).finish_reason in ("length", "stop")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        wait_until(lambda: all(gone(pid) for pid in kids), "every child of `up` to exit", timeout=10)
        ports = [int(a.rsplit(":", 1)[1]) for a in (addresses["orchestrator"], addresses["target"], addresses["draft"])]
        assert all(port_free(p) for p in ports)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        kill_left(kids)
    # Same orchestrator port again; then kill -9 `up` itself: its children follow (PR_SET_PDEATHSIG).
    proc, again = start_up(model, port=ports[0])
    kids = children_of(proc.pid)
    try:
        assert again["orchestrator"] == addresses["orchestrator"] and health_ok(again["orchestrator"])
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        try:
            wait_until(lambda: all(gone(pid) for pid in kids), "the children of a killed `up` to exit", timeout=20)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; still running: {[service_of(p) for p in kids if not gone(p)]}") from None
    finally:
        kill_left(kids)


def kill_left(pids) -> None:
    """SIGKILL whichever of pids still runs (a test's cleanup)."""
    for pid in pids:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def service_of(pid: int) -> str:
    """Which service a child of `up` is (its subcommand), or "gone"."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return "gone"
    return next((w for w in argv if w in ("orchestrator", "target", "draft")), "?")


def test_sigterm_to_the_target_ends_the_orchestrators_stream_within_the_round_not_the_grace(model):
    # The orchestrator keeps one DecodeStream open to the target; a target told to stop ends it
    # once its round loop has closed (requests end UNAVAILABLE), instead of holding the port
    # through the whole shutdown grace period (10 s) waiting for the caller to hang up.
    proc, addresses = start_up(model)
    kids = children_of(proc.pid)
    try:
        with SpecsplitClient(addresses["orchestrator"], timeout=60) as client:
            assert client.generate_text("up", 8).finish_reason in ("length", "stop")
            target = next(pid for pid in kids if service_of(pid) == "target")
            os.kill(target, signal.SIGTERM)
            wait_until(lambda: gone(target), "the target to exit", timeout=8)
            wait_until(lambda: unavailable_now(client), "Generate to answer UNAVAILABLE without a target", timeout=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        kill_left(kids)
