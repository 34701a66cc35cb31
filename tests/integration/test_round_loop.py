"""The round loop in the target service (target_service/rounds.py) over real gRPC, bundled model, CPU.

Covers what the orchestrator-level tests do not see directly: ahead drafting
over the draft's data plane (regression: ahead items asked for k+1 drafts,
which the draft refused as out of range, so ahead drafts were never used),
that the rounds really go over the data plane (the draft's frame count) and
over the gRPC Propose stream when the draft has none, Decode and
ControlRounds refusing bad input with the field named, and a target that
decodes with no draft configured.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from orchestrator.round_client import RemoteRounds
from rounds.scheduler_types import ErrorEvent, FinalEvent, GenerationRequest, RequestError, TokensEvent
from rounds.worker_clients import TargetClient
from core.config import SecurityConfig, ServerConfig
from core.params import SamplingParams
from runtime.config import CacheConfig, GraphConfig, RuntimeConfig, SpecConfig
from worker.config import WorkerConfig
from runtime.tokenizer import ByteTokenizer
from core.admin_token import process_token
from specsplit.v1 import target_pb2 as tpb

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
TIMEOUT = 60.0


def _cfg(role: str, data_plane_port: int = 0, **spec) -> WorkerConfig:
    return WorkerConfig(role=role, target_path=str(TINY), weights_version="v1", data_plane_port=data_plane_port,
                        runtime=RuntimeConfig(backend="torch", device="cpu"),
                        spec=SpecConfig(max_k=3, default_k=3, **spec), cache=CacheConfig(max_slots=4, max_len=512),
                        graphs=GraphConfig(batch_buckets=(1, 2, 4)), server=ServerConfig(host="127.0.0.1", port=0),
                        security=SecurityConfig())


def _prompts(n: int) -> list[tuple[int, ...]]:
    tok = ByteTokenizer()
    return [tuple(tok.encode(p)) for p in json.loads((TINY / "heldout_prompts.json").read_text())[:n]]


def _drain(handle) -> tuple[list[int], object]:
    tokens: list[int] = []
    for _ in range(10_000):
        ev = handle.next_event(TIMEOUT)
        if isinstance(ev, TokensEvent):
            tokens.extend(ev.tokens)
        else:
            return tokens, ev
    raise AssertionError("no final event")


def _services(**target_spec):
    """A draft and a target service in this process (target spec settings ``target_spec``), and the
    target's round loop driven as the orchestrator does: yields (rounds, the draft's address)."""
    from draft_service import server as draft_server
    from target_service import server as target_server

    draft = draft_server.start(_cfg("draft"))
    target = target_server.start(_cfg("target", **target_spec))
    # In-process services share this process's generated admin token (ControlRounds is an admin RPC).
    client = TargetClient(f"127.0.0.1:{target.port}", timeout_s=TIMEOUT, max_message_bytes=1 << 26,
                          admin_token=process_token())
    rounds = RemoteRounds(client, control_timeout_s=TIMEOUT)
    yield rounds, f"127.0.0.1:{draft.port}"
    rounds.stop()
    client.close()
    target.stop(grace=None)
    draft.stop(grace=None)


@pytest.fixture(scope="module")
def stack():
    yield from _services(ahead_drafting=True, adaptive_k=False)


def _draft_status(draft_address: str):
    from specsplit.v1 import common_pb2, draft_pb2_grpc

    with grpc.insecure_channel(draft_address) as ch:
        return draft_pb2_grpc.DraftServiceStub(ch).GetStatus(common_pb2.GetStatusRequest(), timeout=TIMEOUT).status


def _generate(rounds, prompts, k, max_tokens=48):
    handles = [rounds.submit(GenerationRequest(f"r{k}-{i}", p, SamplingParams(max_tokens=max_tokens,
                                                                              ignore_eos=True), k))
               for i, p in enumerate(prompts)]
    return [_drain(h) for h in handles]


def test_ahead_drafting_over_grpc_is_exact_and_used(stack):
    rounds, draft_address = stack
    prompts = _prompts(4)
    rounds.configure("", 4, 8, TIMEOUT)                                # no draft: target-only
    ref = _generate(rounds, prompts, 3)
    assert all(isinstance(f, FinalEvent) and f.stats.drafted == 0 for _, f in ref)
    st = rounds.configure(draft_address, 4, 8, TIMEOUT)
    assert st.speculation_available and st.configured and st.draft_address == draft_address
    before = _draft_status(draft_address)
    assert before.data_plane_port > 0
    got = _generate(rounds, prompts, 3)
    for (tokens, final), (ref_tokens, _) in zip(got, ref):
        assert isinstance(final, FinalEvent) and tokens == ref_tokens
    # The rounds' Propose messages went over the data plane (the gRPC stream carries no frames).
    frames = _draft_status(draft_address).data_plane_frames - before.data_plane_frames
    assert frames > 0
    asked = sum(f.stats.ahead_asked for _, f in got)
    used = sum(f.stats.ahead_used for _, f in got)
    assert asked > 0 and 0 < used <= asked
    assert rounds.status().active_requests == 0


def test_the_last_rounds_chunk_rides_on_the_final_event_when_asked(stack):
    """DecodeRequest.chunk_in_final: the round a request finishes in sends no chunk of its own, its
    tokens come in DecodeFinal.last_chunks (with the round's timing); without it, a chunk and then a
    final event without one, as before. Same tokens either way, and the orchestrator's reader
    (RemoteRounds, which asks for it) streams them all."""
    rounds, draft_address = stack
    rounds.configure(draft_address, 4, 8, TIMEOUT)
    prompt = list(_prompts(1)[0])
    runs = {}
    for flag in (False, True):
        events = list(rounds.target.stub.Decode(tpb.DecodeRequest(
            request_id=f"cif-{flag}", prompt=prompt, max_tokens=24, ignore_eos=True, k=3, chunk_in_final=flag),
            timeout=TIMEOUT))
        *chunks, last = events
        assert all(e.WhichOneof("event") == "chunk" for e in chunks) and last.WhichOneof("event") == "final"
        streamed = [t for e in chunks for t in e.chunk.tokens]
        if flag:
            (tail,) = last.final.last_chunks
            assert tail.tokens and tail.timing.round == tail.round > chunks[-1].chunk.round
            streamed += list(tail.tokens)
        else:
            assert not last.final.last_chunks
        assert streamed == list(last.final.output)
        runs[flag] = (len(events), streamed)
    assert runs[True][1] == runs[False][1] and runs[True][0] == runs[False][0] - 1
    # stream_interval=5: the prefill's token at once, then messages of 5 tokens or more (several
    # rounds in a DecodeChunks), the rest on the final event; every round once, in order.
    *msgs, final = list(rounds.target.stub.Decode(tpb.DecodeRequest(
        request_id="cif-interval", prompt=prompt, max_tokens=24, ignore_eos=True, k=3, chunk_in_final=True,
        stream_interval=5), timeout=TIMEOUT))
    parts = [[m.chunk] if m.WhichOneof("event") == "chunk" else list(m.chunks.chunks) for m in msgs]
    parts.append(list(final.final.last_chunks))
    assert len(parts[0]) == 1 and len(parts[0][0].tokens) == 1 and not parts[0][0].HasField("timing")
    assert all(sum(len(c.tokens) for c in p) >= 5 for p in parts[1:-1]) and any(len(p) > 1 for p in parts)
    rounds_seen = [c.round for p in parts[1:] for c in p]
    assert rounds_seen == sorted(set(rounds_seen)) and all(c.timing.round == c.round for p in parts[1:] for c in p)
    assert [t for p in parts for c in p for t in c.tokens] == list(final.final.output) == runs[True][1]
    ((tokens, final),) = _generate(rounds, [tuple(prompt)], 3, max_tokens=24)
    assert isinstance(final, FinalEvent) and tokens == list(final.output) == runs[True][1]


def test_decode_and_control_refuse_bad_input_naming_the_field(stack):
    rounds, _ = stack
    stub = rounds.target.stub
    bad = [(dict(request_id="", prompt=[1], max_tokens=4), "request_id"),
           (dict(request_id="a", prompt=[], max_tokens=4), "prompt"),
           (dict(request_id="a", prompt=[1], max_tokens=0), "max_tokens"),
           (dict(request_id="a", prompt=[1], max_tokens=4, k=9), "k"),
           (dict(request_id="a", prompt=[1], max_tokens=4, stream_interval=-2), "stream_interval"),
           (dict(request_id="a", prompt=[99999], max_tokens=4), "prompt"),
           (dict(request_id="a", prompt=[1], max_tokens=4, resume_output=[1, 2, 3, 4]), "resume_output"),
           # Called directly, the target refuses a prompt past the model's positions (both numbers named).
           (dict(request_id="a", prompt=[65] * 2049, max_tokens=4), "2049 tokens exceeds the model's "
                                                                     "max_position_embeddings=2048")]
    for fields, name in bad:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Decode(tpb.DecodeRequest(**fields), timeout=TIMEOUT))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in info.value.details(), fields
    admin = [("authorization", f"Bearer {process_token()}")]
    with pytest.raises(grpc.RpcError) as info:
        stub.ControlRounds(tpb.ControlRoundsRequest(), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED          # admin RPC: no token, no answer
    with pytest.raises(grpc.RpcError) as info:
        stub.ControlRounds(tpb.ControlRoundsRequest(), timeout=TIMEOUT, metadata=admin)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "action" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.ControlRounds(tpb.ControlRoundsRequest(action=tpb.ROUNDS_ACTION_CONFIGURE, max_batch=5000),
                           timeout=TIMEOUT, metadata=admin)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_batch" in info.value.details()
    # A full queue is RESOURCE_EXHAUSTED as the request's first event.
    rounds.configure("", 1, 0, TIMEOUT)
    try:
        first = rounds.submit(GenerationRequest("long", _prompts(1)[0], SamplingParams(max_tokens=200,
                                                                                      ignore_eos=True), 0))
        assert isinstance(first.next_event(TIMEOUT), TokensEvent)
        second = rounds.submit(GenerationRequest("second", (1, 2), SamplingParams(max_tokens=4), 0))
        ev = second.next_event(TIMEOUT)
        assert isinstance(ev, ErrorEvent) and ev.code == "RESOURCE_EXHAUSTED"
        first.cancel()
        assert isinstance(first.next_event(TIMEOUT), FinalEvent)
    finally:
        rounds.configure("", 4, 8, TIMEOUT)


def test_micro_batches_over_grpc_are_exact(stack):
    """Two micro-batches through the services: the draft drafts one over its persistent stream
    while the target verifies the other; greedy output equals target-only."""
    from target_service import server as target_server

    _, draft_address = stack
    target = target_server.start(_cfg("target", micro_batches=True))
    client = TargetClient(f"127.0.0.1:{target.port}", timeout_s=TIMEOUT, max_message_bytes=1 << 26,
                          admin_token=process_token())
    rounds = RemoteRounds(client, control_timeout_s=TIMEOUT)
    try:
        prompts = _prompts(4)
        rounds.configure("", 4, 8, TIMEOUT)
        ref = _generate(rounds, prompts, 3)
        assert rounds.configure(draft_address, 4, 8, TIMEOUT).speculation_available
        frames = _draft_status(draft_address).data_plane_frames
        got = _generate(rounds, prompts, 3)
        for (tokens, final), (ref_tokens, _) in zip(got, ref):
            assert isinstance(final, FinalEvent) and tokens == ref_tokens and final.stats.drafted > 0
        assert rounds.status().active_requests == 0
        assert _draft_status(draft_address).data_plane_frames > frames
    finally:
        rounds.stop()
        client.close()
        target.stop(grace=None)


def test_a_draft_without_a_data_plane_serves_the_rounds_over_the_grpc_stream(stack):
    """data_plane_port=-1: the draft advertises no data plane (port 0 in its status), the round
    loop keeps Propose on the gRPC stream, and greedy output still equals target-only."""
    from draft_service import server as draft_server

    rounds, _ = stack
    draft = draft_server.start(_cfg("draft", data_plane_port=-1))
    address = f"127.0.0.1:{draft.port}"
    try:
        assert _draft_status(address).data_plane_port == 0
        prompts = _prompts(2)
        rounds.configure("", 4, 8, TIMEOUT)
        ref = _generate(rounds, prompts, 3)
        assert rounds.configure(address, 4, 8, TIMEOUT).speculation_available
        got = _generate(rounds, prompts, 3)
        for (tokens, final), (ref_tokens, _) in zip(got, ref):
            assert isinstance(final, FinalEvent) and tokens == ref_tokens and final.stats.drafted > 0
        st = _draft_status(address)
        assert st.data_plane_port == 0 and st.data_plane_frames == 0
    finally:
        rounds.configure("", 4, 8, TIMEOUT)
        draft.stop(grace=None)


def test_drain_needs_a_policy_and_resume_all_reopens_admission(stack):
    rounds, _ = stack
    with pytest.raises(RequestError) as info:
        rounds.control(tpb.ROUNDS_ACTION_DRAIN, TIMEOUT)
    assert info.value.code == "INVALID_ARGUMENT" and "drain" in info.value.message
    resp = rounds.drain("wait", 5.0, timeout=TIMEOUT)
    assert resp.count == 0 and resp.status.admission_paused
    resp = rounds.resume_all(None, timeout=TIMEOUT)
    assert not resp.status.admission_paused


def _stream_requests(q):
    """A DecodeStream request iterator fed from ``q`` (None: half-close)."""
    while (msg := q.get(timeout=TIMEOUT)) is not None:
        yield msg


def test_decode_stream_batches_requests_refuses_bad_joins_and_cancels(stack):
    """DecodeStream: several requests on one stream give the tokens one Decode call each gives;
    a round's events of all of them come in one message; a bad join and a duplicate id get their
    error event while the others go on; a cancel ends one request; after the caller half-closes,
    the stream ends with its last request."""
    import queue

    rounds, draft_address = stack
    rounds.configure(draft_address, 4, 8, TIMEOUT)
    stub, prompts = rounds.target.stub, _prompts(3)
    join = {f"s{i}": dict(request_id=f"s{i}", prompt=list(p), max_tokens=24, ignore_eos=True, k=3)
            for i, p in enumerate(prompts)}
    ref = {rid: [t for ev in stub.Decode(tpb.DecodeRequest(**f), timeout=TIMEOUT) if ev.WhichOneof("event") == "chunk"
                 for t in ev.chunk.tokens] for rid, f in join.items()}
    q: queue.Queue = queue.Queue()
    rounds.pause_admission()                      # all three join at one boundary; s0 is still queued below
    try:
        for f in join.values():
            q.put(tpb.DecodeStreamRequest(join=tpb.DecodeRequest(**f)))
        q.put(tpb.DecodeStreamRequest(join=tpb.DecodeRequest(**join["s0"])))                     # duplicate
        q.put(tpb.DecodeStreamRequest(join=tpb.DecodeRequest(**{**join["s1"], "request_id": "bad", "k": 9})))
        q.put(tpb.DecodeStreamRequest(join=tpb.DecodeRequest(**{**join["s2"], "request_id": "long",
                                                                  "max_tokens": 400})))
        responses = stub.DecodeStream(_stream_requests(q), timeout=TIMEOUT)
        got: dict[str, list] = {}
        per_message: list[set] = []
        resumed = cancelled = False
        refused: set[tuple[str, int]] = set()            # (request id, index of its event)
        for resp in responses:
            per_message.append({e.request_id for e in resp.events})
            for e in resp.events:
                if e.join_refused:
                    refused.add((e.request_id, len(got.get(e.request_id, []))))
                got.setdefault(e.request_id, []).append(e.event)
            if not resumed and "bad" in got and len(got.get("s0", [])) == 1:
                rounds.resume_admission()             # both refusals are in: let the batch run
                resumed = True
            if not cancelled and len(got.get("long", [])) >= 3:
                q.put(tpb.DecodeStreamRequest(cancel_request_id="long"))
                q.put(None)                           # half-close: the stream ends after the last request
                cancelled = True
    finally:
        rounds.resume_admission()
    dup, = got["s0"][:1]
    assert dup.WhichOneof("event") == "error" and dup.error.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert refused == {("s0", 0), ("bad", 0)}            # the refusals say so; s0's own events do not
    assert "already running" in dup.error.error.message
    bad, = got["bad"]
    assert bad.WhichOneof("event") == "error" and "k: 9" in bad.error.error.message
    for rid in join:
        evs = got[rid][1:] if rid == "s0" else got[rid]
        tokens = [t for ev in evs if ev.WhichOneof("event") == "chunk" for t in ev.chunk.tokens]
        final = evs[-1].final
        tokens += [t for c in final.last_chunks for t in c.tokens]
        assert evs[-1].WhichOneof("event") == "final" and final.finish_reason == "length" and tokens == ref[rid], rid
    assert got["long"][-1].final.finish_reason == "cancelled"
    # The rounds' events went out together: messages carried several requests each.
    assert max(len(m) for m in per_message) >= 3, per_message
    assert rounds.status().active_requests == 0


@pytest.fixture(scope="module")
def adaptive_stack():
    yield from _services(adaptive_k=True)              # spec.watch_probes on by default


DRAFT_COST = 20e-3      # seconds a Propose costs in the watch test (a remote draft's round trip, above the CPU's noise)


def test_watch_probes_over_grpc_change_no_token(adaptive_stack, monkeypatch):
    """Adaptive k's watch probes through the services: on prompts of random bytes drafting soon stops
    paying and the loop watches instead (the draft drafts beside a target-only step, over the same
    Propose stream, and nothing of it is verified); every token equals target-only's, the final
    stats count the watches, and the draft's caches follow (no request fails a later Propose).

    Each Propose costs ``DRAFT_COST`` more here: on this tiny model a drafting round costs about a
    target-only one on a loaded 2-core CPU, and drafting on then rightly never stops (no watch)."""
    from draft_service.worker import DraftWorker

    propose = DraftWorker.propose

    def dear_propose(self, items, round_=0, inline=None):
        time.sleep(DRAFT_COST)              # the draft's cost, not a wait on anything
        return propose(self, items, round_, inline=inline)

    monkeypatch.setattr(DraftWorker, "propose", dear_propose)
    rounds, draft_address = adaptive_stack
    rng = np.random.default_rng(5)
    prompts = [tuple(int(t) for t in rng.integers(32, 256, 40)) for _ in range(3)]
    rounds.configure("", 4, 8, TIMEOUT)                                # no draft: target-only
    ref = _generate(rounds, prompts, 3, max_tokens=64)
    rounds.configure(draft_address, 4, 8, TIMEOUT)
    got = [_generate(rounds, [p], 3, max_tokens=64)[0] for p in prompts]       # one at a time: batch 1
    for (tokens, final), (ref_tokens, _) in zip(got, ref):
        assert isinstance(final, FinalEvent) and tokens == ref_tokens
    assert sum(f.stats.watch_probes for _, f in got) > 0
    assert rounds.status().active_requests == 0


def test_fixed_k_requests_draft_every_round_where_the_loop_adapts(adaptive_stack):
    """A request with fixed_k (DecodeRequest.fixed_k) on a loop that adapts k drafts its k every
    round; same tokens as an adaptive request on the same prompt. Whether that adaptive request
    stops drafting here depends on this CPU's timing and on what the loop learned from the tests
    before (run alone, or on a loaded machine, it kept drafting): the contrast is
    tests/unit/test_scheduler.py's, with drafts that never pass."""
    rounds, draft_address = adaptive_stack
    rng = np.random.default_rng(7)
    prompts = [tuple(int(t) for t in rng.integers(32, 256, 40)) for _ in range(2)]
    rounds.configure(draft_address, 4, 8, TIMEOUT)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    for i, p in enumerate(prompts):
        adaptive = _drain(rounds.submit(GenerationRequest(f"ad-{i}", p, params, 3)))
        fixed = _drain(rounds.submit(GenerationRequest(f"fx-{i}", p, params, 3, fixed_k=True)))
        assert fixed[0] == adaptive[0]
        stats = fixed[1].stats
        # Every round drafts but a last one with a single token left (k is capped by what remains).
        assert stats.spec_rounds >= stats.rounds - 1 and stats.watch_probes == 0, stats
    assert rounds.status().active_requests == 0
