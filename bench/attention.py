"""``specsplit bench attention``: choosing the decode attention and measuring torch.compile (GPU).

Owns two side-by-side measurements, every variant captured in a CUDA graph
and timed by replay (median of 200):
  1. Decode attention over one slot's context, the shapes of the ~1B config
     (16 query heads / 4 KV heads, head dim 128, bf16, k+1 = 4 queries per
     row) at batch 1 and 8 and spans 512 / 4,096 of a flat KV cache: the
     gather of each slot's first ``span`` rows plus F.scaled_dot_product_attention
     under each SDPA backend (cuDNN, memory-efficient, math), and the earlier
     hand-written float32 masked attention; each checked against a float32
     reference.
  2. The fused split attention (``runtime/backends/torch_kernels.py``) at each
     minimum of keys per split (``attention_plan``'s ``min_split_keys``: 64 is
     the finest split, a span at most the minimum runs as one direct launch
     with no combine), batch 1, 8 and 32, spans 128 to 3,072, the split
     launch and its combine replayed together; each output against the finest
     split's.
  3. ``--compile``: the ~1B target verify step at batch 1, context 256
     (span 512), plain vs ``torch.compile`` (static shapes, and
     ``dynamic=True`` — one compile for every bucket and span), both under a
     CUDA graph; greedy argmax agreement with the plain step is printed.

Must not know: requests, services.
"""

from __future__ import annotations

import math
import time

import numpy as np


def _replay_ms(fn, iters=200) -> tuple:
    import torch

    with torch.no_grad():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del g
    return float(np.median(times)) * 1e3, out


def _handwritten(q, k, v, mask):
    import torch

    b, t, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    qg = q.reshape(b, t, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * t, d)
    scores = torch.matmul(qg.float(), k.permute(0, 2, 3, 1).float()) / math.sqrt(d)
    m = mask[:, None, None, :, :].expand(b, kvh, g, t, mask.shape[-1]).reshape(b, kvh, g * t, -1)
    probs = torch.softmax(scores.masked_fill(~m, float("-inf")), dim=-1)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3).float())
    return out.reshape(b, kvh, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h, d).to(q.dtype)


def attention_table(device: str) -> list[dict]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from runtime.backends.torch_ops import TorchOps

    ops = TorchOps(device, "bfloat16")
    h, kvh, d, t, max_len = 16, 4, 128, 4, 4096
    rows = []
    for b in (1, 8):
        cache_k = torch.randn(((b + 1) * max_len, kvh, d), device=device, dtype=torch.bfloat16)
        cache_v = torch.randn_like(cache_k)
        slots = torch.arange(b, device=device)
        for span in (512, 4096):
            ctx = span // 2 + 7
            q = torch.randn((b, t, h, d), device=device, dtype=torch.bfloat16)
            pos = torch.arange(ctx, ctx + t, device=device)[None].expand(b, t)
            mask = torch.arange(span, device=device)[None, None, :] <= pos[:, :, None]        # [B, T, span]
            ref = _handwritten(q.float(), ops.gather_context(cache_k, slots, span, max_len).float(),
                               ops.gather_context(cache_v, slots, span, max_len).float(), mask).float()

            def run(kind):
                def step():
                    k = ops.gather_context(cache_k, slots, span, max_len)
                    v = ops.gather_context(cache_v, slots, span, max_len)
                    if kind == "handwritten fp32":
                        return _handwritten(q, k, v, mask)
                    backend = {"sdpa cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa efficient": SDPBackend.EFFICIENT_ATTENTION,
                               "sdpa math": SDPBackend.MATH}[kind]
                    with sdpa_kernel([backend]):
                        return ops.attention(q, k, v, ops.attention_mask(mask, q.shape[2] // k.shape[2]))
                return step

            gather_ms, _ = _replay_ms(lambda: (ops.gather_context(cache_k, slots, span, max_len),
                                               ops.gather_context(cache_v, slots, span, max_len)))
            for kind in ("sdpa cudnn", "sdpa efficient", "sdpa math", "handwritten fp32"):
                try:
                    ms, out = _replay_ms(run(kind))
                    err = float((out.float() - ref).norm() / ref.norm())
                except RuntimeError as exc:                 # backend refuses these shapes
                    ms, err = float("nan"), str(exc).splitlines()[0][:60]
                rows.append({"batch": b, "span": span, "variant": kind, "ms": ms, "gather_ms": gather_ms, "rel_err": err})
    return rows


SPLIT_MINIMA = (64, 128, 256, 512, 1024, 4096)
REPEATS = 20                    # kernel calls per captured graph (one call is a few microseconds)


def split_table(device: str) -> list[dict]:
    """Microseconds a call of the fused split attention (split + combine) at each minimum of keys per split."""
    import torch

    from bench.gemm import _graph_us
    from runtime.backends.torch_attention import attention_plan
    from runtime.backends.torch_kernels import Kernels

    h, kvh, d, t, max_len = 16, 4, 128, 4, 4096
    rows = []
    for b in (1, 8, 32):
        cache_k = torch.randn(((b + 1) * max_len, kvh, d), device=device, dtype=torch.bfloat16)
        cache_v = torch.randn_like(cache_k)
        slots = torch.arange(b, device=device, dtype=torch.int64)
        for span in (128, 384, 768, 1536, 3072):
            ctx = span * 2 // 3
            q = torch.randn((b, t, h, d), device=device, dtype=torch.bfloat16)
            pos = torch.arange(ctx, ctx + t, device=device, dtype=torch.int64)[None].expand(b, t).contiguous()
            ref = None
            for least in SPLIT_MINIMA:
                _, per_split, nsplit = attention_plan(b, kvh, h // kvh, t, span, least)

                def call(least=least):
                    return Kernels.cache_attention(q, cache_k, cache_v, slots, pos, span, max_len, least)
                with torch.no_grad():
                    us, out = _graph_us(torch, [call] * REPEATS), call()
                ref = out.float() if ref is None else ref
                rows.append({"batch": b, "span": span, "min_split_keys": least, "splits": nsplit,
                             "keys_per_split": per_split, "us": us,
                             "max_abs_diff": float((out.float() - ref).abs().max())})
    return rows


def compile_table(device: str, k: int) -> list[dict]:
    import torch

    from bench.graphs import BIG, _random_params
    from runtime.backends.torch_ops import TorchOps
    from runtime.batch_layout import Row, layout_rows
    from runtime.config import CacheConfig
    from runtime.graphs import GraphRegistry
    from runtime.model import target_tensor_shapes
    from runtime.target_engine import TargetEngine

    torch._dynamo.config.cache_size_limit = 64
    ops = TorchOps(device, "bfloat16")
    target = TargetEngine(ops, BIG, _random_params(ops, BIG, target_tensor_shapes(BIG), 0),
                          CacheConfig(max_slots=2, max_len=4096), k, GraphRegistry(ops, (1,)))
    rng = np.random.default_rng(0)
    lay = layout_rows([Row(0, 256, rng.integers(0, BIG.vocab_size, k + 1))], k + 1, 2, 4096)
    inp = {n: torch.as_tensor(getattr(lay, n), device=device) for n in ("tokens", "write_slots", "positions", "read_slots")}
    rows = []
    plain_ms, plain_out = _replay_ms(lambda: target._step(**inp, attend_len=512))
    ref = plain_out[1].clone()
    rows.append({"variant": "plain step, graph", "ms": plain_ms, "compile_s": 0.0, "argmax_equal": True})
    for name, kw in (("torch.compile static, graph", {"dynamic": False}), ("torch.compile dynamic=True, graph", {"dynamic": True})):
        fn = torch.compile(target._step, **kw)
        t0 = time.perf_counter()
        with torch.no_grad():
            fn(**inp, attend_len=512)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        ms, out = _replay_ms(lambda: fn(**inp, attend_len=512))
        rows.append({"variant": name, "ms": ms, "compile_s": compile_s,
                     "argmax_equal": bool(torch.equal(out[1], ref))})
    return rows


def main(args) -> int:
    device = args.device if args.device.startswith("cuda") else "cuda:0"
    print(f"bench attention: the fused split attention by its minimum keys per split on {device} "
          "(16 q / 4 kv heads, head dim 128, 4 queries a row, bf16; graph replay medians, us)")
    table = split_table(device)
    print(f"{'batch':>5s} {'span':>5s} " + " ".join(f"{'min ' + str(m):>13s}" for m in SPLIT_MINIMA) + "  max |diff|")
    for i in range(0, len(table), len(SPLIT_MINIMA)):
        cells = table[i:i + len(SPLIT_MINIMA)]
        print(f"{cells[0]['batch']:5d} {cells[0]['span']:5d} "
              + " ".join(f"{c['us']:7.1f} ({c['splits']:3d})" for c in cells)
              + f"  {max(c['max_abs_diff'] for c in cells):.1e}")
    print("(splits in brackets; K/V of the small cases stay in the L2 cache across the repeats)")
    print(f"bench attention: decode attention variants on {device} (graph replay medians)")
    print(f"{'batch':>5s} {'span':>5s} {'variant':18s} {'ms':>8s} {'gather ms':>9s} {'rel err':>10s}")
    for r in attention_table(device):
        err = r["rel_err"]
        print(f"{r['batch']:5d} {r['span']:5d} {r['variant']:18s} {r['ms']:8.4f} {r['gather_ms']:9.4f} "
              + (f"{err:10.2e}" if isinstance(err, float) else f"  {err}"))
    if args.compile:
        print(f"torch.compile of the ~1B verify step (batch 1, context 256, span 512, k={args.k}):")
        for r in compile_table(device, args.k):
            print(f"  {r['variant']:34s} {r['ms']:8.3f} ms   compile {r['compile_s']:6.1f} s   "
                  f"argmax == plain: {r['argmax_equal']}")
    return 0
