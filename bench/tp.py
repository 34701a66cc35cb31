"""``specsplit bench tp``: the target verify step on one device vs tensor-parallel on several (issues 14, 15).

Owns: timing the target's verify step (k+1 positions, through the graph registry:
padding, input copies, replay; CUDA graphs on GPUs, with the TP collectives captured
inside them) of the ~1B config of ``bench graphs`` (``BIG``, bf16) at batch 1 and 32,
context 256, for TP=1 (the plain ``TargetEngine`` in this process) and each TP of
``--tp`` (e.g. ``--tp 2 3``; ``TPTargetEngine`` on ranks 0..tp-1, one spawned process
per GPU, NCCL; shares that tp does not divide are uneven, ``runtime/tp_plan.py``), and the
control-plane cost rank 0 pays per step to hand a verify's inputs to the other ranks.

Each rank builds random weights of its own shard shapes (timing only: the ranks'
values do not form one model), runs the same steps in the same order (so the
collectives pair up) and rank 0 reports. On the CPU (``--small``) it is a gloo smoke
run of the same code.

Must not know: gRPC, the worker's lifecycle (it drives engines and registries directly).
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import time
from typing import Any

import numpy as np

from bench.graphs import BIG, SMALL, _time
from runtime.backends import make_ops, make_tp_group
from runtime.batch_layout import Row, layout_rows
from runtime.config import CacheConfig, RuntimeConfig
from runtime.graphs import GraphRegistry
from runtime.model import init_params, target_tensor_shapes
from runtime.target_engine import TargetEngine
from runtime.tp_engine import TPTargetEngine
from runtime.tp_plan import Rendezvous, TPPlan

BATCHES = (1, 32)
CONTEXT = 256
MAX_LEN = 1024


def _inputs(cfg, k: int, b: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = [Row(i, CONTEXT, rng.integers(0, cfg.vocab_size, k + 1)) for i in range(b)]
    lay = layout_rows(rows, k + 1, max(BATCHES), MAX_LEN)
    return {"tokens": lay.tokens, "write_slots": lay.write_slots, "positions": lay.positions,
            "read_slots": lay.read_slots}


def _rank(rank: int, tp: int, port: int, device: str, small: bool, k: int, iters: int, out: Any) -> None:
    """One rank: its shard of random weights, TPTargetEngine, capture, time the same steps as the others."""
    cfg = SMALL if small else BIG
    dev = f"cuda:{int(device[5:]) + rank}" if device.startswith("cuda:") else device
    # Plain ops on both sides (TP ranks do not run the fused kernels yet: tp_worker.py).
    rt = RuntimeConfig(backend="torch", device=dev, dtype="float32" if small else "bfloat16", fused_kernels=False)
    ops = make_ops(rt)
    ops.bind_thread()
    group = make_tp_group(rt, Rendezvous(rank, tp, "127.0.0.1", port))
    plan = TPPlan(cfg, tp, rank)
    local = plan.local_cfg()
    arrays = init_params(local, 1 + rank, target_tensor_shapes(local))
    arrays["lm_head.weight"] = plan.shard("lm_head.weight", arrays["lm_head.weight"])
    params = {n: ops.from_numpy(arrays.pop(n)) for n in list(arrays)}
    reg = GraphRegistry(ops, BATCHES)
    eng = TPTargetEngine(ops, plan, params, CacheConfig(max_slots=max(BATCHES), max_len=MAX_LEN), k, reg, group)
    reg.capture_all()
    row: dict[str, Any] = {}
    for b in BATCHES:
        inp = _inputs(cfg, k, b)
        row[f"tp_verify_ms@{b}"] = _time(lambda: reg.run(eng._verify_kind, inp), iters, ops.synchronize) * 1e3
    # The control plane: rank 0 hands one verify's inputs (batch 32) to the others.
    command = ("run", eng._verify_kind, _inputs(cfg, k, max(BATCHES)))
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        if rank == 0:
            group.send(command)
        else:
            group.receive()
    row["control_us_per_step"] = (time.perf_counter() - t0) / n * 1e6
    reg.clear()
    if rank == 0:
        out.put(row)
    group.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(args) -> int:
    device, small, k = args.device, args.small or not args.device.startswith("cuda"), args.k
    tps = sorted({int(t) for t in (getattr(args, "tp", None) or [2])})            # default: TP=2
    if not tps or min(tps) < 2:
        raise SystemExit("specsplit: bench tp: --tp: rank counts of 2 or more (TP=1 is always timed)")
    iters = 5 if small else 200
    cfg = SMALL if small else BIG
    # TP=1: the production single-device path.
    rt = RuntimeConfig(backend="torch", device=device, dtype="float32" if small else "bfloat16", fused_kernels=False)
    ops = make_ops(rt)
    ops.bind_thread()
    reg = GraphRegistry(ops, BATCHES)
    params = {n: ops.from_numpy(a) for n, a in init_params(cfg, 1, target_tensor_shapes(cfg)).items()}
    eng = TargetEngine(ops, cfg, params, CacheConfig(max_slots=max(BATCHES), max_len=MAX_LEN), k, reg)
    reg.capture_all()
    one = {b: _time(lambda: reg.run(eng._verify_kind, _inputs(cfg, k, b)), iters, ops.synchronize) * 1e3
           for b in BATCHES}
    reg.clear()
    del eng, params, reg
    ops.empty_cache()
    # Each TP size in turn: one spawned process per rank.
    ctx = multiprocessing.get_context("spawn")
    per_tp: dict[int, dict] = {}
    for tp in tps:
        out, port = ctx.Queue(), _free_port()
        procs = [ctx.Process(target=_rank, args=(r, tp, port, device, small, k, iters, out)) for r in range(tp)]
        for p in procs:
            p.start()
        per_tp[tp] = out.get(timeout=1800)
        for p in procs:
            p.join(60)
    result = {"model": "small (cpu smoke, gloo)" if small else "llama-1b-shaped d2048 L16 bf16", "device": device,
              "tp": list(tps), "k": k, "context": CONTEXT,
              "rows": [{"batch": b, "tp1_verify_ms": round(one[b], 4),
                        **{f"tp{tp}_verify_ms": round(per_tp[tp][f"tp_verify_ms@{b}"], 4) for tp in tps},
                        **{f"tp{tp}_speedup": round(one[b] / per_tp[tp][f"tp_verify_ms@{b}"], 3) for tp in tps}}
                       for b in BATCHES],
              "control_us_per_step": {f"tp{tp}": round(per_tp[tp]["control_us_per_step"], 1) for tp in tps}}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"bench tp: {result['model']} on {device}, verify k+1={k + 1} positions, context {CONTEXT}; "
          f"collectives {'NCCL' if device.startswith('cuda') else 'gloo'}; ms per verify (speedup over TP=1)")
    print(f"{'batch':>5s} {'TP=1 ms':>9s} " + " ".join(f"{f'TP={tp} ms':>16s}" for tp in tps))
    for r in result["rows"]:
        print(f"{r['batch']:5d} {r['tp1_verify_ms']:9.3f} "
              + " ".join(f"{r[f'tp{tp}_verify_ms']:9.3f} (x{r[f'tp{tp}_speedup']:.2f})" for tp in tps))
    for tp in tps:
        print(f"control plane TP={tp} (rank 0 -> others, one verify's inputs at batch {max(BATCHES)}): "
              f"{result['control_us_per_step'][f'tp{tp}']:.0f} us per step")
    return 0
