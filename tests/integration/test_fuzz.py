"""Hypothesis-driven malformed and extreme input against every public and worker RPC.

One stack per module (Paddle draft and target services and the orchestrator,
all in this process on 127.0.0.1): ~1,100 generated cases over Generate,
GetStatus, ReloadWeights and PushWeights of the orchestrator and Prefill,
Verify / Propose streams, Release, GetStatus and the lifecycle RPCs of both
workers: random field values, huge sizes, wrong tensor dtypes / shapes /
bytes, unknown enum values, repeated and stale request ids, random tokens.

Bytes that do not decode at all (invalid UTF-8, truncated fields, bad wire types) on
every RPC of every service: tests/integration/test_fuzz_undecodable.py.

Every case must be answered with a clear status: a per-item error or a call
status from ``CLEAR`` — never UNKNOWN or INTERNAL (which would mean the server
tripped over the input). Meanwhile a healthy greedy stream runs through the
same services without pause and must keep producing the target-only tokens.
"""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from draft_service.server import start as start_draft
from orchestrator.client import SpecsplitClient
from orchestrator.server import create_server
from core.config import SecurityConfig, ServerConfig
from orchestrator.config import OrchestratorConfig
from runtime.config import CacheConfig, GraphConfig, RuntimeConfig, SpecConfig
from worker.config import WorkerConfig
from core.auth import admin_metadata
from specsplit.v1 import common_pb2 as pb
from specsplit.v1 import draft_pb2 as dpb
from specsplit.v1 import draft_pb2_grpc
from specsplit.v1 import orchestrator_pb2 as opb
from specsplit.v1 import orchestrator_pb2_grpc
from specsplit.v1 import target_pb2 as tpb
from specsplit.v1 import target_pb2_grpc
from target_service.server import start as start_target
from tests.integration.hardening_utils import Reference, make_model, prompt_of
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

TIMEOUT = 30.0
MAX_LEN, SLOTS, D, V = 256, 16, 32, 258
MAX_MESSAGE = 512 * 1024
MAX_TENSOR = 64 * 1024
TOKEN, GEN_TOKEN = "fuzz-admin-token", "fuzz-generate-token"
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED,
         grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE}
ITEM_CLEAR = {c.value[0] for c in CLEAR}
FUZZ = settings(deadline=None, database=None, derandomize=False, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


# --- the stack ------------------------------------------------------------------------------------------
def _worker_cfg(role: str, model: Path) -> WorkerConfig:
    return WorkerConfig(role=role, target_path=str(model), weights_version="v1", runtime=RuntimeConfig(backend="paddle"),
                        spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=SLOTS, max_len=MAX_LEN),
                        graphs=GraphConfig(batch_buckets=(1, 4, 16)),
                        server=ServerConfig(port=0, max_workers=16, max_message_bytes=MAX_MESSAGE),
                        security=SecurityConfig(admin_token=TOKEN, generate_token=GEN_TOKEN,
                                                checkpoint_roots=(str(model),), max_tensor_bytes=MAX_TENSOR))


class Stack:
    def __init__(self, model: Path) -> None:
        self.model = model
        self.target, self.draft = start_target(_worker_cfg("target", model)), start_draft(_worker_cfg("draft", model))
        cfg = OrchestratorConfig(draft_address=f"127.0.0.1:{self.draft.port}",
                                 target_address=f"127.0.0.1:{self.target.port}", max_batch=8, max_queue=64,
                                 max_tokens_limit=16, max_prompt_tokens=64, worker_timeout_s=TIMEOUT,
                                 worker_admin_token=TOKEN,
                                 server=ServerConfig(port=0, max_workers=64, max_message_bytes=MAX_MESSAGE),
                                 security=SecurityConfig(admin_token=TOKEN, checkpoint_roots=(str(model),)))
        self.orch, port = create_server(cfg)
        self.channels = {name: grpc.insecure_channel(f"127.0.0.1:{p}") for name, p in
                         (("orch", port), ("target", self.target.port), ("draft", self.draft.port))}
        self.orch_stub = orchestrator_pb2_grpc.OrchestratorStub(self.channels["orch"])
        self.target_stub = target_pb2_grpc.TargetServiceStub(self.channels["target"])
        self.draft_stub = draft_pb2_grpc.DraftServiceStub(self.channels["draft"])
        self.client = SpecsplitClient(f"127.0.0.1:{port}", timeout=TIMEOUT)

    def close(self) -> None:
        self.client.close()
        for ch in self.channels.values():
            ch.close()
        self.orch.stop(0).wait(5)
        self.target.stop(grace=None)
        self.draft.stop(grace=None)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("fuzz_model"), MAX_LEN)


@pytest.fixture(scope="module")
def stack(model):
    s = Stack(model)
    yield s
    s.close()


class Healthy:
    """Greedy requests one after another through the orchestrator for as long as the module runs."""

    def __init__(self, stack: Stack, reference: Reference) -> None:
        self.stack, self.reference = stack, reference
        self.done, self.failures = 0, []
        self._stop = threading.Event()
        self.prompts = [prompt_of(100 + i, 3 + 7 * i) for i in range(4)]
        for p in self.prompts:                        # references first: no CPU contest later
            reference(p, 16)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            prompt = self.prompts[i % len(self.prompts)]
            try:
                res = self.stack.client.generate_text(prompt, 16, k=3, ignore_eos=True, request_id=f"healthy-{i}")
                if res.tokens != self.reference(prompt, 16):
                    self.failures.append(f"healthy-{i}: wrong tokens")
                self.done += 1
            except Exception as exc:  # noqa: BLE001 - reported by the last test
                self.failures.append(f"healthy-{i}: {exc}")
            i += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT)


@pytest.fixture(scope="module")
def healthy(stack, model):
    h = Healthy(stack, Reference(model, MAX_LEN))
    yield h
    h.stop()


# --- strategies --------------------------------------------------------------------------------------------
INT64 = st.integers(-2**63, 2**63 - 1)
INT32 = st.integers(-2**31, 2**31 - 1)
UINT64 = st.integers(0, 2**64 - 1)
F32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
TOKENS = st.one_of(st.integers(0, V - 1), st.integers(-3, V + 3), INT64)
GOOD_TOKENS = st.integers(0, V - 1)
# Request ids: a small pool (repeats, stale ids from earlier examples), empty, long, any text;
# never the healthy stream's ids.
IDS = st.one_of(st.sampled_from(["fz-a", "fz-b", "fz-c", "", "x" * 300]),
                st.text(max_size=40)).filter(lambda s: not s.startswith("healthy"))


@st.composite
def tensors(draw, rows: int | None = None, width: int = D) -> pb.Tensor:
    """Well-formed most of the time; otherwise a wrong dtype (unknown enum values too), shape or byte count."""
    kind = draw(st.sampled_from(["ok", "ok", "dtype", "shape", "bytes", "huge_shape", "nan", "empty", "big"]))
    r = rows if rows is not None else draw(st.integers(0, 4))
    arr = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).standard_normal((r, width)).astype(np.float32)
    t = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[r, width], data=arr.tobytes())
    if kind == "dtype":
        t.dtype = draw(st.one_of(st.sampled_from([0, 2, 3, 4, 5, 99]), INT32))
    elif kind == "shape":
        t.shape[:] = draw(st.lists(st.integers(-5, 70), max_size=10))
    elif kind == "bytes":
        t.data = draw(st.binary(max_size=300))
    elif kind == "huge_shape":
        t.shape[:] = [2**40, 2**40] if draw(st.booleans()) else [2**62, 4]
    elif kind == "nan":
        t.data = np.full((r, width), np.nan, np.float32).tobytes()
    elif kind == "empty":
        t = pb.Tensor()
    elif kind == "big":                              # over max_tensor_bytes, under the message limit
        n = MAX_TENSOR // (4 * width) + 8
        t = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[n, width], data=bytes(4 * width * n))
    return t


@st.composite
def sampling(draw) -> pb.SamplingParams:
    p = pb.SamplingParams(temperature=draw(st.one_of(st.just(0.0), F32)), top_k=draw(st.one_of(st.just(0), INT32)),
                          top_p=draw(st.one_of(st.just(0.0), F32)), draft_sampling=draw(st.booleans()))
    if draw(st.booleans()):
        p.seed = draw(UINT64)
    return p


@st.composite
def good_sampling(draw) -> pb.SamplingParams:
    p = pb.SamplingParams(temperature=draw(st.one_of(st.just(0.0), st.floats(0.05, 3.0))),
                          top_k=draw(st.integers(0, 40)), top_p=draw(st.one_of(st.just(0.0), st.floats(0.05, 1.0))),
                          draft_sampling=draw(st.booleans()))
    if draw(st.booleans()):
        p.seed = draw(UINT64)
    return p


@st.composite
def generate_requests(draw) -> opb.GenerateRequest:
    """Half of them plausible (they run), half anything (they are refused)."""
    if draw(st.booleans()):
        req = opb.GenerateRequest(request_id=draw(IDS), max_tokens=draw(st.integers(1, 16)),
                                  ignore_eos=draw(st.booleans()), sampling=draw(good_sampling()))
        if draw(st.booleans()):
            req.prompt = draw(st.text(min_size=1, max_size=20))
        else:
            req.prompt_token_ids.extend(draw(st.lists(GOOD_TOKENS, min_size=1, max_size=60)))
        if draw(st.booleans()):
            req.k = draw(st.integers(0, 3))
        req.stop_token_ids.extend(draw(st.lists(GOOD_TOKENS, max_size=3)))
        return req
    req = opb.GenerateRequest(request_id=draw(IDS), max_tokens=draw(st.one_of(st.integers(-2, 20), INT32)),
                              ignore_eos=draw(st.booleans()))
    which = draw(st.sampled_from(["text", "ids", "both", "none"]))
    if which in ("text", "both"):
        req.prompt = draw(st.text(min_size=0, max_size=80))
    if which in ("ids", "both"):
        req.prompt_token_ids.extend(draw(st.lists(TOKENS, max_size=80)))
    if draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling()))
    if draw(st.booleans()):
        req.k = draw(st.one_of(st.integers(-1, 5), INT32))
    req.stop_token_ids.extend(draw(st.lists(TOKENS, max_size=4)))
    return req


def target_prefill_items(draw) -> list[tpb.TargetPrefillItem]:
    items = []
    for _ in range(draw(st.integers(0, 5))):
        tokens = st.lists(GOOD_TOKENS, min_size=1, max_size=40) if draw(st.booleans()) else \
            st.lists(TOKENS, max_size=MAX_LEN + 10)
        it = tpb.TargetPrefillItem(request_id=draw(IDS), prompt=draw(tokens))
        if draw(st.booleans()):
            it.params.CopyFrom(draw(sampling()))
        if draw(st.booleans()):
            it.resume_token = draw(TOKENS)
        items.append(it)
    return items


# --- checks --------------------------------------------------------------------------------------------------
def call(fn, *args, **kw):
    """(response, None) or (None, status code); UNKNOWN / INTERNAL and unclear codes fail the test."""
    try:
        out = fn(*args, timeout=TIMEOUT, **kw)
    except grpc.RpcError as exc:
        event(f"call: {exc.code().name}")
        assert exc.code() in CLEAR, (exc.code(), exc.details())
        return None, exc.code()
    event("call: OK")
    return out, None


def check_items(results, items) -> None:
    assert [r.request_id for r in results] == [it.request_id for it in items]
    for r in results:
        if r.HasField("error"):
            event(f"item: code {r.error.code}")
            assert r.error.code in ITEM_CLEAR, (r.error.code, r.error.message)
            assert r.error.message
        else:
            event("item: OK")


def release(stub, items) -> None:
    ids = [it.request_id for it in items if it.request_id]
    if ids:
        stub.Release(pb.ReleaseRequest(request_ids=ids), timeout=TIMEOUT)


# --- the orchestrator's public RPCs ----------------------------------------------------------------------------
@settings(FUZZ, max_examples=330)
@given(req=generate_requests())
@example(req=opb.GenerateRequest(prompt="x" * (MAX_MESSAGE + 10), max_tokens=1))        # over the message limit
@example(req=opb.GenerateRequest(prompt_token_ids=[1] * 70_000, max_tokens=1))         # ~70k ids: under it, too long
@example(req=opb.GenerateRequest(prompt="ok", max_tokens=2**31 - 1))
def test_fuzz_generate(stack, healthy, req):
    responses, code = call(lambda r, timeout: list(stack.orch_stub.Generate(r, timeout=timeout)), req)
    if code is None:
        final = responses[-1]
        assert final.HasField("final"), "a stream that ends without error ends with a final message"
        tokens = [t for r in responses[:-1] for t in r.chunk.token_ids]
        assert 1 <= len(tokens) == final.final.usage.completion_tokens <= req.max_tokens
        assert all(0 <= t < V for t in tokens)
    elif len(req.prompt.encode()) > MAX_MESSAGE:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


@settings(FUZZ, max_examples=60)
@given(req=st.builds(opb.ReloadWeightsRequest, target_path=st.one_of(st.text(max_size=60),
                                                                     st.sampled_from(["..", "/etc", "/", "../../x"])),
                     draft_path=st.text(max_size=20), version=st.text(max_size=20),
                     mode=st.one_of(st.integers(0, 3), INT32), inflight=st.one_of(st.integers(0, 4), INT32)),
       token=st.sampled_from([None, "wrong", GEN_TOKEN, TOKEN]))
def test_fuzz_reload_and_status(stack, healthy, req, token):
    """ReloadWeights with random paths / unknown enum values (never a real checkpoint) and any token."""
    md = admin_metadata(token) or None
    _, code = call(lambda r, timeout: list(stack.orch_stub.ReloadWeights(r, timeout=timeout, metadata=md)), req)
    assert code is not None, "a random path never reloads"
    if token in (None, "wrong", GEN_TOKEN):
        assert code == grpc.StatusCode.UNAUTHENTICATED, code     # generate_token is a worker-side setting here
    status, code = call(stack.orch_stub.GetStatus, pb.GetStatusRequest())
    assert code is None and status.orchestrator.speculation_available


@settings(FUZZ, max_examples=40)
@given(parts=st.lists(st.sampled_from(["header", "chunk", "commit", "empty"]), max_size=5),
       name=st.text(max_size=20), data=st.binary(max_size=64), shape=st.lists(INT64, max_size=3),
       offset=INT64, cfg=st.text(max_size=30), token=st.sampled_from([None, TOKEN]))
def test_fuzz_push_weights(stack, healthy, parts, name, data, shape, offset, cfg, token):
    msgs = []
    for part in parts:
        if part == "header":
            msgs.append(opb.PushWeightsRequest(header=opb.PushWeightsHeader(version=name, target_config_json=cfg)))
        elif part == "chunk":
            msgs.append(opb.PushWeightsRequest(chunk=opb.TensorChunk(name=name, dtype=cfg, shape=shape, offset=offset,
                                                                    data=data)))
        elif part == "commit":
            msgs.append(opb.PushWeightsRequest(commit=opb.PushWeightsCommit(num_tensors=len(msgs))))
        else:
            msgs.append(opb.PushWeightsRequest())
    _, code = call(lambda it, timeout: stack.orch_stub.PushWeights(it, timeout=timeout,
                                                                  metadata=admin_metadata(token) or None), iter(msgs))
    assert code is not None                           # no staging root configured: never applied


# --- the target's RPCs -------------------------------------------------------------------------------------------
@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_fuzz_target_prefill_and_release(stack, healthy, data):
    items = target_prefill_items(data.draw)
    resp, code = call(stack.target_stub.Prefill, tpb.TargetPrefillRequest(items=items))
    try:
        if code is None:
            check_items(resp.results, items)
            for r, it in zip(resp.results, items):
                if r.HasField("output"):
                    assert list(r.output.hidden.shape) == [len(it.prompt), D] and 0 <= r.output.first_token < V
    finally:
        release(stack.target_stub, items)


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_fuzz_verify_stream(stack, healthy, data):
    draw = data.draw
    live = [tpb.TargetPrefillItem(request_id=rid, prompt=[256, 5, 9]) for rid in ("fz-v1", "fz-v2")]
    stack.target_stub.Prefill(tpb.TargetPrefillRequest(items=live), timeout=TIMEOUT)
    msgs = []
    for _ in range(draw(st.integers(1, 3))):
        items = []
        for _ in range(draw(st.integers(0, 4))):
            drafts = st.lists(GOOD_TOKENS, max_size=3) if draw(st.booleans()) else st.lists(TOKENS, max_size=5)
            it = tpb.VerifyItem(request_id=draw(st.one_of(st.sampled_from(["fz-v1", "fz-v2", "fz-gone"]), IDS)),
                                drafts=draw(drafts))
            if draw(st.booleans()):
                it.draft_probs.CopyFrom(draw(tensors(rows=len(it.drafts), width=V)))
            items.append(it)
        msgs.append(tpb.VerifyRequest(round=draw(UINT64), items=items))
    try:
        resps, code = call(lambda it, timeout: list(stack.target_stub.Verify(it, timeout=timeout)), iter(msgs))
        if code is None:
            assert [r.round for r in resps] == [m.round for m in msgs]
            for r, m in zip(resps, msgs):
                check_items(r.results, m.items)
    finally:
        release(stack.target_stub, live + [it for m in msgs for it in m.items])


# --- the draft's RPCs ---------------------------------------------------------------------------------------------
@settings(FUZZ, max_examples=120)
@given(data=st.data())
def test_fuzz_draft_prefill(stack, healthy, data):
    draw = data.draw
    items = []
    for _ in range(draw(st.integers(0, 4))):
        tokens = draw(st.lists(GOOD_TOKENS if draw(st.booleans()) else TOKENS, max_size=40))
        it = dpb.DraftPrefillItem(request_id=draw(IDS), tokens=tokens)
        if draw(st.booleans()):
            it.hidden.CopyFrom(draw(tensors(rows=len(tokens) if draw(st.booleans()) else None)))
        if draw(st.booleans()):
            it.params.CopyFrom(draw(sampling()))
        items.append(it)
    resp, code = call(stack.draft_stub.Prefill, dpb.DraftPrefillRequest(items=items))
    try:
        if code is None:
            check_items(resp.results, items)
    finally:
        release(stack.draft_stub, items)


def _hidden(rows: int) -> pb.Tensor:
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[rows, D], data=np.ones((rows, D), np.float32).tobytes())


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_fuzz_propose_stream(stack, healthy, data):
    draw = data.draw
    live = [dpb.DraftPrefillItem(request_id=rid, tokens=[5, 9], hidden=_hidden(2)) for rid in ("fz-p1", "fz-p2")]
    stack.draft_stub.Prefill(dpb.DraftPrefillRequest(items=live), timeout=TIMEOUT)
    msgs = []
    for _ in range(draw(st.integers(1, 3))):
        items = []
        for _ in range(draw(st.integers(0, 4))):
            if draw(st.booleans()):                   # plausible: the next round of a live request
                tokens = draw(st.lists(GOOD_TOKENS, min_size=1, max_size=3))
                items.append(dpb.ProposeItem(request_id=draw(st.sampled_from(["fz-p1", "fz-p2"])), start_position=2,
                                             tokens=tokens, hidden=_hidden(len(tokens)), k=draw(st.integers(1, 3))))
                continue
            tokens = draw(st.lists(TOKENS, max_size=6))
            items.append(dpb.ProposeItem(
                request_id=draw(st.one_of(st.sampled_from(["fz-p1", "fz-p2", "fz-gone"]), IDS)),
                start_position=draw(st.one_of(st.integers(0, 4), INT64)), tokens=tokens,
                hidden=draw(tensors(rows=len(tokens) if draw(st.booleans()) else None)),
                k=draw(st.one_of(st.integers(-1, 5), INT32))))
        msg = dpb.ProposeRequest(round=draw(UINT64), items=items)
        if items and draw(st.booleans()):             # the round's rows in one tensor (ProposeRequest.hidden_rows)
            rows = sum(len(it.tokens) for it in items if not it.ahead)
            msg.hidden_rows.CopyFrom(draw(tensors(rows=rows if draw(st.booleans()) else None)))
            for it in msg.items:
                it.ClearField("hidden")
        msgs.append(msg)
    try:
        resps, code = call(lambda it, timeout: list(stack.draft_stub.Propose(it, timeout=timeout)), iter(msgs))
        if code is None:
            assert [r.round for r in resps] == [m.round for m in msgs]
            for r, m in zip(resps, msgs):
                check_items(r.results, m.items)
                for res in r.results:
                    if res.HasField("proposal"):
                        assert all(0 <= t < V for t in res.proposal.drafts)
    finally:
        release(stack.draft_stub, live + [it for m in msgs for it in m.items])


# --- lifecycle and admin RPCs of both workers ----------------------------------------------------------------------
@settings(FUZZ, max_examples=140)
@given(role=st.sampled_from(["target", "draft"]),
       rpc=st.sampled_from(["LoadWeights", "ReleaseWeights", "CaptureGraphs", "ClearGraphs", "Release", "GetStatus"]),
       token=st.sampled_from([None, "wrong", GEN_TOKEN, TOKEN]),
       path=st.one_of(st.text(max_size=60), st.sampled_from(["..", "/", "/etc/passwd", "../../..", "\x00", "~"])),
       draft_path=st.text(max_size=30), version=st.text(max_size=30).filter(lambda v: v != "v1"), flags=st.tuples(st.booleans(), st.booleans()),
       ids=st.lists(IDS, max_size=4))
@example(role="target", rpc="LoadWeights", token=TOKEN, path="", draft_path="", version="", flags=(True, False), ids=[])
@example(role="draft", rpc="LoadWeights", token=TOKEN, path="", draft_path="", version="v0", flags=(False, True),
         ids=[])
def test_fuzz_worker_lifecycle_and_admin(stack, healthy, role, rpc, token, path, draft_path, version, flags, ids):
    stub = stack.target_stub if role == "target" else stack.draft_stub
    md = admin_metadata(token) or None
    if rpc == "ReleaseWeights" and token == TOKEN:
        token, md = "wrong", admin_metadata("wrong")  # a real release would stop the healthy stream
    requests = {"LoadWeights": pb.LoadWeightsRequest(target_path=path, draft_path=draft_path, version=version,
                                                     in_place=flags[0], validate_only=flags[1]),
                "ReleaseWeights": pb.ReleaseWeightsRequest(), "CaptureGraphs": pb.CaptureGraphsRequest(),
                "ClearGraphs": pb.ClearGraphsRequest(), "Release": pb.ReleaseRequest(request_ids=ids),
                "GetStatus": pb.GetStatusRequest()}
    resp, code = call(getattr(stub, rpc), requests[rpc], metadata=md)
    admin = rpc in ("LoadWeights", "ReleaseWeights", "CaptureGraphs", "ClearGraphs")
    if admin and token in (None, "wrong"):
        assert code == grpc.StatusCode.UNAUTHENTICATED
    elif admin and token == GEN_TOKEN:
        assert code == grpc.StatusCode.PERMISSION_DENIED
    elif rpc == "LoadWeights" and path == "" and version == "":
        pass                      # "reload the newest version loaded here" (a rollback): the same weights again
    elif rpc == "LoadWeights":
        # A random path is never the model directory (the only checkpoint under the roots).
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), code
    else:
        assert code is None
    st_resp = stub.GetStatus(pb.GetStatusRequest(), timeout=TIMEOUT).status
    assert st_resp.state in (pb.LIFECYCLE_STATE_LOADED, pb.LIFECYCLE_STATE_READY) and st_resp.weights_version == "v1"


# --- the healthy stream ------------------------------------------------------------------------------------------------
def test_zz_the_healthy_stream_stayed_correct_throughout(stack, healthy):
    """Runs last: the greedy stream that ran next to every fuzz case never failed or diverged."""
    assert healthy.done >= 1
    healthy.stop()
    assert healthy.failures == [], healthy.failures[:5]
    status = stack.client.status(timeout=TIMEOUT)
    assert status["orchestrator"]["speculation_available"]

    def leaked() -> list[str]:
        st = stack.client.status(timeout=TIMEOUT)
        return [i for i in st["target"]["active_request_ids"] + st["draft"]["active_request_ids"]
                if i.startswith("healthy")]
    # NOTE: the last request's final event can reach the client before the round loop has
    # released its slots (the draft's release rides on the loop's next boundary): waited for,
    # bounded, then nothing may be left.
    wait_until(lambda: not leaked(), "the healthy stream's slots to be released")
    assert leaked() == []
