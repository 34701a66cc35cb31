"""A split-K Triton GEMM for decode-shaped projections (CUDA, bf16/fp16, blocks of 16 rows).

Owns: ``splitk_linear(x, w, plan, counters)`` = ``x @ w.T`` for x [M, K], M in row blocks of
``MAX_ROWS`` (a program axis: each block is the launch of its rows alone) and a weight stored
as the model stores it (w [N, K], row-major), and ``plan(n, k)``, the launch shape it uses for
a weight of that shape; ``splitk_qkv_rope``, the q/k/v projection
with RoPE and the KV-cache write as its epilogue (a head a column tile; the bits of the GEMM
followed by torch_kernels' ``rope_write_kv``); ``splitk_swiglu``, SwiGLU's gate/up projection
with silu(gate) * up as its epilogue (a tile holds gate and up rows of the same outputs; the
bits of the GEMM followed by ``silu_mul``); and ``preload_plan``, a launch shape whose
programs read their whole weight slice before waiting for the kernel ahead of them, for a
programmatic dependent launch (the o projection after the attention).
Why: at one to sixteen rows a projection is a weight read. cuBLAS tiles N only, so a
2,048- or 3,072-column projection runs 32-48 thread blocks on an H200's 132 SMs and reads
its weight at 34-48 % of the copy rate (docs/performance.md § Session 11). This kernel also
splits K, so such a projection fills the SMs (``pays``: the o and down projections; the wider
q/k/v and gate/up measured no faster than cuBLAS, § Session 13), and reduces the splits without a second launch:
each program writes its partial sum, and the last program of a column tile to finish (an
atomic counter) adds the partials in split order and writes the tile. The sum order is
fixed, so the result does not depend on which program finishes last, and a row's result
does not depend on the other rows (the plan depends on (N, K) only): the same row gives the
same bits at one row or sixteen, or in any number of row blocks, as in a target-only step and
a verify (``torch_kernels.Kernels.gemm_row_blocks`` decides how many rows go to it).

Must not know: models, layers, engines. ``runtime/backends/torch_kernels.py`` decides when it
applies and owns the counters' buffer (allocated outside any CUDA graph's pool).

Every launch is shape-static (the plan is a function of the weight's shape), so a step
using it is captured into a CUDA graph like any other. With ``TRITON_INTERPRET=1`` it runs
on CPU tensors (how CI tests it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

MAX_ROWS = 16               # rows one program holds (the tensor-core dot's smallest width)
# Programs a launch aims for: one per SM of an H200 (132 SMs). NOTE: measured (bench gemm
# --sweep, docs/performance.md § Session 13): o and down (32 column tiles) are fastest split 4,
# and a weight of more than MAX_TILES column tiles is no faster than cuBLAS (q/k/v, 48 tiles:
# 7.1 against 6.6 us; gate/up a tie), so those stay on cuBLAS.
_TARGET_PROGRAMS = 132
MAX_TILES = 32
# K one program reduces at least (fewer, longer programs below it: each split costs a
# partial's write and read).
_MIN_SPLIT_K = 512


class Plan(NamedTuple):
    block_n: int            # output columns per program
    block_k: int            # K per loop step
    split: int              # programs along K (1: no partials, no counter)
    k_per_split: int        # K one program reduces (a multiple of block_k)
    warps: int
    stages: int
    preload: bool = False   # the whole slice (k_per_split, a power of two) read in one go (``preload_plan``)


@triton.jit
def _partial(x_ptr, w_ptr, M, N, K, n, k_lo, K_PER_SPLIT: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # acc[n, m] = sum over [k_lo, k_lo + K_PER_SPLIT) of w[n, k] x[m, k], float32; the weight
    # is the dot's left operand (the n rows), the padded rows of x its right one (MP columns).
    nm = n < N
    m = tl.arange(0, MP)
    mm = m < M
    acc = tl.zeros([BLOCK_N, MP], tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        k = k_lo + k0 + tl.arange(0, BLOCK_K)
        km = k < K
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        x = tl.load(x_ptr + m[None, :] * K + k[:, None], mask=mm[None, :] & km[:, None], other=0.0)
        acc += tl.dot(w, x, input_precision=PRECISION)
    return acc


@triton.jit
def _live(nm, mm, LIVE_ROWS: tl.constexpr):
    # The partials' entries a program writes and reads: its live columns, and with LIVE_ROWS
    # (row tiles wider than MAX_ROWS) its live rows only. NOTE: measured (bench graphs,
    # docs/performance.md § Session 19): on 16-row tiles the row mask made the ~1B verify at
    # batch 1 ~45 us slower (its stores no longer vectorise along the rows); not there.
    if LIVE_ROWS:
        return nm[:, None] & mm[None, :]
    else:
        return nm[:, None]


@triton.jit
def _arrive(part_ptr, count_ptr, acc, tile, pid_n, pid_k, N, live, MP: tl.constexpr, SPLIT: tl.constexpr):
    # Store this program's partial (partials [SPLIT, N, MP] float32, its tile at [pid_k, n, :];
    # only the live [n, m] entries: padded rows cost no traffic) and count it in; True for the
    # last program of the column tile, which then reads all.
    tl.store(part_ptr + pid_k * N * MP + tile, acc, mask=live)
    # NOTE: every thread's partial store is issued before the counter moves (the
    # barrier), and the counter's acq_rel atomic publishes them to the program that
    # sees the count reach SPLIT - 1 and reads them after it.
    tl.debug_barrier()
    return tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel") == SPLIT - 1


@triton.jit
def _total(part_ptr, tile, N, live, MP: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    # The partials of one tile summed in split order: the same bits every run (0 where not live).
    total = tl.zeros([BLOCK_N, MP], tl.float32)
    for s in range(SPLIT):
        total += tl.load(part_ptr + s * N * MP + tile, mask=live, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _row_block(M, MP: tl.constexpr):
    # Program axis 2: the row block r, rows [r * MP, r * MP + MP) of the launch. Each block is
    # the launch of its rows alone (its own partials and counters), so a row's bits never depend
    # on the other rows, however many. -> (r, its first row, the rows from there on). Only
    # launches of more than MP rows take it (ROW_BLOCKS): one block compiles as before.
    r = tl.program_id(2)
    return r, r * MP, M - r * MP


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K,
                   K_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr, MP: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                   PRELOAD: tl.constexpr, PDL: tl.constexpr, ROW_BLOCKS: tl.constexpr, LIVE_ROWS: tl.constexpr):
    # y[m, n] = sum over k of x[m, k] w[n, k]: program (column tile, split) reduces its K range.
    # PDL: launched as a programmatic dependent launch, which may start while the kernel before
    # it (whose output x is) still runs; gdc_wait waits for that kernel's end.
    # NOTE: nothing but the weight is read before gdc_wait, and nothing is written: y, the
    # partials and the counters may share memory the kernel before it still uses.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if ROW_BLOCKS:                                      # more than MP rows: this program's block
        r, r0, M = _row_block(M, MP)
        x_ptr, y_ptr = x_ptr + r0 * K, y_ptr + r0 * N
        part_ptr, count_ptr = part_ptr + r * SPLIT * N * MP, count_ptr + r * tl.num_programs(0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    m = tl.arange(0, MP)
    mm = m < M
    k_lo = pid_k * K_PER_SPLIT
    if PRELOAD:
        # the program's whole weight slice [BLOCK_N, K_PER_SPLIT] loaded into registers before
        # the wait (so the reads really happen while the kernel before runs), one dot after it
        kk = k_lo + tl.arange(0, K_PER_SPLIT)
        kmask = kk < K
        w_all = tl.load(w_ptr + n[:, None].to(tl.int64) * K + kk[None, :], mask=nm[:, None] & kmask[None, :],
                        other=0.0)
        if PDL:
            gdc_wait()
        x_all = tl.load(x_ptr + m[None, :] * K + kk[:, None], mask=mm[None, :] & kmask[:, None], other=0.0)
        acc = tl.dot(w_all, x_all, input_precision=PRECISION)
    else:
        if PDL:
            gdc_wait()
        acc = _partial(x_ptr, w_ptr, M, N, K, n, k_lo, K_PER_SPLIT, MP, BLOCK_N, BLOCK_K, PRECISION)
    out = y_ptr + m[None, :] * N + n[:, None]
    if SPLIT == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=nm[:, None] & mm[None, :])
    else:
        tile = n[:, None] * MP + m[None, :]
        live = _live(nm, mm, LIVE_ROWS)
        if _arrive(part_ptr, count_ptr, acc, tile, pid_n, pid_k, N, live, MP, SPLIT):
            total = _total(part_ptr, tile, N, live, MP, BLOCK_N, SPLIT)
            tl.store(out, total.to(y_ptr.dtype.element_ty), mask=nm[:, None] & mm[None, :])
            # NOTE: the counter goes back to 0 for the next launch, which (stream order)
            # starts only after this one has finished.
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed")


@triton.jit
def _splitk_rope_kernel(x_ptr, w_ptr, part_ptr, count_ptr, cos_ptr, sin_ptr, trow_ptr, widx_ptr, q_ptr, kc_ptr,
                        vc_ptr, M, N, K, K_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr, MP: tl.constexpr,
                        D: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr, SWAP_IN_REGS: tl.constexpr, INDEXED: tl.constexpr,
                        ROW_BLOCKS: tl.constexpr, LIVE_ROWS: tl.constexpr):
    # The fused q/k/v projection with RoPE and the KV-cache write as its epilogue: a column
    # tile is one head (D columns of x @ w^T, heads in the order q (H), k (KVH), v (KVH)).
    # The last program of a tile rounds the head's sum to the model's dtype, as the
    # projection's output is, then does what torch_kernels' rope_write_kv does with it:
    # q and k rotated (x*cos + [x2, x1]*sin with the sign-folded sin table, cos/sin [M, D], or
    # INDEXED: tables read at row trow[m]), q to q [M, H, D], k and v to cache row widx[m].
    # The rotation's other half is the same sum at the columns rotated by D/2, read from the
    # partials too (SWAP_IN_REGS: taken from the tile's own sum by swapping its halves in
    # registers, the same values).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if ROW_BLOCKS:                                      # as in _splitk_kernel
        r, r0, M = _row_block(M, MP)
        x_ptr, q_ptr, widx_ptr = x_ptr + r0 * K, q_ptr + r0 * H * D, widx_ptr + r0
        part_ptr, count_ptr = part_ptr + r * SPLIT * N * MP, count_ptr + r * tl.num_programs(0)
        if INDEXED:
            trow_ptr += r0
        else:
            cos_ptr, sin_ptr = cos_ptr + r0 * D, sin_ptr + r0 * D
    d = tl.arange(0, D)
    n = pid_n * D + d
    nm = n < N
    m = tl.arange(0, MP)
    mm = m < M
    acc = _partial(x_ptr, w_ptr, M, N, K, n, pid_k * K_PER_SPLIT, K_PER_SPLIT, MP, D, BLOCK_K, PRECISION)
    tile = n[:, None] * MP + m[None, :]
    live = _live(nm, mm, LIVE_ROWS)
    if _arrive(part_ptr, count_ptr, acc, tile, pid_n, pid_k, N, live, MP, SPLIT):
        dt = q_ptr.dtype.element_ty
        x = _total(part_ptr, tile, N, live, MP, D, SPLIT).to(dt).to(tl.float32)     # [D, MP]
        out_m = mm[None, :] & (d >= 0)[:, None]
        row = tl.load(widx_ptr + m, mask=mm, other=0)                                 # k/v cache rows
        if pid_n < H + KVH:
            if SWAP_IN_REGS:
                # the halves of x swapped in registers: [x2, x1] without a second pass over the partials
                lo, hi = tl.split(tl.permute(tl.reshape(x, [2, D // 2, MP]), [1, 2, 0]))     # [D/2, MP] each
                xs = tl.reshape(tl.permute(tl.join(hi, lo), [2, 0, 1]), [D, MP])
            else:
                sw = pid_n * D + (d + D // 2) % D
                xs = _total(part_ptr, sw[:, None] * MP + m[None, :], N, live, MP, D, SPLIT).to(dt).to(tl.float32)
            tr = tl.load(trow_ptr + m, mask=mm, other=0) if INDEXED else m               # table rows
            c = tl.load(cos_ptr + tr[None, :] * D + d[:, None], mask=out_m, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + tr[None, :] * D + d[:, None], mask=out_m, other=0.0).to(tl.float32)
            rot = x * c + xs * s
            if pid_n < H:
                tl.store(q_ptr + (m[None, :] * H + pid_n) * D + d[:, None], rot.to(dt), mask=out_m)
            else:
                tl.store(kc_ptr + (row[None, :] * KVH + pid_n - H) * D + d[:, None], rot.to(kc_ptr.dtype.element_ty),
                         mask=out_m)
        else:
            tl.store(vc_ptr + (row[None, :] * KVH + pid_n - H - KVH) * D + d[:, None],
                     x.to(vc_ptr.dtype.element_ty), mask=out_m)
        tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed")      # NOTE: as in _splitk_kernel


@triton.jit
def _splitk_swiglu_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, F, K, K_PER_SPLIT: tl.constexpr,
                          SPLIT: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PRECISION: tl.constexpr, ROW_BLOCKS: tl.constexpr, LIVE_ROWS: tl.constexpr):
    # SwiGLU's gate/up projection with silu(gate) * up as its epilogue: w [2F, K] holds the
    # gate rows [0, F) and the up rows [F, 2F) (the model's fused gate_up weight). A column
    # tile of BLOCK_N weight rows interleaves them: tile row 2i is gate row f, row 2i + 1 up
    # row F + f, f = pid_n * BLOCK_N / 2 + i, so the tile's program (or the last of its
    # splits) holds both halves of BLOCK_N / 2 outputs. Each half is rounded to the model's
    # dtype, as the projection's output is, then silu_mul's math: the bits of the split-K GEMM
    # followed by torch_kernels' silu_mul, without the [M, 2F] output's write and read.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if ROW_BLOCKS:                                      # as in _splitk_kernel
        r, r0, M = _row_block(M, MP)
        x_ptr, y_ptr = x_ptr + r0 * K, y_ptr + r0 * F
        part_ptr = part_ptr + r * SPLIT * tl.num_programs(0) * BLOCK_N * MP
        count_ptr = count_ptr + r * tl.num_programs(0)
    i = tl.arange(0, BLOCK_N)
    f = pid_n * (BLOCK_N // 2) + i // 2
    n = tl.where(f < F, f + (i % 2) * F, 2 * F)               # 2F: a padded row, masked in _partial
    m = tl.arange(0, MP)
    mm = m < M
    acc = _partial(x_ptr, w_ptr, M, 2 * F, K, n, pid_k * K_PER_SPLIT, K_PER_SPLIT, MP, BLOCK_N, BLOCK_K, PRECISION)
    last = True
    if SPLIT > 1:
        # partials [SPLIT, tiles * BLOCK_N, MP], indexed by the tile's own rows
        j = pid_n * BLOCK_N + i
        tile = j[:, None] * MP + m[None, :]
        nv = tl.num_programs(0) * BLOCK_N
        live = _live(j < nv, mm, LIVE_ROWS)
        last = _arrive(part_ptr, count_ptr, acc, tile, pid_n, pid_k, nv, live, MP, SPLIT)
        if last:
            acc = _total(part_ptr, tile, nv, live, MP, BLOCK_N, SPLIT)
    if last:
        dt = y_ptr.dtype.element_ty
        gu = tl.permute(tl.reshape(acc.to(dt).to(tl.float32), [BLOCK_N // 2, 2, MP]), [0, 2, 1])
        g, u = tl.split(gu)                                                      # [BLOCK_N / 2, MP] each
        a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        fo = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + m[None, :] * F + fo[:, None], (a * u).to(dt), mask=(fo < F)[:, None] & mm[None, :])
        if SPLIT > 1:
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed")  # NOTE: as in _splitk_kernel


def plan(n: int, k: int, block_n: int = 64) -> Plan:
    """The launch shape for a weight [n, k]: ``block_n`` columns a program (64; a head's width
    for ``splitk_qkv_rope``), K split in powers of two until the launch has about
    ``_TARGET_PROGRAMS`` programs, each reducing at least ``_MIN_SPLIT_K``."""
    block_k = 128
    tiles = triton.cdiv(n, block_n)
    split = 1
    while tiles * split * 2 <= _TARGET_PROGRAMS and k // (split * 2) >= _MIN_SPLIT_K:
        split *= 2
    per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    return Plan(block_n, block_k, triton.cdiv(k, per), per, 4, 5)


def preload_plan(n: int, k: int) -> Plan | None:
    """The launch shape that holds each program's whole weight slice in registers, 64 x 512
    (8 warps), when the weight splits into such slices that fit one wave (``_TARGET_PROGRAMS``):
    the ~1B o projection [2048, 2048] as 32 x 4. None otherwise. NOTE: measured as a dependent
    launch after a 4 us kernel (``bench gemm-pdl``): 3.73 us against 5.68 for ``plan``."""
    per = 512
    tiles, split = triton.cdiv(n, 64), k // per
    if k % per or split < 2 or tiles * split > _TARGET_PROGRAMS:
        return None
    return Plan(64, 128, split, per, 8, 1, True)


def pays(n: int, k: int) -> bool:
    """Whether a weight [n, k] goes to this GEMM: few column tiles, so cuBLAS (N tiles only)
    would leave most SMs idle, and a K long enough to split."""
    p = plan(n, k)
    return triton.cdiv(n, p.block_n) <= MAX_TILES and p.split > 1


def counters_needed(n: int, p: Plan, rows: int = 1, block_rows: int = MAX_ROWS) -> int:
    """Counter slots a launch of ``p`` over n columns and ``rows`` rows uses (0 without a split)."""
    return triton.cdiv(n, p.block_n) * row_blocks(rows, block_rows) if p.split > 1 else 0


def row_blocks(rows: int, block_rows: int = MAX_ROWS) -> int:
    """Row blocks of ``block_rows`` a launch over ``rows`` rows runs (program axis 2)."""
    return max(1, triton.cdiv(rows, block_rows))


def splitk_linear(x: torch.Tensor, w: torch.Tensor, p: Plan, counters: torch.Tensor,
                  pdl: bool = False, block_rows: int = MAX_ROWS) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] in x's dtype, M in row blocks of ``block_rows`` (a power of
    two from ``MAX_ROWS``; one launch, a row's bits those of its block alone, for one
    ``block_rows``). ``counters``: int32 zeros, at least ``counters_needed(N, p, M, block_rows)``
    of them, left zero again by every launch. ``pdl`` (CUDA, compute capability 9.0+): a
    programmatic dependent launch."""
    m, k = x.shape
    n = w.shape[0]
    rb = row_blocks(m, block_rows)
    x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = (torch.empty((rb, p.split, n, block_rows), dtype=torch.float32, device=x.device) if p.split > 1 else y)
    _splitk_kernel[(triton.cdiv(n, p.block_n), p.split, rb)](
        x, w, y, part, counters, m, n, k, K_PER_SPLIT=p.k_per_split, SPLIT=p.split, MP=block_rows,
        BLOCK_N=p.block_n, BLOCK_K=p.block_k, num_warps=p.warps, num_stages=p.stages,
        # float32 stays float32 (a tensor-core dot would take it as TF32: other math)
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PRELOAD=p.preload, PDL=pdl, ROW_BLOCKS=rb > 1,
        LIVE_ROWS=block_rows > MAX_ROWS,
        launch_pdl=pdl)
    return y


def splitk_qkv_rope(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                    kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, write_index: torch.Tensor,
                    counters: torch.Tensor, swap_in_regs: bool = False,
                    table_rows: torch.Tensor | None = None, block_rows: int = MAX_ROWS) -> torch.Tensor:
    """x [M, K] (in row blocks, as ``splitk_linear``) @ w[(H + 2 KVH) D, K]^T with RoPE and the
    cache write as its epilogue: returns the rotated q [M, H, D]; the rotated k and the v heads go to cache rows
    ``write_index`` [M]. cos/sin [M, D], or with ``table_rows`` [M] tables [P, D] read at those
    rows (the RoPE tables at each token's position: no gather launch). The same bits as
    ``splitk_linear`` with the plan of ``plan(N, K, D)`` followed by torch_kernels'
    ``rope_write_kv``. ``counters``: int32 zeros, H + 2 KVH a row block, left zero again.
    ``swap_in_regs``: RoPE's swapped halves from the tile's own sum instead of a second read of
    the partials (the same bits)."""
    m, k = x.shape
    n = w.shape[0]
    d = n // (heads + 2 * kv_heads)
    p = plan(n, k, d)
    x = x.contiguous()
    rb = row_blocks(m, block_rows)
    q = torch.empty((m, heads, d), dtype=x.dtype, device=x.device)
    part = torch.empty((rb, p.split, n, block_rows), dtype=torch.float32, device=x.device)
    # NOTE: the kernel indexes write_index and table_rows as dense [M]; a fused propose's
    # substep positions are a strided column (runtime/fused_propose.py), read as dense they gave
    # batch rows past the first another row's RoPE angle (drafts differed from the per-substep path).
    write_index = write_index.contiguous()
    rows = write_index if table_rows is None else table_rows.contiguous()
    _splitk_rope_kernel[(heads + 2 * kv_heads, p.split, rb)](
        x, w, part, counters, cos.contiguous(), sin.contiguous(), rows,
        write_index, q, k_cache, v_cache, m, n, k,
        K_PER_SPLIT=p.k_per_split, SPLIT=p.split, MP=block_rows, D=d, H=heads, KVH=kv_heads, BLOCK_K=p.block_k,
        num_warps=p.warps, num_stages=p.stages, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        SWAP_IN_REGS=swap_in_regs, INDEXED=table_rows is not None, ROW_BLOCKS=rb > 1,
        LIVE_ROWS=block_rows > MAX_ROWS)
    return q


def splitk_swiglu(x: torch.Tensor, w: torch.Tensor, counters: torch.Tensor, block_n: int = 64,
                  block_rows: int = MAX_ROWS) -> torch.Tensor:
    """silu(x @ w[:F]^T) * (x @ w[F:]^T) for x [M, K] (in row blocks, as ``splitk_linear``) and
    the fused gate/up weight w [2F, K], in one launch with the plan of ``plan(2F, K, block_n)`` (``block_n`` weight
    rows a program, half of them gate rows): -> [M, F]. The same bits as ``splitk_linear`` with
    that plan followed by torch_kernels' ``silu_mul``. ``counters``: int32 zeros, at least
    ``counters_needed(2F, plan(2F, K, block_n), M)`` of them, left zero again."""
    m, k = x.shape
    f = w.shape[0] // 2
    p = plan(2 * f, k, block_n)
    x = x.contiguous()
    y = torch.empty((m, f), dtype=x.dtype, device=x.device)
    tiles, rb = triton.cdiv(2 * f, p.block_n), row_blocks(m, block_rows)
    part = (torch.empty((rb, p.split, tiles * p.block_n, block_rows), dtype=torch.float32, device=x.device)
            if p.split > 1 else y)
    _splitk_swiglu_kernel[(tiles, p.split, rb)](
        x, w, y, part, counters, m, f, k, K_PER_SPLIT=p.k_per_split, SPLIT=p.split, MP=block_rows,
        BLOCK_N=p.block_n, BLOCK_K=p.block_k, num_warps=p.warps, num_stages=p.stages,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", ROW_BLOCKS=rb > 1,
        LIVE_ROWS=block_rows > MAX_ROWS)
    return y
