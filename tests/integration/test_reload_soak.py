"""CPU soak of weight reload: 50 reloads alternating checkpoints A and B under concurrent Generate traffic.

Every combination of mode (RECAPTURE, IN_PLACE) and in-flight policy (WAIT,
ABORT, RECOMPUTE) recurs. What must hold:
- 0 hangs: every client call (60 s deadline) and every reload returns;
- every request ends with a final message (length / stop / aborted) — none
  lost, no error expected at all here;
- every greedy request's tokens, segment by segment, equal the target-only
  continuation under the weights version its chunks are labelled with (so the
  labels are honest and RECOMPUTE continues correctly on the new weights);
- no cache slot is left held on either worker;
- process RSS (workers and orchestrator all live in this process) stays flat:
  growth from cycle 10 to the end under RSS_TOLERANCE_MB.
Kept under ~3 minutes on a 2-core machine by the tiny model (d=32).
"""

from __future__ import annotations

import gc
import random
import threading
import time

import pytest

from orchestrator.client import SpecsplitClient, SpecsplitError
from tests.integration.reload_harness import Stack, check_segments, models, prompt_of, ref  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CYCLES = 50
CLIENTS = 4
CALL_TIMEOUT = 60.0
# Measured growth from cycle 10 to 50: 4-10 MB (allocator noise). A leaked engine per RECAPTURE (KV caches
# 1 + 0.5 MiB, weights 0.2 MiB) would add ~1.7 MiB x ~20 RECAPTURE cycles = ~34 MiB on top.
RSS_TOLERANCE_MB = 24.0
POLICIES = ("wait", "abort", "recompute")
MODES = ("recapture", "in_place")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_soak_50_reloads_under_traffic_all_policies(models, ref):
    s = Stack(models["A"], "A", max_batch=8, max_queue=64)
    stop = threading.Event()
    results: list[tuple] = []
    lock = threading.Lock()

    def client_loop(i: int) -> None:
        rng = random.Random(i)
        with SpecsplitClient(s.address, timeout=CALL_TIMEOUT) as c:
            while not stop.is_set():
                prompt = prompt_of(rng.randrange(40), rng.randrange(1, 40))
                n, k = rng.randrange(8, 80), rng.choice((0, 1, 3))
                sampled = rng.random() < 0.15
                kw = dict(k=k, temperature=0.8 if sampled else 0.0, seed=rng.randrange(1 << 30) if sampled else None)
                chunks, end = [], None
                t0 = time.monotonic()
                try:
                    for ev in c.generate(prompt, n, ignore_eos=True, **kw):
                        if ev.final:
                            end = ev
                        else:
                            chunks.append(ev)
                except SpecsplitError as exc:
                    end = exc
                with lock:
                    results.append((prompt, n, sampled, chunks, end, time.monotonic() - t0))

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(CLIENTS)]
    versions = {"A": models["A"]}
    reloads, rss = [], {}
    try:
        for t in threads:
            t.start()
        rng = random.Random(1234)
        for i in range(CYCLES):
            time.sleep(rng.uniform(0.05, 0.3))
            name = f"{'BA'[i % 2]}-{i}"
            versions[name] = models[name[0]]
            mode, policy = MODES[(i // 3) % 2], POLICIES[i % 3]
            t0 = time.monotonic()
            events = s.client.reload(str(models[name[0]]), name, mode=mode, inflight=policy, timeout=CALL_TIMEOUT)
            reloads.append((name, mode, policy, time.monotonic() - t0, events[-1].done))
            if i + 1 in (10, 20, 30, 40, CYCLES):
                gc.collect()
                rss[i + 1] = rss_mb()
    finally:
        stop.set()
        for t in threads:
            t.join(CALL_TIMEOUT + 10)
        hung = [t for t in threads if t.is_alive()]
        st = s.status()
        s.close()
    assert not hung, f"{len(hung)} client threads hung"
    assert len(reloads) == CYCLES and all(done for *_, done in reloads)

    errors = [(p, n, end) for p, n, _, _, end, _ in results if isinstance(end, SpecsplitError)]
    assert not errors, errors[:5]
    reasons = [end.finish_reason for *_, end, _ in results]
    assert set(reasons) <= {"length", "aborted"}, set(reasons)
    spanned = 0
    for prompt, n, sampled, chunks, end, _ in results:
        assert end.tokens == tuple(t for c in chunks for t in c.tokens)
        if end.finish_reason == "length":
            assert len(end.tokens) == n
        labels = {c.weights_version for c in chunks}
        spanned += len(labels) > 1
        if not sampled:
            check_segments(ref, models, prompt, chunks, versions)
    for role in ("target", "draft"):
        assert st[role]["used_slots"] == 0 and st[role]["weights_version"] == reloads[-1][0]
    growth = max(rss.values()) - rss[10]
    by = {(m, p): [] for m in MODES for p in POLICIES}
    for _, m, p, secs, _ in reloads:
        by[(m, p)].append(secs)
    print(f"\nsoak: {len(results)} requests ({reasons.count('aborted')} aborted, {spanned} spanned a reload), "
          f"{CYCLES} reloads; RSS MB at cycles {rss}: growth {growth:.1f} MB (tolerance {RSS_TOLERANCE_MB})")
    for (m, p), secs in by.items():
        print(f"  {m:9s} {p:9s} n={len(secs):2d} mean {sum(secs) / len(secs):.3f}s max {max(secs):.3f}s")
    assert reasons.count("aborted") > 0 and spanned > 0 and len(results) >= 100
    assert growth < RSS_TOLERANCE_MB, rss
