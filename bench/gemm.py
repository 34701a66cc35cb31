"""``specsplit bench gemm``: the ~1B projections at decode shapes, cuBLAS variants side by side (GPU).

Owns: for each projection of ``bench graphs``' ~1B config (q/k/v, o, gate/up, down, output
head) at 1, 4 and 16 rows, bf16, the time of one call of each variant, every variant replayed
inside a CUDA graph over enough copies of the weight that none is still in the L2 cache
when it is read again (an H200's L2 holds 50 MB; a weight replayed alone stays there and
every variant then looks faster than it is in a step), with the share of the measured
copy rate each reaches. Variants: ``F.linear(x, W)`` as the model runs it (W [N, K]),
``x @ Wt`` with the weight stored transposed (Wt [K, N] contiguous), and both again with
``torch.backends.cuda.preferred_blas_library("cublaslt")``. With ``--small``: the bundled
model's float32 projections instead (``small_table``).

Why: the verify step is ~0.8 ms of projections out of ~1.0, at 45-65 % of the copy
rate for all but gate/up and the head (docs/performance.md, session 6); a Triton GEMV
did not beat cuBLAS there. Which layout or library cuBLAS is fastest with is a
measurement, and this is it.

Must not know: models, engines, services.
"""

from __future__ import annotations

import statistics

COPIES_BYTES = 256 << 20        # rotate through at least this many bytes of weight copies


def _graph_us(torch, fns) -> float:
    """Median microseconds of one call, from one CUDA graph replaying every fn of ``fns`` once."""
    for fn in fns:
        fn()                                    # warm (and let cuBLAS pick its kernels) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for fn in fns:
            fn()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    del graph
    return statistics.median(times)


def small_table(torch, dev) -> None:
    """--small: the bundled model's float32 projections (d=256, ffn 704, vocab 258) at decode
    and verify row counts: F.linear as the model runs it, the operands swapped ((W x^T)^T,
    tried in session 11 and not kept), and F.linear with TF32 allowed (not used: it
    changes the math)."""
    import torch.nn.functional as F

    shapes = {"qkv": (512, 256), "o": (256, 256), "gate_up": (1408, 256), "down": (256, 704), "head": (258, 256)}
    print(f"bench gemm --small: {dev} float32, the bundled model's projections, one call replayed in a CUDA graph "
          "(20 calls a graph); us per call")
    print(f"{'proj':8s} {'rows':>4s} {'linear':>8s} {'swapped':>8s} {'tf32':>8s}")
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev) * 0.05
        for m in (4, 8, 16, 32, 64):
            x = torch.randn(m, k, device=dev)
            linear = _graph_us(torch, [lambda: F.linear(x, w)] * 20)
            swapped = _graph_us(torch, [lambda: torch.mm(w, x.t()).t().contiguous()] * 20)
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                tf32 = _graph_us(torch, [lambda: F.linear(x, w)] * 20)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = False
            print(f"{name:8s} {m:4d} {linear:8.2f} {swapped:8.2f} {tf32:8.2f}")


def main(args) -> int:
    import torch
    import torch.nn.functional as F

    from bench.graphs import BIG

    if not args.device.startswith("cuda"):
        print("bench gemm: needs a CUDA device (--device cuda:N)")
        return 2
    torch.cuda.set_device(torch.device(args.device))
    dev = torch.device(args.device)
    if args.small:
        small_table(torch, dev)
        return 0
    src = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    rate = 2 * src.numel() / (_graph_us(torch, [lambda: dst.copy_(src)]) * 1e-6)      # read + write bytes/s
    del src, dst
    d, f, v = BIG.hidden_size, BIG.intermediate_size, BIG.vocab_size
    kv = BIG.num_key_value_heads * BIG.head_dim
    shapes = {"qkv": (d + 2 * kv, d), "o": (d, d), "gate_up": (2 * f, d), "down": (d, f), "head": (v, d)}
    if args.sweep:
        splitk_table(torch, dev, rate, {k: v for k, v in shapes.items() if k != "head"}, sweep=True,
                     budget_s=args.seconds)
        return 0
    libs = ["default", "cublaslt"]
    print(f"bench gemm: {args.device} bf16, one call replayed in a CUDA graph over weight copies "
          f"(>= {COPIES_BYTES >> 20} MiB, no L2 reuse); copy rate {rate / 1e12:.2f} TB/s; "
          "us per call (share of the copy rate)")
    print(f"{'proj':8s} {'rows':>4s} " + " ".join(f"{name:>22s}" for name in
          [f"{lay} {lib}" for lib in libs for lay in ("linear", "x@Wt")]))
    for name, (n, k) in shapes.items():
        copies = max(1, COPIES_BYTES // (n * k * 2))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        byte_us = n * k * 2 / rate * 1e6
        for m in (1, 4, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cells = []
            for lib in libs:
                if lib != "default":
                    torch.backends.cuda.preferred_blas_library(lib)
                for fns in ([lambda w=w: F.linear(x, w) for w in ws], [lambda wt=wt: x @ wt for wt in wts]):
                    us = _graph_us(torch, fns)
                    cells.append(f"{us:8.2f} ({100 * byte_us / us:3.0f} %)")
                torch.backends.cuda.preferred_blas_library("cublas")
            print(f"{name:8s} {m:4d} " + " ".join(f"{c:>22s}" for c in cells))
        del ws, wts
    return 0


def _grid(n: int, k: int):
    """The split-K launch shapes ``--sweep`` times for a weight [n, k]."""
    import triton

    from runtime.backends.torch_gemm import Plan

    for block_n in (64, 32, 128):
        for block_k in (128, 256):
            for split in (1, 2, 4, 8, 16):
                per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
                if triton.cdiv(k, per) != split:
                    continue
                for stages in (3, 5):
                    yield Plan(block_n, block_k, split, per, 4, stages)


def splitk_table(torch, dev, rate: float, shapes: dict, sweep: bool, budget_s: float = 50.0) -> None:
    """F.linear against the split-K Triton GEMM (``runtime/backends/torch_gemm.py``) with its
    plan, at 1, 4 and 16 rows over weight copies; with ``sweep``, every grid shape at 4 rows
    (until ``budget_s`` a projection has passed), the best three then at 1 and 16 rows too."""
    import time

    import torch.nn.functional as F

    from runtime.backends.torch_gemm import counters_needed, plan, splitk_linear

    counters = torch.zeros(4096, dtype=torch.int32, device=dev)
    print(f"bench gemm: split-K Triton GEMM against F.linear, bf16, us per call (share of the "
          f"{rate / 1e12:.2f} TB/s copy rate); plan = (block_n, block_k, split, k_per_split, warps, stages)")
    for name, (n, k) in shapes.items():
        copies = max(1, COPIES_BYTES // (n * k * 2))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        byte_us = n * k * 2 / rate * 1e6
        xs = {m: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for m in (1, 4, 16)}

        def timed(p, m):
            assert counters_needed(n, p) <= counters.numel()
            return _graph_us(torch, [lambda w=w: splitk_linear(xs[m], w, p, counters) for w in ws])

        def cell(us):
            return f"{us:7.2f} ({100 * byte_us / us:3.0f} %)"

        p0 = plan(n, k)
        worst = max(float((splitk_linear(xs[16], ws[0], p0, counters).float()
                           - F.linear(xs[16], ws[0]).float()).abs().max()), 0.0)
        for m in (1, 4, 16):
            lin = _graph_us(torch, [lambda w=w: F.linear(xs[m], w) for w in ws])
            print(f"{name:8s} {m:4d} linear {cell(lin)}  plan {tuple(p0)} {cell(timed(p0, m))}"
                  + (f"  max |diff| {worst:.2e}" if m == 16 else ""))
        if sweep:
            found, start = [], time.monotonic()
            for p in _grid(n, k):
                if time.monotonic() - start > budget_s:
                    print(f"{name:8s} sweep: time budget spent")
                    break
                try:
                    found.append((timed(p, 4), p))
                except Exception as e:                    # a shape past the SM's shared memory
                    print(f"{name:8s} {tuple(p)}: {type(e).__name__}")
            for us, p in sorted(found)[:3]:
                print(f"{name:8s} best {tuple(p)}: rows 4 {cell(us)}, rows 1 {cell(timed(p, 1))}, "
                      f"rows 16 {cell(timed(p, 16))}")
        del ws
