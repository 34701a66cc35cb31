"""Small-batch projections (GEMV) in Triton, chosen per shape against cuBLAS by timing (CUDA).

Owns: ``y = x @ W^T`` for a few rows of x (decode and verify steps: x [M <= 16, K],
W [N, K] in bf16 / fp16) as one Triton kernel that streams W once, in a handful
of tile shapes; and the choice, per (M, N, K, dtype), between cuBLAS
(``F.linear``) and each tile shape, made once by timing every candidate replayed
inside a CUDA graph (the launch cost on these hosts is tens of microseconds, so
timing single launches would measure the host, not the kernel).

Why: at these shapes a projection only reads its weight; the step is bound by
bytes. On an H200 cuBLAS reached 43% of the copy rate on the 2048x2048 and
3072x2048 projections of the ~1B config and 53% on its 2048x5632 one (split-K
plus a reduce kernel); see docs/performance.md § Small-batch projections.

Must not know: models, layers, requests. The model asks ``Kernels.linear`` (the
fused-kernel switch, ``runtime/backends/torch_kernels.py``); steps outside the
captured graphs run the plain ops, so this runs only in graphs and their warm-up.

Exactness: each output is one float32 dot product rounded once to x's dtype, as
cuBLAS does; only the summation order differs (bf16 rounding of the result may
differ in the last bit). Both the speculative and the target-only rounds replay
the same graphs, so greedy equality between them is unaffected.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 16                   # rows of x one program holds (tl.dot needs 16)
# (BLOCK_N, BLOCK_K, num_warps, num_stages): the candidate tile shapes.
TILES = ((16, 256, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4), (32, 512, 8, 3), (64, 256, 8, 3))
_REPS = 20                      # calls per timed graph
_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    # y[m, n] = sum_k x[m, k] w[n, k] over BLOCK_N output columns per program, all M rows
    # at once (padded to MP for the tensor-core dot), float32 accumulation. K is a
    # compile-time constant (a model has a few: d, 2d, ffn), N and M are not.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    m = tl.arange(0, MP)
    mm = m < M
    acc = tl.zeros([MP, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + m[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def gemv(x2: torch.Tensor, w: torch.Tensor, tile: tuple[int, int, int, int]) -> torch.Tensor:
    """x2 [M, K] (contiguous, M <= MAX_ROWS) @ w[N, K]^T -> [M, N] with one tile shape."""
    m, k = x2.shape
    n = w.shape[0]
    bn, bk, warps, stages = tile
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    _gemv_kernel[(triton.cdiv(n, bn),)](x2, w, y, m, n, K=k, MP=MAX_ROWS, BLOCK_N=bn, BLOCK_K=bk,
                                        num_warps=warps, num_stages=stages)
    return y


def _graph_ms(fn) -> float:
    """Median time of one call, from ``_REPS`` calls captured in a CUDA graph and replayed."""
    fn()                                                    # compile / warm outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(_REPS):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / _REPS)
    del graph
    return sorted(times)[len(times) // 2]


class SmallGemm:
    """``linear(x, w)``: the fastest of cuBLAS and the Triton tiles for this shape (chosen once)."""

    def __init__(self) -> None:
        # (M, N, K, dtype) -> None (cuBLAS) or a tile; filled when a shape is first seen outside
        # a capture. SPECSPLIT_GEMV=cublas|triton forces one side (tests, A/B runs).
        self.choice: dict[tuple, tuple[int, int, int, int] | None] = {}
        self.timings: dict[tuple, dict[str, float]] = {}
        self.force = os.environ.get("SPECSPLIT_GEMV", "")

    def fits(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1]
        return x.dtype in _DTYPES and w.dtype == x.dtype and rows <= MAX_ROWS and w.is_contiguous()

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if not self.fits(x, w):
            return F.linear(x, w)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        key = (x2.shape[0], w.shape[0], w.shape[1], x.dtype)
        if key not in self.choice:
            if x2.is_cuda and torch.cuda.is_current_stream_capturing():
                # NOTE: never time inside a capture; a shape first seen there keeps cuBLAS (every
                # captured step is warmed up first, so this is only a safety net).
                return F.linear(x, w)
            self.choice[key] = self._choose(x2, w, key)
        tile = self.choice[key]
        if tile is None:
            return F.linear(x, w)
        return gemv(x2, w, tile).view(*x.shape[:-1], w.shape[0])

    def _choose(self, x2: torch.Tensor, w: torch.Tensor, key: tuple) -> tuple[int, int, int, int] | None:
        if self.force == "cublas":
            return None
        if self.force == "triton" or not x2.is_cuda:
            return TILES[0]
        times = {"cublas": _graph_ms(lambda: F.linear(x2, w))}
        for tile in TILES:
            times[str(tile)] = _graph_ms(lambda t=tile: gemv(x2, w, t))
        self.timings[key] = times
        best = min(times, key=times.get)
        return None if best == "cublas" else next(t for t in TILES if str(t) == best)
