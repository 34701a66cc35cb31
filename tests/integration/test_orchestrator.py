"""The orchestrator over real draft and target services on 127.0.0.1 (port 0).

Paddle workers run in this process (threads of their gRPC servers); the Torch
workers run in a subprocess (one framework per process). Every stub call has
a deadline and every wait is a bounded loop.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from draft_service.server import start as start_draft
from orchestrator.client import SpecsplitClient, SpecsplitError
from orchestrator.server import create_server
from rounds.draft_client import DraftClient
from rounds.worker_clients import TargetClient
from rounds.scheduler import WorkerUnavailable
from core.config import ServerConfig
from core.params import SamplingParams
from orchestrator.config import OrchestratorConfig
from runtime.config import CacheConfig, EngineConfig, GraphConfig, RuntimeConfig, SpecConfig
from worker.config import WorkerConfig
from runtime.engine import GenRequest, SpecEngine
from runtime.tokenizer import ByteTokenizer
from runtime.types import ProposeRequest
from specsplit.v1 import draft_pb2, draft_pb2_grpc
from target_service.server import start as start_target
from tests.byte_model import write_byte_model
from tests.waiting import wait_until
from tests.ports import free_port

pytestmark = pytest.mark.integration

TIMEOUT = 30.0                     # deadline of every call
MAX_LEN = 1024
MAX_TOKENS_LIMIT = 1000
REPO = Path(__file__).resolve().parents[2]


def make_tiny_model(path: Path, seed: int = 0) -> None:
    write_byte_model(path, seed, MAX_LEN)


def worker_cfg(role: str, model: Path, backend: str = "paddle") -> WorkerConfig:
    return WorkerConfig(role=role, target_path=str(model), weights_version="v1",
                        runtime=RuntimeConfig(backend=backend), spec=SpecConfig(max_k=3, default_k=3),
                        cache=CacheConfig(max_slots=24, max_len=MAX_LEN), graphs=GraphConfig(batch_buckets=(1, 4, 16)),
                        server=ServerConfig(port=0, max_workers=8))


def orch_cfg(target_port: int, draft_port: int | None, **kw) -> OrchestratorConfig:
    base = dict(draft_address=f"127.0.0.1:{draft_port}" if draft_port else None,
                target_address=f"127.0.0.1:{target_port}", default_k=3, max_k=3, max_batch=6, max_queue=32,
                max_tokens_limit=MAX_TOKENS_LIMIT, worker_timeout_s=TIMEOUT, server=ServerConfig(port=0))
    base.update(kw)
    return OrchestratorConfig(**base)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("orch_model")
    make_tiny_model(d)
    return d


@pytest.fixture(scope="module")
def workers(model_dir):
    target, draft = start_target(worker_cfg("target", model_dir)), start_draft(worker_cfg("draft", model_dir))
    yield target.port, draft.port
    target.stop(grace=None)
    draft.stop(grace=None)


@pytest.fixture(scope="module")
def orch(workers):
    server, port = create_server(orch_cfg(*workers, server=ServerConfig(port=0, metrics_port=0)))
    yield server, f"127.0.0.1:{port}"
    server.stop(0).wait(5)


@pytest.fixture(scope="module")
def client(orch):
    with SpecsplitClient(orch[1], timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def reference(model_dir):
    eng = SpecEngine(EngineConfig(target_path=str(model_dir), runtime=RuntimeConfig(backend="paddle"),
                                  spec=SpecConfig(max_k=3, default_k=0), cache=CacheConfig(max_slots=2, max_len=MAX_LEN)),
                     use_draft=False)
    memo: dict = {}

    def run(prompt, max_tokens: int) -> tuple[int, ...]:
        ids = tuple(ByteTokenizer().encode(prompt)) if isinstance(prompt, str) else tuple(prompt)
        key = (ids, max_tokens)
        if key not in memo:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            memo[key] = eng.generate([GenRequest("ref", ids, params, k=0)])[0].tokens
        return memo[key]
    return run


def prompt_of(i: int, n: int) -> list[int]:
    return [256, *(int(x) for x in np.random.default_rng(500 + i).integers(0, 256, n - 1))]


def slots_free(client: SpecsplitClient) -> bool:
    st = client.status()
    return (st["orchestrator"]["active_requests"] == 0 and st["target"]["used_slots"] == 0
            and st["draft"]["used_slots"] == 0)


def run_threads(fns, timeout: float = 120.0) -> list:
    """Run callables concurrently; return their results (exceptions re-raised)."""
    out: list = [None] * len(fns)

    def wrap(i, fn):
        try:
            out[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            out[i] = exc
    threads = [threading.Thread(target=wrap, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a client thread did not finish in time"
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


PROMPTS = ["Hello, speculative world!", prompt_of(0, 1), prompt_of(1, 9), prompt_of(2, 60)]


def check_greedy(client: SpecsplitClient, reference) -> None:
    for k in (1, 3):
        for i, prompt in enumerate(PROMPTS):
            max_tokens = 24 + 11 * i
            res = client.generate_text(prompt, max_tokens, k=k, ignore_eos=True)
            assert res.tokens == reference(prompt, max_tokens), (k, prompt)
            assert res.finish_reason == "length" and res.usage["completion_tokens"] == max_tokens
            assert res.drafted > 0 and 0 <= res.acceptance_rate <= 1 and len(res.per_position) == k


# --- exactness ---------------------------------------------------------------------------------
def test_greedy_through_services_equals_target_only_paddle(client, reference):
    check_greedy(client, reference)
    res = client.generate_text("Hi", 12, k=3, ignore_eos=True)
    assert res.text == ByteTokenizer().decode(list(res.tokens))
    # No wait: the last request's slots are free on both workers before its stream ends (CI once
    # saw the draft's deferred release arrive after the final chunk; rounds.scheduler._end).
    assert slots_free(client)


TORCH_WORKERS = r"""
import json, sys
from core.observability import configure_logging
configure_logging("torch-workers", "WARNING")      # logs to stderr; stdout carries only the ports
from core.config import ServerConfig
from runtime.config import CacheConfig, GraphConfig, RuntimeConfig, SpecConfig
from worker.config import WorkerConfig
from target_service.server import start as start_target
from draft_service.server import start as start_draft
def cfg(role):
    return WorkerConfig(role=role, target_path=sys.argv[1], weights_version="v1", runtime=RuntimeConfig(backend="torch"),
                        spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=24, max_len=int(sys.argv[2])),
                        graphs=GraphConfig(batch_buckets=(1, 4, 16)), server=ServerConfig(port=0, max_workers=8))
t, d = start_target(cfg("target")), start_draft(cfg("draft"))
print(json.dumps({"target": t.port, "draft": d.port}), flush=True)
sys.stdin.read()                                   # until the test closes our stdin
t.stop(grace=None)
d.stop(grace=None)
"""


@pytest.mark.slow
def test_greedy_through_services_equals_target_only_torch(model_dir, reference):
    """Torch workers (own process) against the Paddle target-only reference: same weights, same tokens."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", TORCH_WORKERS, str(model_dir), str(MAX_LEN)], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "torch workers did not start within 120s"
        ports = json.loads(proc.stdout.readline())
        server, port = create_server(orch_cfg(ports["target"], ports["draft"]))
        try:
            with SpecsplitClient(f"127.0.0.1:{port}", timeout=TIMEOUT) as c:
                assert c.status()["target"]["backend"] == "torch"
                check_greedy(c, reference)
        finally:
            server.stop(0).wait(5)
    finally:
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# --- continuous batching over the services ----------------------------------------------------
def _round_count(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=TIMEOUT).read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith('specsplit_round_seconds_count{part="total"}')]
    return float(lines[0].split()[-1]) if lines else 0.0            # no round observed yet: no sample


def test_stream_interval_sends_fewer_bigger_chunks_with_the_same_output(workers, client, reference):
    """``stream_interval``: the target holds chunks back until that many tokens are (the prefill's
    token goes at once, the last ones ride on the final event) and the orchestrator sends each
    message's rounds on as one chunk: the same tokens, text and stop-string cut as every-round
    streaming, fewer chunks, and every round still observed once in the metrics."""
    server, port = create_server(orch_cfg(*workers, stream_interval=6, server=ServerConfig(port=0, metrics_port=0)))
    try:
        with SpecsplitClient(f"127.0.0.1:{port}", timeout=TIMEOUT) as held:
            for prompt in PROMPTS[:3]:
                every = client.generate_text(prompt, 40, k=3, ignore_eos=True)
                before = _round_count(server.metrics_port)
                got = held.generate_text(prompt, 40, k=3, ignore_eos=True)
                assert got.tokens == every.tokens == reference(prompt, 40) and got.text == every.text
                assert _round_count(server.metrics_port) - before == got.rounds == every.rounds
                assert got.chunks < every.chunks
                sizes = [len(e.tokens) for e in held.generate(prompt, 40, k=3, ignore_eos=True)
                         if not e.final and e.tokens]          # (a text-only chunk ends a cut UTF-8 character)
                assert sum(sizes) == 40 and sizes[0] == 1 and all(n >= 6 for n in sizes[1:-1]), str(sizes)
                cut = every.text[len(every.text) // 2:len(every.text) // 2 + 2]
                a = client.generate_text(prompt, 40, k=3, ignore_eos=True, stop=[cut])
                b = held.generate_text(prompt, 40, k=3, ignore_eos=True, stop=[cut])
                assert (a.tokens, a.text, a.finish_reason) == (b.tokens, b.text, b.finish_reason)
                assert a.finish_reason == "stop" and cut not in a.text
        # A stop string cancels the request: the target frees it at its next round boundary.
        wait_until(lambda: slots_free(client), "all slots free after the stop strings")
    finally:
        server.stop(0).wait(5)


def test_wait_ready_connects_or_says_unavailable(orch):
    with SpecsplitClient(orch[1], timeout=TIMEOUT) as c:
        assert c.wait_ready() is c and c.status()["orchestrator"]["active_requests"] >= 0

    closed = free_port()                             # nothing listens there
    with SpecsplitClient(f"127.0.0.1:{closed}", timeout=TIMEOUT) as c:
        t0 = time.monotonic()
        with pytest.raises(SpecsplitError) as info:
            c.wait_ready(0.5)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 5.0


def test_16_concurrent_streams_join_and_leave(client, reference):
    specs = []
    for i in range(16):
        specs.append(dict(prompt=prompt_of(10 + i, 1 + (7 * i) % 45), max_tokens=[6, 70, 25, 120, 3, 40][i % 6],
                          temperature=0.0 if i % 2 == 0 else 0.9, seed=1000 + i, k=[0, 1, 3][i % 3]))

    def run(spec):
        chunks, final = [], None
        for ev in client.generate(spec["prompt"], spec["max_tokens"], temperature=spec["temperature"],
                                  seed=spec["seed"], k=spec["k"], ignore_eos=True):
            if ev.final:
                final = ev
            else:
                chunks.append(ev)
        return chunks, final

    results = run_threads([lambda s=s: run(s) for s in specs])
    spans = []
    for spec, (chunks, final) in zip(specs, results):
        assert final is not None and final.finish_reason == "length"
        assert len(final.tokens) == spec["max_tokens"] == final.completion_tokens
        assert final.tokens == tuple(t for c in chunks for t in c.tokens)
        if spec["temperature"] == 0.0:
            assert final.tokens == reference(spec["prompt"], spec["max_tokens"]), spec
        if spec["k"] == 0:
            assert final.drafted == 0
        spans.append((chunks[0].round, chunks[-1].round))
    # max_batch=6 < 16: some requests only joined after others had finished and left.
    assert any(first > min(last for _, last in spans) for first, _ in spans)
    # A seeded sampled request gives the same tokens when it runs alone.
    again = client.generate_text(specs[1]["prompt"], specs[1]["max_tokens"], temperature=0.9, seed=specs[1]["seed"],
                                 k=specs[1]["k"], ignore_eos=True)
    assert again.tokens == results[1][1].tokens
    wait_until(lambda: slots_free(client), "all slots free after the streams ended")


def test_cancel_and_deadline_free_slots_others_untouched(client, reference):
    others = [(prompt_of(40 + i, 5 + 6 * i), 50 + 10 * i) for i in range(3)]
    seen = {}

    def cancel_after_two_chunks():
        gen = client.generate(prompt_of(50, 8), MAX_TOKENS_LIMIT - 20, k=3, ignore_eos=True, request_id="victim-cancel")
        for _ in range(2):
            next(gen)
        wait_until(lambda: "victim-cancel" in client.status()["target"]["active_request_ids"], "victim on target")
        gen.close()                                  # cancels the call
        seen["cancel"] = True

    def pass_deadline():
        with pytest.raises(SpecsplitError) as info:
            for _ in client.generate(prompt_of(51, 8), MAX_TOKENS_LIMIT - 20, k=0, ignore_eos=True, timeout=0.5,
                                     request_id="victim-deadline"):
                pass
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        seen["deadline"] = True

    def normal(prompt, n):
        return client.generate_text(prompt, n, k=3, ignore_eos=True).tokens

    results = run_threads([cancel_after_two_chunks, pass_deadline] + [lambda p=p, n=n: normal(p, n) for p, n in others])
    assert seen == {"cancel": True, "deadline": True}
    for (prompt, n), tokens in zip(others, results[2:]):
        assert tokens == reference(prompt, n)

    def victims_gone():
        st = client.status()
        held = set(st["target"]["active_request_ids"]) | set(st["draft"]["active_request_ids"])
        return not held & {"victim-cancel", "victim-deadline"}
    wait_until(victims_gone, "the cancelled requests' slots to be released on both workers")
    wait_until(lambda: slots_free(client), "all slots free")


def test_unknown_request_at_a_worker_ends_only_that_request(client, workers, reference):
    """A per-item ItemError (the draft lost the request) ends that stream only."""
    draft = DraftClient(f"127.0.0.1:{workers[1]}", timeout_s=TIMEOUT, max_message_bytes=1 << 24)
    outcome = {}

    def victim():
        # NOTE: the first token reaches the client before the draft's prefill runs (see
        # rounds.admission), so an early release may find nothing yet: release again on each
        # streamed event until the draft had the request (bounded by the stream's length).
        try:
            for ev in client.generate(prompt_of(60, 6), MAX_TOKENS_LIMIT - 20, k=3, ignore_eos=True,
                                      request_id="lost-at-draft"):
                if not ev.final and not outcome.get("released"):
                    outcome["released"] = draft.release_many(["lost-at-draft"])
        except SpecsplitError as exc:
            outcome["error"] = exc

    try:
        results = run_threads([victim, lambda: client.generate_text(prompt_of(61, 9), 80, k=3, ignore_eos=True).tokens])
    finally:
        draft.close()
    assert outcome["released"] == ["lost-at-draft"]
    assert outcome["error"].code == grpc.StatusCode.INVALID_ARGUMENT and "lost-at-draft" in outcome["error"].details
    assert results[1] == reference(prompt_of(61, 9), 80)
    wait_until(lambda: slots_free(client), "all slots free")


# --- bad input ---------------------------------------------------------------------------------------
BAD = [
    (dict(prompt=""), "INVALID_ARGUMENT", "prompt"),
    (dict(prompt=[5, 258]), "INVALID_ARGUMENT", "prompt_token_ids[1]"),
    (dict(prompt=[5, -1]), "INVALID_ARGUMENT", "prompt_token_ids[1]"),
    (dict(max_tokens=0), "INVALID_ARGUMENT", "max_tokens"),
    (dict(max_tokens=-3), "INVALID_ARGUMENT", "max_tokens"),
    (dict(max_tokens=MAX_TOKENS_LIMIT + 1), "INVALID_ARGUMENT", "max_tokens"),
    (dict(prompt=[1] * 900, max_tokens=200), "RESOURCE_EXHAUSTED", "prompt_token_ids"),
    (dict(prompt="x" * 5000), "INVALID_ARGUMENT", "max_prompt_tokens"),
    (dict(k=4), "INVALID_ARGUMENT", "k"),
    (dict(k=-1), "INVALID_ARGUMENT", "k"),
    (dict(temperature=-1.0), "INVALID_ARGUMENT", "sampling.temperature"),
    (dict(temperature=float("nan")), "INVALID_ARGUMENT", "sampling.temperature"),
    (dict(top_p=1.5), "INVALID_ARGUMENT", "sampling.top_p"),
    (dict(top_k=-2), "INVALID_ARGUMENT", "sampling.top_k"),
    (dict(stop_token_ids=[999]), "INVALID_ARGUMENT", "stop_token_ids[0]"),
    (dict(request_id="r" * 200), "INVALID_ARGUMENT", "request_id"),
]


def test_bad_input_is_refused_naming_the_field_and_serving_continues(client, reference):
    for kw, code, field in BAD:
        kw = {"prompt": "ok", "max_tokens": 5, **kw}
        with pytest.raises(SpecsplitError) as info:
            client.generate_text(kw.pop("prompt"), kw.pop("max_tokens"), **kw)
        assert info.value.code.name == code, (kw, info.value)
        assert field in info.value.details, (field, info.value.details)
    both = SpecsplitClient.build_request("text", 5)
    both.prompt_token_ids.extend([1, 2])
    with pytest.raises(SpecsplitError) as info:
        list(client.stream(both))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in info.value.details
    assert client.generate_text(prompt_of(70, 4), 20, k=3, ignore_eos=True).tokens == reference(prompt_of(70, 4), 20)


def test_full_admission_queue_is_resource_exhausted(workers):
    server, port = create_server(orch_cfg(*workers, max_batch=1, max_queue=0))
    try:
        with SpecsplitClient(f"127.0.0.1:{port}", timeout=TIMEOUT) as c:
            gen = c.generate(prompt_of(80, 4), MAX_TOKENS_LIMIT - 20, k=0, ignore_eos=True)
            next(gen)
            with pytest.raises(SpecsplitError) as info:
                c.generate_text("second", 5)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue" in info.value.details
            gen.close()
            wait_until(lambda: c.status()["orchestrator"]["active_requests"] == 0, "the first request to leave")
            assert c.generate_text("third", 5).finish_reason in ("length", "stop")
    finally:
        server.stop(0).wait(5)


def test_graceful_shutdown_lets_in_flight_requests_finish(workers, reference):
    server, port = create_server(orch_cfg(*workers))
    with SpecsplitClient(f"127.0.0.1:{port}", timeout=TIMEOUT) as c:
        gen = c.generate(prompt_of(85, 6), 200, k=3, ignore_eos=True)
        first = next(gen)
        stopper = threading.Thread(target=server.graceful_shutdown, args=(TIMEOUT,), daemon=True)
        stopper.start()
        wait_until(lambda: server.core.draining, "draining to start")
        with pytest.raises(SpecsplitError) as info:
            c.generate_text("late", 5)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        rest = [ev for ev in gen]
        assert rest[-1].final and rest[-1].tokens == reference(prompt_of(85, 6), 200) and first.tokens
        stopper.join(TIMEOUT)
        assert not stopper.is_alive()
    target = TargetClient(f"127.0.0.1:{workers[0]}", timeout_s=TIMEOUT, max_message_bytes=1 << 20)
    try:
        assert target.get_status().used_slots == 0
    finally:
        target.close()


# --- operations ----------------------------------------------------------------------------------------
def test_status_health_reflection_metrics_and_reload_checks_its_request(orch, client):
    server, address = orch
    st = client.status()
    assert st["target"]["role"] == "target" and st["draft"]["role"] == "draft"
    assert st["orchestrator"]["speculation_available"] and st["orchestrator"]["max_k"] == 3
    assert st["target_error"] == st["draft_error"] == ""
    channel = grpc.insecure_channel(address)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "specsplit.v1.Orchestrator"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=TIMEOUT)
        names = {s.name for a in answers for s in a.list_services_response.service}
        assert "specsplit.v1.Orchestrator" in names and "grpc.health.v1.Health" in names
        from specsplit.v1 import orchestrator_pb2, orchestrator_pb2_grpc
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        from core.admin_token import find_admin_token
        from core.auth import admin_metadata
        with pytest.raises(grpc.RpcError) as info:          # admin RPCs are never open: the generated token
            list(stub.ReloadWeights(orchestrator_pb2.ReloadWeightsRequest(), timeout=TIMEOUT,
                                    metadata=admin_metadata(find_admin_token(address))))
        # An empty request is refused naming the field (reload itself: tests/integration/test_reload.py).
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "target_path" in info.value.details()
    finally:
        channel.close()
    client.generate_text(prompt_of(90, 5), 30, k=3, ignore_eos=True)
    with pytest.raises(SpecsplitError):
        client.generate_text(prompt_of(90, 5), 0)
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=TIMEOUT).read().decode()
    for name in ("specsplit_drafted_tokens_total", "specsplit_accepted_tokens_total",
                 'specsplit_position_drafted_total{position="3"}', 'specsplit_position_accepted_total{position="1"}',
                 "specsplit_accepted_length_bucket", 'specsplit_round_seconds_bucket{le="0.001",part="overhead"}',
                 'part="draft"', 'part="target"', "specsplit_active_requests", "specsplit_queued_requests",
                 'specsplit_requests_total{code="OK",finish_reason="length"}',
                 'specsplit_requests_total{code="INVALID_ARGUMENT",finish_reason="none"}',
                 'specsplit_worker_up{worker="draft"} 1.0', "specsplit_speculation_available 1.0"):
        assert name in text, name
    # Latency: the finished request above has its time to first token, its whole time and its
    # time per token after the first (a 30-token request: 29 of them).
    for name in ("specsplit_time_to_first_token_seconds", "specsplit_request_seconds",
                 "specsplit_time_per_output_token_seconds"):
        count = re.search(rf"^{name}_count (\S+)$", text, re.M)
        total = re.search(rf"^{name}_sum (\S+)$", text, re.M)
        assert count and float(count.group(1)) >= 1 and total and float(total.group(1)) > 0, name


def test_target_only_orchestrator(model_dir, reference):
    # NOTE: a target worker of its own: the module's orchestrator (``orch``, with a draft) still
    # runs, and its poller configures its draft again on a target whose round loop names none
    # (as after a target restart), turning this orchestrator's target-only rounds speculative
    # mid-test (seen once in `make test`).
    target = start_target(worker_cfg("target", model_dir))
    server, port = create_server(orch_cfg(target.port, None))
    try:
        with SpecsplitClient(f"127.0.0.1:{port}", timeout=TIMEOUT) as c:
            res = c.generate_text(prompt_of(95, 7), 30, k=3, ignore_eos=True)
            assert res.tokens == reference(prompt_of(95, 7), 30) and res.drafted == 0
            st = c.status()
            assert not st["orchestrator"]["speculation_available"] and "draft" not in st
    finally:
        server.stop(0).wait(5)
        target.stop(grace=None)


# --- the round stream's bounded wait ---------------------------------------------------------------------
class StallingDraft(draft_pb2_grpc.DraftServiceServicer):
    """Answers Propose only while ``healthy`` is set; otherwise never answers."""

    def __init__(self) -> None:
        self.healthy = threading.Event()
        self.streams = 0

    def Propose(self, request_iterator, context):
        self.streams += 1
        for msg in request_iterator:
            while not self.healthy.is_set():
                if not context.is_active():
                    return
                time.sleep(0.01)
            yield draft_pb2.ProposeResponse(round=msg.round, results=[
                draft_pb2.ProposeResult(request_id=it.request_id, proposal=draft_pb2.Proposal(drafts=[1] * it.k))
                for it in msg.items])


def test_stalled_stream_times_out_then_reconnects():
    from concurrent import futures
    servicer = StallingDraft()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = DraftClient(f"127.0.0.1:{port}", timeout_s=0.5, max_message_bytes=1 << 20)
    req = [ProposeRequest("a", 0, np.array([3], np.int64), np.zeros((1, 4), np.float32), 2)]
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerUnavailable, match="no response within 0.5s"):
            client.propose(req)
        assert time.monotonic() - t0 < 3.0
        servicer.healthy.set()
        out = client.propose(req)                      # a fresh stream
        assert list(out[0].drafts) == [1, 1] and servicer.streams == 2
        assert list(client.propose(req)[0].drafts) == [1, 1] and servicer.streams == 2   # and it persists
    finally:
        client.close()
        server.stop(0).wait(5)
