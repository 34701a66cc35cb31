"""Weight reload through the orchestrator (ReloadWeights / PushWeights) over real services on 127.0.0.1.

Two random tiny checkpoints A and B (every tensor differs, embedding and head
included) are served by Paddle workers in this process (one test runs the
target as a subprocess so it can be killed). What is shown:
- after a reload (RECAPTURE and IN_PLACE) the outputs, and the draft's
  per-round acceptance, equal a fresh stack started with B; the draft's
  embedding / norm / head are B's (stale copies would change acceptance);
- RECAPTURE clears every graph on both workers before any weight is
  released, for every combination of draft/target graphs on/off;
- bad checkpoints change nothing; a failure injected at each phase (and a
  worker killed mid-load) rolls both workers back to A with nothing lost;
- WAIT / ABORT / RECOMPUTE; one reload at a time; Generate waits or gets
  UNAVAILABLE with RetryInfo; PushWeights; the soak is in test_reload_soak.py.
Every stub call has a deadline; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from draft_service.server import start as start_draft
from orchestrator.client import ReloadFailed, SpecsplitClient, SpecsplitError
from orchestrator.server import create_server
from runtime.checkpoint import index_checkpoint, load_tensors, save_safetensors, save_target
from core.config import SecurityConfig, ServerConfig
from core.params import SamplingParams
from orchestrator.config import OrchestratorConfig
from runtime.config import CacheConfig, EngineConfig, GraphConfig, ModelConfig, RuntimeConfig, SpecConfig
from worker.config import WorkerConfig
from runtime.engine import GenRequest, SpecEngine
from specsplit.v1 import common_pb2
from target_service.server import start as start_target
from tests.byte_model import write_byte_model
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

TIMEOUT = 30.0
MAX_LEN = 512
REPO = Path(__file__).resolve().parents[2]
SHARED = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
READY, LOADED = common_pb2.LIFECYCLE_STATE_READY, common_pb2.LIFECYCLE_STATE_LOADED


def make_model(path: Path, seed: int, ffn: int = 64) -> Path:
    """tests/byte_model.py's model; the final norm varies too, so versions differ in every shared tensor."""
    write_byte_model(path, seed, MAX_LEN, ffn, vary_final_norm=True)
    return path


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reload_models")
    return {"A": make_model(root / "A", 0), "B": make_model(root / "B", 10)}


class Reference:
    """Target-only greedy decoding per checkpoint, in process (memoized)."""

    def __init__(self) -> None:
        self.engines: dict[Path, SpecEngine] = {}
        self.memo: dict = {}

    def __call__(self, model: Path, prompt, n: int) -> tuple[int, ...]:
        key = (model, tuple(prompt), n)
        if key not in self.memo:
            if model not in self.engines:
                self.engines[model] = SpecEngine(EngineConfig(
                    target_path=str(model), runtime=RuntimeConfig(backend="paddle"),
                    spec=SpecConfig(max_k=3, default_k=0), cache=CacheConfig(max_slots=2, max_len=MAX_LEN)),
                    use_draft=False)
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            self.memo[key] = self.engines[model].generate([GenRequest("ref", tuple(prompt), params, k=0)])[0].tokens
        return self.memo[key]


@pytest.fixture(scope="session")
def ref() -> Reference:
    return Reference()


def wcfg(role: str, model: Path, version: str, graphs: bool = True, port: int = 0) -> WorkerConfig:
    return WorkerConfig(role=role, target_path=str(model), weights_version=version, capture_on_start=graphs,
                        runtime=RuntimeConfig(backend="paddle"), spec=SpecConfig(max_k=3, default_k=3),
                        cache=CacheConfig(max_slots=8, max_len=MAX_LEN), graphs=GraphConfig(batch_buckets=(1, 4, 8)),
                        server=ServerConfig(port=port, max_workers=8))


class Stack:
    """In-process target + draft (Paddle) + orchestrator + client; ``close`` stops everything."""

    def __init__(self, model: Path, version: str, *, draft_graphs: bool = True, target_graphs: bool = True,
                 target_port: int | None = None, draft_model: Path | None = None, **orch) -> None:
        self.target = None if target_port else start_target(wcfg("target", model, version, target_graphs))
        self.draft = start_draft(wcfg("draft", draft_model or model, version, draft_graphs))
        kw = dict(draft_address=f"127.0.0.1:{self.draft.port}",
                  target_address=f"127.0.0.1:{target_port or self.target.port}", max_batch=8, max_queue=32,
                  max_tokens_limit=MAX_LEN, worker_timeout_s=TIMEOUT, reload_call_timeout_s=TIMEOUT,
                  reload_wait_timeout_s=TIMEOUT, reload_rollback_wait_s=TIMEOUT, generate_wait_during_reload_s=TIMEOUT,
                  server=ServerConfig(port=0))
        kw.update(orch)
        self.server, port = create_server(OrchestratorConfig(**kw))
        self.address = f"127.0.0.1:{port}"
        self.client = SpecsplitClient(self.address, timeout=TIMEOUT, token=(kw.get("security") or SecurityConfig()).admin_token)

    def workers(self) -> dict:
        return {"target": self.target.worker, "draft": self.draft.worker}

    def status(self) -> dict:
        return self.client.status()

    def slow_rounds(self, seconds: float) -> None:
        """Each Verify takes at least ``seconds`` (so requests are still running when a reload comes)."""
        w = self.target.worker
        orig = type(w).verify.__get__(w)
        w.verify = lambda items, round_=0: (time.sleep(seconds), orig(items, round_))[1]

    def close(self) -> None:
        self.client.close()
        self.server.stop(0).wait(5)
        for svc in (self.target, self.draft):
            if svc is not None:
                svc.stop(grace=None)


@pytest.fixture
def stacks():
    made: list[Stack] = []

    def make(*a, **kw) -> Stack:
        made.append(Stack(*a, **kw))
        return made[-1]
    yield make
    for s in reversed(made):
        s.close()


def prompt_of(i: int, n: int) -> list[int]:
    return [256, *(int(x) for x in np.random.default_rng(900 + i).integers(0, 256, n - 1))]


PROMPTS = [prompt_of(0, 1), prompt_of(1, 7), prompt_of(2, 30)]


def run_gen(client: SpecsplitClient, prompt, n: int, **kw):
    """(chunk events, final event) or (chunks, SpecsplitError)."""
    chunks = []
    try:
        for ev in client.generate(prompt, n, ignore_eos=True, **kw):
            if ev.final:
                return chunks, ev
            chunks.append(ev)
    except SpecsplitError as exc:
        return chunks, exc
    raise AssertionError("stream ended without a final event")


def in_thread(fn):
    out: dict = {}

    def wrap():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
            out["error"] = exc
    t = threading.Thread(target=wrap, daemon=True)
    t.start()

    def join(timeout: float = 120.0):
        t.join(timeout)
        assert not t.is_alive(), "thread did not finish in time"
        if "error" in out:
            raise out["error"]
        return out["value"]
    return join


def check_segments(ref: Reference, models: dict, prompt, chunks, versions: dict | None = None) -> None:
    """Tokens produced under each weights version equal that version's target-only
    greedy continuation of everything before them (honest version labels)."""
    versions = versions or models
    done: list[int] = []
    i = 0
    while i < len(chunks):
        v, seg = chunks[i].weights_version, []
        while i < len(chunks) and chunks[i].weights_version == v:
            seg.extend(chunks[i].tokens)
            i += 1
        assert tuple(seg) == ref(versions[v], list(prompt) + done, len(seg)), (v, len(done))
        done.extend(seg)


def acceptance_pattern(client, prompt, n) -> list[tuple]:
    chunks, final = run_gen(client, prompt, n, k=3)
    return [(c.tokens, c.num_accepted, c.num_drafted) for c in chunks] + [final.tokens]


def assert_serving(stack: Stack, version: str, graphs: dict[str, bool] | None = None) -> None:
    # NOTE: a request's final event can reach the client before the round loop has released its
    # slot on the draft (seen under CPU contention): the slots are waited for (bounded), then checked.
    wait_until(lambda: all(stack.status()[r]["used_slots"] == 0 for r in ("target", "draft")),
               f"every slot to be released (serving {version})")
    st = stack.status()
    for role in ("target", "draft"):
        assert st[role]["weights_version"] == version, (role, st[role])
        want = "LIFECYCLE_STATE_READY" if (graphs or {}).get(role, True) else "LIFECYCLE_STATE_LOADED"
        assert st[role]["state"] == want, (role, st[role]["state"])
        assert st[role]["used_slots"] == 0, st[role]["active_request_ids"]


# --- after a reload: same outputs as a fresh stack with the new weights ---------------------------------
@pytest.mark.parametrize("mode", ["recapture", "in_place"])
def test_reload_equals_a_fresh_stack_with_the_new_weights(stacks, models, ref, mode):
    """Regression for "draft keeps the old embedding/head": acceptance and draft tensors must be B's."""
    s = stacks(models["A"], "A")
    for p in PROMPTS:
        assert s.client.generate_text(p, 40, k=3, ignore_eos=True).tokens == ref(models["A"], p, 40)
    events = s.client.reload(str(models["B"]), "B", mode=mode, inflight="wait")
    assert events[-1].done and events[-1].weights_version == "B" and not any(e.error_code for e in events)
    phases = [e.phase for e in events]
    want = (["clear_graphs", "release", "load", "capture"] if mode == "recapture" else ["load"])
    assert [p for p in dict.fromkeys(phases) if p in ("clear_graphs", "release", "load", "capture")] == want
    assert_serving(s, "B")
    fresh = stacks(models["B"], "B")
    stale = stacks(models["B"], "B", draft_model=models["A"])     # what a stale embed/head copy would look like
    for p in PROMPTS:
        got = acceptance_pattern(s.client, p, 60)
        assert got[-1] == ref(models["B"], p, 60)                 # lossless: the target decides the tokens
        assert got == acceptance_pattern(fresh.client, p, 60)     # the draft proposes exactly as a fresh B draft
    assert any(acceptance_pattern(stale.client, p, 60) != acceptance_pattern(fresh.client, p, 60) for p in PROMPTS)
    b = load_tensors(index_checkpoint(models["B"]))
    draft = s.draft.worker
    for name in SHARED:
        assert np.array_equal(draft.ops.to_numpy(draft.engine.params[name]), b[name]), name
    chunks, final = run_gen(s.client, PROMPTS[1], 20, k=3)
    assert {c.weights_version for c in chunks} == {"B"} and final.weights_version == "B"


# --- teardown order --------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft_graphs", [True, False])
@pytest.mark.parametrize("target_graphs", [True, False])
def test_recapture_clears_every_graph_before_any_release(stacks, models, ref, draft_graphs, target_graphs):
    s = stacks(models["A"], "A", draft_graphs=draft_graphs, target_graphs=target_graphs)
    graphs = {"draft": draft_graphs, "target": target_graphs}
    start = {r: len(w.lifecycle.events()) for r, w in s.workers().items()}
    s.client.reload(str(models["B"]), "B", mode="recapture", inflight="abort")
    events = {r: w.lifecycle.events()[start[r]:] for r, w in s.workers().items()}
    for role, evs in events.items():
        want = (["clear_graphs"] if graphs[role] else []) + ["release_weights", "load_weights"] + \
               (["capture_graphs"] if graphs[role] else [])
        assert [e.action for e in evs] == want, role
    clears = [e.at for evs in events.values() for e in evs if e.action == "clear_graphs"]
    releases = [e.at for evs in events.values() for e in evs if e.action == "release_weights"]
    assert len(releases) == 2 and (not clears or max(clears) <= min(releases))
    # GetStatus reports the same log (names) on both workers.
    st = s.status()
    for role in ("draft", "target"):
        assert st[role]["lifecycle_events"][-len(events[role]):] == [e.action for e in events[role]]
    assert_serving(s, "B", graphs)
    assert s.client.generate_text(PROMPTS[2], 30, k=3, ignore_eos=True).tokens == ref(models["B"], PROMPTS[2], 30)


# --- bad checkpoints: refused at validation, nothing changes ---------------------------------------------
def _variant(models: dict, tmp: Path, kind: str) -> Path:
    d = tmp / kind
    a = load_tensors(index_checkpoint(models["B"]))
    cfg = ModelConfig.from_json_file(models["B"] / "config.json")
    mtp = load_tensors(index_checkpoint(models["B"] / "mtp.safetensors"))
    if kind == "missing_tensor":
        del a["model.layers.1.mlp.up_proj.weight"]
    if kind == "wrong_shape":
        a["model.layers.0.self_attn.q_proj.weight"] = a["model.layers.0.self_attn.q_proj.weight"][:, :16]
    if kind == "missing_mtp_tensor":
        del mtp["mtp.enorm.weight"]
    save_target(d, cfg, a)
    save_safetensors(d / "mtp.safetensors", mtp)
    if kind == "corrupt_file":
        raw = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(raw[:8] + b"{not json" + raw[17:len(raw) // 2])
    return d


@pytest.mark.parametrize("kind,role", [("corrupt_file", "target"), ("missing_tensor", "target"),
                                       ("wrong_shape", "target"), ("missing_mtp_tensor", "draft")])
@pytest.mark.parametrize("mode", ["recapture", "in_place"])
def test_bad_checkpoint_is_refused_before_anything_changes(stacks, models, ref, tmp_path, kind, role, mode):
    s = stacks(models["A"], "A")
    s.slow_rounds(0.004)
    bad = _variant(models, tmp_path, kind)
    start = {r: len(w.lifecycle.events()) for r, w in s.workers().items()}
    inflight = in_thread(lambda: run_gen(s.client, PROMPTS[1], 120, k=3))
    wait_until(lambda: s.status()["orchestrator"]["active_requests"] == 1, "the request to be running")
    with pytest.raises(ReloadFailed) as info:
        s.client.reload(str(bad), "bad", mode=mode, inflight="recompute")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "nothing changed" in info.value.details
    failed = [e for e in info.value.events if e.error_code]
    assert failed and all(e.phase == "validate" for e in failed) and role in {e.service for e in failed}
    assert {r: len(w.lifecycle.events()) for r, w in s.workers().items()} == start   # no transition at all
    chunks, final = inflight()
    assert final.tokens == ref(models["A"], PROMPTS[1], 120) and {c.weights_version for c in chunks} == {"A"}
    assert_serving(s, "A")


def test_in_place_is_refused_when_shapes_differ_and_recapture_takes_them(stacks, models, ref, tmp_path):
    wide = make_model(tmp_path / "wide", 20, ffn=96)
    s = stacks(models["A"], "A")
    with pytest.raises(ReloadFailed) as info:
        s.client.reload(str(wide), "wide", mode="in_place")
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "IN_PLACE refused" in info.value.details and "RECAPTURE" in info.value.details
    assert_serving(s, "A")
    s.client.reload(str(wide), "wide", mode="recapture")
    assert_serving(s, "wide")
    assert s.client.generate_text(PROMPTS[2], 30, k=3, ignore_eos=True).tokens == ref(wide, PROMPTS[2], 30)


# --- failure injection at each phase: rollback, nothing lost ------------------------------------------------
def _inject(worker, phase: str) -> None:
    """The worker's next ``phase`` work fails once (like an OOM), then works again."""
    attr = {"clear_graphs": "_clear", "release": "_drop_engine", "load": "_install", "capture": "_capture",
            "in_place": "_copy_in_place"}[phase]

    def boom(*_a, **_k):
        del worker.__dict__[attr]
        raise MemoryError(f"injected failure at {phase} (out of memory)")

    def half_then_fail(new_cfg, arrays, version):
        for n in sorted(worker.engine.params)[: len(worker.engine.params) // 2]:   # half the tensors hold B
            worker.ops.copy_(worker.engine.params[n], worker.ops.from_numpy(arrays[n]))
        boom()
    setattr(worker, attr, half_then_fail if phase == "in_place" else boom)


@pytest.mark.parametrize("phase,role", [("clear_graphs", "draft"), ("release", "target"), ("load", "target"),
                                        ("load", "draft"), ("capture", "draft"), ("capture", "target"),
                                        ("in_place", "draft"), ("in_place", "target")])
def test_failure_at_each_phase_rolls_back_both_workers(stacks, models, ref, phase, role):
    s = stacks(models["A"], "A")
    s.slow_rounds(0.004)
    _inject(s.workers()[role], phase)
    inflight = in_thread(lambda: run_gen(s.client, PROMPTS[2], 150, k=3))
    wait_until(lambda: s.status()["orchestrator"]["active_requests"] == 1, "the request to be running")
    with pytest.raises(ReloadFailed) as info:
        s.client.reload(str(models["B"]), "B", mode="in_place" if phase == "in_place" else "recapture",
                        inflight="recompute")
    failed_phase = "load" if phase == "in_place" else phase
    assert f"failed at {failed_phase}" in info.value.details and "rolled back" in info.value.details
    assert "injected failure" in info.value.details
    errs = [(e.phase, e.service) for e in info.value.events if e.error_code]
    assert errs == [(failed_phase, role)], errs
    assert [e.service for e in info.value.events if e.phase == "rollback"] and info.value.events[-1].phase == "resume"
    chunks, final = inflight()                                 # paused, then resumed on A: nothing lost
    assert final.finish_reason == "length" and final.tokens == ref(models["A"], PROMPTS[2], 150)
    assert {c.weights_version for c in chunks} == {"A"}
    wait_until(lambda: s.status()["target"]["used_slots"] == 0, "slots free")
    assert_serving(s, "A")
    a = load_tensors(index_checkpoint(models["A"]))
    for r, w in s.workers().items():
        for name in SHARED:
            assert np.array_equal(w.ops.to_numpy(w.engine.params[name]), a[name]), (r, name)
    for p in PROMPTS:
        assert s.client.generate_text(p, 40, k=3, ignore_eos=True).tokens == ref(models["A"], p, 40)
    s.client.reload(str(models["B"]), "B")                    # no lock or state left behind
    assert_serving(s, "B")


TARGET_WORKER = r"""
import json, sys, time
from core.observability import configure_logging
configure_logging("target-subprocess", "WARNING")
import worker.base as lc
from core.config import ServerConfig
from runtime.config import CacheConfig, GraphConfig, RuntimeConfig, SpecConfig
from worker.config import WorkerConfig
from target_service.server import start
model, version, port, hang_on = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
real_read = lc.read_arrays
def read_arrays(checked, *a, **kw):
    if hang_on and any(hang_on in str(i.file) for i in checked.infos.values()):
        print(json.dumps({"event": "loading"}), flush=True)
        time.sleep(600)                                  # killed here
    return real_read(checked, *a, **kw)
lc.read_arrays = read_arrays
svc = start(WorkerConfig(role="target", target_path=model, weights_version=version, capture_on_start=True,
                         runtime=RuntimeConfig(backend="paddle"), spec=SpecConfig(max_k=3, default_k=3),
                         cache=CacheConfig(max_slots=8, max_len=512), graphs=GraphConfig(batch_buckets=(1, 4, 8)),
                         server=ServerConfig(port=port, max_workers=8)))
print(json.dumps({"event": "listening", "port": svc.port}), flush=True)
sys.stdin.read()
svc.stop(grace=None)
"""


def _spawn_target(model: Path, version: str, port: int, hang_on: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", TARGET_WORKER, str(model), version, str(port), hang_on], cwd=REPO,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    _expect_line(proc, "listening", 120)
    return proc


def _expect_line(proc: subprocess.Popen, event: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            if json.loads(line).get("event") == event:
                return
    raise AssertionError(f"subprocess target: no {event!r} line within {timeout}s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


def test_target_killed_mid_load_rolls_back_when_it_returns(stacks, models, ref):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [_spawn_target(models["A"], "A", port, hang_on=str(models["B"]))]
    try:
        s = stacks(models["A"], "A", target_port=port)
        inflight = in_thread(lambda: run_gen(s.client, PROMPTS[2], 200, k=3))
        wait_until(lambda: s.status()["orchestrator"]["active_requests"] == 1, "the request to be running")
        reload = in_thread(lambda: s.client.reload(str(models["B"]), "B", inflight="recompute"))
        _expect_line(procs[0], "loading", TIMEOUT)           # weights released, load of B in progress
        procs[0].kill()
        procs[0].wait(30)
        procs.append(_spawn_target(models["A"], "A", port, hang_on=""))   # the supervisor restarts it (on A)
        with pytest.raises(ReloadFailed) as info:
            reload()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE and "failed at load" in info.value.details
        assert "rolled back" in info.value.details
        assert [e.service for e in info.value.events if e.phase == "load" and e.error_code] == ["target"]
        chunks, final = inflight()
        assert final.finish_reason == "length" and final.tokens == ref(models["A"], PROMPTS[2], 200)
        st = s.status()
        assert st["target"]["weights_version"] == st["draft"]["weights_version"] == "A"
        assert st["target"]["state"] == st["draft"]["state"] == "LIFECYCLE_STATE_READY"
        assert s.client.generate_text(PROMPTS[1], 40, k=3, ignore_eos=True).tokens == ref(models["A"], PROMPTS[1], 40)
    finally:
        for p in procs:
            _stop(p)


# --- in-flight policies ----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["wait", "abort", "recompute"])
def test_inflight_policies(stacks, models, ref, policy):
    s = stacks(models["A"], "A")
    s.slow_rounds(0.004)
    p, n = PROMPTS[1], 200
    inflight = in_thread(lambda: run_gen(s.client, p, n, k=3))
    wait_until(lambda: s.status()["orchestrator"]["active_requests"] == 1, "the request to be running")
    s.client.reload(str(models["B"]), "B", mode="recapture", inflight=policy)
    chunks, final = inflight()
    versions = [c.weights_version for c in chunks]
    if policy == "wait":
        assert final.finish_reason == "length" and set(versions) == {"A"} and final.tokens == ref(models["A"], p, n)
    elif policy == "abort":
        assert final.finish_reason == "aborted" and set(versions) == {"A"} and 0 < len(final.tokens) < n
        assert final.tokens == ref(models["A"], p, n)[:len(final.tokens)]
    else:
        assert final.finish_reason == "length" and len(final.tokens) == n and final.weights_version == "B"
        assert versions[0] == "A" and versions[-1] == "B" and versions == sorted(versions)
        check_segments(ref, models, p, chunks)
    assert_serving(s, "B")


def test_wait_bound_passed_fails_the_reload_and_changes_nothing(stacks, models, ref):
    s = stacks(models["A"], "A", reload_wait_timeout_s=0.3)
    s.slow_rounds(0.015)
    inflight = in_thread(lambda: run_gen(s.client, PROMPTS[1], 150, k=3))
    wait_until(lambda: s.status()["orchestrator"]["active_requests"] == 1, "the request to be running")
    with pytest.raises(ReloadFailed) as info:
        s.client.reload(str(models["B"]), "B", inflight="wait")
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "reload_wait_timeout_s" in info.value.details
    chunks, final = inflight()
    assert final.tokens == ref(models["A"], PROMPTS[1], 150) and {c.weights_version for c in chunks} == {"A"}
    assert_serving(s, "A")


# --- one at a time; Generate during a reload; health -------------------------------------------------------
def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                    timeout=TIMEOUT).status


def test_one_reload_at_a_time_generate_waits_or_gets_retry_info(stacks, models, ref, monkeypatch):
    import worker.base as lc
    s = stacks(models["A"], "A", generate_wait_during_reload_s=2.0)
    gate, loading = threading.Event(), threading.Event()
    real = lc.read_arrays

    def blocked(checked, *a, **kw):
        loading.set()
        assert gate.wait(TIMEOUT)
        return real(checked, *a, **kw)
    monkeypatch.setattr(lc, "read_arrays", blocked)
    first = in_thread(lambda: s.client.reload(str(models["B"]), "B"))
    assert loading.wait(TIMEOUT)
    assert s.status()["orchestrator"]["reloading"]
    for svc in (s.target, s.draft):                              # EMPTY while reloading: NOT_SERVING
        assert _health(f"127.0.0.1:{svc.port}") == health_pb2.HealthCheckResponse.NOT_SERVING
    assert _health(s.address) == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(ReloadFailed) as info:
        s.client.reload(str(models["A"]), "A2")
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "already running" in info.value.details
    # A Generate waits up to generate_wait_during_reload_s, then UNAVAILABLE with RetryInfo.
    with grpc.insecure_channel(s.address) as ch:
        from specsplit.v1 import orchestrator_pb2_grpc
        call = orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(
            SpecsplitClient.build_request(PROMPTS[0], 5), timeout=TIMEOUT)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert 1.9 < time.monotonic() - t0 < TIMEOUT
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "reloading" in err.value.details()
        retry = error_details_pb2.RetryInfo()
        assert rpc_status.from_call(err.value).details[0].Unpack(retry) and retry.retry_delay.seconds >= 1
    # One that arrives shortly before the reload ends waits and is served by B.
    reloader, entered = s.server.core.reloader, threading.Event()
    real_wait = reloader.wait_idle

    def wait_idle(timeout: float) -> bool:
        entered.set()                                    # this Generate now waits on the reload gate
        return real_wait(timeout)
    monkeypatch.setattr(reloader, "wait_idle", wait_idle)
    waiting = in_thread(lambda: run_gen(s.client, PROMPTS[1], 20, k=3))
    assert entered.wait(TIMEOUT), "the Generate never reached the reload gate"
    assert reloader.active                               # ... while the reload still runs
    gate.set()
    first()
    chunks, final = waiting()
    assert final.tokens == ref(models["B"], PROMPTS[1], 20) and {c.weights_version for c in chunks} == {"B"}
    assert _health(s.address) == health_pb2.HealthCheckResponse.SERVING and not s.status()["orchestrator"]["reloading"]


def test_reload_requests_are_checked_and_need_the_admin_token(stacks, models):
    s = stacks(models["A"], "A", security=SecurityConfig(admin_token="s3cret"))
    for kw, code, text in [(dict(version=""), "INVALID_ARGUMENT", "version"),
                           (dict(target_path=""), "INVALID_ARGUMENT", "target_path"),
                           (dict(version="A"), "INVALID_ARGUMENT", "already serving")]:
        args = {"target_path": str(models["B"]), "version": "B", **kw}
        with pytest.raises(ReloadFailed) as info:
            s.client.reload(args.pop("target_path"), args.pop("version"), **args)
        assert info.value.code.name == code and text in info.value.details
    with SpecsplitClient(s.address, timeout=TIMEOUT) as anonymous:
        with pytest.raises(ReloadFailed) as info:
            anonymous.reload(str(models["B"]), "B")
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    from specsplit import cli
    assert cli.main(["reload", str(models["B"]), "--version", "B", "--address", s.address, "--token", "s3cret",
                     "--mode", "in_place", "--inflight", "abort", "--json"]) == 0
    assert_serving(s, "B")
    from prometheus_client import generate_latest
    text = generate_latest(s.server.core.metrics.registry).decode()
    assert 'specsplit_reloads_total{mode="in_place",outcome="ok"} 1.0' in text
    assert 'specsplit_reloads_total{mode="recapture",outcome="failed"}' in text       # the refused ones
    assert 'specsplit_reload_phase_seconds_count{phase="load",service="draft"} 1.0' in text


# --- PushWeights --------------------------------------------------------------------------------------------
def _tensors(model: Path) -> dict[str, np.ndarray]:
    return {**load_tensors(index_checkpoint(model)), **load_tensors(index_checkpoint(model / "mtp.safetensors"))}


def test_push_weights_stages_validates_and_applies(stacks, models, ref, tmp_path):
    staging = tmp_path / "staging"
    s = stacks(models["A"], "A", push_staging_dir=str(staging), push_keep_versions=2)
    config = json.loads((models["B"] / "config.json").read_text())
    res = s.client.push_weights(_tensors(models["B"]), config, "B-pushed", mode="in_place", chunk_bytes=4096)
    assert res.weights_version == "B-pushed" and res.events[-1].done and Path(res.staged_path).parent == staging
    assert_serving(s, "B-pushed")
    for p in PROMPTS:
        assert s.client.generate_text(p, 40, k=3, ignore_eos=True).tokens == ref(models["B"], p, 40)
    # bf16 over the wire (what a trainer sends), RECAPTURE; older staged versions are pruned.
    for v in ("A-bf16", "B-bf16"):
        res = s.client.push_weights(_tensors(models[v[0]]), config, v, bfloat16=True, inflight="abort")
        assert res.weights_version == v
    assert sorted(p.name.split("-")[1] for p in staging.iterdir()) == ["A", "B"]
    assert_serving(s, "B-bf16")


def test_push_weights_refusals_change_nothing(stacks, models, ref, tmp_path):
    staging = tmp_path / "staging"
    s = stacks(models["A"], "A", push_staging_dir=str(staging), push_max_bytes=400_000)
    config = json.loads((models["B"] / "config.json").read_text())
    good = _tensors(models["B"])
    wrong = dict(good)
    wrong["model.norm.weight"] = np.ones(31, np.float32)
    missing = {k: v for k, v in good.items() if k != "mtp.hnorm.weight"}
    cases = [(dict(tensors=missing), "INVALID_ARGUMENT", "missing tensor 'mtp.hnorm.weight'"),
             (dict(tensors=wrong), "INVALID_ARGUMENT", "shape [31]"),
             (dict(tensors={**good, "model.extra": np.ones(3, np.float32)}), "INVALID_ARGUMENT", "not a tensor"),
             (dict(target_config="{]"), "INVALID_ARGUMENT", "target_config_json"),
             (dict(version=""), "INVALID_ARGUMENT", "version"),
             (dict(tensors={k: np.concatenate([v.ravel()] * 4) for k, v in good.items()}), "INVALID_ARGUMENT", "shape")]
    for kw, code, text in cases:
        args = {"tensors": good, "target_config": config, "version": "B", **kw}
        with pytest.raises(ReloadFailed) as info:
            s.client.push_weights(args.pop("tensors"), args.pop("target_config"), args.pop("version"))
        assert info.value.code.name == code and text in info.value.details, (text, info.value.details)
    big = stacks(models["A"], "A", push_staging_dir=str(staging), push_max_bytes=100_000)
    with pytest.raises(ReloadFailed) as info:
        big.client.push_weights(good, config, "B")
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "push_max_bytes" in info.value.details
    off = stacks(models["A"], "A")
    with pytest.raises(ReloadFailed) as info:
        off.client.push_weights(good, config, "B")
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "push_staging_dir" in info.value.details
    assert list(staging.iterdir()) == []                       # nothing half-written is left behind
    assert_serving(s, "A")
    assert s.client.generate_text(PROMPTS[1], 30, k=3, ignore_eos=True).tokens == ref(models["A"], PROMPTS[1], 30)
