"""Attention over the flat KV cache for the Torch backend's fused decoder layer (CUDA, Triton).

Owns: ``cache_attention`` — grouped-query attention of a step's new tokens over each row's
slot prefix, read in place from the flat KV cache (no gather), split over the keys
(flash-decoding: ``_attention_split_kernel``) and combined (``_attention_combine_kernel``) —
and the two launch plans it runs on: ``attention_plan`` (the split follows the batch and the
span, the fastest) and ``invariant_attention_plan`` (tiles, split boundaries and the order of
the combine's sums fixed by the model and max_len alone: a row's bits do not depend on the
batch, the step's width or the span).

Must not know: models, requests, the other fused kernels (``torch_kernels.Kernels`` wraps this
one for the model, deciding ``early`` and ``invariant``).

Every launch is shape-static given its inputs' shapes (the split count too), so a step using it
is captured into a CUDA graph like any other; with ``TRITON_INTERPRET=1`` the kernels run on CPU
tensors (how CI tests them).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Key rows per block of the attention loop, and the programs the split
# attention aims for (about two waves of an H200's 132 SMs). A step's split
# count depends only on its shapes (batch, KV heads, span), never on the data.
_BLOCK_N = 64
_TARGET_PROGRAMS = 256
# Query rows one attention program holds (G query heads per K/V head times T
# new tokens); above this the model keeps the plain attention (long prefills).
# NOTE: 32, not 64: a program of 64 query rows (the bundled model's 32-token prefill
# graph, fp32, head dim 64) took 206 us per layer on an H200 against ~9 us at 32 rows;
# the prefill 2.09 -> 0.58 ms with it at 32 (`bench prefill`, docs/performance.md § Session 9).
MAX_QUERY_ROWS = 32
# Splits over max_len of a batch-invariant attention launch (``invariant_attention_plan``):
# the keys per split stay the same at every batch and span, so this bounds both the combine's
# tile and the partials a large batch writes (16 splits of 256 keys at max_len 4,096).
INVARIANT_SPLITS = 16


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


@triton.jit(do_not_specialize=["span", "max_len", "T", "TB", "nsplit"])
def _attention_split_kernel(q_ptr, kc_ptr, vc_ptr, slots_ptr, pos_ptr, out_ptr, acc_ptr, ml_ptr,
                            span, max_len, scale, T, TB, nsplit,
                            H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr,
                            D: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr,
                            DIRECT: tl.constexpr, KEYS_PER_SPLIT: tl.constexpr, EARLY: tl.constexpr):
    # Program (b*KVH + kh, split, token block tb): the G*TB query rows of K/V head kh of batch
    # row b for tokens [tb*TB, tb*TB + TB) (row r = g*TB + i is query head kh*G + g of token
    # tb*TB + i; TB = T, one block, unless the plan is batch-invariant) against keys
    # [split*keys_per_split, ...) of the slot's prefix, key j visible iff j <= pos[b, t]
    # and j < span. Online softmax (running max m, sum l, unnormalised acc); one split
    # writes the output, several write (acc, m, l) for _attention_combine_kernel.
    # EARLY: the dependent launch after this one (the combine, or the o projection after a
    # direct launch) may start now; it waits for this kernel's end before it reads.
    if EARLY:
        gdc_launch_dependents()
    bk = tl.program_id(0)
    sp = tl.program_id(1)
    tb = tl.program_id(2)
    b = (bk // KVH).to(tl.int64)
    kh = bk % KVH
    r = tl.arange(0, M)
    g = r // TB
    t = tb * TB + r % TB
    live = (r < G * TB) & (t < T)
    d = tl.arange(0, D)
    qoff = ((b * T + t) * H + kh * G + g) * D
    q = tl.load(q_ptr + qoff[:, None] + d[None, :], mask=live[:, None], other=0.0)
    pos = tl.load(pos_ptr + b * T + t, mask=live, other=-1)
    first_row = tl.load(slots_ptr + b) * max_len
    m_i = tl.full([M], -1.0e30, tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    start = sp * KEYS_PER_SPLIT
    end = tl.minimum(start + KEYS_PER_SPLIT, span)
    for j0 in range(0, KEYS_PER_SPLIT, BLOCK_N):       # the last split's tail is masked
        j = start + j0 + tl.arange(0, BLOCK_N)
        jm = j < end
        rows = (first_row + j) * KVH + kh
        k = tl.load(kc_ptr + rows[:, None] * D + d[None, :], mask=jm[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        vis = (j[None, :] <= pos[:, None]) & jm[None, :]
        s = tl.where(vis, s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(vis, tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + rows[:, None] * D + d[None, :], mask=jm[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    if DIRECT:
        out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
        tl.store(out_ptr + qoff[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=live[:, None])
    else:
        at = ((bk * tl.num_programs(2) + tb) * nsplit + sp) * M + r
        tl.store(acc_ptr + at[:, None] * D + d[None, :], acc)
        tl.store(ml_ptr + at * 2, m_i)
        tl.store(ml_ptr + at * 2 + 1, l_i)


@triton.jit(do_not_specialize=["T", "TB", "nsplit"])
def _attention_combine_kernel(acc_ptr, ml_ptr, out_ptr, T, TB, nsplit, H: tl.constexpr, KVH: tl.constexpr,
                              G: tl.constexpr, D: tl.constexpr, M: tl.constexpr, NSPLIT_P: tl.constexpr,
                              EARLY: tl.constexpr):
    # One program per (batch row x K/V head, query row r of token block tb):
    # out = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s, m = max_s m_s (splits that
    # saw no visible key carry m_s = -1e30 and weigh nothing). All splits of the row are
    # read as one [NSPLIT_P, D] tile: a serial loop over the splits in a handful of
    # programs cost ~22 us per layer at span 3,072 on an H200 (docs/performance.md).
    # NSPLIT_P is nsplit rounded up to a power of two, or (batch-invariant) a constant of the
    # model and max_len: the tile's shape fixes the order of the sums, the splits past
    # nsplit add exact zeros.
    # EARLY: itself a dependent launch of the split kernel: lets the o projection start, then
    # waits for the split kernel's end before reading its partials.
    if EARLY:
        gdc_launch_dependents()
        gdc_wait()
    bk = tl.program_id(0)
    r = tl.program_id(1)
    tb = tl.program_id(2)
    t = tb * TB + r % TB
    if t < T:
        b = (bk // KVH).to(tl.int64)
        kh = bk % KVH
        sp = tl.arange(0, NSPLIT_P)
        ok = sp < nsplit
        at = ((bk * tl.num_programs(2) + tb) * nsplit + sp) * M + r            # [NSPLIT_P]
        m_s = tl.load(ml_ptr + at * 2, mask=ok, other=-1.0e30)
        l_s = tl.load(ml_ptr + at * 2 + 1, mask=ok, other=0.0)
        w = tl.where(ok, tl.exp(m_s - tl.max(m_s, 0)), 0.0)
        den = tl.sum(w * l_s, 0)
        d = tl.arange(0, D)
        acc = tl.load(acc_ptr + at[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)   # [NSPLIT_P, D]
        out = tl.sum(w[:, None] * acc, 0) / tl.maximum(den, 1.0e-30)                         # [D]
        qoff = ((b * T + t) * H + kh * G + r // TB) * D
        tl.store(out_ptr + qoff + d, out.to(out_ptr.dtype.element_ty))


def attention_plan(batch: int, kv_heads: int, groups: int, tokens: int, span: int,
                   min_split_keys: int = _BLOCK_N) -> tuple[int, int, int]:
    """(query rows per program M, keys per split, split count) of one attention launch.

    A split holds at least ``min_split_keys`` keys (rounded up to a power-of-two number
    of blocks): with fewer splits the combine has less to read, and a span of at most
    that many keys runs as one direct launch with no combine at all. NOTE: the default
    (one block, the finest split) measured best or within 0.6 us of it at every batch and
    span graphs use; a direct launch walks its keys serially (``bench attention``,
    docs/performance.md § Session 11).

    NOTE: M and the keys per split are compile-time constants of the kernel and Triton
    compiles each new value (~1 s), so both take only powers of two: eager steps with ever
    new spans and widths reuse the kernels compiled for the captured graphs. The split
    count is a runtime argument."""
    blocks = triton.cdiv(span, _BLOCK_N)
    per_split = pow2(max(triton.cdiv(blocks, max(1, triton.cdiv(_TARGET_PROGRAMS, batch * kv_heads))),
                          triton.cdiv(min_split_keys, _BLOCK_N))) * _BLOCK_N
    return max(16, pow2(groups * tokens)), per_split, triton.cdiv(span, per_split)


def invariant_attention_plan(groups: int, max_len: int) -> tuple[int, int, int, int]:
    """(query rows per program M, tokens per program TB, keys per split, the combine's split
    tile NSPLIT_P) of a batch-invariant attention launch: functions of the model's grouping
    and max_len only, so a query row meets the same tiles, the same split boundaries and the
    same order of sums whatever the batch, the step's width and its span (``Kernels.invariant``).
    At most ``INVARIANT_SPLITS`` splits over max_len, at least one key block a split."""
    m = max(16, pow2(groups))
    per_split = max(_BLOCK_N, pow2(triton.cdiv(max_len, INVARIANT_SPLITS)))
    return m, m // groups, per_split, pow2(triton.cdiv(max_len, per_split))


def cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, read_slots: torch.Tensor,
                    positions: torch.Tensor, span: int, max_len: int,
                    min_split_keys: int = _BLOCK_N, early: bool = False, invariant: bool = False) -> torch.Tensor:
    """q [B, T, H, D] over the first ``span`` rows of each row's slot -> [B, T, H, D]
    (``min_split_keys``: see ``attention_plan``). ``early`` (``_gdc`` devices): the kernel
    after it may be a programmatic dependent launch that starts before this one ends.
    ``invariant``: on ``invariant_attention_plan`` (a row's bits those it has alone)."""
    b, t, h, d = q.shape
    kvh = k_cache.shape[1]
    g = h // kvh
    if invariant:
        m, tb, per_split, nsplit_p = invariant_attention_plan(g, max_len)
        nsplit = triton.cdiv(span, per_split)
    else:
        m, per_split, nsplit = attention_plan(b, kvh, g, t, span, min_split_keys)
        tb, nsplit_p = t, pow2(nsplit)
    ntb = triton.cdiv(t, tb)
    # NOTE: the kernels index read_slots, positions and q as dense [B], [B, T] and
    # [B, T, H, D]; a strided view (a substep's column of a fused propose's inputs) would
    # be read at the wrong rows for every batch row past the first (seen on an H200).
    q, read_slots, positions = q.contiguous(), read_slots.contiguous(), positions.contiguous()
    out = torch.empty_like(q)
    # NOTE: one split writes the output itself (DIRECT); batch-invariant, that is the same
    # division of the same sums as the combine's for a row whose keys lie in one split.
    if nsplit > 1:
        acc = torch.empty((b * kvh * ntb * nsplit * m, d), dtype=torch.float32, device=q.device)
        ml = torch.empty((b * kvh * ntb * nsplit * m, 2), dtype=torch.float32, device=q.device)
    else:
        acc = ml = out                                   # not written when nothing is split
    _attention_split_kernel[(b * kvh, nsplit, ntb)](q, k_cache, v_cache, read_slots, positions, out, acc, ml,
                                                    span, max_len, 1.0 / math.sqrt(d), t, tb, nsplit,
                                                    H=h, KVH=kvh, G=g, D=d, M=m, BLOCK_N=_BLOCK_N,
                                                    DIRECT=nsplit == 1, KEYS_PER_SPLIT=per_split, EARLY=early)
    if nsplit > 1:
        _attention_combine_kernel[(b * kvh, g * tb, ntb)](acc, ml, out, t, tb, nsplit, H=h, KVH=kvh, G=g, D=d,
                                                          M=m, NSPLIT_P=nsplit_p, EARLY=early, launch_pdl=early)
    return out
