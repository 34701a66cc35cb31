"""Weight reload through the orchestrator over real services on 127.0.0.1 (harness: ``reload_harness``).

What is shown:
- after a reload (RECAPTURE and IN_PLACE) the outputs, and the draft's
  per-round acceptance, equal a fresh stack started with B; the draft's
  embedding / norm / head are B's (stale copies would change acceptance);
- RECAPTURE clears every graph on both workers before any weight is
  released, for every combination of draft/target graphs on/off;
- bad checkpoints change nothing; a failure injected at each phase (and a
  worker killed mid-load) rolls both workers back to A with nothing lost.
The in-flight policies, one reload at a time and PushWeights are in
``test_reload_policies.py``; the soak in ``test_reload_soak.py``. Every stub call
has a deadline; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from orchestrator.client import ReloadFailed
from runtime.checkpoint import index_checkpoint, load_tensors, save_safetensors, save_target
from runtime.config import ModelConfig
from tests.integration.reload_harness import (PROMPTS, REPO, SHARED, TIMEOUT, acceptance_pattern,  # noqa: F401
                                              assert_serving, in_thread, make_model, models, ref, run_gen, stacks)
from tests.waiting import wait_until
from tests.ports import free_port

pytestmark = pytest.mark.integration


# --- after a reload: same outputs as a fresh stack with the new weights ---------------------------------
@pytest.mark.parametrize("colocated", [False, True], ids=["draft_service", "colocated_draft"])
@pytest.mark.parametrize("mode", ["recapture", "in_place"])
def test_reload_equals_a_fresh_stack_with_the_new_weights(stacks, models, ref, mode, colocated):
    """Regression for "draft keeps the old embedding/head": acceptance and draft tensors must be B's.
    ``colocated``: the draft in the target's process, reloaded through the target's port, its
    rounds queued ahead (the same acceptance as a fresh draft service's, round by round)."""
    s = stacks(models["A"], "A", colocated=colocated)
    for p in PROMPTS:
        assert s.client.generate_text(p, 40, k=3, ignore_eos=True).tokens == ref(models["A"], p, 40)
    assert s.status()["orchestrator"].get("draft_in_process", False) == colocated
    assert s.server.core.metrics.registry.get_sample_value("specsplit_draft_in_process") == float(colocated)
    events = s.client.reload(str(models["B"]), "B", mode=mode, inflight="wait")
    assert events[-1].done and events[-1].weights_version == "B" and not any(e.error_code for e in events)
    phases = [e.phase for e in events]
    want = (["clear_graphs", "release", "load", "capture"] if mode == "recapture" else ["load"])
    assert [p for p in dict.fromkeys(phases) if p in ("clear_graphs", "release", "load", "capture")] == want
    assert_serving(s, "B")
    wait_until(lambda: s.status()["orchestrator"].get("draft_in_process", False) == colocated,
               "the draft attached again (in the target's process when colocated)")
    fresh = stacks(models["B"], "B")
    stale = stacks(models["B"], "B", draft_model=models["A"])     # what a stale embed/head copy would look like
    for p in PROMPTS:
        got = acceptance_pattern(s.client, p, 60)
        assert got[-1] == ref(models["B"], p, 60)                 # lossless: the target decides the tokens
        assert got == acceptance_pattern(fresh.client, p, 60)     # the draft proposes exactly as a fresh B draft
    assert any(acceptance_pattern(stale.client, p, 60) != acceptance_pattern(fresh.client, p, 60) for p in PROMPTS)
    if colocated:                     # its rounds were queued ahead (runtime/round_ahead.py), after the reload too
        assert s.target.worker.engine.round_stats.used > 0
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
    _check_recapture_order(s, {"draft": draft_graphs, "target": target_graphs}, models, ref)


def test_recapture_with_a_colocated_draft_clears_both_workers_graphs_before_any_release(stacks, models, ref):
    """One process, two workers: no weight of either is released while a graph of either is live."""
    s = stacks(models["A"], "A", colocated=True)
    assert s.draft.worker is not s.target.worker and s.status()["draft"]["role"] == "draft"
    _check_recapture_order(s, {"draft": True, "target": True}, models, ref)


def _check_recapture_order(s, graphs: dict[str, bool], models, ref) -> None:
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
    port = free_port()
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


