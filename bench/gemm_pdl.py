"""``specsplit bench gemm-pdl``: does a programmatic dependent launch let a decode GEMM read its
weight while the kernel before it runs? (GPU, compute capability 9.0 and up.)

Owns: two probes, each timed as CUDA-graph replays of 20 copies of a chain:
  - overlap: a kernel that spins ~8 us (and lets dependents launch at its start), then a
    second kernel that spins ~8 us *before* waiting on the first (``gdc_wait``): ~8 us a
    pair if the second launch really overlaps the first, ~16 us if it does not;
  - the o and down projections of ``bench graphs``' ~1B config at 4 rows (bf16, weights
    rotated through copies beyond the L2), each after a kernel that spins ~4 us the way
    the attention or the SiLU kernel runs before them, as: cuBLAS; ``torch_gemm``'s split-K
    kernel launched plainly; the same as a dependent launch that only waits; that also
    asks the L2 for its weight slice first (bulk prefetch, one instruction a row); that
    reads its slice with ordinary loads first (summed, so they complete, then read again
    from the L2); and, for o, that holds its whole slice in registers across the wait.
Prints each chain's microseconds over the spin kernel alone.

Why: a decode projection reads 8-46 MB at 37-79 % of the copy rate; most of what is lost is
its start (launch, the first loads' latency) and its end (the split-K reduction). A
dependent launch can move the weight's reads before the previous kernel ends. Session 14
measured the first two variants inside ``bench graphs``; this probe isolates them.

Must not know: models, engines. A copy of the split-K kernel with the variants as
compile-time switches lives here, not in ``runtime/backends/torch_gemm.py``.
"""

from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait, globaltimer

from runtime.backends import torch_gemm

COPIES_BYTES = 256 << 20
REPS = 20


@triton.jit
def spin(out_ptr, cycles, TRIGGER: tl.constexpr):
    if TRIGGER:
        gdc_launch_dependents()
    t0 = globaltimer()
    x = 0
    while globaltimer() - t0 < cycles:
        x += 1
    tl.store(out_ptr + tl.program_id(0), x)


@triton.jit
def spin_then_wait(out_ptr, cycles):
    t0 = globaltimer()
    x = 0
    while globaltimer() - t0 < cycles:
        x += 1
    gdc_wait()
    tl.store(out_ptr + tl.program_id(0), x)


@triton.jit
def gemm(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K, dummy_ptr,
         K_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr, MP: tl.constexpr,
         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr):
    # MODE 0 plain, 1 wait only, 2 bulk L2 prefetch then wait, 3 loads summed then wait,
    # 4 the whole slice in registers across the wait (one dot).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    m = tl.arange(0, MP)
    mm = m < M
    k_lo = pid_k * K_PER_SPLIT
    acc = tl.zeros([BLOCK_N, MP], tl.float32)
    if MODE == 2:
        nb = tl.where(nm, (tl.minimum(k_lo + K_PER_SPLIT, K) - k_lo) * 2, 16)
        row = tl.where(nm, w_ptr + n.to(tl.int64) * K + k_lo, w_ptr)
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r", [row, nb],
                                  dtype=tl.int32, is_pure=False, pack=1)
    if MODE == 3:
        s = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K_PER_SPLIT, BLOCK_K):
            k = k_lo + k0 + tl.arange(0, BLOCK_K)
            s += tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :],
                         mask=nm[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        tl.store(dummy_ptr + pid_n * SPLIT + pid_k, tl.sum(tl.sum(s, 1), 0))
    if MODE == 4:
        kk = k_lo + tl.arange(0, K_PER_SPLIT)
        w_all = tl.load(w_ptr + n[:, None].to(tl.int64) * K + kk[None, :], mask=nm[:, None] & (kk < K)[None, :],
                        other=0.0)
        gdc_wait()
        x_all = tl.load(x_ptr + m[None, :] * K + kk[:, None], mask=mm[None, :] & (kk < K)[:, None], other=0.0)
        acc = tl.dot(w_all, x_all)
    else:
        if MODE != 0:
            gdc_wait()
        for k0 in range(0, K_PER_SPLIT, BLOCK_K):
            k = k_lo + k0 + tl.arange(0, BLOCK_K)
            km = k < K
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            x = tl.load(x_ptr + m[None, :] * K + k[:, None], mask=mm[None, :] & km[:, None], other=0.0)
            acc += tl.dot(w, x)
    out = y_ptr + m[None, :] * N + n[:, None]
    tile = n[:, None] * MP + m[None, :]
    tl.store(part_ptr + pid_k * N * MP + tile, acc, mask=nm[:, None])
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
    if done == SPLIT - 1:
        total = tl.zeros([BLOCK_N, MP], tl.float32)
        for s2 in range(SPLIT):
            total += tl.load(part_ptr + s2 * N * MP + tile, mask=nm[:, None], other=0.0, cache_modifier=".cg")
        tl.store(out, total.to(y_ptr.dtype.element_ty), mask=nm[:, None] & mm[None, :])
        tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed")



def main(args) -> int:
    dev = args.device
    if not dev.startswith("cuda") or torch.cuda.get_device_capability(dev) < (9, 0):
        print("bench gemm-pdl: needs a CUDA device of compute capability 9.0 or more")
        return 2

    sink = torch.zeros(4096, dtype=torch.int32, device=dev)
    counters = torch.zeros(4096, dtype=torch.int32, device=dev)
    dummy = torch.zeros(4096, dtype=torch.float32, device=dev)

    def graph_us(fns) -> float:
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            for fn in fns:
                fn()
        times = []
        for _ in range(9):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / REPS)
        del g
        return statistics.median(times)

    def spin_fn(ns, trigger):
        return lambda: spin[(8,)](sink, ns, TRIGGER=trigger)

    print(f"bench gemm-pdl: {torch.cuda.get_device_name(dev)}, us per chain (median of 9 replays of {REPS} chains)")
    a_only = graph_us([spin_fn(8000, True)] * REPS)
    plain = graph_us([f for _ in range(REPS) for f in (spin_fn(8000, False),
                                                      lambda: spin[(8,)](sink, 8000, TRIGGER=False))])
    pdl = graph_us([f for _ in range(REPS) for f in (spin_fn(8000, True),
                                                    lambda: spin_then_wait[(8,)](sink, 8000, launch_pdl=True))])
    print(f"overlap probe: one 8 us spin {a_only:.2f}; two in a row {plain:.2f}; the second as a dependent launch "
          f"spinning before its wait {pdl:.2f} (overlap works if close to the first)")

    g = torch.Generator(device=dev).manual_seed(0)
    rows = 4
    pre_ns = 4000
    pre_alone = graph_us([spin_fn(pre_ns, True)] * REPS)
    print(f"{'proj':6s} {'[N, K]':>12s} {'cublas':>8s} {'plain':>8s} {'wait':>8s} {'bulk-pf':>8s} {'load-pf':>8s} "
          f"{'regs':>8s} {'floor':>8s}   (us over the {pre_alone:.2f} us spin kernel alone)")
    for name, (n, k) in {"o": (2048, 2048), "down": (2048, 5632)}.items():
        copies = max(REPS, COPIES_BYTES // (n * k * 2))
        ws = [(torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        x = torch.randn(rows, k, device=dev, generator=g).to(torch.bfloat16)
        p = torch_gemm.plan(n, k)
        y = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
        res = {}

        def chain(call):
            return [f for i in range(REPS) for f in (spin_fn(pre_ns, True), lambda i=i: call(ws[i % copies]))]

        res["cublas"] = graph_us(chain(lambda w: torch.matmul(x, w.T, out=y)))
        ref = x.float() @ ws[0].float().T
        for mode, col in ((0, "plain"), (1, "wait"), (2, "bulk-pf"), (3, "load-pf"), (4, "regs")):
            per, split = p.k_per_split, p.split
            if mode == 4:
                if name != "o":
                    res[col] = float("nan")
                    continue
                per, split = 512, triton.cdiv(k, 512)
            part = torch.empty((split, n, 16), dtype=torch.float32, device=dev)

            def call(w, mode=mode, per=per, split=split, part=part):
                gemm[(triton.cdiv(n, p.block_n), split)](
                    x, w, y, part, counters, rows, n, k, dummy, K_PER_SPLIT=per, SPLIT=split, MP=16,
                    BLOCK_N=p.block_n, BLOCK_K=p.block_k, MODE=mode, num_warps=8 if mode == 4 else p.warps,
                    num_stages=p.stages, launch_pdl=mode != 0)
            call(ws[0])
            torch.cuda.synchronize()
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, (name, col, err)
            res[col] = graph_us(chain(call))
        floor = n * k * 2 / 4.26e12 * 1e6
        print(f"{name:6s} {str([n, k]):>12s} " + " ".join(f"{v - pre_alone:8.2f}" for v in res.values())
              + f" {floor:8.2f}")
    return 0
