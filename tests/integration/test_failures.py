"""Worker failures with real processes: kill -9 and SIGSTOP of the draft and the target.

The workers run as subprocesses (``python -m specsplit draft|target``); the
orchestrator runs in this process so the tests can read its status and
metrics. Greedy outputs are compared with in-process target-only decoding.
Every wait is bounded; every stub call has a deadline.
"""

from __future__ import annotations

import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.client import SpecsplitClient, SpecsplitError
from orchestrator.server import create_server
from core.config import ServerConfig
from orchestrator.config import OrchestratorConfig
from specsplit.v1 import common_pb2 as pb
from specsplit.v1 import draft_pb2_grpc
from tests.integration.hardening_utils import Reference, Stream, WorkerProcs, make_model, prompt_of, wait_until
from tests.ports import free_port

pytestmark = pytest.mark.integration

MAX_LEN = 2100
LONG = 2000                      # tokens of a request that must outlive a failure and a recovery
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("failures_model"), MAX_LEN)


@pytest.fixture(scope="module")
def reference(model) -> Reference:
    return Reference(model, MAX_LEN)


@pytest.fixture
def procs(model):
    p = WorkerProcs(model, MAX_LEN)
    yield p
    p.close()


@pytest.fixture
def orchestrator():
    """orchestrator(target_child, draft_child | None, **cfg) -> (server, client); stopped after the test."""
    started = []

    def start(target, draft, **kw):
        cfg = OrchestratorConfig(draft_address=draft.address if draft is not None else None,
                                 target_address=target.address, max_batch=8, max_tokens_limit=LONG,
                                 server=ServerConfig(port=0, metrics_port=0), **{"worker_timeout_s": TIMEOUT, **kw})
        server, port = create_server(cfg)
        client = SpecsplitClient(f"127.0.0.1:{port}", timeout=120)
        started.append((server, client))
        return server, client

    yield start
    for server, client in started:
        client.close()
        server.stop(0).wait(5)


def speculating(client: SpecsplitClient) -> bool:
    return client.status(timeout=10)["orchestrator"]["speculation_available"]


def metric(server, name: str) -> str:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return next((line for line in text.splitlines() if line.startswith(name + " ")), "")


def health(server) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def drafting_started(s: Stream) -> bool:
    return sum(ev.num_drafted for _, ev in list(s.chunks)) > 0 and len(s.chunks) >= 5


# --- the draft ----------------------------------------------------------------------------------------
def test_draft_killed_mid_stream_falls_back_then_reconnects_and_resumes(procs, orchestrator, reference):
    """kill -9 the draft: live and new requests go on target-only (same tokens); a draft restarted
    on the same port is found again, live requests are re-attached, speculation resumes."""
    target, draft = procs.start("target"), procs.start("draft")
    server, client = orchestrator(target, draft)
    assert speculating(client) and metric(server, "specsplit_speculation_available").endswith(" 1.0")
    a = Stream(client, prompt_of(1, 7), LONG, dict(k=3, ignore_eos=True))
    b = Stream(client, prompt_of(2, 30), 400, dict(k=2, ignore_eos=True))
    wait_until(lambda: drafting_started(a), "request A to speculate")
    port = procs.port(draft)
    procs.kill9(draft)
    wait_until(lambda: not speculating(client), "speculation_available=false after the draft died", timeout=10)
    assert metric(server, "specsplit_speculation_available").endswith(" 0.0")
    st = client.status(timeout=10)
    assert st["draft_error"] and health(server) == SERVING            # degraded, still serving
    # New requests run target-only meanwhile, with the target's exact tokens.
    c = client.generate_text(prompt_of(3, 5), 30, k=3, ignore_eos=True)
    assert c.tokens == reference(prompt_of(3, 5), 30) and c.drafted == 0
    assert a.error is None and a.final is None, "A must still be streaming (make LONG larger)"

    restarted = procs.start("draft", port=port)
    wait_until(lambda: speculating(client), "the orchestrator to reconnect to the restarted draft", timeout=20)
    t_back = time.monotonic()
    assert metric(server, "specsplit_speculation_available").endswith(" 1.0")
    assert a.final is None, "A finished before the draft came back (make LONG larger)"
    wait_until(lambda: a.drafted_after(t_back) > 0 or a.final is not None, "A to speculate again")
    a.join()
    b.join()
    assert a.error is None and b.error is None, (a.error, b.error)
    assert a.final.tokens == reference(prompt_of(1, 7), LONG) and a.drafted_after(t_back) > 0
    assert b.final.tokens == reference(prompt_of(2, 30), 400)
    d = client.generate_text(prompt_of(4, 9), 80, k=3, ignore_eos=True)
    assert d.tokens == reference(prompt_of(4, 9), 80) and d.drafted > 0
    # The restarted draft (its data plane on a new free port) was found through its status and
    # served the rounds over the data plane.
    assert int(client.status(timeout=10)["draft"]["data_plane_frames"]) > 0
    # The restarted draft holds nothing once its requests are gone (shadow ids included).
    wait_until(lambda: client.status(timeout=10)["draft"]["used_slots"] == 0 and
               client.status(timeout=10)["target"]["used_slots"] == 0, "all slots free")
    assert restarted.proc.poll() is None


def draft_holds(child, request_id: str) -> bool:
    with grpc.insecure_channel(child.address) as ch:
        status = draft_pb2_grpc.DraftServiceStub(ch).GetStatus(pb.GetStatusRequest(), timeout=10).status
    return request_id in status.active_request_ids


def test_draft_moves_to_a_new_address_through_the_address_file(procs, orchestrator, reference, tmp_path):
    """draft_address_file names the draft: a new host:port written there moves the orchestrator,
    live requests included: (1) while the old draft is healthy, (2) after the draft died."""
    target, first, second, third = (procs.start("target"), procs.start("draft"), procs.start("draft"),
                                    procs.start("draft"))
    address_file = tmp_path / "draft_address"
    address_file.write_text(first.address + "\n")
    server, client = orchestrator(target, None, draft_address_file=str(address_file))
    assert speculating(client)
    a = Stream(client, prompt_of(5, 11), LONG, dict(k=3, ignore_eos=True, request_id="mover"))
    wait_until(lambda: drafting_started(a), "request A to speculate")
    # (1) A healthy move: A's draft cache is rebuilt on the second draft; the first is left alone.
    address_file.write_text(f"# moved by the operator\n{second.address}\n")
    wait_until(lambda: draft_holds(second, "mover"), "A to be re-attached on the second draft", timeout=20)
    t_moved = time.monotonic()
    wait_until(lambda: a.drafted_after(t_moved) > 0 or a.final is not None, "A to speculate on the second draft")
    procs.kill9(first)                                 # no longer used: nothing happens
    assert speculating(client) and a.error is None
    # (2) The second draft dies; the draft comes back at a third address.
    procs.kill9(second)
    wait_until(lambda: not speculating(client), "fallback", timeout=10)
    address_file.write_text(third.address + "\n")
    wait_until(lambda: speculating(client), "the move to the third address", timeout=20)
    t_back = time.monotonic()
    assert a.final is None, "A finished before the third draft was attached (make LONG larger)"
    a.join()
    assert a.error is None and a.final.tokens == reference(prompt_of(5, 11), LONG)
    assert a.drafted_after(t_moved) > 0 and a.drafted_after(t_back) > 0


def test_stalled_draft_falls_back_after_the_timeout_and_is_reattached(procs, orchestrator, reference):
    """SIGSTOP the draft: the round waits at most worker_timeout_s, then goes on target-only; after
    SIGCONT the draft (still holding the old caches) is cleared and re-attached."""
    target, draft = procs.start("target"), procs.start("draft")
    server, client = orchestrator(target, draft, worker_timeout_s=1.5)
    a = Stream(client, prompt_of(6, 8), LONG, dict(k=3, ignore_eos=True))
    wait_until(lambda: drafting_started(a), "request A to speculate")
    draft.proc.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: not speculating(client), "fallback after the stall", timeout=15)
        n = len(a.chunks)
        wait_until(lambda: len(a.chunks) > n + 20, "A to go on target-only while the draft is stopped")
    finally:
        draft.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: speculating(client), "re-attach after SIGCONT", timeout=20)
    t_back = time.monotonic()
    a.join()
    assert a.error is None and a.final.tokens == reference(prompt_of(6, 8), LONG)
    assert a.drafted_after(t_back) > 0
    wait_until(lambda: client.status(timeout=10)["draft"]["used_slots"] == 0, "the draft's stale caches freed")


def test_orchestrator_starts_without_its_draft_and_attaches_it_later(procs, orchestrator, reference):
    """A draft that is not up yet when the orchestrator starts: serving begins target-only."""
    port = free_port()                                  # a port nobody listens on (yet)
    target = procs.start("target")
    missing = type("Missing", (), {"address": f"127.0.0.1:{port}"})()
    server, client = orchestrator(target, missing)
    assert not speculating(client) and health(server) == SERVING
    res = client.generate_text(prompt_of(7, 6), 40, k=3, ignore_eos=True)
    assert res.tokens == reference(prompt_of(7, 6), 40) and res.drafted == 0
    procs.start("draft", port=port)
    wait_until(lambda: speculating(client), "the late draft to be attached", timeout=20)
    res = client.generate_text(prompt_of(8, 6), 40, k=3, ignore_eos=True)
    assert res.tokens == reference(prompt_of(8, 6), 40) and res.drafted > 0


# --- the target ------------------------------------------------------------------------------------------
def test_target_killed_streams_end_unavailable_then_it_comes_back(procs, orchestrator, reference):
    target, draft = procs.start("target"), procs.start("draft")
    server, client = orchestrator(target, draft)
    streams = [Stream(client, prompt_of(10 + i, 6), LONG, dict(k=3 * (i % 2), ignore_eos=True, timeout=60))
               for i in range(3)]
    wait_until(lambda: all(len(s.chunks) >= 3 for s in streams), "the streams to run")
    port = procs.port(target)
    t_kill = time.monotonic()
    procs.kill9(target)
    for s in streams:
        s.join(30)
        assert isinstance(s.error, SpecsplitError) and s.error.code == grpc.StatusCode.UNAVAILABLE, s.error
    assert time.monotonic() - t_kill < 10, "streams must end promptly, not at their deadline"
    wait_until(lambda: health(server) == NOT_SERVING, "health NOT_SERVING", timeout=10)
    with pytest.raises(SpecsplitError) as info:
        client.generate_text(prompt_of(20, 4), 10, timeout=10)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert client.status(timeout=10)["target_error"]                  # the orchestrator is alive
    wait_until(lambda: client.status(timeout=10)["draft"]["used_slots"] == 0, "draft slots of the dead streams freed")

    procs.start("target", port=port)
    wait_until(lambda: health(server) == SERVING, "health SERVING after the target restarted", timeout=20)
    res = client.generate_text(prompt_of(21, 9), 50, k=3, ignore_eos=True)
    assert res.tokens == reference(prompt_of(21, 9), 50) and res.drafted > 0


def test_stalled_target_ends_streams_unavailable_and_recovers(procs, orchestrator, reference):
    """SIGSTOP the target: streams end with UNAVAILABLE after worker_timeout_s (not at their own
    deadline, not one release timeout per request); after SIGCONT the same request ids work again."""
    target, draft = procs.start("target"), procs.start("draft")
    server, client = orchestrator(target, draft, worker_timeout_s=1.5)
    ids = [f"stall-{i}" for i in range(3)]
    streams = [Stream(client, prompt_of(30 + i, 6), LONG, dict(k=3, ignore_eos=True, request_id=rid, timeout=60))
               for i, rid in enumerate(ids)]
    wait_until(lambda: all(len(s.chunks) >= 3 for s in streams), "the streams to run")
    target.proc.send_signal(signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        for s in streams:
            s.join(30)
            assert isinstance(s.error, SpecsplitError) and s.error.code == grpc.StatusCode.UNAVAILABLE, s.error
        assert time.monotonic() - t_stop < 6, "all streams end after one worker timeout"
        wait_until(lambda: health(server) == NOT_SERVING, "health NOT_SERVING", timeout=15)
    finally:
        target.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: health(server) == SERVING, "health SERVING after SIGCONT", timeout=15)
    # The stalled target still held the three caches: reusing an id must work (they are freed first).
    res = client.generate_text(prompt_of(33, 6), 40, k=3, ignore_eos=True, request_id=ids[0])
    assert res.tokens == reference(prompt_of(33, 6), 40)
    wait_until(lambda: client.status(timeout=10)["target"]["used_slots"] == 0, "target slots free")
