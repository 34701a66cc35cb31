"""``specsplit bench profile``: a Torch profiler summary of one speculative round at batch 1 (GPU).

Owns: building the ~1B bf16 config of ``bench graphs`` (target + MTP draft,
random weights, graphs captured at batch bucket 1), prefilling one request
at a given context, running warm rounds (``DraftEngine.propose`` with k
drafts, then ``TargetEngine.verify``) and profiling one of them. It prints:
  - round wall time, and the draft / verify split (host clock, synchronous),
  - GPU busy time (union of kernel intervals) and host gaps (wall - busy,
    plus the count of idle stretches > 20 us between kernels),
  - the top kernels by total GPU time,
at two contexts (256 and 2,048 tokens), so the before/after of the attention
work shows in one table. Uses only the engines' public calls, so it runs the
same on the code before and after a change (docs/performance.md keeps both).

With ``--small``: the bundled model in the in-process engine (graphs at buckets 1 and
8), greedy, at each ``--batch`` (default 1 and 8), target-only and k drafts side by
side: tokens/s and rounds of one timed generation, then a profiled generation: GPU
busy and host gap per round, the top kernels per round, and the top host functions
by own time (cProfile of the same generation's Python) — where a batch's round goes.

Must not know: gRPC or the services.
"""

from __future__ import annotations

import json
import time

import numpy as np

from bench.graphs import BIG, SMALL, _random_params
from runtime.backends import make_ops
from core.params import SamplingParams
from runtime.config import CacheConfig, RuntimeConfig
from runtime.draft_engine import DraftEngine
from runtime.graphs import GraphRegistry
from runtime.model import mtp_tensor_shapes, target_tensor_shapes
from runtime.target_engine import TargetEngine
from runtime.types import DraftPrefillRequest, PrefillRequest, ProposeRequest, VerifyRequest

CONTEXTS = (256, 2048)
MAX_LEN = 4096


def _build(device: str, k: int, compile_steps: bool = False):
    on_gpu = device.startswith("cuda")
    cfg = BIG if on_gpu else SMALL
    ops = make_ops(RuntimeConfig(backend="torch", device=device, dtype="bfloat16" if on_gpu else "float32",
                                   compile=compile_steps))
    cache = CacheConfig(max_slots=2, max_len=MAX_LEN)
    t_reg, d_reg = GraphRegistry(ops, (1,)), GraphRegistry(ops, (1,))
    target = TargetEngine(ops, cfg, _random_params(ops, cfg, target_tensor_shapes(cfg), 0), cache, k, t_reg)
    shared = {n: target.params[n] for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    draft = DraftEngine(ops, cfg, {**_random_params(ops, cfg, mtp_tensor_shapes(cfg), 1), **shared}, cache, k, d_reg)
    return ops, cfg, target, draft


class _Req:
    """One request's round state (the round driver's bookkeeping, reduced to batch 1)."""

    def __init__(self, ops, cfg, target, draft, rid: str, context: int, k: int) -> None:
        self.ops, self.target, self.draft, self.rid, self.k = ops, target, draft, rid, k
        rng = np.random.default_rng(context)
        prompt = rng.integers(0, cfg.vocab_size, context).astype(np.int64)
        res = target.prefill([PrefillRequest(rid, prompt, SamplingParams(max_tokens=MAX_LEN))])[0]
        tokens = np.concatenate([prompt[1:], [res.first_token]]).astype(np.int64)
        draft.prefill([DraftPrefillRequest(rid, tokens[:-1], res.hidden[:-1], SamplingParams(max_tokens=MAX_LEN))])
        self.pairs = len(tokens) - 1
        self.pending_tokens, self.pending_hidden = tokens[-1:], res.hidden[-1:]

    def round(self) -> tuple[float, float]:
        """One round; returns (draft seconds, verify seconds), host clock around each call."""
        t0 = time.perf_counter()
        prop = self.draft.propose([ProposeRequest(self.rid, self.pairs, self.pending_tokens, self.pending_hidden,
                                                  self.k)])[0]
        t1 = time.perf_counter()
        res = self.target.verify([VerifyRequest(self.rid, prop.drafts, None)])[0]
        t2 = time.perf_counter()
        self.pairs += len(self.pending_tokens)
        self.pending_tokens = np.asarray(res.tokens, dtype=np.int64)
        self.pending_hidden = res.hidden
        return t1 - t0, t2 - t1

    def release(self) -> None:
        self.target.release(self.rid)
        self.draft.release(self.rid)


def _kernel_summary(prof, wall_s: float, top: int) -> dict:
    """Kernels from the trace: GPU busy (union of intervals), gaps > 20 us, top kernels by time."""
    kernels = []
    for e in prof.events():
        dev = getattr(e, "device_type", None)
        if dev is not None and "CUDA" in str(dev) and e.time_range.elapsed_us() > 0:
            kernels.append((e.time_range.start, e.time_range.end, e.name))
    kernels.sort()
    busy, gaps, big_gaps, end = 0.0, 0.0, 0, None
    for s, e, _ in kernels:
        if end is None or s >= end:
            if end is not None:
                gaps += s - end
                big_gaps += int(s - end > 20)
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    by_name: dict[str, list[float]] = {}
    for s, e, name in kernels:
        by_name.setdefault(name, []).append(e - s)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"kernels": len(kernels), "gpu_busy_ms": round(busy / 1e3, 3), "wall_ms": round(wall_s * 1e3, 3),
            "host_gap_ms": round(wall_s * 1e3 - busy / 1e3, 3), "gaps_over_20us": big_gaps,
            "top": [{"name": n[:90], "calls": len(v), "total_us": round(sum(v), 1)} for n, v in ranked]}


def _host_summary(prof, top: int) -> list[dict]:
    """The host side of the same trace: CPU-side events by their own time, the top ``top`` —
    every thread's CUDA runtime calls (traced by the driver's tools), Torch's ops only of the
    thread that started the profiler. Nested events overlap their parents, so the rows do not
    sum to the wall time; what they show is which calls the host spends its microseconds in."""
    rows = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    rows.sort(key=lambda e: -e.self_cpu_time_total)
    return [{"name": e.key[:90], "calls": e.count, "self_us": round(e.self_cpu_time_total, 1)} for e in rows[:top]]


def _main_small(args) -> int:
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from bench.engine import TINY, heldout_prompts
    from runtime.config import EngineConfig, GraphConfig, SpecConfig
    from runtime.engine import GenRequest, SpecEngine
    from runtime.tokenizer import ByteTokenizer

    device, k, max_new = args.device, args.k, min(args.max_tokens, 64)
    batches = tuple(args.batch or (1, 8))
    engine = SpecEngine(EngineConfig(str(TINY), runtime=RuntimeConfig(backend="torch", device=device),
                                     spec=SpecConfig(max_k=k, default_k=k),
                                     cache=CacheConfig(max_slots=max(batches), max_len=512),
                                     graphs=GraphConfig(batch_buckets=tuple(sorted({1, *batches})))))
    on_gpu = device.startswith("cuda")
    if on_gpu:
        engine.capture_graphs()
    tok = ByteTokenizer()
    prompts = [tuple(tok.encode(p)[:96]) for p in heldout_prompts(max(batches))]
    params = SamplingParams(max_tokens=max_new, ignore_eos=True)

    def generate(b: int, kk: int):
        reqs = [GenRequest(f"p{kk}-{i}", prompts[i], params, kk) for i in range(b)]
        engine.ops.synchronize()
        t0 = time.perf_counter()
        got = engine.generate(reqs, max_batch=b)
        engine.ops.synchronize()
        return got, time.perf_counter() - t0

    print(f"bench profile --small: the bundled model in process, torch {device}, greedy, {max_new} tokens a request, "
          f"prompts <= 96 tokens; rounds of one generation")
    for b in batches:
        for kk in (0, k):
            generate(b, kk)                                          # warm-up
            got, wall = generate(b, kk)
            rounds = max(g.stats.rounds for g in got)
            tokens = sum(len(g.tokens) for g in got)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
            with profile(activities=activities) as prof:
                _, pwall = generate(b, kk)
            summary = _kernel_summary(prof, pwall, 8)
            host = cProfile.Profile()
            host.enable()
            generate(b, kk)
            host.disable()
            print(f"batch {b} k={kk}: {tokens / wall:8.1f} tok/s, {rounds} rounds, {1e3 * wall / rounds:.3f} ms a round; "
                  f"profiled: gpu busy {summary['gpu_busy_ms'] / rounds:.3f} ms a round, "
                  f"{summary['kernels'] / rounds:.0f} kernels a round")
            for t in summary["top"]:
                print(f"    {t['calls'] / rounds:6.1f} {t['total_us'] / rounds:8.1f} us/round  {t['name'][:70]}")
            text = io.StringIO()
            pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(10)
            lines = [ln for ln in text.getvalue().splitlines() if ln.strip()[:1].isdigit() and "function calls" not in ln]
            for ln in lines[:6]:
                print("    host " + ln.strip()[:150])
    return 0


def main(args) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    if args.small:
        return _main_small(args)
    device = args.device
    k = args.k
    ops, cfg, target, draft = _build(device, k, args.compile)
    reqs = {c: _Req(ops, cfg, target, draft, f"ctx{c}", c, k) for c in CONTEXTS}
    if device.startswith("cuda"):
        target.registry.capture_all()
        draft.registry.capture_all()
    out = {"k": k, "device": device, "rows": []}
    for c, req in reqs.items():
        for _ in range(5):
            req.round()
        ops.synchronize()
        splits = [req.round() for _ in range(20)]
        d_ms = float(np.median([s[0] for s in splits])) * 1e3
        v_ms = float(np.median([s[1] for s in splits])) * 1e3
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        ops.synchronize()
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            req.round()
            ops.synchronize()
            wall = time.perf_counter() - t0
        row = {"context": c, "draft_ms": round(d_ms, 3), "verify_ms": round(v_ms, 3),
               "round_ms": round(d_ms + v_ms, 3), **_kernel_summary(prof, wall, 12)}
        out["rows"].append(row)
    for req in reqs.values():
        req.release()
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"bench profile: one round at batch 1, k={k}, torch {device}, "
          + ("~1B bf16 (d=2048, 16 layers)" if device.startswith("cuda") else "small fp32 config (CPU smoke)")
          + f", max_len {MAX_LEN}; torch {torch.__version__}" + ("; runtime.compile on" if args.compile else ""))
    print(f"{'context':>7s} {'draft ms':>8s} {'verify ms':>9s} {'round ms':>8s} | profiled round: {'wall':>6s} "
          f"{'gpu busy':>8s} {'host gap':>8s} {'kernels':>7s} {'gaps>20us':>9s}")
    for r in out["rows"]:
        print(f"{r['context']:7d} {r['draft_ms']:8.3f} {r['verify_ms']:9.3f} {r['round_ms']:8.3f} | "
              f"{'':15s}{r['wall_ms']:6.3f} {r['gpu_busy_ms']:8.3f} {r['host_gap_ms']:8.3f} {r['kernels']:7d} "
              f"{r['gaps_over_20us']:9d}")
    for r in out["rows"]:
        print(f"top kernels, context {r['context']} (calls, total us):")
        for t in r["top"]:
            print(f"  {t['calls']:5d} {t['total_us']:9.1f}  {t['name']}")
    return 0
