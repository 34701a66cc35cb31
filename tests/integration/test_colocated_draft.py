"""A target that hosts its draft (``colocated_draft``) over real gRPC, bundled model, Torch on the CPU.

What is shown: the round loop calls the in-process draft (no exchange) when the draft address it
is configured with reaches this very process, however the address is spelled and under mutual
TLS too, and a draft service elsewhere when it names one; greedy output is target-only's token
for token, ahead drafting, micro-batches and adaptive k included; the draft's lifecycle RPCs and health
answer on the target's port, and a draft released there sends the rounds target-only (same
tokens) until it is loaded again, when it re-attaches in process. The orchestrator-level reload
with a colocated draft is in ``test_reload.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.admin_token import process_token
from core.config import SecurityConfig
from core.params import SamplingParams
from draft_service.server import SERVICE_NAME as DRAFT_SERVICE
from draft_service.server import colocated
from orchestrator.round_client import RemoteRounds
from rounds.local_draft import LocalDraft
from rounds.scheduler_types import FinalEvent, GenerationRequest, RequestError
from runtime.types import DraftPrefillRequest, ProposeRequest
from rounds.worker_clients import TargetClient
from specsplit.v1 import common_pb2, draft_pb2_grpc
from tests.integration.hardening_utils import make_certs
from tests.integration.test_round_loop import TIMEOUT, _cfg, _drain, _generate, _prompts
from tests.waiting import wait_until
from worker.service import status_to_proto

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def _colocated(security: SecurityConfig | None = None, client_tls: dict | None = None, device_drafts: bool = True,
               round_ahead: bool | None = None, **spec):
    """(rounds, the target's port, the target's service): a target hosting its draft (target spec
    settings ``spec``, ``security``, ``colocated_device_drafts``, ``graphs.round_ahead``), driven as the orchestrator drives
    it (``client_tls``: the rounds client's TLS arguments; the admin token is the process's, or
    ``security``'s)."""
    from target_service import server as target_server

    base = _cfg("target", **spec)
    cfg = dataclasses.replace(base, colocated_draft=True, security=security or SecurityConfig(),
                              colocated_device_drafts=device_drafts,
                              graphs=dataclasses.replace(base.graphs, round_ahead=round_ahead))
    target = target_server.start(cfg, draft=colocated(cfg))
    client = TargetClient(f"127.0.0.1:{target.port}", timeout_s=TIMEOUT, max_message_bytes=1 << 26,
                          admin_token=cfg.security.admin_token or process_token(), **(client_tls or {}))
    rounds = RemoteRounds(client, control_timeout_s=TIMEOUT)
    try:
        yield rounds, target.port, target
    finally:
        rounds.stop()
        client.close()
        target.stop(grace=None)


def test_a_draft_address_naming_a_plain_target_says_what_is_missing():
    from rounds.draft_client import DraftClient
    from target_service import server as target_server

    target = target_server.start(_cfg("target"))
    client = DraftClient(f"127.0.0.1:{target.port}", timeout_s=TIMEOUT, max_message_bytes=1 << 26)
    try:
        with pytest.raises(RequestError, match="has no draft service .*--colocated-draft") as err:
            client.get_status(timeout=TIMEOUT)
        assert err.value.code == "UNIMPLEMENTED"
    finally:
        client.close()
        target.stop(grace=None)


def test_under_mtls_the_target_finds_its_own_draft(tmp_path):
    """The probe that recognizes the in-process draft goes to the configured address like any
    draft client: under mutual TLS with the target's own certificate (its default towards a draft)."""
    certs = make_certs(tmp_path, names=("server", "orchestrator"), rogue=False)
    security = SecurityConfig(tls_cert=certs["server.pem"], tls_key=certs["server.key"], tls_client_ca=certs["ca"],
                              admin_token="colocated-mtls-token")
    tls = dict(tls_ca=certs["ca"], client_cert=certs["orchestrator.pem"], client_key=certs["orchestrator.key"])
    with _colocated(security, tls) as (rounds, port, _):
        prompts = _prompts(2)
        rounds.configure("", 4, 8, TIMEOUT)
        ref = _generate(rounds, prompts, 3)
        st = rounds.configure(f"localhost:{port}", 4, 8, TIMEOUT)
        assert st.speculation_available and st.draft_in_process, st
        got = _generate(rounds, prompts, 3)
        assert _tokens(got) == _tokens(ref) and sum(f.stats.drafted for _, f in got) > 0


@pytest.fixture(scope="module")
def colocated_stack():
    with _colocated(ahead_drafting=True) as stack:
        yield stack


def _tokens(results) -> list[list[int]]:
    assert all(isinstance(f, FinalEvent) for _, f in results), results
    return [t for t, _ in results]


def test_the_colocated_draft_is_called_in_process_and_exact(colocated_stack):
    rounds, port, _ = colocated_stack
    prompts = _prompts(4)
    rounds.configure("", 4, 8, TIMEOUT)                                # no draft: target-only
    ref = _generate(rounds, prompts, 3)
    assert all(f.stats.drafted == 0 for _, f in ref)
    for address in (f"127.0.0.1:{port}", f"localhost:{port}"):        # however the address is spelled
        st = rounds.configure(address, 4, 8, TIMEOUT)
        assert st.speculation_available and st.draft_in_process and st.draft_address == address
        got = _generate(rounds, prompts, 3)
        assert _tokens(got) == _tokens(ref)
        assert sum(f.stats.drafted for _, f in got) > 0 and sum(f.stats.accepted for _, f in got) > 0
        # Ahead drafting (on in this stack) goes through the in-process draft too.
        assert sum(f.stats.ahead_used for _, f in got) > 0
    rounds.configure("", 4, 8, TIMEOUT)


@pytest.mark.parametrize("on_device", [True, False])
def test_greedy_drafts_reach_the_verify_on_the_device(on_device):
    """``colocated_device_drafts`` (default on): a greedy round's drafts stay on the device and
    the verify reads them there (one host synchronisation a round), and the round after it is
    queued ahead (switched on here, as on a GPU); a sampled request's go through the host in any
    case. Off: every draft through the host. Same tokens either way."""
    with _colocated(device_drafts=on_device, round_ahead=True) as (rounds, port, target):
        prompts = _prompts(3)
        rounds.configure("", 4, 8, TIMEOUT)
        ref = _generate(rounds, prompts, 3)
        assert rounds.configure(f"127.0.0.1:{port}", 4, 8, TIMEOUT).draft_in_process
        engine = target.worker.engine
        # As on a GPU: graphs (the CPU's eager stand-in) and rounds queued ahead (runtime/round_ahead.py).
        target.worker.capture_graphs()
        target.hosted.worker.capture_graphs()
        got = _generate(rounds, prompts, 3)
        assert _tokens(got) == _tokens(ref) and sum(f.stats.accepted for _, f in got) > 0
        chained = engine.device_draft_verifies
        assert (chained > 0) == on_device
        # Through the draft worker's guard (its device thread idle): queued and taken, or never.
        taken = target.hosted.worker.engine.next_taken
        assert (engine.round_stats.used > 0) == on_device and taken == engine.round_stats.used
        sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=3)
        _, final = _drain(rounds.submit(GenerationRequest("sampled", prompts[0], sampled, 3)))
        assert isinstance(final, FinalEvent) and final.stats.drafted > 0
        assert engine.device_draft_verifies == chained           # sampled: drafts through the host


def test_rounds_queued_ahead_are_counted_when_scraped():
    """``specsplit_target_queued_ahead_total{kind, outcome}`` reads the engine's counts of rounds
    queued ahead when scraped, and keeps them when the engine goes (a release), once."""
    from prometheus_client import REGISTRY

    from target_service.metrics import OUTCOMES

    def scraped() -> dict[str, float]:
        return {o: REGISTRY.get_sample_value("specsplit_target_queued_ahead_total",
                                             {"kind": "round", "outcome": o}) or 0.0 for o in OUTCOMES}

    with _colocated(round_ahead=True) as (rounds, port, target):
        before = scraped()
        assert rounds.configure(f"127.0.0.1:{port}", 4, 8, TIMEOUT).draft_in_process
        target.worker.capture_graphs()
        target.hosted.worker.capture_graphs()
        _generate(rounds, _prompts(3), 3)
        st = target.worker.engine.round_stats
        counted = {o: scraped()[o] - before[o] for o in OUTCOMES}
        assert st.used > 0 and counted == {"launched": st.launched, "used": st.used, "dropped": st.dropped}
        target.worker.clear_graphs()
        target.worker.release_weights()
        assert target.worker.engine is None
        assert {o: scraped()[o] - before[o] for o in OUTCOMES} == counted
        target.worker.load_weights(target.worker.cfg.target_path, "", "v2")    # a new engine counts from there
        assert target.worker.engine is not None
        assert {o: scraped()[o] - before[o] for o in OUTCOMES} == counted


def test_micro_batches_with_the_colocated_draft_are_exact():
    """Two micro-batches: on the target's device the draft's Propose of one runs before the
    verify of the other (``LocalDraft.propose_async`` with ``inline``)."""
    with _colocated(micro_batches=True) as (rounds, port, target):
        prompts = _prompts(4)
        rounds.configure("", 4, 8, TIMEOUT)
        ref = _generate(rounds, prompts, 3)
        assert rounds.configure(f"127.0.0.1:{port}", 4, 8, TIMEOUT).draft_in_process
        got = _generate(rounds, prompts, 3)
        assert _tokens(got) == _tokens(ref) and sum(f.stats.drafted for _, f in got) > 0
        assert target.hosted.worker.status().eager_runs > 0


def test_adaptive_k_with_the_colocated_draft_is_exact():
    """Adaptive k (watch probes on) over the in-process draft, rounds queued ahead where the next
    round's k cannot change (graphs captured, as on a GPU), on random-byte prompts where drafting
    soon stops paying and held-out ones where it pays: every token is target-only's (whether the
    loop watched or drafted here depends on this CPU's timing; the policy's choices are
    tests/unit/test_scheduler.py's)."""
    with _colocated(adaptive_k=True, round_ahead=True) as (rounds, port, target):
        rng = np.random.default_rng(5)
        prompts = [tuple(int(t) for t in rng.integers(32, 256, 40)) for _ in range(2)] + _prompts(2)
        rounds.configure("", 4, 8, TIMEOUT)
        ref = _generate(rounds, prompts, 3, max_tokens=64)
        assert rounds.configure(f"127.0.0.1:{port}", 4, 8, TIMEOUT).draft_in_process
        target.worker.capture_graphs()
        target.hosted.worker.capture_graphs()
        got = [_generate(rounds, [p], 3, max_tokens=64)[0] for p in prompts]       # one at a time: batch 1
        assert _tokens(got) == _tokens(ref)
        assert rounds.status().active_requests == 0


def test_a_queued_propose_drafts_what_a_direct_one_does(colocated_stack):
    """The overlapped path of a draft on another device (``inline`` off: the Propose queued on the
    draft's device thread, ``Worker.run_async``), on the real draft worker: the same drafts as a
    direct call, for two requests with the same pairs."""
    _, _, target = colocated_stack
    worker = target.hosted.worker
    status = lambda: status_to_proto(worker.status())                     # noqa: E731
    direct, queued = LocalDraft(worker, status, "x", inline=True), LocalDraft(worker, status, "x", inline=False)
    d = worker.model_cfg.hidden_size
    rng = np.random.default_rng(5)
    h0, toks0 = rng.standard_normal((5, d)).astype(np.float32), rng.integers(0, 256, 5)
    try:
        for port, rid in ((direct, "direct"), (queued, "queued")):
            port.prefill([DraftPrefillRequest(rid, toks0, h0, SamplingParams())])
        start = 5
        for m in (1, 2, 4):
            h, toks = rng.standard_normal((m, d)).astype(np.float32), rng.integers(0, 256, m)
            (want,) = direct.propose([ProposeRequest("direct", start, toks, h, 3)])
            collect = queued.propose_async([ProposeRequest("queued", start, toks, h, 3)])
            (got,) = collect()
            assert got.drafts.tolist() == want.drafts.tolist() and len(got.drafts) == 3
            start += m
    finally:
        worker.release(["direct", "queued"])


def test_a_draft_service_elsewhere_is_not_taken_for_the_colocated_one(colocated_stack):
    from draft_service import server as draft_server

    rounds, _, _ = colocated_stack
    draft = draft_server.start(_cfg("draft"))
    try:
        prompts = _prompts(2)
        rounds.configure("", 4, 8, TIMEOUT)
        ref = _generate(rounds, prompts, 3)
        st = rounds.configure(f"127.0.0.1:{draft.port}", 4, 8, TIMEOUT)
        assert st.speculation_available and not st.draft_in_process
        got = _generate(rounds, prompts, 3)
        assert _tokens(got) == _tokens(ref) and sum(f.stats.drafted for _, f in got) > 0
        assert draft.worker.status().graph_replays + draft.worker.status().eager_runs > 0   # it drafted
    finally:
        rounds.configure("", 4, 8, TIMEOUT)
        draft.stop(grace=None)


def test_the_colocated_drafts_lifecycle_answers_on_the_targets_port(colocated_stack):
    rounds, port, target = colocated_stack
    prompts = _prompts(2)
    rounds.configure("", 4, 8, TIMEOUT)
    ref = _generate(rounds, prompts, 3)
    address = f"127.0.0.1:{port}"
    assert rounds.configure(address, 4, 8, TIMEOUT).draft_in_process
    channel = grpc.insecure_channel(address)
    try:
        draft = draft_pb2_grpc.DraftServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        meta = (("authorization", f"Bearer {process_token()}"),)

        def draft_health() -> int:
            return health.Check(health_pb2.HealthCheckRequest(service=DRAFT_SERVICE), timeout=TIMEOUT).status

        st = draft.GetStatus(common_pb2.GetStatusRequest(), timeout=TIMEOUT).status
        assert st.role == "draft" and st.instance_id == target.hosted.worker.instance_id
        assert st.instance_id != target.worker.instance_id and st.data_plane_port == 0
        assert draft_health() == health_pb2.HealthCheckResponse.SERVING
        draft.ClearGraphs(common_pb2.ClearGraphsRequest(), timeout=TIMEOUT, metadata=meta)
        draft.ReleaseWeights(common_pb2.ReleaseWeightsRequest(), timeout=TIMEOUT, metadata=meta)
        assert draft_health() == health_pb2.HealthCheckResponse.NOT_SERVING
        # The server's own health follows the target: it still serves, target-only.
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT).status == \
            health_pb2.HealthCheckResponse.SERVING
        got = _generate(rounds, prompts, 3)
        assert _tokens(got) == _tokens(ref)
        status = rounds.status()
        assert not status.speculation_available and not status.draft_in_process and status.draft_error
        draft.LoadWeights(common_pb2.LoadWeightsRequest(target_path=target.worker.cfg.target_path,
                                                        version="v1"), timeout=TIMEOUT, metadata=meta)
        wait_until(lambda: rounds.status().speculation_available, "the colocated draft to re-attach")
        assert rounds.status().draft_in_process
        again = _generate(rounds, prompts, 3)
        assert _tokens(again) == _tokens(ref) and sum(f.stats.drafted for _, f in again) > 0
    finally:
        channel.close()
        rounds.configure("", 4, 8, TIMEOUT)
