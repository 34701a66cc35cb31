"""Weight reload through the orchestrator, continued (harness: ``reload_harness``): WAIT / ABORT /
RECOMPUTE and the WAIT bound; one reload at a time, Generate waiting or getting UNAVAILABLE with
RetryInfo, health; checked requests and the admin token; PushWeights. Every stub call has a
deadline; every wait is bounded.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from core.config import SecurityConfig
from orchestrator.client import ReloadFailed, SpecsplitClient
from runtime.checkpoint import index_checkpoint, load_tensors
from tests.integration.reload_harness import (PROMPTS, TIMEOUT, assert_serving, check_segments,  # noqa: F401
                                              in_thread, models, ref, run_gen, stacks)
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


# --- in-flight policies ----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy,interval", [("wait", 1), ("abort", 1), ("recompute", 1), ("recompute", 5)])
def test_inflight_policies(stacks, models, ref, policy, interval):
    """interval: the orchestrator's stream_interval (held chunks never span the weight swap)."""
    s = stacks(models["A"], "A", stream_interval=interval)
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
