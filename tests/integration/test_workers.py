"""Draft and target services over real gRPC on 127.0.0.1 (port 0): lifecycle, validation, parity.

Every stub call carries a deadline (``TIMEOUT``). Servers run the tiny random
model from ``tests/conftest.py`` on CPU, where graph capture uses the
registry's eager stand-in (same bookkeeping as on a GPU).
"""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from runtime.backends import make_ops
from core.config import SecurityConfig, ServerConfig
from core.params import SamplingParams
from runtime.config import CacheConfig, RuntimeConfig
from runtime.draft_engine import DraftEngine
from runtime.graphs import GraphRegistry
from runtime.target_engine import TargetEngine
from runtime.types import DraftPrefillRequest, PrefillRequest, ProposeRequest, VerifyRequest
from runtime.weights import check_draft, check_target, read_arrays, resolve_draft_path, to_device
from core import wire
from core.serving import admin_metadata
from tests.integration.hardening_utils import make_cert
from specsplit.v1 import common_pb2 as pb
from specsplit.v1 import draft_pb2 as dpb
from specsplit.v1 import target_pb2 as tpb
from tests.conftest import TIMEOUT, write_tiny_model

pytestmark = pytest.mark.integration

INVALID, EXHAUSTED, PRECONDITION = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    grpc.StatusCode.FAILED_PRECONDITION)
V, D, MAX_K, MAX_LEN, SLOTS = 64, 64, 3, 64, 4


# --- helpers ------------------------------------------------------------------------------


def status(w) -> pb.WorkerStatus:
    return w.stub.GetStatus(pb.GetStatusRequest(), timeout=TIMEOUT).status


def health(w, service: str = "") -> int:
    return w.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT).status


def aborts(fn, code: grpc.StatusCode, match: str = "") -> str:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == code, info.value.details()
    assert match in (info.value.details() or ""), info.value.details()
    return info.value.details()


def item_code(result) -> grpc.StatusCode | None:
    if not result.HasField("error"):
        return None
    return next(c for c in grpc.StatusCode if c.value[0] == result.error.code)


def target_prefill(w, *items: tpb.TargetPrefillItem) -> list[tpb.TargetPrefillResult]:
    return list(w.stub.Prefill(tpb.TargetPrefillRequest(items=list(items)), timeout=TIMEOUT).results)


def prompt_item(rid: str, prompt, **kw) -> tpb.TargetPrefillItem:
    return tpb.TargetPrefillItem(request_id=rid, prompt=list(prompt), **kw)


def verify(w, *batches: list[tpb.VerifyItem]) -> list[tpb.VerifyResponse]:
    """One Verify stream carrying one message per batch; returns the responses in order."""
    msgs = [tpb.VerifyRequest(round=r + 1, items=b) for r, b in enumerate(batches)]
    return list(w.stub.Verify(iter(msgs), timeout=TIMEOUT))


def propose(w, *batches: list[dpb.ProposeItem]) -> list[dpb.ProposeResponse]:
    msgs = [dpb.ProposeRequest(round=r + 1, items=b) for r, b in enumerate(batches)]
    return list(w.stub.Propose(iter(msgs), timeout=TIMEOUT))


def hidden_tensor(rows: int, width: int = D, seed: int = 0) -> pb.Tensor:
    return wire.encode_tensor(np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32))


def draft_prefill(w, rid: str, tokens, seed: int = 0, **kw) -> dpb.DraftPrefillResult:
    item = dpb.DraftPrefillItem(request_id=rid, tokens=list(tokens), hidden=hidden_tensor(len(tokens), seed=seed), **kw)
    return w.stub.Prefill(dpb.DraftPrefillRequest(items=[item]), timeout=TIMEOUT).results[0]


# --- lifecycle order --------------------------------------------------------------------


def test_out_of_order_calls_on_empty_worker_change_nothing(worker_server):
    t = worker_server("target", load=False)
    before = status(t)
    assert before.state == pb.LIFECYCLE_STATE_EMPTY and health(t) == health_pb2.HealthCheckResponse.NOT_SERVING
    aborts(lambda: t.stub.CaptureGraphs(pb.CaptureGraphsRequest(), timeout=TIMEOUT), PRECONDITION, "LoadWeights first")
    aborts(lambda: target_prefill(t, prompt_item("a", [1, 2])), PRECONDITION, "state EMPTY")
    (resp,) = verify(t, [tpb.VerifyItem(request_id="a", drafts=[1])])       # stream answers, per item
    assert item_code(resp.results[0]) == PRECONDITION
    # Idempotent no-ops on EMPTY.
    t.stub.ReleaseWeights(pb.ReleaseWeightsRequest(), timeout=TIMEOUT)
    t.stub.ClearGraphs(pb.ClearGraphsRequest(), timeout=TIMEOUT)
    assert t.stub.Release(pb.ReleaseRequest(request_ids=["a"]), timeout=TIMEOUT).released == []
    assert status(t) == before

    d = worker_server("draft", load=False)
    aborts(lambda: draft_prefill(d, "a", [1, 2]), PRECONDITION)
    (resp,) = propose(d, [dpb.ProposeItem(request_id="a", tokens=[1], hidden=hidden_tensor(1), k=1)])
    assert item_code(resp.results[0]) == PRECONDITION and "LoadWeights" in resp.results[0].error.message
    assert status(d).state == pb.LIFECYCLE_STATE_EMPTY and list(status(d).lifecycle_events) == []


def test_release_weights_while_ready_is_refused_and_changes_nothing(worker_server):
    d = worker_server("draft")
    d.stub.CaptureGraphs(pb.CaptureGraphsRequest(), timeout=TIMEOUT)
    before = status(d)
    assert before.state == pb.LIFECYCLE_STATE_READY and before.graph_keys
    aborts(lambda: d.stub.ReleaseWeights(pb.ReleaseWeightsRequest(), timeout=TIMEOUT), PRECONDITION,
           "clear graphs first")
    aborts(lambda: d.stub.LoadWeights(pb.LoadWeightsRequest(target_path=d.worker.cfg.target_path), timeout=TIMEOUT),
           PRECONDITION, "in_place")
    after = status(d)
    assert after == before
    assert d.worker.engine is not None


def test_capture_clear_release_reload_cycle_and_teardown_order(worker_server):
    t = worker_server("target")
    assert health(t) == health(t, "specsplit.v1.TargetService") == health_pb2.HealthCheckResponse.SERVING
    s = t.stub.CaptureGraphs(pb.CaptureGraphsRequest(), timeout=TIMEOUT).status
    assert s.state == pb.LIFECYCLE_STATE_READY
    assert list(s.graph_keys) == [f"verify{w}@{b}" for w in (1, 4) for b in (1, 2, 4)]
    assert s.graphs_mode == "eager (cpu)"
    assert t.stub.CaptureGraphs(pb.CaptureGraphsRequest(), timeout=TIMEOUT).status == s        # idempotent

    target_prefill(t, prompt_item("a", [1, 2, 3]), prompt_item("b", [4]), prompt_item("c", [5, 6]))
    replays = status(t).graph_replays
    (resp,) = verify(t, [tpb.VerifyItem(request_id=r, drafts=[1, 2]) for r in "abc"])   # 3 rows -> bucket 4
    assert all(r.HasField("output") for r in resp.results) and resp.compute_seconds > 0
    assert status(t).graph_replays == replays + 1 and status(t).eager_runs == 0

    s = t.stub.ClearGraphs(pb.ClearGraphsRequest(), timeout=TIMEOUT).status
    assert s.state == pb.LIFECYCLE_STATE_LOADED and list(s.graph_keys) == []
    (resp,) = verify(t, [tpb.VerifyItem(request_id="a", drafts=[])])                   # LOADED serves eagerly
    assert resp.results[0].HasField("output") and status(t).eager_runs == 1

    s = t.stub.ReleaseWeights(pb.ReleaseWeightsRequest(), timeout=TIMEOUT).status
    assert s.state == pb.LIFECYCLE_STATE_EMPTY and s.weights_version == "" and s.free_slots == 0
    assert list(s.active_request_ids) == [] and s.vocab_size == 0
    assert health(t) == health(t, "specsplit.v1.TargetService") == health_pb2.HealthCheckResponse.NOT_SERVING
    assert list(s.lifecycle_events) == ["load_weights", "capture_graphs", "clear_graphs", "release_weights"]

    s = t.stub.LoadWeights(pb.LoadWeightsRequest(target_path=t.worker.cfg.target_path, version="v2"),
                           timeout=TIMEOUT).status
    assert s.state == pb.LIFECYCLE_STATE_LOADED and s.weights_version == "v2" and s.free_slots == SLOTS
    assert health(t) == health_pb2.HealthCheckResponse.SERVING
    assert target_prefill(t, prompt_item("a", [1]))[0].HasField("output")


def test_draft_teardown_clears_graphs_before_releasing_weights(worker_server):
    """Regression: the draft's graphs must be cleared before its weights are released (else a hang)."""
    d = worker_server("draft")
    d.stub.CaptureGraphs(pb.CaptureGraphsRequest(), timeout=TIMEOUT)
    kinds = ("catchup4", "catchup16", "substep", "propose1", "propose2", "propose3")
    assert sorted(status(d).graph_keys) == sorted(f"{k}@{b}" for k in kinds for b in (1, 2, 4))
    d.stub.ClearGraphs(pb.ClearGraphsRequest(), timeout=TIMEOUT)
    d.stub.ReleaseWeights(pb.ReleaseWeightsRequest(), timeout=TIMEOUT)
    events = list(status(d).lifecycle_events)
    assert events.index("clear_graphs") < events.index("release_weights")
    # Shutdown teardown keeps the order too.
    d.stub.LoadWeights(pb.LoadWeightsRequest(target_path=d.worker.cfg.target_path), timeout=TIMEOUT)
    d.stub.CaptureGraphs(pb.CaptureGraphsRequest(), timeout=TIMEOUT)
    d.worker.close()
    assert d.worker.lifecycle.event_names()[-2:] == ["clear_graphs", "release_weights"]


def test_get_status_does_not_wait_for_model_work(worker_server):
    t = worker_server("target")
    busy, release_busy = threading.Event(), threading.Event()
    # A long step occupies the worker's device thread.
    step = threading.Thread(target=lambda: t.worker.device.run(lambda: (busy.set(), release_busy.wait(10))),
                            daemon=True)
    step.start()
    assert busy.wait(5.0)
    try:
        done = threading.Event()
        result = {}
        threading.Thread(target=lambda: (result.update(s=status(t)), done.set()), daemon=True).start()
        assert done.wait(5.0), "GetStatus blocked behind model work"
    finally:
        release_busy.set()
        step.join(10)
    assert result["s"].state == pb.LIFECYCLE_STATE_LOADED


# --- bad input ----------------------------------------------------------------------------


def test_target_prefill_bad_items_get_clear_errors_and_good_items_run(worker_server):
    t = worker_server("target")
    target_prefill(t, prompt_item("dup", [1]))
    items = [
        prompt_item("empty", []),
        prompt_item("oov", [1, V]),
        prompt_item("long", [1] * MAX_LEN),
        prompt_item("dup", [1]),
        prompt_item("", [1]),
        prompt_item("params", [1], params=pb.SamplingParams(temperature=-1)),
        prompt_item("resume", [1], resume_token=-5),
        prompt_item("good", [1, 2, 3]),
    ]
    res = target_prefill(t, *items)
    expect = [(INVALID, "items[0].prompt"), (INVALID, "items[1].prompt[1]: token id 64"),
              (EXHAUSTED, "items[2].prompt"), (INVALID, "items[3].request_id: 'dup' is already active"),
              (INVALID, "items[4].request_id"), (INVALID, "items[5].params.temperature"),
              (INVALID, "items[6].resume_token"), (None, "")]
    for r, it, (code, match) in zip(res, items, expect):
        assert r.request_id == it.request_id and item_code(r) == code, (r, code)
        assert match in r.error.message
    assert res[-1].output.hidden.shape == [3, D]
    # Slots: 4 total, 'dup' and 'good' hold two; of three more, the last finds none.
    res = target_prefill(t, prompt_item("x", [1]), prompt_item("y", [1]), prompt_item("z", [1]))
    assert [item_code(r) for r in res] == [None, None, EXHAUSTED] and "no free KV cache slot" in res[2].error.message
    assert status(t).free_slots == 0
    # Duplicates inside one batch are refused (all copies), not half-run.
    t.stub.Release(pb.ReleaseRequest(request_ids=["x", "y"]), timeout=TIMEOUT)
    res = target_prefill(t, prompt_item("q", [1]), prompt_item("q", [2]))
    assert [item_code(r) for r in res] == [INVALID, INVALID] and "more than once" in res[0].error.message


def test_target_verify_bad_items_keep_the_stream_and_the_batch_alive(worker_server):
    t = worker_server("target", cache=CacheConfig(max_slots=8, max_len=MAX_LEN))
    target_prefill(t, *(prompt_item(r, [1, 2]) for r in "abcde"), prompt_item("long", [1] * (MAX_LEN - 3)))
    probs_bad_shape = wire.encode_tensor(np.full((2, V - 1), 1.0 / V, dtype=np.float32))
    probs_bad_bytes = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, V], data=b"\0" * 10)
    bad = [
        tpb.VerifyItem(request_id="nope", drafts=[1]),
        tpb.VerifyItem(request_id="a", drafts=[1, V + 5]),
        tpb.VerifyItem(request_id="b", drafts=[1] * (MAX_K + 1)),
        tpb.VerifyItem(request_id="c", drafts=[1, 2], draft_probs=probs_bad_shape),
        tpb.VerifyItem(request_id="d", drafts=[1], draft_probs=probs_bad_bytes),
        tpb.VerifyItem(request_id="long", drafts=[1, 2, 3]),
    ]
    good_after = [tpb.VerifyItem(request_id="a", drafts=[1]), tpb.VerifyItem(request_id="b", drafts=[])]
    r1, r2, r3 = verify(t, bad, bad[:1] + good_after, [tpb.VerifyItem(request_id="a"), tpb.VerifyItem(request_id="a")])
    expect = [(INVALID, "items[0].request_id: 'nope' is unknown"), (INVALID, "items[1].drafts[1]: token id 69"),
              (INVALID, "items[2].drafts: 4 drafts exceed max_k=3"), (INVALID, "items[3].draft_probs: shape [2, 63]"),
              (INVALID, "items[4].draft_probs: 10 bytes, expected 256"), (EXHAUSTED, "items[5]")]
    assert [r.request_id for r in r1.results] == [it.request_id for it in bad] and r1.round == 1
    for r, (code, match) in zip(r1.results, expect):
        assert item_code(r) == code and match in r.error.message, r
    assert [item_code(r) for r in r2.results] == [INVALID, None, None] and r2.round == 2
    assert r2.results[1].output.num_accepted in (0, 1) and len(r2.results[2].output.tokens) == 1
    assert [item_code(r) for r in r3.results] == [INVALID, INVALID]          # duplicate id in one batch
    assert "more than once" in r3.results[0].error.message
    # Nothing in the rejected items moved the cache state.
    assert set(status(t).active_request_ids) == {"a", "b", "c", "d", "e", "long"}


def test_whole_batch_failure_answers_every_item_and_the_stream_continues(worker_server, monkeypatch):
    t = worker_server("target")
    target_prefill(t, prompt_item("a", [1, 2]))
    real = t.worker.engine.verify
    calls = {"n": 0}

    def flaky(reqs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device error")
        return real(reqs)

    monkeypatch.setattr(t.worker.engine, "verify", flaky)
    r1, r2 = verify(t, [tpb.VerifyItem(request_id="a", drafts=[1]), tpb.VerifyItem(request_id="zz")],
                    [tpb.VerifyItem(request_id="a", drafts=[1])])
    assert [item_code(r) for r in r1.results] == [grpc.StatusCode.INTERNAL, INVALID]
    assert "simulated device error" in r1.results[0].error.message
    assert r2.results[0].HasField("output")


def test_draft_bad_items_get_clear_errors_and_good_items_run(worker_server):
    d = worker_server("draft")
    assert draft_prefill(d, "a", [1, 2, 3]).error.code == 0
    assert draft_prefill(d, "b", []).error.code == 0                     # one-token prompt: no pairs yet
    assert "already active" in draft_prefill(d, "a", [1]).error.message
    bad_hidden = dpb.DraftPrefillItem(request_id="h", tokens=[1, 2], hidden=hidden_tensor(3))
    oov = dpb.DraftPrefillItem(request_id="o", tokens=[1, -1], hidden=hidden_tensor(2))
    res = d.stub.Prefill(dpb.DraftPrefillRequest(items=[bad_hidden, oov]), timeout=TIMEOUT).results
    assert [item_code(r) for r in res] == [INVALID, INVALID]
    assert "items[0].hidden: shape [3, 64], expected [2, 64]" in res[0].error.message
    assert "items[1].tokens[1]: token id -1" in res[1].error.message

    def item(rid, start, tokens, k, hidden=None):
        return dpb.ProposeItem(request_id=rid, start_position=start, tokens=tokens, k=k,
                               hidden=hidden if hidden is not None else hidden_tensor(len(tokens), seed=1))

    bad = [
        item("nope", 0, [1], 1),
        item("a", 2, [1], 1),                                           # start_position mismatch (3 held)
        item("a", 3, [1], 0),
        item("a", 3, [1], MAX_K + 1),
        item("a", 3, [1], 1, hidden_tensor(1, width=D + 1)),
        item("a", 3, [1], 1, wire.encode_tensor(np.ones((1, D), dtype=np.int64))),
        item("a", 3, [1], 1, pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, D], data=b"\0" * 7)),
        item("a", 3, [V], 1),
        item("a", 3, [], 1),
        item("b", 0, [4], 2),                                           # the good one
    ]
    # One stream: each bad 'a' item in its own round (one id per batch), then a mixed batch.
    *singles, mixed = propose(d, *([b] for b in bad[:-1]), [bad[7], bad[-1]])
    expect = ["start_position: 2 != 3", "k: 0 is out of range [1, 3]", "k: 4", "hidden: shape [1, 65]",
              "hidden: dtype int64 is not allowed", "hidden: 7 bytes, expected 256", "tokens[0]: token id 64",
              "tokens: at least one"]
    assert "items[0].request_id: 'nope' is unknown" in singles[0].results[0].error.message
    for resp, match in zip(singles[1:], expect):
        assert item_code(resp.results[0]) == INVALID and f"items[0].{match}" in resp.results[0].error.message, resp
    assert [r.round for r in singles] == list(range(1, 10)) and mixed.round == 10
    assert item_code(mixed.results[0]) == INVALID and "items[0].tokens[0]" in mixed.results[0].error.message
    good = mixed.results[1]
    assert len(good.proposal.drafts) == 2 and not good.proposal.HasField("draft_probs")
    # The failed items did not move the request: the right start_position still works.
    (resp,) = propose(d, [item("a", 3, [1], 3), item("b", 1, [2, 3], 1)])
    assert [len(r.proposal.drafts) for r in resp.results] == [3, 1]


def test_draft_sampling_sends_q(worker_server):
    d = worker_server("draft")
    params = pb.SamplingParams(temperature=1.0, seed=3, draft_sampling=True)
    assert draft_prefill(d, "s", [1, 2], params=params).error.code == 0
    (resp,) = propose(d, [dpb.ProposeItem(request_id="s", start_position=2, tokens=[3], hidden=hidden_tensor(1), k=2)])
    q = wire.decode_tensor(resp.results[0].proposal.draft_probs, "q")
    assert q.shape == (2, V) and np.allclose(q.sum(-1), 1.0, atol=1e-5)


# --- parity with the in-process engines ------------------------------------------------------


def _target_engine(path: Path, backend: str) -> TargetEngine:
    ops = make_ops(RuntimeConfig(backend=backend))
    ck = check_target(path)
    return TargetEngine(ops, ck.cfg, to_device(ops, read_arrays(ck)), CacheConfig(SLOTS, MAX_LEN), MAX_K,
                        GraphRegistry(ops, (1, 2, 4)))


def _draft_engine(path: Path, backend: str) -> DraftEngine:
    ops = make_ops(RuntimeConfig(backend=backend))
    ck = check_draft(check_target(path), resolve_draft_path(path, None))
    return DraftEngine(ops, ck.cfg, to_device(ops, read_arrays(ck)), CacheConfig(SLOTS, MAX_LEN), MAX_K,
                       GraphRegistry(ops, (1, 2, 4)))


@pytest.mark.parametrize("backend,capture", [("paddle", False), ("paddle", True),
                                             pytest.param("torch", False, marks=pytest.mark.slow)])
def test_prefill_and_verify_match_the_in_process_engine(worker_server, tiny_model_dir, backend, capture):
    t = worker_server("target", backend=backend)
    if capture:
        t.stub.CaptureGraphs(pb.CaptureGraphsRequest(), timeout=TIMEOUT)
    ref = _target_engine(tiny_model_dir, backend)
    prompts = {"a": [5, 9, 2, 7], "b": [1], "c": [3, 3, 8]}
    res = target_prefill(t, *(prompt_item(r, p) for r, p in prompts.items()))
    want = ref.prefill([PrefillRequest(r, np.asarray(p), SamplingParams()) for r, p in prompts.items()])
    last = {}
    for got, exp in zip(res, want):
        assert got.output.first_token == exp.first_token
        np.testing.assert_allclose(wire.decode_tensor(got.output.hidden, "h"), exp.hidden, rtol=1e-5, atol=1e-5)
        last[exp.request_id] = exp.first_token
    rng = np.random.default_rng(0)
    for rnd in range(4):
        # Drafts: the target's own greedy continuation for 'a' (mostly accepted), random for the others.
        drafts = {"a": [], "b": rng.integers(0, V, size=2).tolist(), "c": rng.integers(0, V, size=3).tolist()}
        (resp,) = verify(t, [tpb.VerifyItem(request_id=r, drafts=dr) for r, dr in drafts.items()])
        exp = ref.verify([VerifyRequest(r, np.asarray(dr, dtype=np.int64), None) for r, dr in drafts.items()])
        for got, e in zip(resp.results, exp):
            assert (got.output.num_accepted, tuple(got.output.tokens)) == (e.num_accepted, e.tokens), rnd
            np.testing.assert_allclose(wire.decode_tensor(got.output.hidden, "h"), e.hidden, rtol=1e-5, atol=1e-5)
    assert status(t).graph_replays == (4 if capture else 0)


def test_propose_matches_the_in_process_draft_engine(worker_server, tiny_model_dir):
    d = worker_server("draft")
    ref = _draft_engine(tiny_model_dir, "paddle")
    rng = np.random.default_rng(1)
    h0 = rng.standard_normal((5, D)).astype(np.float32)
    d.stub.Prefill(dpb.DraftPrefillRequest(items=[dpb.DraftPrefillItem(
        request_id="a", tokens=[1, 2, 3, 4, 5], hidden=wire.encode_tensor(h0))]), timeout=TIMEOUT)
    ref.prefill([DraftPrefillRequest("a", np.arange(1, 6), h0, SamplingParams())])
    start = 5
    for rnd in range(3):
        m = rnd + 1
        h, toks = rng.standard_normal((m, D)).astype(np.float32), rng.integers(0, V, size=m)
        (resp,) = propose(d, [dpb.ProposeItem(request_id="a", start_position=start, tokens=toks.tolist(),
                                              hidden=wire.encode_tensor(h), k=3)])
        (exp,) = ref.propose([ProposeRequest("a", start, toks, h, 3)])
        assert list(resp.results[0].proposal.drafts) == exp.drafts.tolist()
        start += m


# --- weights ------------------------------------------------------------------------------


def test_in_place_load_keeps_graphs_and_addresses_and_bad_loads_change_nothing(worker_server, tiny_model_dir,
                                                                               tiny_model_cfg, tmp_path):
    other = write_tiny_model(tmp_path / "other", tiny_model_cfg, seed=10)
    t = worker_server("target")
    t.stub.CaptureGraphs(pb.CaptureGraphsRequest(), timeout=TIMEOUT)
    addresses = t.worker.registry.static_addresses()
    params = {k: t.worker.ops.data_ptr(v) for k, v in t.worker.engine.params.items()}
    before = status(t)

    # validate_only: nothing changes.
    t.stub.LoadWeights(pb.LoadWeightsRequest(target_path=str(other), validate_only=True), timeout=TIMEOUT)
    assert status(t) == before
    # Incompatible checkpoint in place: refused, nothing changes.
    wide = write_tiny_model(tmp_path / "wide", tiny_model_cfg.__class__(**{**tiny_model_cfg.__dict__, "vocab_size": 80}))
    aborts(lambda: t.stub.LoadWeights(pb.LoadWeightsRequest(target_path=str(wide), in_place=True), timeout=TIMEOUT),
           INVALID, "vocab_size")
    aborts(lambda: t.stub.LoadWeights(pb.LoadWeightsRequest(target_path=str(tmp_path / "missing"), in_place=True),
                                      timeout=TIMEOUT), INVALID)
    assert status(t) == before

    s = t.stub.LoadWeights(pb.LoadWeightsRequest(target_path=str(other), version="v9", in_place=True),
                           timeout=TIMEOUT).status
    assert s.state == pb.LIFECYCLE_STATE_READY and s.weights_version == "v9" and s.graph_keys == before.graph_keys
    assert list(s.lifecycle_events)[-1] == "load_weights_in_place"
    assert t.worker.registry.static_addresses() == addresses
    assert {k: t.worker.ops.data_ptr(v) for k, v in t.worker.engine.params.items()} == params
    # The graphs now compute with the new weights.
    ref = _target_engine(other, "paddle")
    got = target_prefill(t, prompt_item("a", [4, 5, 6]))[0]
    want = ref.prefill([PrefillRequest("a", np.asarray([4, 5, 6]), SamplingParams())])[0]
    assert got.output.first_token == want.first_token
    (resp,) = verify(t, [tpb.VerifyItem(request_id="a", drafts=[1, 2])])
    assert tuple(resp.results[0].output.tokens) == ref.verify([VerifyRequest("a", np.asarray([1, 2]), None)])[0].tokens


def test_checkpoint_paths_must_resolve_under_the_roots(worker_server, tiny_model_dir, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "escape").symlink_to(tiny_model_dir)               # a symlink out of the root
    inside = root / "model"
    inside.symlink_to(tiny_model_dir)  # also a symlink out, resolved: refused
    t = worker_server("target", load=False, security=SecurityConfig(checkpoint_roots=(str(root),)))
    for path in (str(tiny_model_dir), str(root / "escape"), str(root / ".." / tiny_model_dir.name)):
        aborts(lambda p=path: t.stub.LoadWeights(pb.LoadWeightsRequest(target_path=p), timeout=TIMEOUT),
               INVALID, "outside the allowed checkpoint roots")
    aborts(lambda: t.stub.LoadWeights(pb.LoadWeightsRequest(), timeout=TIMEOUT), INVALID, "target_path is required")
    assert status(t).state == pb.LIFECYCLE_STATE_EMPTY
    t2 = worker_server("draft", load=False, security=SecurityConfig(checkpoint_roots=(str(tiny_model_dir.parent),)))
    s = t2.stub.LoadWeights(pb.LoadWeightsRequest(target_path=str(tiny_model_dir)), timeout=TIMEOUT).status
    assert s.state == pb.LIFECYCLE_STATE_LOADED and s.weights_version == str(tiny_model_dir)


# --- slots, security, discovery --------------------------------------------------------------


def test_release_frees_slots(worker_server):
    t = worker_server("target")
    target_prefill(t, prompt_item("a", [1]), prompt_item("b", [2]))
    s = status(t)
    assert (s.free_slots, s.used_slots, sorted(s.active_request_ids)) == (SLOTS - 2, 2, ["a", "b"])
    resp = t.stub.Release(pb.ReleaseRequest(request_ids=["a", "ghost", "a"]), timeout=TIMEOUT)
    assert list(resp.released) == ["a"]
    s = status(t)
    assert (s.free_slots, s.used_slots, list(s.active_request_ids)) == (SLOTS - 1, 1, ["b"])
    (resp,) = verify(t, [tpb.VerifyItem(request_id="a")])
    assert item_code(resp.results[0]) == INVALID                                    # released means gone
    assert target_prefill(t, prompt_item("a", [3]))[0].HasField("output")           # and the id is reusable


def test_admin_rpcs_need_the_token(worker_server, capfd):
    token = "s3cret-token-value"
    d = worker_server("draft", security=SecurityConfig(admin_token=token))
    for call in (lambda md: d.stub.CaptureGraphs(pb.CaptureGraphsRequest(), timeout=TIMEOUT, metadata=md),
                 lambda md: d.stub.ClearGraphs(pb.ClearGraphsRequest(), timeout=TIMEOUT, metadata=md),
                 lambda md: d.stub.ReleaseWeights(pb.ReleaseWeightsRequest(), timeout=TIMEOUT, metadata=md),
                 lambda md: d.stub.LoadWeights(pb.LoadWeightsRequest(target_path="x"), timeout=TIMEOUT, metadata=md)):
        aborts(lambda: call(()), grpc.StatusCode.UNAUTHENTICATED, "admin RPC")
        aborts(lambda: call(admin_metadata("wrong")), grpc.StatusCode.UNAUTHENTICATED, "wrong")
        aborts(lambda: call((("authorization", token),)), grpc.StatusCode.UNAUTHENTICATED)  # no "Bearer "
    assert status(d).state == pb.LIFECYCLE_STATE_LOADED                     # non-admin RPCs need no token
    assert d.stub.CaptureGraphs(pb.CaptureGraphsRequest(), timeout=TIMEOUT,
                                metadata=admin_metadata(token)).status.state == pb.LIFECYCLE_STATE_READY
    out, err = capfd.readouterr()
    assert token not in out + err and "***" in out + err                    # logged config is redacted


def test_reflection_lists_the_services(worker_server):
    t = worker_server("target")
    stub = reflection_pb2_grpc.ServerReflectionStub(t.channel)
    (resp,) = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=TIMEOUT))
    names = {s.name for s in resp.list_services_response.service}
    assert {"specsplit.v1.TargetService", "grpc.health.v1.Health"} <= names


def test_status_reports_model_facts(worker_server):
    d = worker_server("draft")
    s = status(d)
    assert (s.role, s.backend, s.device, s.max_k, s.vocab_size, s.hidden_size, s.max_len) == \
           ("draft", "paddle", "cpu", MAX_K, V, D, MAX_LEN)
    assert s.weights_version == "v1" and not s.HasField("eos_token_id") and s.graphs_mode == "eager (cpu)"
    assert list(s.lifecycle_events) == ["load_weights"]


def test_capture_on_start(worker_server):
    t = worker_server("target", capture_on_start=True)
    s = status(t)
    assert s.state == pb.LIFECYCLE_STATE_READY and list(s.lifecycle_events) == ["load_weights", "capture_graphs"]
    assert health(t, "specsplit.v1.TargetService") == health_pb2.HealthCheckResponse.SERVING


def test_metrics_count_transitions_graph_steps_and_item_errors(worker_server):
    from prometheus_client import REGISTRY

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    t = worker_server("target", server=ServerConfig(host="127.0.0.1", port=0, metrics_port=0, max_workers=8))
    port = t.service.metrics_port
    assert port
    refused = sample("specsplit_target_lifecycle_transitions_total", action="release_weights", outcome="refused")
    replays = sample("specsplit_target_graph_steps_total", mode="replay")
    errors = sample("specsplit_target_item_errors_total", step="verify", code="INVALID_ARGUMENT")
    t.stub.CaptureGraphs(pb.CaptureGraphsRequest(), timeout=TIMEOUT)
    aborts(lambda: t.stub.ReleaseWeights(pb.ReleaseWeightsRequest(), timeout=TIMEOUT), PRECONDITION)
    target_prefill(t, prompt_item("a", [1]))
    verify(t, [tpb.VerifyItem(request_id="a", drafts=[2]), tpb.VerifyItem(request_id="nope")])
    assert sample("specsplit_target_lifecycle_transitions_total", action="release_weights",
                  outcome="refused") == refused + 1
    assert sample("specsplit_target_graph_steps_total", mode="replay") == replays + 1
    assert sample("specsplit_target_item_errors_total", step="verify", code="INVALID_ARGUMENT") == errors + 1
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT) as resp:
        text = resp.read().decode()
    assert "specsplit_target_compute_seconds_bucket" in text and "specsplit_target_free_slots" in text


def test_paddle_without_cuda_says_so(worker_server):
    import paddle

    if paddle.device.is_compiled_with_cuda():
        pytest.skip("this Paddle build has CUDA")
    d = worker_server("draft", runtime=RuntimeConfig(backend="paddle", device="cuda:0"))
    s = status(d)
    assert (s.device, s.graphs_mode) == ("cpu", "eager (paddle without CUDA)")


# --- TLS ----------------------------------------------------------------------------------


def test_tls_and_mutual_tls(worker_server, tmp_path):
    from grpc_health.v1 import health_pb2_grpc

    ca_key, ca_name, _, ca_pem = make_cert("specsplit-test-ca", ca=True)
    _, _, srv_key, srv_pem = make_cert("localhost", ca_key, ca_name)
    _, _, cli_key, cli_pem = make_cert("client", ca_key, ca_name)
    files = {}
    for name, data in (("ca.pem", ca_pem), ("srv.key", srv_key), ("srv.pem", srv_pem)):
        (tmp_path / name).write_bytes(data)
        files[name] = str(tmp_path / name)
    opts = (("grpc.ssl_target_name_override", "localhost"),)

    def health_over(port: int, creds: grpc.ChannelCredentials) -> int:
        with grpc.secure_channel(f"127.0.0.1:{port}", creds, options=opts) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status

    tls = worker_server("target", security=SecurityConfig(tls_cert=files["srv.pem"], tls_key=files["srv.key"]))
    assert health_over(tls.service.port, grpc.ssl_channel_credentials(ca_pem)) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError):                                  # plaintext to a TLS port fails
        with grpc.insecure_channel(f"127.0.0.1:{tls.service.port}") as ch:
            from specsplit.v1 import target_pb2_grpc
            target_pb2_grpc.TargetServiceStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5)

    mtls = worker_server("target", security=SecurityConfig(tls_cert=files["srv.pem"], tls_key=files["srv.key"],
                                                           tls_client_ca=files["ca.pem"]))
    with pytest.raises(grpc.RpcError):                                  # no client certificate
        health_over(mtls.service.port, grpc.ssl_channel_credentials(ca_pem))
    assert health_over(mtls.service.port, grpc.ssl_channel_credentials(ca_pem, cli_key, cli_pem)) == \
        health_pb2.HealthCheckResponse.SERVING
