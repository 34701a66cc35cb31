"""``specsplit bench gemv``: the small-batch projections, cuBLAS vs the Triton GEMV tiles (GPU).

Owns: for the projections of the ~1B config (``bench graphs``' BIG: q/k/v, o, gate/up,
down, output head) at 1, 4 and 16 rows, bf16, the time of one call of cuBLAS
(``F.linear``) and of each Triton tile shape (``runtime/backends/torch_gemv.py``), each
replayed inside a CUDA graph, side by side in one run, with the bytes-per-second each
reaches and the share of the measured copy rate; the choice ``SmallGemm`` makes.

Must not know: models, engines, services.
"""

from __future__ import annotations


def main(args) -> int:
    import torch

    from bench.graphs import BIG
    from runtime.backends.torch_gemv import SmallGemm

    if not args.device.startswith("cuda"):
        print("bench gemv: needs a CUDA device (--device cuda:N)")
        return 2
    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    d, f, v = BIG.hidden_size, BIG.intermediate_size, BIG.vocab_size
    kv = BIG.num_key_value_heads * BIG.head_dim
    shapes = {"qkv": (d + 2 * kv, d), "o": (d, d), "gate_up": (2 * f, d), "down": (d, f), "head": (v, d)}
    src = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    from runtime.backends.torch_gemv import _graph_ms
    rate = src.numel() * 2 / (_graph_ms(lambda: dst.copy_(src)) * 1e-3)          # read + write bytes/s
    del src, dst
    sg = SmallGemm()
    print(f"bench gemv: {args.device} bf16, one call replayed in a CUDA graph; copy rate {rate / 1e12:.2f} TB/s")
    print(f"{'proj':8s} {'rows':>4s} {'N':>6s} {'K':>5s} {'cublas us':>9s} {'triton us':>9s} {'tile':>20s} "
          f"{'cublas %':>8s} {'triton %':>8s} {'choice':>7s}")
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        for m in (1, 4, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            sg.linear(x, w)
            key = (m, n, k, torch.bfloat16)
            t = sg.timings[key]
            tri = {kk: vv for kk, vv in t.items() if kk != "cublas"}
            best = min(tri, key=tri.get)
            byte_ms = w.numel() * 2 / rate * 1e3
            print(f"{name:8s} {m:4d} {n:6d} {k:5d} {t['cublas'] * 1e3:9.2f} {tri[best] * 1e3:9.2f} {best:>20s} "
                  f"{100 * byte_ms / t['cublas']:7.0f}% {100 * byte_ms / tri[best]:7.0f}% "
                  f"{'cublas' if sg.choice[key] is None else 'triton':>7s}")
    return 0
