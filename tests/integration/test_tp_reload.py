"""Reloads under traffic with a tensor-parallel target (TP=2 and TP=3, Torch + gloo on the CPU).

The target's rank 0 runs in this process, the other ranks in processes it spawned; a Torch draft
and the orchestrator beside them (``reload_harness.Stack``). While two clients generate greedily
(k = 0, 1 or 3), the orchestrator reloads RECAPTURE and IN_PLACE in turn, alternating two
checkpoints, under every in-flight policy. Every request's tokens, segment by weights version,
must equal that version's single-device target-only continuation; the target must end READY on
the last version with no slot held; every reload must finish. Each rank's own lifecycle refuses a
release while its graphs are live (``target_service/tp_worker.py``), so a reload that finishes
went through clear -> release -> load -> capture on every rank. ``run_tp_reloads`` is also the
four-GPU run's (``tests/gpu/test_tp_reload_gpu.py``: CUDA, 20 cycles, memory per GPU).
"""

from __future__ import annotations

import random
import threading
from typing import Callable

import pytest

from core.config import SecurityConfig, ServerConfig
from core.params import SamplingParams
from draft_service.server import start as start_draft
from orchestrator.client import SpecsplitClient, SpecsplitError
from runtime.config import CacheConfig, EngineConfig, GraphConfig, RuntimeConfig, SpecConfig
from runtime.engine import GenRequest, SpecEngine
from target_service.server import start as start_target
from tests.integration.reload_harness import (MAX_LEN, TIMEOUT, Stack, check_segments, models,  # noqa: F401
                                              prompt_of, run_gen)
from tests.waiting import wait_until
from worker.config import WorkerConfig

pytestmark = pytest.mark.integration

CLIENTS = 2
MODES = ("recapture", "in_place")
POLICIES = ("wait", "abort", "recompute")


class TorchReference:
    """Single-device Torch target-only greedy decoding per checkpoint on ``device`` (memoized):
    what every TP rank count must reproduce."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.engines: dict = {}
        self.memo: dict = {}

    def __call__(self, model, prompt, n: int) -> tuple[int, ...]:
        key = (model, tuple(prompt), n)
        if key not in self.memo:
            if model not in self.engines:
                self.engines[model] = SpecEngine(EngineConfig(
                    target_path=str(model), runtime=RuntimeConfig(backend="torch", device=self.device),
                    spec=SpecConfig(max_k=3, default_k=0), cache=CacheConfig(max_slots=2, max_len=MAX_LEN),
                    graphs=GraphConfig(batch_buckets=(1,))), use_draft=False)
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            self.memo[key] = self.engines[model].generate([GenRequest("ref", tuple(prompt), params, k=0)])[0].tokens
        return self.memo[key]


def _worker(role: str, model, tp: int, device: str) -> WorkerConfig:
    return WorkerConfig(
        role=role, target_path=str(model), weights_version="A", tp=tp, capture_on_start=True,
        runtime=RuntimeConfig(backend="torch", device=device), spec=SpecConfig(max_k=3, default_k=3),
        cache=CacheConfig(max_slots=8, max_len=MAX_LEN), graphs=GraphConfig(batch_buckets=(1, 4, 8)),
        server=ServerConfig(host="127.0.0.1", port=0, max_workers=8), security=SecurityConfig())


def run_tp_reloads(models, tp: int, cycles: int, device: str = "cpu", draft_device: str = "cpu",
                   after_reload: Callable[[int], None] | None = None) -> dict:
    """The run of the module doc: ``cycles`` reloads; ``after_reload(i)`` right after reload i
    finishes (e.g. to read device memory). Returns {"results", "reloads", "status", "versions",
    "hung"}; the caller checks them (``check_tp_reloads``)."""
    target = start_target(_worker("target", models["A"], tp, device))
    draft = start_draft(_worker("draft", models["A"], 1, draft_device))
    stack = Stack(models["A"], "A", target_port=target.port, draft_port=draft.port, max_batch=8, max_queue=32)
    stop = threading.Event()
    results: list[tuple] = []
    lock = threading.Lock()

    def client_loop(i: int) -> None:
        rng = random.Random(10 * tp + i)
        with SpecsplitClient(stack.address, timeout=TIMEOUT) as c:
            while not stop.is_set():
                prompt, n = prompt_of(rng.randrange(40), rng.randrange(1, 30)), rng.randrange(8, 48)
                chunks, end = run_gen(c, prompt, n, k=rng.choice((0, 1, 3)))
                with lock:
                    results.append((prompt, n, chunks, end))

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(CLIENTS)]
    versions, reloads = {"A": models["A"]}, []
    try:
        for t in threads:
            t.start()
        for i in range(cycles):
            done = len(results)
            wait_until(lambda: len(results) >= done + 1, "a request to finish before the next reload")
            name = f"{'BA'[i % 2]}-{i}"
            versions[name] = models[name[0]]
            events = stack.client.reload(str(models[name[0]]), name, mode=MODES[i % 2], inflight=POLICIES[i % 3],
                                         timeout=TIMEOUT * 2)
            reloads.append((name, events[-1].done))
            if after_reload is not None:
                after_reload(i)
        done = len(results)
        wait_until(lambda: len(results) >= done + CLIENTS, "requests on the last version")
    finally:
        stop.set()
        for t in threads:
            t.join(TIMEOUT + 10)
        hung = [t for t in threads if t.is_alive()]
        st = stack.status()
        stack.close()
        target.stop(grace=None)
        draft.stop(grace=None)
    return {"results": results, "reloads": reloads, "status": st, "versions": versions, "hung": hung}


def check_tp_reloads(run: dict, models, ref, cycles: int) -> None:
    results, reloads, st = run["results"], run["reloads"], run["status"]
    assert not run["hung"], f"{len(run['hung'])} client threads hung"
    assert len(reloads) == cycles and all(ok for _, ok in reloads), reloads
    assert st["target"]["weights_version"] == reloads[-1][0] and st["target"]["used_slots"] == 0
    assert st["target"]["state"] == "LIFECYCLE_STATE_READY"
    finished = 0
    for prompt, n, chunks, end in results:
        assert end is not None
        if not isinstance(end, SpecsplitError):
            finished += 1
            assert end.tokens == tuple(t for c in chunks for t in c.tokens)
        check_segments(ref, models, prompt, chunks, run["versions"])   # what streamed is exact, even if aborted
    assert finished >= cycles
    served = {c.weights_version for _, _, chunks, _ in results for c in chunks}
    assert len(served) >= cycles // 2, served                 # tokens came from many versions, not one


@pytest.mark.parametrize("tp", [2, 3])
def test_reloads_under_traffic_with_a_tp_target_keep_every_token_exact(models, tp):
    cycles = 6
    check_tp_reloads(run_tp_reloads(models, tp, cycles), models, TorchReference(), cycles)
