"""The draft's per-round data plane (worker/data_plane.py, rounds/data_plane.py), bundled model, CPU.

A Propose over the data plane answers exactly what the gRPC stream answers (one handling); a
frame that is too large or undecodable closes only its own connection; a draft that does not
answer raises ``WorkerUnavailable`` within the timeout and the next round reconnects; TLS and
mTLS use the gRPC server's certificates (a client without a certificate is refused); a draft
with the data plane off keeps Propose on the gRPC stream. Every wait is bounded.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import structlog

from core import frames
from core.config import ConfigError, SecurityConfig, ServerConfig
from core.params import SamplingParams
from draft_service import server as draft_server
from rounds.data_plane import DataPlaneLink, address_host, tls_context
from rounds.scheduler_types import WorkerUnavailable
from rounds.draft_client import DraftClient
from runtime.config import CacheConfig, GraphConfig, RuntimeConfig, SpecConfig
from runtime.types import DraftPrefillRequest, ProposeRequest
from specsplit.v1 import draft_pb2
from tests.integration.hardening_utils import make_certs
from tests.waiting import wait_until
from tests.ports import free_port
from worker.config import WorkerConfig
from worker.data_plane import DataPlaneServer

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
TIMEOUT = 30.0
MAX_BYTES = 1 << 26


def _cfg(security: SecurityConfig = SecurityConfig(), data_plane_port: int = 0) -> WorkerConfig:
    return WorkerConfig(role="draft", target_path=str(TINY), weights_version="v1", data_plane_port=data_plane_port,
                        runtime=RuntimeConfig(backend="torch", device="cpu"), spec=SpecConfig(max_k=3, default_k=3),
                        cache=CacheConfig(max_slots=8, max_len=256), graphs=GraphConfig(batch_buckets=(1, 2)),
                        server=ServerConfig(host="127.0.0.1", port=0), security=security)


def _client(svc, **kw) -> DraftClient:
    c = DraftClient(f"127.0.0.1:{svc.port}", timeout_s=TIMEOUT, max_message_bytes=MAX_BYTES, **kw)
    c.get_status(timeout=TIMEOUT)            # learns the data plane's port, as the draft link's probe does
    return c


def _propose(client: DraftClient, request_id: str, hidden_size: int) -> np.ndarray:
    """Prefill ``request_id`` with fixed pairs, then one Propose of k=3; its drafts."""
    rng = np.random.default_rng(0)
    tokens = np.arange(5, 21, dtype=np.int64)
    hidden = rng.standard_normal((len(tokens), hidden_size)).astype(np.float32)
    client.prefill([DraftPrefillRequest(request_id, tokens, hidden, SamplingParams())])
    last = rng.standard_normal((1, hidden_size)).astype(np.float32)
    (p,) = client.propose([ProposeRequest(request_id, len(tokens), np.array([42]), last, 3)])
    client.release(request_id)
    client.flush_releases()
    return p.drafts


@pytest.fixture(scope="module")
def draft():
    svc = draft_server.start(_cfg())
    yield svc
    svc.stop(grace=None)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    return make_certs(tmp_path_factory.mktemp("certs"), names=("server", "client"))


def test_propose_over_the_data_plane_equals_the_grpc_stream(draft):
    dp, grpc_only = _client(draft), _client(draft, data_plane=False)
    try:
        st = dp.get_status(timeout=TIMEOUT)
        assert st.data_plane_port > 0 and dp.uses_data_plane and not grpc_only.uses_data_plane
        assert st.propose_hidden_rows and dp._hidden_rows          # the Propose carries one tensor of rows
        over_dp = _propose(dp, "a", st.hidden_size)
        mid = dp.get_status(timeout=TIMEOUT).data_plane_frames
        over_grpc = _propose(grpc_only, "b", st.hidden_size)
        assert len(over_dp) == 3 and over_dp.tolist() == over_grpc.tolist()
        assert mid == st.data_plane_frames + 3        # the data plane carried the prefill, the Propose, the release
        assert dp.get_status(timeout=TIMEOUT).data_plane_frames == mid        # the stream did not
    finally:
        dp.close()
        grpc_only.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    """True when the peer closed ``sock`` (EOF or reset) within the timeout."""
    sock.settimeout(TIMEOUT)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("frame", [(1 << 31).to_bytes(4, "big") + b"x",       # above max_message_bytes
                                   frames.encode(b"\xff\xff\xff\xff garbage"),  # not a ProposeRequest
                                   ], ids=["oversized", "garbage"])
def test_a_bad_frame_closes_only_its_connection(draft, frame):
    client = _client(draft)
    try:
        hidden = client.get_status(timeout=TIMEOUT).hidden_size
        first = _propose(client, "c", hidden)
        conn_before = client._data._conn
        with socket.create_connection(("127.0.0.1", client._data.port), timeout=TIMEOUT) as bad:
            bad.sendall(frame)
            assert _closed_by_peer(bad)
        # The service goes on serving, on the connection it already had and on new ones.
        assert _propose(client, "c", hidden).tolist() == first.tolist()
        assert client._data._conn is conn_before
        fresh = _client(draft)
        try:
            assert _propose(fresh, "d", hidden).tolist() == first.tolist()
        finally:
            fresh.close()
    finally:
        client.close()


def _echo(body: bytes) -> bytes:
    msg = draft_pb2.ProposeRequest.FromString(body)
    return draft_pb2.ProposeResponse(round=msg.round).SerializeToString()


def test_a_stalled_draft_raises_worker_unavailable_within_the_timeout_then_reconnects():
    release = threading.Event()
    answered: list[int] = []

    def stall_once(body: bytes) -> bytes:
        if not answered:
            answered.append(0)
            release.wait(TIMEOUT)             # the first frame is answered only after the test gave up
        return _echo(body)

    server = DataPlaneServer("127.0.0.1", 0, stall_once, max_frame_bytes=MAX_BYTES, ssl_context=None,
                             log=structlog.get_logger("test")).start()
    link = DataPlaneLink("draft", "127.0.0.1", draft_pb2.ProposeResponse.FromString, timeout_s=0.5,
                         max_frame_bytes=MAX_BYTES)
    link.advertised(server.port)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerUnavailable, match="no response within 0.5s"):
            link.exchange(draft_pb2.ProposeRequest(round=1), "Propose")
        assert 0.5 <= time.monotonic() - t0 < 5.0
        release.set()
        # The next round opens a fresh connection and is answered for its own round.
        assert link.exchange(draft_pb2.ProposeRequest(round=2), "Propose").round == 2
        wait_until(lambda: server.frames == 2, "the stalled frame's late answer to be written (and dropped)")
    finally:
        release.set()
        link.close()
        server.stop()


def test_connections_past_the_cap_are_closed_and_the_open_ones_keep_serving():
    from worker import data_plane

    server = DataPlaneServer("127.0.0.1", 0, _echo, max_frame_bytes=MAX_BYTES, ssl_context=None,
                             log=structlog.get_logger("test")).start()
    held = []
    try:
        for i in range(data_plane.MAX_CONNECTIONS):      # each answered once: its thread is busy with it
            s = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT)
            s.sendall(frames.encode(draft_pb2.ProposeRequest(round=i + 1).SerializeToString()))
            held.append(s)
        wait_until(lambda: server.frames == data_plane.MAX_CONNECTIONS, "every held connection answered")
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as extra:
            assert _closed_by_peer(extra)
        held[0].sendall(frames.encode(draft_pb2.ProposeRequest(round=99).SerializeToString()))
        wait_until(lambda: server.frames == data_plane.MAX_CONNECTIONS + 1, "a held connection still served")
        held.pop().close()                               # a slot frees: a new connection is served again
        link = DataPlaneLink("draft", "127.0.0.1", draft_pb2.ProposeResponse.FromString, timeout_s=TIMEOUT,
                             max_frame_bytes=MAX_BYTES)
        link.advertised(server.port)
        try:
            got = wait_until(lambda: _try_exchange(link), "a new connection once a slot is free")
            assert got.round == 7
        finally:
            link.close()
    finally:
        for s in held:
            s.close()
        server.stop()


def _try_exchange(link: DataPlaneLink):
    try:
        return link.exchange(draft_pb2.ProposeRequest(round=7), "Propose")
    except WorkerUnavailable:
        return None


def test_a_response_for_another_round_or_a_closed_connection_is_worker_unavailable():
    stale = lambda body: draft_pb2.ProposeResponse(round=99).SerializeToString()    # noqa: E731
    server = DataPlaneServer("127.0.0.1", 0, stale, max_frame_bytes=MAX_BYTES, ssl_context=None,
                             log=structlog.get_logger("test")).start()
    link = DataPlaneLink("draft", "127.0.0.1", draft_pb2.ProposeResponse.FromString, timeout_s=TIMEOUT,
                         max_frame_bytes=MAX_BYTES)
    link.advertised(server.port)
    try:
        with pytest.raises(WorkerUnavailable, match="response for round 99, expected 1"):
            link.exchange(draft_pb2.ProposeRequest(round=1), "Propose")
        assert link._conn is None             # closed; the next round reconnects
    finally:
        server.stop()
    with pytest.raises(WorkerUnavailable, match="data plane"):   # stopped: connection refused
        link.exchange(draft_pb2.ProposeRequest(round=2), "Propose")


def test_mtls_data_plane_needs_a_client_certificate(certs):
    sec = SecurityConfig(tls_cert=certs["server.pem"], tls_key=certs["server.key"], tls_client_ca=certs["ca"])
    svc = draft_server.start(_cfg(sec))
    client = _client(svc, tls_ca=certs["ca"], client_cert=certs["client.pem"], client_key=certs["client.key"])
    try:
        st = client.get_status(timeout=TIMEOUT)
        assert client.uses_data_plane
        drafts = _propose(client, "m", st.hidden_size)
        frames_after = client.get_status(timeout=TIMEOUT).data_plane_frames
        assert len(drafts) == 3 and frames_after > st.data_plane_frames
        for ctx in (tls_context(certs["ca"], None, None),                             # no client certificate
                    tls_context(certs["ca"], certs["rogue.pem"], certs["rogue.key"]),  # one no CA signed
                    None):                                                            # plaintext
            link = DataPlaneLink("draft", "127.0.0.1", draft_pb2.ProposeResponse.FromString, timeout_s=TIMEOUT,
                                 max_frame_bytes=MAX_BYTES, ssl_context=ctx)
            link.advertised(st.data_plane_port)
            with pytest.raises(WorkerUnavailable):
                link.exchange(draft_pb2.ProposeRequest(round=1), "Propose")
            link.close()
        assert client.get_status(timeout=TIMEOUT).data_plane_frames == frames_after   # none was answered
        assert _propose(client, "m", st.hidden_size).tolist() == drafts.tolist()    # still serving
    finally:
        client.close()
        svc.stop(grace=None)


def test_tls_data_plane_without_client_certificates(certs, draft):
    svc = draft_server.start(_cfg(SecurityConfig(tls_cert=certs["server.pem"], tls_key=certs["server.key"])))
    client = _client(svc, tls_ca=certs["ca"])
    plain = _client(draft)
    try:
        st = client.get_status(timeout=TIMEOUT)
        assert client.uses_data_plane
        assert _propose(client, "t", st.hidden_size).tolist() == _propose(plain, "t", st.hidden_size).tolist()
        assert client.get_status(timeout=TIMEOUT).data_plane_frames == st.data_plane_frames + 3   # prefill, Propose, release
    finally:
        client.close()
        plain.close()
        svc.stop(grace=None)


def test_polling_readers_on_both_ends_answer_the_same_over_tls(certs, draft):
    """``data_plane_poll_us`` on the draft (its connection polls for the next frame) and on the
    client (it polls for the answer), over TLS (non-blocking reads of an SSL socket): the same
    drafts as a blocking plaintext pair, every frame on the data plane."""
    import dataclasses

    cfg = dataclasses.replace(_cfg(SecurityConfig(tls_cert=certs["server.pem"], tls_key=certs["server.key"])),
                              data_plane_poll_us=20_000)
    svc = draft_server.start(cfg)
    assert svc.data_plane.poll_s == 0.02
    client = _client(svc, tls_ca=certs["ca"], data_plane_poll_s=0.02)
    plain = _client(draft)
    try:
        st = client.get_status(timeout=TIMEOUT)
        for rid in ("p1", "p2"):
            assert _propose(client, rid, st.hidden_size).tolist() == _propose(plain, rid, st.hidden_size).tolist()
        assert client.get_status(timeout=TIMEOUT).data_plane_frames == st.data_plane_frames + 6
    finally:
        client.close()
        plain.close()
        svc.stop(grace=None)


def test_data_plane_off_keeps_propose_on_the_grpc_stream(draft):
    svc = draft_server.start(_cfg(data_plane_port=-1))
    client, reference = _client(svc), _client(draft)
    try:
        st = client.get_status(timeout=TIMEOUT)
        assert st.data_plane_port == 0 and not client.uses_data_plane
        assert _propose(client, "g", st.hidden_size).tolist() == _propose(reference, "g", st.hidden_size).tolist()
        assert client.get_status(timeout=TIMEOUT).data_plane_frames == 0
    finally:
        client.close()
        reference.close()
        svc.stop(grace=None)


def test_an_unreachable_data_plane_falls_back_to_the_grpc_stream(draft, monkeypatch):
    """A draft whose gRPC port is reachable but whose data plane is not (a firewall, a wrong
    port): Propose goes over the gRPC stream in the same round, and again until the retry
    interval has passed; then the data plane is tried again."""
    from rounds import data_plane as link_mod

    client, reference = _client(draft), _client(draft)
    dead_port = free_port()                                 # nothing listens there
    try:
        hidden = client.get_status(timeout=TIMEOUT).hidden_size
        want = _propose(reference, "u", hidden).tolist()
        frames_before = client.get_status(timeout=TIMEOUT).data_plane_frames
        client._data.advertised(dead_port)                  # as a status from a draft behind a firewall
        assert _propose(client, "v", hidden).tolist() == want
        assert not client.uses_data_plane                   # refused: the stream carries the next rounds
        assert _propose(client, "w", hidden).tolist() == want
        st = client.get_status(timeout=TIMEOUT)             # the draft's real port again
        assert st.data_plane_frames == frames_before        # none of the three went over the data plane
        monkeypatch.setattr(link_mod, "RETRY_AFTER_S", 0.0)
        client._data.advertised(dead_port)
        assert client.uses_data_plane                       # the interval is over: tried again ...
        assert _propose(client, "x", hidden).tolist() == want   # ... refused again, the stream answers
        client._data.advertised(st.data_plane_port)         # reachable: used from the next round
        assert client.uses_data_plane
        assert _propose(client, "y", hidden).tolist() == want
        assert client.get_status(timeout=TIMEOUT).data_plane_frames > frames_before
    finally:
        client.close()
        reference.close()


def test_the_service_stops_its_data_plane():
    svc = draft_server.start(_cfg())
    client = _client(svc)
    port = client._data.port
    _propose(client, "s", client.get_status(timeout=TIMEOUT).hidden_size)
    svc.stop(grace=None)
    with pytest.raises(WorkerUnavailable):
        client.propose([ProposeRequest("s", 0, np.zeros(0, np.int64), np.zeros((0, 0), np.float32), 1,
                                       ahead=True)])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT).close()
    client.close()


def test_config_and_addresses():
    with pytest.raises(ConfigError, match="data_plane_port"):
        WorkerConfig(role="draft", target_path=None, data_plane_port=-2)
    assert address_host("draft:50061") == "draft" and address_host("[::1]:5") == "::1"
    assert address_host("dns:///10.0.0.2:7") == "10.0.0.2" and address_host("unix:/tmp/s") is None


# --- prefill and releases between rounds ----------------------------------------------------


def _prefill_errors(client: DraftClient, hidden_size: int) -> tuple[type, str, str]:
    """(exception type, code, message tail) of a prefill that the draft refuses as a whole."""
    hidden = np.zeros((2, hidden_size), dtype=np.float32)
    try:
        client.prefill([DraftPrefillRequest("e", np.array([5, 6]), hidden, SamplingParams())])
    except Exception as exc:  # noqa: BLE001 - what is compared is the failure itself
        return type(exc), getattr(exc, "code", ""), str(exc).split(": ", 2)[-1]
    raise AssertionError("the prefill was not refused")


def test_a_whole_prefill_failure_reads_the_same_over_both_transports():
    """A draft with no weights refuses a prefill as a whole: over the data plane the client raises
    what the Prefill RPC's status raises (the scheduler then treats the draft as lost, not the
    requests as failed)."""
    import dataclasses

    svc = draft_server.start(dataclasses.replace(_cfg(), target_path=None))
    dp, rpc = _client(svc), _client(svc, data_plane=False)
    try:
        st = dp.get_status(timeout=TIMEOUT)
        assert dp.uses_data_plane and st.data_plane_frames == 0
        with structlog.testing.capture_logs() as logs:
            over_dp, over_rpc = _prefill_errors(dp, 256), _prefill_errors(rpc, 256)
        assert over_dp == over_rpc and over_dp[1] == "FAILED_PRECONDITION", (over_dp, over_rpc)
        assert not [e for e in logs if e["event"] == "draft_data_plane_prefill_unsupported"]   # not an old draft
        assert dp.get_status(timeout=TIMEOUT).data_plane_frames == 1          # the data plane carried it
    finally:
        dp.close()
        rpc.close()
        svc.stop(grace=None)


def test_a_draft_that_ignores_prefill_items_gets_the_prefill_rpc(draft):
    """A draft that predates ``prefill_items`` answers such a message without ``prefill_results``
    (it ran the releases, ignored the rest): the client prefills through the Prefill RPC, then and
    from then on, and the drafts are the same."""
    svc = draft_server.start(_cfg())
    real = svc.data_plane._handle

    def older_draft(body: bytes) -> bytes:
        msg = draft_pb2.ProposeRequest.FromString(body)
        msg.ClearField("prefill_items")
        return real(msg.SerializeToString())

    svc.data_plane._handle = older_draft
    client, reference = _client(svc), _client(draft)
    try:
        hidden = client.get_status(timeout=TIMEOUT).hidden_size
        with structlog.testing.capture_logs() as logs:
            got = _propose(client, "old-1", hidden)
        assert got.tolist() == _propose(reference, "old-1", hidden).tolist()
        assert [e["event"] for e in logs].count("draft_data_plane_prefill_unsupported") == 1
        before = client.get_status(timeout=TIMEOUT).data_plane_frames
        assert _propose(client, "old-2", hidden).tolist() == got.tolist()
        # The second prefill went over gRPC at once: only the Propose and the release used frames.
        assert client.get_status(timeout=TIMEOUT).data_plane_frames == before + 2
    finally:
        client.close()
        reference.close()
        svc.stop(grace=None)


def test_a_per_item_prefill_failure_over_the_data_plane_fails_only_that_item(draft):
    from rounds.scheduler_types import ItemFailures

    client = _client(draft)
    try:
        hidden = client.get_status(timeout=TIMEOUT).hidden_size
        good = DraftPrefillRequest("ok-item", np.array([5, 6]), np.zeros((2, hidden), np.float32), SamplingParams())
        bad = DraftPrefillRequest("bad-item", np.array([5, 6]), np.zeros((2, hidden + 1), np.float32),
                                  SamplingParams())
        with pytest.raises(ItemFailures) as caught:
            client.prefill([good, bad])
        assert set(caught.value.errors) == {"bad-item"} and caught.value.errors["bad-item"].code == "INVALID_ARGUMENT"
        client.release("ok-item")
        client.flush_releases()
    finally:
        client.close()
