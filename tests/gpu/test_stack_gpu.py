"""The three-service stack on two GPUs: draft on cuda:0 under CUDA graphs, target on cuda:1
(both on cuda:0 on a one-GPU host, the target still eager).

Run on an ``nvidia-h200-x2`` host: ``python3 -m pytest -m gpu tests/gpu/test_stack_gpu.py -s``.
Shows: greedy output through the stack identical to target-only; tokens/s of
both; the draft's graphs are live on its GPU while the target runs eagerly;
and a RECAPTURE reload clears the draft's graphs before its weights are
released even though the target has no graphs (regression test for "clear
draft graphs after releasing weights -> hang"), then recaptures them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from orchestrator.client import SpecsplitClient  # noqa: E402
from specsplit.launcher import Stack, StackOptions  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
TARGET = "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"


def _prompts(n: int) -> list[str]:
    return json.loads((TINY / "heldout_prompts.json").read_text())[:n]


def _decode(client: SpecsplitClient, prompts: list[str], k: int, max_tokens: int = 128):
    t0 = time.perf_counter()
    out = [client.generate_text(p, max_tokens=max_tokens, k=k, ignore_eos=True) for p in prompts]
    return out, time.perf_counter() - t0


def test_two_gpu_stack_greedy_equals_target_only_and_reload_order():
    opts = StackOptions(model=str(TINY), backend="torch", draft_device="cuda:0", target_device=TARGET,
                        k=3, max_batch=8, capture_draft=True, capture_target=False, log_level="WARNING",
                        admin_token="gpu-test-token")
    with Stack(opts) as stack, SpecsplitClient(stack.orchestrator_address, timeout=300,
                                               token="gpu-test-token") as client:
        status = client.status()
        assert status["draft"]["device"] == "cuda:0" and status["target"]["device"] == TARGET
        assert status["draft"]["graphs_mode"] == "cuda" and status["draft"]["graph_keys"]
        assert not status["target"]["graph_keys"]
        prompts = _prompts(8)
        _decode(client, prompts[:1], 3, 8)                               # warm-up
        _decode(client, prompts[:1], 0, 8)
        ref, t_ref = _decode(client, prompts, 0)
        spec, t_spec = _decode(client, prompts, 3)
        assert [r.tokens for r in spec] == [r.tokens for r in ref]
        n = sum(len(r.tokens) for r in spec)
        acc = sum(r.accepted for r in spec) / max(1, sum(r.drafted for r in spec))
        print(f"\n[gpu] draft cuda:0 (graphs), target {TARGET} (eager): target-only {n / t_ref:.1f} tok/s, "
              f"speculative {n / t_spec:.1f} tok/s (x{t_ref / t_spec:.2f}), acceptance {acc:.3f}, identical output")

        mem_before = int(client.status()["draft"]["device_memory_bytes"])
        events = client.reload(str(TINY), "v2", mode="recapture", inflight="wait")
        assert events[-1].done
        after = client.status()
        draft_events = list(after["draft"]["lifecycle_events"])
        last_clear = max(i for i, e in enumerate(draft_events) if e == "clear_graphs")
        last_release = max(i for i, e in enumerate(draft_events) if e == "release_weights")
        assert last_clear < last_release, f"draft released weights before clearing graphs: {draft_events}"
        assert after["draft"]["graph_keys"] and after["draft"]["weights_version"] == "v2"
        # The target had no graphs: the reload must not capture any there either.
        assert "capture_graphs" not in after["target"]["lifecycle_events"] and not after["target"]["graph_keys"]
        again, _ = _decode(client, prompts[:2], 3)
        assert [r.tokens for r in again] == [r.tokens for r in ref[:2]]
        mem_after = int(after["draft"]["device_memory_bytes"])
        print(f"[gpu] RECAPTURE reload: draft events {draft_events[-6:]}; draft memory "
              f"{mem_before / 2**20:.1f} -> {mem_after / 2**20:.1f} MiB; output unchanged")
