"""``specsplit bench prefill``: a prefill eager vs replayed from a prefill graph, side by side.

Owns: timing what a request waits for at admission on each worker: the target's
``prefill`` (forward, output head on the last position, the one host sync) and the
draft's prefill of the same prompt's pairs, for prompt lengths and batches that fit the
prefill graphs and one that does not (eager either way), first eagerly (no graphs
captured) and then with the graphs live, in one process. Two models: the bundled one
(fp32) and the ~1B random bf16 config of ``bench graphs`` (on a GPU; a small config on
CPU, where the "graph" is the eager step and only the padding shows).

Prints medians (ms) and whether the first tokens match (greedy; fused kernels under the
graphs against plain ops eagerly, so they may differ only where the argmax is a near tie).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from bench.graphs import BIG, SMALL, _random_params
from core.params import SamplingParams
from runtime.backends import make_ops
from runtime.config import CacheConfig, EngineConfig, GraphConfig, RuntimeConfig, SpecConfig
from runtime.draft_engine import DraftEngine
from runtime.engine import SpecEngine
from runtime.graphs import GraphRegistry
from runtime.model import mtp_tensor_shapes, target_tensor_shapes
from runtime.target_engine import TargetEngine
from runtime.types import DraftPrefillRequest, PrefillRequest

TINY = Path(__file__).resolve().parents[1] / "models" / "tiny"
WIDTHS = GraphConfig().prefill_widths
BUCKETS = (1, 2, 4, 8)
CASES = ((1, 8), (1, 30), (1, 100), (1, 250), (1, 500), (4, 30), (1, 800))   # (batch, prompt tokens); 800: eager
MAX_LEN = 1024


def _bundled(device: str, k: int):
    eng = SpecEngine(EngineConfig(str(TINY), runtime=RuntimeConfig(backend="torch", device=device),
                                  spec=SpecConfig(max_k=k, default_k=k), cache=CacheConfig(max_slots=8, max_len=MAX_LEN),
                                  graphs=GraphConfig(batch_buckets=BUCKETS, prefill_graphs=True, prefill_widths=WIDTHS)))
    return eng.ops, eng.target, eng.draft, eng.model_cfg.vocab_size


def _random(device: str, k: int):
    on_gpu = device.startswith("cuda")
    cfg = BIG if on_gpu else SMALL
    ops = make_ops(RuntimeConfig(backend="torch", device=device, dtype="bfloat16" if on_gpu else "float32"))
    cache = CacheConfig(max_slots=8, max_len=MAX_LEN)
    target = TargetEngine(ops, cfg, _random_params(ops, cfg, target_tensor_shapes(cfg), 0), cache, k,
                          GraphRegistry(ops, BUCKETS), prefill_widths=WIDTHS)
    shared = {n: target.params[n] for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    draft = DraftEngine(ops, cfg, {**_random_params(ops, cfg, mtp_tensor_shapes(cfg), 1), **shared}, cache, k,
                        GraphRegistry(ops, BUCKETS), prefill_widths=WIDTHS)
    return ops, target, draft, cfg.vocab_size


def _time_prefills(ops, target, draft, prompts, reps: int) -> tuple[float, float, list[int]]:
    """Median ms of the target's prefill and of the draft's, and the first tokens."""
    t_ms, d_ms, first = [], [], []
    for rep in range(reps + 2):                          # two warm-up rounds
        reqs = [PrefillRequest(f"p{rep}-{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
        ops.synchronize()
        t0 = time.perf_counter()
        res = target.prefill(reqs)
        t1 = time.perf_counter()
        draft.prefill([DraftPrefillRequest(r.request_id, np.asarray(r.prompt[1:], dtype=np.int64), x.hidden[:-1],
                                           r.params) for r, x in zip(reqs, res)])
        ops.synchronize()
        t2 = time.perf_counter()
        for r in reqs:
            target.release(r.request_id)
            draft.release(r.request_id)
        if rep >= 2:
            t_ms.append((t1 - t0) * 1e3)
            d_ms.append((t2 - t1) * 1e3)
        first = [x.first_token for x in res]
    return statistics.median(t_ms), statistics.median(d_ms), first


def _profile(ops, target, prompts, label: str) -> str:
    """A Torch profiler summary of one target prefill (graphs live): GPU busy, host gap, top kernels."""
    from torch.profiler import ProfilerActivity, profile

    from bench.profile_round import _kernel_summary

    reqs = [PrefillRequest(f"prof-{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
    ops.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        target.prefill(reqs)
        wall = time.perf_counter() - t0
    for r in reqs:
        target.release(r.request_id)
    s = _kernel_summary(prof, wall, 6)
    top = ", ".join(f"{t['name'][:40]} {t['calls']}x {t['total_us']:.0f} us" for t in s["top"])
    return (f"profile, target prefill {label}: wall {s['wall_ms']} ms, GPU busy {s['gpu_busy_ms']} ms, "
            f"{s['kernels']} kernels; top: {top}")


def main(args) -> int:
    rng = np.random.default_rng(0)
    reps = 20
    rows, captures, profiles = [], [], []
    for model, build in (("tiny", _bundled), ("1b" if args.device.startswith("cuda") else "small", _random)):
        ops, target, draft, vocab = build(args.device, args.k)
        prompts = {case: [tuple(int(x) for x in rng.integers(0, vocab, case[1])) for _ in range(case[0])]
                   for case in CASES}
        eager = {case: _time_prefills(ops, target, draft, prompts[case], reps) for case in CASES}
        t0 = time.perf_counter()
        target.registry.capture_all()
        draft.registry.capture_all()
        keys = target.registry.span_keys() + draft.registry.span_keys()
        captures.append(f"{model}: {len(keys)} graphs ({sum(k.startswith('prefill') for _, k, _ in keys)} prefill) "
                        f"captured in {time.perf_counter() - t0:.2f} s")
        for case in CASES:
            te, de, fe = eager[case]
            tg, dg, fg = _time_prefills(ops, target, draft, prompts[case], reps)
            rows.append({"model": model, "batch": case[0], "prompt": case[1], "target_eager_ms": round(te, 3),
                         "target_graph_ms": round(tg, 3), "draft_eager_ms": round(de, 3),
                         "draft_graph_ms": round(dg, 3), "same_first_tokens": fe == fg})
        if args.device.startswith("cuda") and model == "tiny":
            profiles += [_profile(ops, target, prompts[case], f"{model} B={case[0]} prompt {case[1]}")
                         for case in ((1, 8), (1, 30))]
        target.registry.clear()
        draft.registry.clear()
    if args.json:
        print(json.dumps({"rows": rows, "captures": captures}))
        return 0
    print(f"bench prefill: torch {args.device}, widths {WIDTHS}, batch buckets {BUCKETS}, medians of {reps} (ms; "
          "a prompt of 800 tokens runs eagerly either way)")
    print(f"{'model':6s} {'B':>2s} {'prompt':>6s}   {'target eager':>12s} {'graph':>7s} {'ratio':>6s}   "
          f"{'draft eager':>11s} {'graph':>7s} {'ratio':>6s}  same first tokens")
    for r in rows:
        print(f"{r['model']:6s} {r['batch']:2d} {r['prompt']:6d}   {r['target_eager_ms']:12.3f} "
              f"{r['target_graph_ms']:7.3f} x{r['target_eager_ms'] / r['target_graph_ms']:5.2f}   "
              f"{r['draft_eager_ms']:11.3f} {r['draft_graph_ms']:7.3f} x{r['draft_eager_ms'] / r['draft_graph_ms']:5.2f}"
              f"  {r['same_first_tokens']}")
    print("; ".join(captures))
    for p in profiles:
        print(p)
    return 0
