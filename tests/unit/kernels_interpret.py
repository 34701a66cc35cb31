"""Run by ``test_fused_kernels.py`` in a subprocess with ``TRITON_INTERPRET=1`` (Triton reads
it when the kernels are defined). ``kernels``: the fused decoder-layer kernels on CPU tensors,
each against the plain ops it replaces, and a fused propose against the per-substep path at
batch 3; ``engine PROMPTS TOKENS``: the bundled model's greedy decoding with the kernels on
against the same engine with them off (``test_fused_kernels_engine.py``: a file of its own, so
the two minutes-long halves can run on two test workers). Prints one JSON object.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from runtime.backends import torch_attention, torch_gemm  # noqa: E402
from runtime.backends.torch_kernels import Kernels  # noqa: E402
from runtime.backends.torch_ops import TorchOps  # noqa: E402
from runtime.model import apply_rope  # noqa: E402
from core.params import SamplingParams  # noqa: E402


def _exact_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's ``tl.dot`` for float32 tiles, its bits independent of the tile's shape.

    Triton's interpreter multiplies a tile with numpy's ``matmul`` in float32, and which BLAS
    kernel that takes (so the order of a dot's additions) depends on the tile's rows and on the
    CPU: two kernels that give the same bits on a GPU (the split-K GEMM, and SwiGLU with it as
    its prologue, whose tiles have other row counts) gave the same bits on one x86 CPU and not
    on another (an AMD EPYC: 5.4e-7 apart). Here each product of two float32 values is exact in
    float64 and a tile's row of at most a few hundred of them sums there before one rounding to
    float32: whatever the order, the same float32 (barring a tie at a float32 half-way point)."""
    if a.data.dtype != np.float32 or b.data.dtype != np.float32 or d.data.dtype != np.float32:
        return _interpreter_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    prod = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
    return interpreter.TensorHandle(prod + d.data, d.dtype.scalar)


_interpreter_dot = interpreter.InterpreterBuilder.create_dot
interpreter.InterpreterBuilder.create_dot = _exact_dot


def kernel_errors() -> dict[str, float]:
    """Worst absolute difference of each kernel from the plain ops (float32)."""
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ops, out = TorchOps("cpu", "float32"), {}
    x, d, w = rnd(3, 4, 256), rnd(3, 4, 256), torch.rand(256, generator=g)
    s, y = Kernels.add_rms_norm(x, d, w, 1e-5)
    out["add_rms_norm"] = max((s - (x + d)).abs().max().item(), (y - ops.rms_norm(x + d, w, 1e-5)).abs().max().item())
    out["rms_norm"] = (Kernels.rms_norm(x, w, 1e-5) - ops.rms_norm(x, w, 1e-5)).abs().max().item()
    assert Kernels.rms_norm(x[:0], w, 1e-5).shape == (0, 4, 256)
    gu = rnd(3, 4, 2 * 704)
    out["silu_mul"] = (Kernels.silu_mul(gu, 704) - F.silu(gu[..., :704]) * gu[..., 704:]).abs().max().item()

    # argmax split over the vocabulary: torch.argmax's indices, ties to the lowest index
    # within a chunk and across chunks, a row of -inf, a vocabulary not a multiple of the chunk
    kern, worst = Kernels(), 0
    for v in (5, 512, 10_000, 32_000):
        x = torch.round(rnd(3, 4, v) * 2) / 2                 # many exact ties
        x[0, 0] = -float("inf")
        x[1, 1, v // 3] = x[1, 1, v - 1] = x[1, 1].max() + 1  # a tie between two chunks
        assert kern.fits_argmax(x, -1)
        worst = max(worst, int((kern.argmax(x) != torch.argmax(x, -1)).sum()))
    out["argmax"] = worst
    assert not kern.fits_argmax(x.double(), -1) and not kern.fits_argmax(x, 0)
    # the output head's cast to float32 from the argmax's own loads: the exact float32 values
    # of half-precision logits and torch's argmax of them; float32 logits come back as they are
    worst = 0
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        xh = x.to(dt)
        assert kern.fits_float_argmax(xh)
        f32, best = kern.float_argmax(xh)
        assert f32.dtype == torch.float32 and torch.equal(f32, xh.float()) and (dt != torch.float32 or f32 is xh)
        worst = max(worst, int((best != torch.argmax(xh.float(), -1)).sum()))
    out["float_argmax"] = worst
    assert not kern.fits_float_argmax(x.double())

    b, t, h, kvh, hd, slots, max_len = 2, 4, 4, 2, 64, 3, 256
    qkv, cos, sin = rnd(b, t, h + 2 * kvh, hd), rnd(b, t, 1, hd), rnd(b, t, 1, hd)
    rows = torch.tensor([5, 6, 7, 8, 130, 131, 132, 133])
    kc, vc = rnd((slots + 1) * max_len, kvh, hd), rnd((slots + 1) * max_len, kvh, hd)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q = Kernels.rope_write_kv(qkv, cos, sin, h, kvh, kc, vc, rows)
    qk = apply_rope(ops, qkv[:, :, :h + kvh], cos, sin)
    ops.scatter_rows_(kc_ref, rows, qk[:, :, h:].reshape(b * t, kvh, hd))
    ops.scatter_rows_(vc_ref, rows, qkv[:, :, h + kvh:].reshape(b * t, kvh, hd))
    out["rope_write_kv"] = max((q - qk[:, :, :h]).abs().max().item(), (kc - kc_ref).abs().max().item(),
                               (vc - vc_ref).abs().max().item())
    # the RoPE tables read at each token's position in the kernel: the bits of the gathered rows
    cos_t, sin_t, pos = rnd(300, hd), rnd(300, hd), torch.tensor([3, 299, 0, 17, 17, 150, 2, 9])
    kc2, vc2 = kc_ref.clone(), vc_ref.clone()
    q2 = Kernels.rope_write_kv(qkv, cos_t, sin_t, h, kvh, kc2, vc2, rows, table_rows=pos)
    q3 = Kernels.rope_write_kv(qkv, cos_t[pos].view(b, t, 1, hd), sin_t[pos].view(b, t, 1, hd), h, kvh,
                               kc_ref, vc_ref, rows)
    assert torch.equal(q2, q3) and torch.equal(kc2, kc_ref) and torch.equal(vc2, vc_ref)
    # Regression (seen on an H100): table rows and write rows as strided views (a fused propose's
    # substep column at batch > 1) read as dense arrays gave rows past the first other positions.
    wide = torch.stack([pos, pos + 1], dim=1)[:, 0]                             # stride 2
    wide_rows = torch.stack([rows, rows + 1], dim=1)[:, 0]
    assert not wide.is_contiguous() and not wide_rows.is_contiguous()
    kc5, vc5 = kc_ref.clone(), vc_ref.clone()
    q5 = Kernels.rope_write_kv(qkv, cos_t, sin_t, h, kvh, kc5, vc5, wide_rows, table_rows=wide)
    assert torch.equal(q5, q3) and torch.equal(kc5, kc_ref) and torch.equal(vc5, vc_ref)

    read_slots, positions = torch.tensor([2, 0]), torch.tensor([[60, 61, 62, 63], [10, 11, 12, 13]])
    worst = 0.0
    for span in (64, 100, 128, 192):   # 192 with many programs: 3 splits (not a power of two)
        # many splits (combine kernel), one split (direct), and splits of two blocks each
        for programs, least in ((256, 64), (2, 64), (256, 128)):
            torch_attention._TARGET_PROGRAMS = programs
            q = rnd(b, t, h, hd)
            got = Kernels.cache_attention(q, kc, vc, read_slots, positions, span, max_len, least)
            mask = ops.attention_mask(torch.arange(span).reshape(1, 1, span) <= positions.reshape(b, t, 1), h // kvh)
            ref = ops.attention(q, ops.gather_context(kc, read_slots, span, max_len),
                                ops.gather_context(vc, read_slots, span, max_len), mask)
            worst = max(worst, (got - ref).abs().max().item())
    torch_attention._TARGET_PROGRAMS = 256
    # Regression (seen on an H200): strided views of read_slots / positions (a fused propose's
    # substep column) were read as dense arrays, so batch rows past the first read wrong rows.
    q = rnd(b, t, h, hd)
    wide_pos = torch.cat([positions, positions + 50], dim=1)[:, :t]             # stride 2t
    wide_slots = torch.stack([read_slots, read_slots + 1], dim=1)[:, 0]         # stride 2
    assert not wide_pos.is_contiguous() and not wide_slots.is_contiguous()
    got = Kernels.cache_attention(q, kc, vc, wide_slots, wide_pos, 128, max_len)
    ref = Kernels.cache_attention(q, kc, vc, read_slots, positions, 128, max_len)
    worst = max(worst, (got - ref).abs().max().item())
    out["cache_attention"] = worst

    # The split-K GEMM (float32 here; on a GPU it takes bf16/fp16): with and without splits,
    # a row's bits independent of the other rows, every counter back at zero.
    kern = Kernels()
    kern.linear_dtypes = (torch.float32,)
    worst = 0.0
    for n, k in ((512, 256), (256, 2048), (96, 1600), (200, 96), (130, 1000)):
        w = rnd(n, k) * 0.05
        x = rnd(2, 5, k)
        assert kern.fits_linear(x, w) == torch_gemm.pays(n, k) and not kern.fits_linear(rnd(17, k), w)
        y = kern.linear(x, w)
        worst = max(worst, (y - x @ w.T).abs().max().item())
        assert torch.equal(kern.linear(x[:1, :2], w), y[:1, :2]), (n, k)
    # Row blocks (Kernels.gemm_row_blocks): 40 rows in one launch of three blocks, each block's
    # bits those of its rows launched alone (with splits: partials and counters a block each)
    counters = kern._counters[torch.device("cpu")]
    kern.gemm_row_blocks = 3
    for n, k in ((256, 2048), (200, 96)):
        w, x = rnd(n, k) * 0.05, rnd(40, k)
        p = torch_gemm.plan(n, k)
        y = torch_gemm.splitk_linear(x, w, p, counters)
        for r0 in (0, 16, 32):
            assert torch.equal(y[r0:r0 + 16], torch_gemm.splitk_linear(x[r0:r0 + 16], w, p, counters)), (n, k, r0)
        assert torch.equal(y[37:38], torch_gemm.splitk_linear(x[37:38], w, p, counters)) and not counters.any()
        worst = max(worst, (y - x @ w.T).abs().max().item())
    w = rnd(256, 2048)
    assert kern.fits_linear(rnd(48, 2048), w) and not kern.fits_linear(rnd(49, 2048), w)
    kern.gemm_row_blocks = 1
    assert torch_gemm.plan(256, 2048).split == 4 and torch_gemm.plan(96, 1600).split == 2
    assert torch_gemm.plan(200, 96).split == 1 and not torch_gemm.pays(200, 96)
    assert torch_gemm.pays(2048, 2048) and torch_gemm.pays(2048, 5632) and not torch_gemm.pays(3072, 2048)
    # The preload plan (each program's whole slice in one load and one dot; on a GPU the o
    # projection's, launched as a dependent launch): the same product, rows independent.
    pre = torch_gemm.preload_plan(256, 1024)
    assert pre is not None and pre.split == 2 and pre.preload
    assert torch_gemm.preload_plan(2048, 2048).split == 4 and torch_gemm.preload_plan(3072, 2048) is None
    w, x = rnd(256, 1024) * 0.05, rnd(10, 1024)
    counters = kern._counters[torch.device("cpu")]
    y = torch_gemm.splitk_linear(x, w, pre, counters)
    worst = max(worst, (y - x @ w.T).abs().max().item())
    assert torch.equal(torch_gemm.splitk_linear(x[:3], w, pre, counters), y[:3])
    # q/k/v with RoPE and the cache write as the GEMM's epilogue: the bits of the split-K GEMM
    # (a head a column tile) followed by rope_write_kv, with splits and without
    n = (h + 2 * kvh) * hd
    for least in (64, 512):
        torch_gemm._MIN_SPLIT_K = least
        w, x = rnd(n, 256) * 0.05, rnd(b, 3, 256)
        cos, sin = rnd(b, 3, 1, hd), rnd(b, 3, 1, hd)
        rows = torch.tensor([5, 6, 7, 130, 131, 132])
        kc1, vc1 = rnd((slots + 1) * max_len, kvh, hd), rnd((slots + 1) * max_len, kvh, hd)
        kc2, vc2 = kc1.clone(), vc1.clone()
        kc3, vc3 = kc1.clone(), vc1.clone()
        assert kern.fits_qkv_rope(x, w, hd)
        q1 = kern.qkv_rope(x, w, cos, sin, h, kvh, kc1, vc1, rows)
        p = torch_gemm.plan(n, 256, hd)
        assert p.split == (2 if least == 64 else 1)
        qkv = torch_gemm.splitk_linear(x.reshape(-1, 256), w, p, kern._counters[torch.device("cpu")])
        q2 = Kernels.rope_write_kv(qkv.view(b, 3, h + 2 * kvh, hd), cos, sin, h, kvh, kc2, vc2, rows)
        assert torch.equal(q1, q2) and torch.equal(kc1, kc2) and torch.equal(vc1, vc2), least
        kern.rope_swap_in_regs = True                # the swapped halves from registers: same bits
        q3 = kern.qkv_rope(x, w, cos, sin, h, kvh, kc3, vc3, rows)
        del kern.rope_swap_in_regs
        assert torch.equal(q3, q1) and torch.equal(kc3, kc1) and torch.equal(vc3, vc1), least
        cos_t, sin_t, pos = rnd(40, hd), rnd(40, hd), torch.tensor([39, 0, 7, 7, 20, 1])   # tables at positions
        kc4, vc4 = kc1.clone(), vc1.clone()
        q4 = kern.qkv_rope(x, w, cos_t, sin_t, h, kvh, kc4, vc4, rows, table_rows=pos)
        q5 = kern.qkv_rope(x, w, cos_t[pos].view(b, 3, 1, hd), sin_t[pos].view(b, 3, 1, hd), h, kvh, kc1, vc1, rows)
        assert torch.equal(q4, q5) and torch.equal(kc4, kc1) and torch.equal(vc4, vc1), least
        wide, wide_rows = torch.stack([pos, pos], dim=1)[:, 0], torch.stack([rows, rows], dim=1)[:, 0]
        assert not wide.is_contiguous() and not wide_rows.is_contiguous()       # strided: the regression above
        kc8, vc8 = kc1.clone(), vc1.clone()
        q8 = kern.qkv_rope(x, w, cos_t, sin_t, h, kvh, kc8, vc8, wide_rows, table_rows=wide)
        assert torch.equal(q8, q5) and torch.equal(kc8, kc1) and torch.equal(vc8, vc1), least
        # 20 rows in two row blocks: each block's bits (q and cache rows) those of its rows alone
        kern.gemm_row_blocks = 2
        x20, pos20, rows20 = rnd(5, 4, 256), torch.arange(20) * 2, torch.arange(20) + 300
        kc6, vc6 = kc1.clone(), vc1.clone()
        assert kern.fits_qkv_rope(x20, w, hd)
        q6 = kern.qkv_rope(x20, w, cos_t, sin_t, h, kvh, kc6, vc6, rows20, table_rows=pos20 % 40)
        flat = x20.reshape(1, 20, 256)
        for lo, hi in ((0, 16), (16, 20)):
            q7 = kern.qkv_rope(flat[:, lo:hi], w, cos_t, sin_t, h, kvh, kc1, vc1, rows20[lo:hi],
                               table_rows=pos20[lo:hi] % 40)
            assert torch.equal(q6.reshape(20, h, hd)[lo:hi], q7.reshape(hi - lo, h, hd)), (least, lo)
        assert torch.equal(kc6, kc1) and torch.equal(vc6, vc1), least
        kern.gemm_row_blocks = 1
    # SwiGLU's gate/up with silu * up as the GEMM's epilogue: the bits of the split-K GEMM (the
    # plan of the [2F, K] weight) followed by silu_mul, with splits and without, F not a
    # multiple of the tile, a row's bits independent of the other rows
    # (16 and 32 outputs a program)
    for (least, f, kk), block in itertools.product(((64, 96, 256), (512, 100, 256), (128, 704, 512)), (32, 64)):
        torch_gemm._MIN_SPLIT_K = least
        kern.swiglu_block_n = block
        w, x = rnd(2 * f, kk) * 0.05, rnd(b, 3, kk)
        assert kern.fits_swiglu(x, w, f) and not kern.fits_swiglu(x, w, f + 1) and not kern.fits_swiglu(rnd(17, kk), w, f)
        y = kern.swiglu(x, w)
        p = torch_gemm.plan(2 * f, kk, block)
        assert (p.split > 1) == (least < 512), (least, p)
        ref = Kernels.silu_mul(torch_gemm.splitk_linear(x.reshape(-1, kk), w, p, kern._counters[torch.device("cpu")]), f)
        assert torch.equal(y.reshape(-1, f), ref), (least, f, block, (y.reshape(-1, f) - ref).abs().max())
        assert torch.equal(kern.swiglu(x[:1, :2], w), y[:1, :2])
        kern.gemm_row_blocks = 2                     # 20 rows in two row blocks, as above
        x20 = rnd(20, kk)
        assert kern.fits_swiglu(x20, w, f)
        y20 = kern.swiglu(x20, w)
        assert torch.equal(y20[:16], kern.swiglu(x20[:16], w)) and torch.equal(y20[16:], kern.swiglu(x20[16:], w))
        kern.gemm_row_blocks = 1
        worst = max(worst, (y - F.silu(x @ w[:f].T) * (x @ w[f:].T)).abs().max().item())
    del kern.swiglu_block_n
    torch_gemm._MIN_SPLIT_K = 512
    assert int(kern._counters[torch.device("cpu")].abs().sum()) == 0
    out["linear"] = worst
    return out


def invariance() -> dict[str, object]:
    """Batch invariance (``Kernels.invariant``): a row's bits, kernel by kernel and through the
    bundled model's target step, whatever else its launch holds. (The interpreter runs the
    kernels' math, not the GPU's tiles: tests/gpu/test_kernels_gpu.py checks the compiled bits.)"""
    import numpy as np

    from runtime.batch_layout import Row, layout_rows
    from runtime.types import PrefillRequest
    from tests.unit.test_engine_bundled import _engine, _prompts

    g = torch.Generator().manual_seed(1)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    kern = Kernels()
    ops = TorchOps("cpu", "float32")
    out: dict[str, object] = {}
    # every projection on the split-K GEMM, float32 too, any rows, whether or not it pays
    for n, k in ((258, 256), (256, 256), (256, 2048), (48, 1100)):
        w, x = rnd(n, k) * 0.05, rnd(40, k)
        assert not kern.fits_linear(x, w) and not kern.fits_linear(x[:3], w)
        with kern.invariant_steps():
            assert kern.fits_linear(x, w) and kern.invariant
            y = kern.linear(x, w)
            for lo, hi in ((0, 40), (5, 8), (17, 18), (30, 40)):
                assert torch.equal(kern.linear(x[lo:hi], w), y[lo:hi]), (n, k, lo, hi)
        assert not kern.invariant
        out.setdefault("linear", 0.0)
        out["linear"] = max(out["linear"], (y - x @ w.T).abs().max().item())
    # q/k/v + RoPE + the cache write, and gate/up + SiLU·mul, in row blocks of invariant_rows
    torch_gemm._MIN_SPLIT_K = 128                    # K = 256 splits in two: partials and counters too
    wq, wg, x = rnd(8 * 32, 256) * 0.05, rnd(2 * 96, 256) * 0.05, rnd(1, 40, 256)
    cos_t, sin_t, pos = rnd(64, 32), rnd(64, 32), torch.arange(40) % 64
    caches = [rnd(200, 2, 32) for _ in range(4)]
    with kern.invariant_steps():
        q = kern.qkv_rope(x, wq, cos_t, sin_t, 4, 2, caches[0], caches[1], torch.arange(40) + 100, table_rows=pos)
        q2 = kern.qkv_rope(x[:, 30:33], wq, cos_t, sin_t, 4, 2, caches[2], caches[3], torch.arange(30, 33) + 100,
                           table_rows=pos[30:33])
        y = kern.swiglu(x, wg)
        assert torch.equal(kern.swiglu(x[:, 30:33], wg), y[:, 30:33])
    assert torch.equal(q2, q[:, 30:33]) and torch.equal(caches[0][130:133], caches[2][130:133])
    torch_gemm._MIN_SPLIT_K = 512
    # the attention on the invariant plan: a query row's output bits alone (one token, short
    # span) and inside a batch of three rows of four tokens over a longer span; its keys in
    # several splits (max_len 1,024: 64 keys a split), the combine's tile the same 16 splits
    h, kvh, hd, slots, max_len = 4, 2, 64, 4, 1024
    m, tb, per_split, nsplit_p = torch_attention.invariant_attention_plan(h // kvh, max_len)
    assert (m, tb, per_split, nsplit_p) == (16, 8, 64, 16), (m, tb, per_split, nsplit_p)
    kc, vc = rnd((slots + 1) * max_len, kvh, hd), rnd((slots + 1) * max_len, kvh, hd)
    q_all = rnd(3, 4, h, hd)
    read_slots, positions = torch.tensor([1, 3, 0]), torch.tensor([[200, 201, 202, 203], [5, 6, 7, 8],
                                                                     [700, 701, 702, 703]])
    with kern.invariant_steps():
        assert kern.fits_attention(h // kvh, 20)
        big = Kernels.cache_attention(q_all, kc, vc, read_slots, positions, 768, max_len, invariant=True)
        alone = Kernels.cache_attention(q_all[:1, 1:2], kc, vc, read_slots[:1], positions[:1, 1:2], 256, max_len,
                                        invariant=True)
        short = Kernels.cache_attention(q_all[1:2], kc, vc, read_slots[1:2], positions[1:2], 64, max_len,
                                        invariant=True)                                  # one split: direct
    assert torch.equal(alone[0, 0], big[0, 1]) and torch.equal(short[0], big[1])
    mask = ops.attention_mask(torch.arange(768).reshape(1, 1, 768) <= positions.reshape(3, 4, 1), h // kvh)
    ref = ops.attention(q_all, ops.gather_context(kc, read_slots, 768, max_len),
                        ops.gather_context(vc, read_slots, 768, max_len), mask)
    out["cache_attention"] = (big - ref).abs().max().item()

    # the bundled model's target step: one row's hidden state and logits bits in a decode of
    # one token and in a verify of three rows of four tokens (spans 256 and 512), prefills one
    # request at a time
    engine = _engine("torch")
    te = engine.target
    te.ops.kernels, te.ops.batch_invariant = Kernels(), True
    prompts = [np.asarray(p[:150 - 40 * i], dtype=np.int64) for i, p in enumerate(_prompts(3))]
    first = te.prefill([PrefillRequest(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)])
    slot = [te.cache.get(f"r{i}").slot for i in range(3)]

    def step(rows: list[Row], span: int):
        lay = layout_rows(rows, te.max_k + 1, te.cache.scratch_slot, te.cache.max_len)
        t = lambda a: torch.from_numpy(a)  # noqa: E731
        with torch.no_grad():
            hidden, best, logits = te._step(t(lay.tokens), t(lay.write_slots), t(lay.positions), t(lay.read_slots),
                                            attend_len=span)
        return hidden, logits

    n0 = len(prompts[0])
    drafts = [first[0].first_token, 7, 8, 9]
    wide = step([Row(slot[0], n0, np.asarray(drafts)),
                 Row(slot[1], len(prompts[1]), np.asarray([first[1].first_token, 1, 2])),
                 Row(slot[2], len(prompts[2]), np.asarray([first[2].first_token]))], 512)
    one = step([Row(slot[0], n0, np.asarray(drafts[:1]))], 256)
    same = torch.equal(one[0][0, 0], wide[0][0, 0]) and torch.equal(one[1][0, 0], wide[1][0, 0])
    out["model_row_bits_equal"] = same
    return out


def engine_tokens(n_prompts: int, max_tokens: int) -> dict[str, object]:
    """Greedy tokens of the bundled model, target-only and k=3, kernels on vs off."""
    from tests.unit.test_engine_bundled import _engine, _prompts, _run

    engine = _engine("torch")
    prompts = [p[:24] for p in _prompts(n_prompts)]     # short: the interpreter is slow
    plain = {k: _run(engine, prompts, k, 2, max_tokens)[0] for k in (0, 3)}
    # Every step on the kernels, as steps inside captured graphs run on a GPU (CPU has no
    # graphs: its steps are the eager ones, which run the plain ops), each launch counted.
    calls: dict[str, int] = {}
    kernels = Kernels()
    # the bundled model's float32 projections on the split-K GEMM too, split down to 128 of K
    # (its d=256 would not split at the GPU's 512) so the partials and counters run in the model
    kernels.linear_dtypes = (torch.float32,)
    torch_gemm._MIN_SPLIT_K = 128
    # SwiGLU in 64-wide weight tiles (kernel_errors has both widths' bits): half the interpreted
    # programs of the default 32, and the gate/up GEMM was most of this run's time
    kernels.swiglu_block_n = 64
    for name in ("add_rms_norm", "silu_mul", "rope_write_kv", "cache_attention", "linear", "qkv_rope", "argmax",
                 "swiglu", "rms_norm", "float_argmax"):
        def counted(*a, _f=getattr(kernels, name), _n=name, **kw):
            calls[_n] = calls.get(_n, 0) + 1
            return _f(*a, **kw)
        setattr(kernels, name, counted)
    engine.ops.kernels = kernels
    engine.ops.plain_ops = contextlib.nullcontext
    fused = {k: _run(engine, prompts, k, 2, max_tokens)[0] for k in (0, 3)}
    return {"identical": plain == fused, "tokens": sum(len(x) for x in fused[3]),
            "target_only_equals_speculative": fused[0] == fused[3], "calls": calls}


def fused_propose_rows(rounds: int = 2) -> dict[str, object]:
    """A fused greedy propose (one ``propose{k}`` step: catch-up, then substeps fed on the device)
    against the per-substep path, both on the kernels, at batch 3 with k = 3 for every row: the
    substeps' positions and write slots are strided columns of [B, k-1] inputs there, which a
    kernel reading them as dense got wrong for rows past the first (seen on an H100: the drafts
    differed, acceptance at batch 8 fell from 0.78 to 0.70)."""
    import numpy as np

    from runtime.config import CacheConfig, ModelConfig
    from runtime.draft_engine import DraftEngine
    from runtime.graphs import GraphRegistry
    from runtime.model import init_params, mtp_tensor_shapes, target_tensor_shapes
    from runtime.types import DraftPrefillRequest, ProposeRequest

    cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    kernels = Kernels()
    kernels.linear_dtypes = (torch.float32,)
    drafts = []
    for fused in (True, False):
        ops = TorchOps("cpu", "float32")
        ops.kernels, ops.plain_ops = kernels, contextlib.nullcontext
        scale = lambda p: {k: ops.from_numpy(v * (6 if v.ndim == 2 else 1)) for k, v in p.items()}  # noqa: E731
        t, d = scale(init_params(cfg, 0, target_tensor_shapes(cfg))), scale(init_params(cfg, 1, mtp_tensor_shapes(cfg)))
        d.update({n: t[n] for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")})
        draft = DraftEngine(ops, cfg, d, CacheConfig(max_slots=4, max_len=64), 3, GraphRegistry(ops, (4,)),
                            fused_propose=fused)
        draft.registry.capture_all(warmup=0)
        rng, lens, got = np.random.default_rng(3), {}, []
        for i in range(3):
            m = 6 + 5 * i
            draft.prefill([DraftPrefillRequest(f"r{i}", rng.integers(0, 256, m),
                                               rng.standard_normal((m, 128)).astype(np.float32), SamplingParams())])
            lens[f"r{i}"] = m
        for _ in range(rounds):
            reqs = []
            for rid in lens:
                reqs.append(ProposeRequest(rid, lens[rid], rng.integers(0, 256, 2),
                                           rng.standard_normal((2, 128)).astype(np.float32), 3))
                lens[rid] += 2
            got.append([p.drafts.tolist() for p in draft.propose(reqs)])
        drafts.append((got, draft.fused_proposes))
    (fused_drafts, n_fused), (plain_drafts, _) = drafts
    return {"identical": fused_drafts == plain_drafts, "fused_proposes": n_fused}


if __name__ == "__main__":
    if sys.argv[1] == "kernels":
        print(json.dumps({"errors": kernel_errors(), "invariance": invariance(), "fused_propose": fused_propose_rows()}))
    else:
        print(json.dumps({"engine": engine_tokens(int(sys.argv[2]), int(sys.argv[3]))}))
