"""``specsplit bench graphs``: CUDA graphs vs eager vs the bare-framework floor (GPU).

Owns: a ~1B Llama-shaped target (d=2048, 16 layers, 16 heads / 4 KV heads,
FFN 5632, vocab 32000, random bf16 weights: timing only) and its MTP layer,
timed at batch buckets 1, 8, 32 for
  - draft substep (1 position): eager vs graph (through the registry, host
    work included: layout, input copies, replay),
  - target verify (k+1 positions): eager vs graph,
  - floor: the same step captured bare with the framework and replayed with
    no host work at all.
All numbers come from one process, side by side; ratios are printed.
"""

from __future__ import annotations

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

BIG = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
SMALL = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)   # CPU smoke run (no CUDA graphs there)
BUCKETS = (1, 8, 32)
CONTEXT = 256          # tokens already in each request's cache
MAX_LEN = 512


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

    static = {k: ops.from_numpy(v, None if v.dtype.kind == "f" else "int64") for k, v in inputs.items()}
    if not ops.device.startswith("cuda"):
        with torch.no_grad():
            return _time(lambda: step(**static), 10, ops.synchronize)
    with torch.no_grad():
        for _ in range(2):
            step(**static)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(**static)
    t = _time(g.replay, 200, torch.cuda.synchronize)
    del g
    return t


def main(args) -> int:
    device = args.device
    on_gpu = device.startswith("cuda")
    cfg = BIG if on_gpu else SMALL
    ops = make_ops(RuntimeConfig(backend="torch", device=device, dtype="bfloat16" if on_gpu else "float32"))
    k = args.k
    cache = CacheConfig(max_slots=max(BUCKETS), max_len=MAX_LEN)
    t_reg, d_reg = GraphRegistry(ops, BUCKETS), GraphRegistry(ops, BUCKETS)
    target = TargetEngine(ops, cfg, _random_params(ops, cfg, target_tensor_shapes(cfg), 0), cache, k, t_reg)
    shared = {n: target.params[n] for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    draft = DraftEngine(ops, cfg, {**_random_params(ops, cfg, mtp_tensor_shapes(cfg), 1), **shared}, cache, k, d_reg)
    rng = np.random.default_rng(0)

    def inputs_for(kind: str, b: int) -> dict:
        width = 1 if kind == "substep" else k + 1
        rows = [Row(i, CONTEXT, rng.integers(0, cfg.vocab_size, width)) for i in range(b)]
        lay = layout_rows(rows, width, cache.max_slots, MAX_LEN)
        base = {"tokens": lay.tokens, "write_slots": lay.write_slots, "positions": lay.positions,
                "read_slots": lay.read_slots}
        if kind == "substep":
            base["prev_hidden"] = rng.standard_normal((b, 1, cfg.hidden_size)).astype(np.float32)
            base["last_index"] = lay.last_index
        return base

    results = {}
    for kind, engine, reg, name in (("substep", draft, d_reg, SUBSTEP), ("verify", target, t_reg, target._verify_kind)):
        for b in BUCKETS:
            inp = inputs_for(kind, b)
            eager = _time(lambda: reg.run(name, inp), 30, ops.synchronize)
            floor = _floor(ops, engine._step, inp)
            results[(kind, b)] = {"eager_ms": eager * 1e3, "floor_ms": floor * 1e3}
    t_reg.capture_all()
    d_reg.capture_all()
    for kind, reg, name in (("substep", d_reg, SUBSTEP), ("verify", t_reg, target._verify_kind)):
        for b in BUCKETS:
            inp = inputs_for(kind, b)
            replayed = reg.run(name, inp)[1]
            assert replayed, f"{name}@{b} did not replay"
            results[(kind, b)]["graph_ms"] = _time(lambda: reg.run(name, inp), 200 if on_gpu else 10,
                                                   ops.synchronize) * 1e3
    rows = []
    for (kind, b), r in results.items():
        rows.append({"step": kind, "batch": b, **{k2: round(v, 4) for k2, v in r.items()},
                     "graph_speedup_vs_eager": round(r["eager_ms"] / r["graph_ms"], 2),
                     "graph_over_floor": round(r["graph_ms"] / r["floor_ms"], 3)})
    if args.json:
        print(json.dumps({"model": "llama-1b-shaped d2048 L16" if on_gpu else "small (cpu smoke)", "k": k,
                          "context": CONTEXT, "rows": rows}))
        return 0
    print(f"bench graphs: torch {device} " + ("bf16, d=2048 L=16" if on_gpu else
          "fp32 small config (CPU smoke run: 'graph' is the eager stand-in)") + f", k={k}, context {CONTEXT}")
    print(f"{'step':8s} {'batch':>5s} {'eager ms':>9s} {'graph ms':>9s} {'floor ms':>9s} {'eager/graph':>11s} {'graph/floor':>11s}")
    for r in rows:
        print(f"{r['step']:8s} {r['batch']:5d} {r['eager_ms']:9.3f} {r['graph_ms']:9.3f} {r['floor_ms']:9.3f} "
              f"{r['graph_speedup_vs_eager']:11.2f} {r['graph_over_floor']:11.3f}")
    return 0
