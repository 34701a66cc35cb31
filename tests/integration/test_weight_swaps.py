"""Weight swaps owned by the worker over real gRPC: PrepareWeights, CommitWeights, AbortWeights.

- Prepare validates from the headers (read once per file for prepare + commit)
  and changes nothing live; every refusal names the field or the reason.
- A RECAPTURE commit runs clear -> [held] -> release -> load -> capture inside
  the worker, in the lifecycle's order; a hold answered "stop" (or a caller
  that leaves during it) puts the graphs back and keeps the old weights.
- IN_PLACE copies into the live tensors (graphs and addresses kept); a preload
  reads the tensors at prepare; AbortWeights drops what was staged.
- A commit of a version loaded before (not prepared) restores it: the rollback.
"""

from __future__ import annotations

import dataclasses
import queue
from pathlib import Path

import grpc
import numpy as np
import pytest

import runtime.checkpoint
from specsplit.v1 import common_pb2 as pb
from tests.conftest import TIMEOUT, write_tiny_model
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

RECAPTURE, IN_PLACE = pb.WEIGHTS_MODE_RECAPTURE, pb.WEIGHTS_MODE_IN_PLACE


@pytest.fixture(scope="module")
def model_b(tmp_path_factory, tiny_model_cfg) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("swap_b"), tiny_model_cfg, seed=7)


@pytest.fixture(scope="module")
def model_wide(tmp_path_factory, tiny_model_cfg) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("swap_wide"),
                            dataclasses.replace(tiny_model_cfg, intermediate_size=96), seed=3)


def prepare(w, path: Path, version: str, mode=RECAPTURE, **kw) -> pb.WorkerStatus:
    return w.stub.PrepareWeights(pb.PrepareWeightsRequest(target_path=str(path), version=version, mode=mode, **kw),
                                 timeout=TIMEOUT).status


HOLD_ALL = ["clear_graphs", "release", "load"]


def commit(w, version: str, mode=RECAPTURE, answers: list[bool] | None = None, capture: bool | None = None):
    """All events of one CommitWeights stream; with ``answers``, it holds after the clear, the
    release and the load, and each held event is answered from the list."""
    start = pb.CommitWeightsStart(version=version, mode=mode, hold_after=HOLD_ALL if answers is not None else [])
    if capture is not None:
        start.capture_graphs = capture
    requests: queue.SimpleQueue = queue.SimpleQueue()
    requests.put(pb.CommitWeightsRequest(start=start))

    def it():
        while (m := requests.get()) is not None:
            yield m
    events = []
    try:
        for ev in w.stub.CommitWeights(it(), timeout=TIMEOUT):
            events.append(ev)
            if ev.held:
                requests.put(pb.CommitWeightsRequest(resume=pb.CommitWeightsResume(proceed=answers.pop(0))))
    finally:
        requests.put(None)
    return events


def actions(w, since: int) -> list[str]:
    return [e.action for e in w.worker.lifecycle.events()[since:]]


def refused(fn, code: grpc.StatusCode, match: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == code and match in info.value.details(), (info.value.code(), info.value.details())


def params_of(w) -> dict[str, np.ndarray]:
    return {n: w.worker.ops.to_numpy(t).copy() for n, t in w.worker.engine.params.items()}


def test_prepare_refuses_with_the_reason_and_changes_nothing(worker_server, tiny_model_dir, model_wide, tmp_path):
    t = worker_server("target", capture_on_start=True)
    n = len(t.worker.lifecycle.events())
    inv, pre = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    refused(lambda: prepare(t, tiny_model_dir, ""), inv, "version: required")
    refused(lambda: prepare(t, tiny_model_dir, "v1"), inv, "'v1' is already serving on target")
    refused(lambda: prepare(t, tiny_model_dir, "v2", mode=pb.WEIGHTS_MODE_UNSPECIFIED), inv, "mode")
    refused(lambda: prepare(t, tmp_path / "nothing-here", "v2"), inv, "")
    refused(lambda: prepare(t, model_wide, "wide", mode=IN_PLACE), pre, "does not fit the target's running tensors")
    refused(lambda: commit(t, "never-prepared"), inv, "was not loaded here before")
    assert len(t.worker.lifecycle.events()) == n and t.worker.weights_version == "v1"
    empty = worker_server("draft", load=False)
    refused(lambda: prepare(empty, tiny_model_dir, "v1", mode=IN_PLACE), pre, "holds none (state EMPTY)")


@pytest.mark.parametrize("role", ["target", "draft"])
def test_recapture_commit_runs_in_order_inside_the_worker_and_reads_headers_once(worker_server, model_b, role,
                                                                                 monkeypatch):
    w = worker_server(role, capture_on_start=True)
    n = len(w.worker.lifecycle.events())
    indexed: list[str] = []
    real = runtime.checkpoint.index_checkpoint
    monkeypatch.setattr(runtime.checkpoint, "index_checkpoint", lambda p: (indexed.append(str(p)), real(p))[1])
    st = prepare(w, model_b, "B")
    assert st.state == pb.LIFECYCLE_STATE_READY and st.weights_version == "v1"      # nothing live changed
    events = commit(w, "B", answers=[True, True, True])
    assert [e.phase for e in events] == ["clear_graphs", "held", "release", "held", "load", "held", "capture",
                                         "done"]
    assert [e.after for e in events if e.held] == HOLD_ALL
    assert not any(e.HasField("error") for e in events)
    assert events[-1].status.state == pb.LIFECYCLE_STATE_READY and events[-1].status.weights_version == "B"
    assert actions(w, n) == ["clear_graphs", "release_weights", "load_weights", "capture_graphs"]
    # One header read per file for prepare + commit (the draft: target dir and its MTP file).
    assert len(indexed) == (1 if role == "target" else 2), indexed
    assert w.worker.swaps.staged_version == ""                                      # the commit took it


def test_a_hold_answered_stop_or_left_keeps_the_old_weights_and_puts_the_graphs_back(worker_server, model_b):
    t = worker_server("target", capture_on_start=True)
    before = params_of(t)
    prepare(t, model_b, "B")
    events = commit(t, "B", answers=[False])
    assert [e.phase for e in events] == ["clear_graphs", "held", "capture"]
    assert t.worker.weights_version == "v1" and t.worker.lifecycle.state.value == "READY"
    assert all(np.array_equal(before[n], v) for n, v in params_of(t).items())
    # Stopped after the release: no weights until a commit of the previous version.
    prepare(t, model_b, "B")
    events = commit(t, "B", answers=[True, False])
    assert [e.phase for e in events] == ["clear_graphs", "held", "release", "held"]
    assert t.worker.lifecycle.state.value == "EMPTY"
    assert [e.phase for e in commit(t, "v1", capture=True)] == ["load", "capture", "done"]
    assert all(np.array_equal(before[n], v) for n, v in params_of(t).items())
    # The caller goes away during the hold: the worker stops there too.
    prepare(t, model_b, "B")
    n = len(t.worker.lifecycle.events())
    requests: queue.SimpleQueue = queue.SimpleQueue()
    requests.put(pb.CommitWeightsRequest(start=pb.CommitWeightsStart(version="B", mode=RECAPTURE,
                                                                     hold_after=["clear_graphs"])))
    call = t.stub.CommitWeights(iter(requests.get, None), timeout=TIMEOUT)
    assert next(call).phase == "clear_graphs" and next(call).held
    call.cancel()
    wait_until(lambda: t.worker.lifecycle.state.value == "READY", "the graphs to be captured again")
    assert t.worker.weights_version == "v1"
    assert actions(t, n) == ["clear_graphs", "capture_graphs"]


def test_in_place_with_preload_keeps_addresses_and_abort_drops_the_staged_copy(worker_server, model_b,
                                                                               tiny_model_dir):
    t = worker_server("target", capture_on_start=True)
    ptrs = {n: t.worker.engine.params[n].data_ptr() for n in t.worker.engine.params} \
        if t.worker.ops.name == "torch" else None
    prepare(t, model_b, "B", mode=IN_PLACE, preload=True)
    assert t.worker.swaps._staged.arrays                                           # read at prepare
    dropped = t.stub.AbortWeights(pb.AbortWeightsRequest(version="B"), timeout=TIMEOUT)
    assert dropped.dropped and not t.stub.AbortWeights(pb.AbortWeightsRequest(), timeout=TIMEOUT).dropped
    refused(lambda: commit(t, "B", mode=IN_PLACE), grpc.StatusCode.INVALID_ARGUMENT, "was not loaded here before")
    n = len(t.worker.lifecycle.events())
    prepare(t, model_b, "B", mode=IN_PLACE, preload=True)
    refused(lambda: commit(t, "B", mode=RECAPTURE), grpc.StatusCode.INVALID_ARGUMENT, "prepared for IN_PLACE")
    prepare(t, model_b, "B", mode=IN_PLACE, preload=True)
    events = commit(t, "B", mode=IN_PLACE)
    assert [e.phase for e in events] == ["load", "done"] and events[-1].status.weights_version == "B"
    assert actions(t, n) == ["load_weights_in_place"] and t.worker.lifecycle.state.value == "READY"
    b = runtime.checkpoint.load_tensors(runtime.checkpoint.index_checkpoint(model_b),
                                        list(t.worker.engine.params), False)
    for name, arr in params_of(t).items():
        np.testing.assert_allclose(arr, b[name], rtol=0, atol=0, err_msg=name)
    if ptrs is not None:
        assert ptrs == {n: t.worker.engine.params[n].data_ptr() for n in t.worker.engine.params}


@pytest.mark.parametrize("backend", ["paddle", "torch"])
def test_a_commit_of_an_earlier_version_is_the_rollback(worker_server, model_b, tiny_model_dir, backend):
    t = worker_server("target", backend=backend, capture_on_start=True)
    a = params_of(t)
    prepare(t, model_b, "B")
    commit(t, "B")
    assert t.worker.weights_version == "B"
    events = commit(t, "v1", capture=True)                     # not prepared: from where v1 came from
    assert [e.phase for e in events] == ["clear_graphs", "release", "load", "capture", "done"]
    assert t.worker.weights_version == "v1" and all(np.array_equal(a[n], v) for n, v in params_of(t).items())
    # Serving it already: only the graphs are set as asked; nothing is reloaded.
    n = len(t.worker.lifecycle.events())
    assert [e.phase for e in commit(t, "v1", capture=False)] == ["clear_graphs", "done"]
    assert [e.phase for e in commit(t, "v1", capture=True)] == ["capture", "done"]
    assert actions(t, n) == ["clear_graphs", "capture_graphs"]
    # An empty version holds nothing afterwards (a worker that held nothing before a reload).
    assert [e.phase for e in commit(t, "")] == ["clear_graphs", "release", "done"]
    assert t.worker.lifecycle.state.value == "EMPTY"


def test_a_failed_phase_is_reported_on_the_stream_and_stops_there(worker_server, model_b):
    t = worker_server("target", capture_on_start=True)
    prepare(t, model_b, "B")

    def boom(*_a, **_k):
        del t.worker.__dict__["_install"]
        raise MemoryError("injected failure at load (out of memory)")
    t.worker._install = boom
    events = commit(t, "B")
    assert [e.phase for e in events] == ["clear_graphs", "release", "load"]
    assert events[-1].HasField("error") and "injected failure" in events[-1].error.message
    assert events[-1].status.state == pb.LIFECYCLE_STATE_EMPTY
    assert [e.phase for e in commit(t, "v1", capture=True)] == ["load", "capture", "done"]
    assert t.worker.weights_version == "v1"


def test_swap_rpcs_need_the_admin_token(worker_server, tiny_model_dir):
    t = worker_server("target")
    bare = grpc.insecure_channel(t.address)
    try:
        from specsplit.v1 import target_pb2_grpc
        stub = target_pb2_grpc.TargetServiceStub(bare)
        for call in (lambda: stub.PrepareWeights(pb.PrepareWeightsRequest(target_path=str(tiny_model_dir),
                                                                           version="x", mode=RECAPTURE),
                                                 timeout=TIMEOUT),
                     lambda: stub.AbortWeights(pb.AbortWeightsRequest(), timeout=TIMEOUT),
                     lambda: list(stub.CommitWeights(iter([pb.CommitWeightsRequest(
                         start=pb.CommitWeightsStart(version="v1", mode=RECAPTURE))]), timeout=TIMEOUT))):
            refused(call, grpc.StatusCode.UNAUTHENTICATED, "")
    finally:
        bare.close()
    assert t.worker.weights_version == "v1" and t.worker.swaps.staged_version == ""


def test_the_first_commit_message_must_be_start(worker_server):
    t = worker_server("target")
    refused(lambda: list(t.stub.CommitWeights(iter([pb.CommitWeightsRequest(
        resume=pb.CommitWeightsResume(proceed=True))]), timeout=TIMEOUT)), grpc.StatusCode.INVALID_ARGUMENT,
        "must be `start`")


def test_hold_is_only_for_recapture(worker_server, model_b):
    t = worker_server("target")
    prepare(t, model_b, "B", mode=IN_PLACE)
    refused(lambda: list(t.stub.CommitWeights(iter([pb.CommitWeightsRequest(start=pb.CommitWeightsStart(
        version="B", mode=IN_PLACE, hold_after=["clear_graphs"]))]), timeout=TIMEOUT)),
        grpc.StatusCode.INVALID_ARGUMENT, "hold_after")
    prepare(t, model_b, "B")
    refused(lambda: list(t.stub.CommitWeights(iter([pb.CommitWeightsRequest(start=pb.CommitWeightsStart(
        version="B", mode=RECAPTURE, hold_after=["capture"]))]), timeout=TIMEOUT)),
        grpc.StatusCode.INVALID_ARGUMENT, "are not among")
