"""``specsplit bench graphs``: CUDA graphs vs eager vs the bare-framework floor (GPU).

Owns: a ~1B Llama-shaped target (d=2048, 16 layers, 16 heads / 4 KV heads,
FFN 5632, vocab 32000, random bf16 weights: timing only) and its MTP layer,
timed at batch buckets 1, 8, 32 and contexts 256 and 2,048 (max_len 4,096) for
  - draft substep (1 position): eager vs graph (through the registry, host
    work included: layout, input copies, replay),
  - target verify (k+1 positions): eager vs graph,
  - floor: the same step (same context span) captured bare with the framework
    and replayed with no host work at all,
  - host us: the host's own time per registry step (queue idle before it),
  - the weight-bytes floor of a target step (weight bytes / measured copy rate),
  - the bare step again under other settings of the fused kernels (``VARIANTS``): on the
    plain ops, with every projection on cuBLAS (no split-K GEMM), without the o projection as a
    dependent launch that reads its weight during the attention (``Kernels.preload``), with up
    to 64 rows on the split-K GEMMs in row blocks (``Kernels.gemm_row_blocks`` = 4; the default
    1 sends more than 16 rows to cuBLAS), and batch-invariant (``Kernels.invariant_steps``,
    ``runtime.batch_invariant`` runs the target's verify so; the substep's column is for comparison).
All numbers come from one process, side by side; ratios are printed.
"""

from __future__ import annotations

import contextlib
import json
import time

import numpy as np

from runtime.backends import make_ops
from runtime.batch_layout import Row, layout_rows
from runtime.config import CacheConfig, ModelConfig, RuntimeConfig
from runtime.draft_engine import SUBSTEP, DraftEngine
from runtime.graphs import GraphRegistry
from runtime.model import init_params, mtp_tensor_shapes, target_tensor_shapes
from runtime.target_engine import TargetEngine
from core.progress import progress

BIG = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
SMALL = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)   # CPU smoke run (no CUDA graphs there)
BUCKETS = (1, 8, 32)
# Other settings of the fused kernels, each timed as a bare step beside the default one:
# column -> the Kernels attributes set for it (None: the plain ops).
# "invariant": the step inside ``Kernels.invariant_steps`` (``runtime.batch_invariant``);
# "invariant-16": so with ``Kernels.invariant_rows`` = 16.
# (The columns of earlier sessions' switches, each measured and kept: docs/performance.md.)
VARIANTS = {"plain": None, "cublas": {"linear_dtypes": ()}, "no-preload": {"preload": False},
            "row-blocks": {"gemm_row_blocks": 4}, "invariant": {}, "invariant-16": {"invariant_rows": 16}}
CONTEXTS = (256, 2048)  # tokens already in each request's cache
MAX_LEN = 4096


def _random_params(ops, cfg, names, seed):
    params = {}
    for name, arr in init_params(cfg, seed, names).items():
        params[name] = ops.from_numpy(arr)
    return params


def _time(fn, iters, sync) -> float:
    """Median-free simple mean over iters after 3 warm-ups (seconds per call)."""
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def _floor(ops, step, inputs: dict) -> float:
    """Capture ``step`` on static device inputs with torch directly; time bare replays.
    On CPU (smoke runs) the floor is the bare eager step on prebuilt tensors."""
    import torch

    from runtime.backends.torch_ops import gc_paused

    static = {k: ops.from_numpy(v, None if v.dtype.kind == "f" else "int64") for k, v in inputs.items()}
    if not ops.device.startswith("cuda"):
        with torch.no_grad():
            return _time(lambda: step(**static), 10, ops.synchronize)
    with torch.no_grad():
        for _ in range(2):
            step(**static)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with gc_paused(), torch.cuda.graph(g):
            step(**static)
    t = _time(g.replay, 200, torch.cuda.synchronize)
    del g
    return t


def _host_us(fn, iters, sync) -> float:
    """Host time of one call with an idle GPU queue (synchronised before, not after): the
    layout, uploads and launch the host does per step, without waiting for the GPU."""
    total = 0.0
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        total += time.perf_counter() - t0
    sync()
    return total / iters * 1e6


def _weight_floor_ms(ops, params, device) -> tuple[float, float]:
    """(weight bytes / device copy rate in ms, copy rate TB/s): the bandwidth floor of one step."""
    import torch

    nbytes = sum(int(p.numel()) * p.element_size() for p in params.values())
    if not device.startswith("cuda"):
        return 0.0, 0.0
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_(0, 255)
    y = torch.empty_like(x)
    t = _time(lambda: y.copy_(x), 20, torch.cuda.synchronize)
    rate = 2 * (1 << 30) / t
    return nbytes / rate * 1e3, rate / 1e12


def main(args) -> int:
    device = args.device
    on_gpu = device.startswith("cuda")
    cfg = BIG if on_gpu else SMALL
    compile_steps = args.compile
    ops = make_ops(RuntimeConfig(backend="torch", device=device, dtype="bfloat16" if on_gpu else "float32",
                                   compile=compile_steps))
    k = args.k
    cache = CacheConfig(max_slots=max(BUCKETS), max_len=MAX_LEN)
    t_reg, d_reg = GraphRegistry(ops, BUCKETS), GraphRegistry(ops, BUCKETS)
    target = TargetEngine(ops, cfg, _random_params(ops, cfg, target_tensor_shapes(cfg), 0), cache, k, t_reg)
    shared = {n: target.params[n] for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    draft = DraftEngine(ops, cfg, {**_random_params(ops, cfg, mtp_tensor_shapes(cfg), 1), **shared}, cache, k, d_reg)
    rng = np.random.default_rng(0)
    floor_w_ms, rate = _weight_floor_ms(ops, target.params, device)

    def inputs_for(kind: str, b: int, ctx: int) -> dict:
        width = 1 if kind == "substep" else k + 1
        rows = [Row(i, ctx, rng.integers(0, cfg.vocab_size, width)) for i in range(b)]
        lay = layout_rows(rows, width, cache.max_slots, MAX_LEN)
        base = {"tokens": lay.tokens, "write_slots": lay.write_slots, "positions": lay.positions,
                "read_slots": lay.read_slots}
        if kind == "substep":
            base["prev_hidden"] = rng.standard_normal((b, 1, cfg.hidden_size)).astype(np.float32)
            base["last_index"] = lay.last_index
        return base

    cases = [(kind, b, ctx) for kind in ("substep", "verify") for ctx in CONTEXTS for b in BUCKETS]
    engines = {"substep": (draft, d_reg, SUBSTEP), "verify": (target, t_reg, target._verify_kind)}
    results, inputs = {}, {}
    for kind, b, ctx in progress(cases, desc="bench graphs: eager and floor", unit="step"):
        engine, reg, name = engines[kind]
        inp = inputs[(kind, b, ctx)] = inputs_for(kind, b, ctx)
        span = reg.span_for(reg.kinds[name], int(inp["positions"].max()) + 1)
        eager = _time(lambda: reg.run(name, inp), 10 if on_gpu else 3, ops.synchronize)
        bare = lambda: _floor(ops, lambda **kw: engine._step(**kw, attend_len=span), inp)  # noqa: E731
        results[(kind, b, ctx)] = r = {"span": span, "eager_ms": eager * 1e3, "floor_ms": bare() * 1e3}
        for col, attrs in VARIANTS.items():         # the same bare step under other settings, side by side
            if attrs is None or ops.kernels is None:
                with ops.plain_ops():
                    r[f"{col}_ms"] = bare() * 1e3
                continue
            for a, v in attrs.items():
                setattr(ops.kernels, a, v)
            try:
                with ops.kernels.invariant_steps() if col.startswith("invariant") else contextlib.nullcontext():
                    r[f"{col}_ms"] = bare() * 1e3
            finally:
                for a in attrs:
                    delattr(ops.kernels, a)          # the class's setting again
    t_reg.capture_all()
    d_reg.capture_all()
    for kind, b, ctx in progress(cases, desc="bench graphs: replays", unit="step"):
        _, reg, name = engines[kind]
        inp = inputs[(kind, b, ctx)]
        assert reg.run(name, inp)[1], f"{name}@{b} did not replay"
        results[(kind, b, ctx)]["graph_ms"] = _time(lambda: reg.run(name, inp), 200 if on_gpu else 5,
                                                    ops.synchronize) * 1e3
        results[(kind, b, ctx)]["host_us"] = _host_us(lambda: reg.run(name, inp), 50 if on_gpu else 3, ops.synchronize)
    rows = []
    for (kind, b, ctx), r in results.items():
        rows.append({"step": kind, "batch": b, "context": ctx, **{k2: round(v, 4) for k2, v in r.items()},
                     "graph_speedup_vs_eager": round(r["eager_ms"] / r["graph_ms"], 2),
                     "graph_over_floor": round(r["graph_ms"] / r["floor_ms"], 3),
                     "graph_over_weight_floor": round(r["graph_ms"] / floor_w_ms, 2) if floor_w_ms else None})
    by = {(r["step"], r["batch"], r["context"]): r["graph_ms"] for r in rows}
    growth = {f"{kind}@{b}": round(by[(kind, b, CONTEXTS[-1])] / by[(kind, b, CONTEXTS[0])], 3)
              for kind in ("substep", "verify") for b in BUCKETS}
    if args.json:
        print(json.dumps({"model": "llama-1b-shaped d2048 L16" if on_gpu else "small (cpu smoke)", "k": k,
                          "contexts": CONTEXTS, "max_len": MAX_LEN, "weight_floor_ms": round(floor_w_ms, 4),
                          "copy_rate_TBps": round(rate, 3), "rows": rows, "growth_long_over_short": growth}))
        return 0
    print(f"bench graphs: torch {device} " + ("bf16, d=2048 L=16" if on_gpu else
          "fp32 small config (CPU smoke run: 'graph' is the eager stand-in)") + f", k={k}, max_len {MAX_LEN}, "
          f"contexts {CONTEXTS}; weight-bytes floor {floor_w_ms:.3f} ms per target step (copy {rate:.2f} TB/s); "
          f"fused kernels {'on' if ops.kernels is not None else 'off'}; the last columns time the bare step under "
          "other settings: 'plain' the plain ops, 'cublas' the fused kernels with every projection on cuBLAS, "
          "'no-preload' the o projection launched plainly, 'row-blocks' up to 64 rows on the split-K GEMMs, "
          "'invariant' the step batch-invariant (runtime.batch_invariant runs the target's verify so), "
          "'invariant-16' so on GEMM tiles of 16 rows instead of 32)")
    print(f"{'step':8s} {'batch':>5s} {'ctx':>5s} {'span':>5s} {'eager ms':>9s} {'graph ms':>9s} {'floor ms':>9s} "
          f"{'host us':>8s} {'eager/graph':>11s} {'graph/floor':>11s} {'graph/wfloor':>12s} "
          + " ".join(f"{c + ' ms':>10s}" for c in VARIANTS))
    for r in rows:
        wf = r["graph_over_weight_floor"]
        print(f"{r['step']:8s} {r['batch']:5d} {r['context']:5d} {r['span']:5d} {r['eager_ms']:9.3f} "
              f"{r['graph_ms']:9.3f} {r['floor_ms']:9.3f} {r['host_us']:8.1f} {r['graph_speedup_vs_eager']:11.2f} "
              f"{r['graph_over_floor']:11.3f} {wf if wf is not None else '-':>12} "
              + " ".join(f"{r[c + '_ms']:10.3f}" for c in VARIANTS))
    if floor_w_ms:
        print("verify, bare step over the weight floor: " + "; ".join(
            f"batch {r['batch']} context {r['context']}: " + " ".join(
                f"{c} {r[c + '_ms'] / floor_w_ms:.2f}" for c in ("floor", *VARIANTS))
            for r in rows if r["step"] == "verify"))
    print("graph time at context %d / at %d: " % (CONTEXTS[-1], CONTEXTS[0])
          + ", ".join(f"{key} {v:.2f}" for key, v in growth.items()))
    return 0
