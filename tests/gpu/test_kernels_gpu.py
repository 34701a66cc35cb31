"""The fused decoder-layer kernels compiled on a real GPU. Skipped without CUDA.

What is shown (docs/gpu.md records the run):
- each kernel against the plain ops it replaces (argmax: the same indices), at the ~1B config's decode and
  verify shapes (16 heads, 4 K/V heads, head dim 128; spans 384 and 3,072, so
  one split and many), in float32 and bfloat16;
- the split-K GEMM (``Kernels.linear``) against F.linear at the ~1B projections' shapes
  and two odd ones, at 1 to 16 rows, in bfloat16 and float16: a row's bits do not depend
  on the other rows or on the run, a captured launch gives the eager launch's bits, and
  every launch leaves its counters at zero; the q/k/v projection with RoPE and the KV-cache
  write in its epilogue gives the bits of the GEMM followed by rope_write_kv (RoPE's swapped
  halves read again from the partials or taken in registers);
  the o projection as a dependent launch after the attention gives a plain launch's bits; the gate/up projection with
  SiLU·mul in its epilogue gives the bits of the GEMM followed by silu_mul;
- the bundled model under CUDA graphs with the kernels decodes the same greedy tokens as
  eagerly with the plain ops (float32), and target-only equals speculative (float32, and
  bfloat16 with the projections on the split-K GEMM).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

import torch.nn.functional as F  # noqa: E402

from core.params import SamplingParams  # noqa: E402
from runtime.backends.torch_kernels import Kernels  # noqa: E402
from runtime.backends.torch_ops import TorchOps  # noqa: E402
from runtime.config import CacheConfig, EngineConfig, GraphConfig, RuntimeConfig, SpecConfig  # noqa: E402
from runtime.engine import GenRequest, SpecEngine  # noqa: E402
from runtime.model import apply_rope  # noqa: E402
from runtime.tokenizer import ByteTokenizer  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"
TOL = {"float32": 2e-5, "bfloat16": 3e-2}


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_kernel_equals_the_plain_ops(dtype):
    ops = TorchOps("cuda:0", dtype)
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda").to(dt)  # noqa: E731
    worst = {}
    x, d, w = rnd(8, 4, 2048), rnd(8, 4, 2048), rnd(2048)
    s, y = Kernels.add_rms_norm(x, d, w, 1e-5)
    worst["add_rms_norm"] = max(_rel(s, x + d), _rel(y, ops.rms_norm(x + d, w, 1e-5)))
    worst["rms_norm"] = _rel(Kernels.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5))
    gu = rnd(8, 4, 2 * 5632)
    worst["silu_mul"] = _rel(Kernels.silu_mul(gu, 5632), F.silu(gu[..., :5632]) * gu[..., 5632:])

    kern = Kernels()
    for shape in ((1, 4, 32000), (8, 4, 151936), (3, 1000)):
        logits = torch.round(torch.randn(*shape, generator=g, device="cuda") * 4) / 4      # ties
        assert kern.fits_argmax(logits, -1)
        assert torch.equal(kern.argmax(logits), torch.argmax(logits, -1)), shape
        half = logits.to(dt)                                                # the head's own dtype
        assert kern.fits_float_argmax(half)
        f32, best = kern.float_argmax(half)
        assert torch.equal(f32, half.float()) and torch.equal(best, torch.argmax(half.float(), -1)), shape
    h, kvh, hd, slots, max_len = 16, 4, 128, 8, 4096
    kc, vc = rnd((slots + 1) * max_len, kvh, hd), rnd((slots + 1) * max_len, kvh, hd)
    for b, t, span in ((1, 4, 384), (1, 4, 3072), (8, 4, 3072), (2, 16, 384)):
        qkv = rnd(b, t, h + 2 * kvh, hd)
        cos, sin = rnd(b, t, 1, hd), rnd(b, t, 1, hd)
        positions = torch.stack([torch.arange(span - t - 7 * i, span - 7 * i, device="cuda") for i in range(b)])
        read_slots = torch.arange(b, device="cuda") * 1
        rows = (read_slots[:, None] * max_len + positions).reshape(-1)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        q = Kernels.rope_write_kv(qkv, cos, sin, h, kvh, kc, vc, rows)
        qk = apply_rope(ops, qkv[:, :, :h + kvh], cos, sin)
        ops.scatter_rows_(kc_ref, rows, qk[:, :, h:].reshape(b * t, kvh, hd))
        ops.scatter_rows_(vc_ref, rows, qkv[:, :, h + kvh:].reshape(b * t, kvh, hd))
        worst["rope_write_kv"] = max(worst.get("rope_write_kv", 0.0), _rel(q, qk[:, :, :h]),
                                     _rel(kc, kc_ref), _rel(vc, vc_ref))
        got = Kernels.cache_attention(q, kc, vc, read_slots, positions, span, max_len)
        mask = ops.attention_mask(torch.arange(span, device="cuda").reshape(1, 1, span) <= positions[:, :, None],
                                  h // kvh)
        ref = ops.attention(q, ops.gather_context(kc, read_slots, span, max_len),
                            ops.gather_context(vc, read_slots, span, max_len), mask)
        worst["cache_attention"] = max(worst.get("cache_attention", 0.0), _rel(got, ref))
    print(f"\n[gpu kernels {dtype}] worst relative difference from the plain ops: {json.dumps(worst)}")
    assert all(v < TOL[dtype] for v in worst.values()), worst


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_k_linear_equals_f_linear_and_keeps_each_rows_bits(dtype):
    kernels = Kernels()
    ops = TorchOps("cuda:0", "bfloat16", fused_kernels=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    for n, k in ((3072, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (200, 96), (1000, 1000)):
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(dtype)
        x16 = torch.randn(16, k, device="cuda", generator=g).to(dtype)
        y16 = kernels.linear(x16, w)
        worst = max(worst, _rel(y16, x16.float() @ w.float().T))
        for rows in (1, 4, 7):
            assert torch.equal(kernels.linear(x16[:rows], w), y16[:rows]), (n, k, rows)
        assert torch.equal(kernels.linear(x16, w), y16)
        graph, (captured,) = ops.capture(lambda x: (kernels.linear(x, w),), {"x": x16}, None)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, y16), (n, k)
        del graph
    assert int(kernels._counters[torch.device("cuda:0")].abs().sum()) == 0
    print(f"\n[gpu kernels] split-K linear {dtype}: worst relative difference from float32 math {worst:.2e}")
    assert worst < 1e-2
    assert not kernels.fits_linear(torch.zeros(17, 64, device="cuda", dtype=dtype), torch.zeros(8, 64, device="cuda", dtype=dtype))
    assert not kernels.fits_linear(torch.zeros(4, 64, device="cuda"), torch.zeros(8, 64, device="cuda"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("span", [384, 40])
def test_o_projection_as_a_dependent_launch_after_the_attention(dtype, span):
    """``Kernels.preload``: the attention lets the o projection launch at once (the combine
    kernel a dependent launch too, or the direct launch at a short span), and the projection
    reads its weight slice before it waits. Captured, with fresh queries before every replay: the bits
    of the same plan launched plainly after a plain attention."""
    from runtime.backends import torch_gemm

    kernels = Kernels()
    kernels.preload = True
    ops = TorchOps("cuda:0", "bfloat16", fused_kernels=True)
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(3)
    h, kvh, hd, max_len = 16, 4, 128, 4096
    kc, vc = (torch.randn(2 * max_len, kvh, hd, device="cuda", generator=g).to(dt) for _ in range(2))
    w = (torch.randn(2048, 2048, device="cuda", generator=g) * 0.02).to(dt)
    slots = torch.tensor([1], device="cuda")
    pos = torch.arange(span - 4, span, device="cuda").view(1, 4)
    pre = torch_gemm.preload_plan(2048, 2048)
    assert pre is not None
    assert kernels._preloads(torch.zeros(1, 4, h * hd, device="cuda", dtype=dt), w)
    assert not kernels._preloads(torch.zeros(8, 4, h * hd, device="cuda", dtype=dt), w)   # 32 rows: cuBLAS

    def chain(q):
        attn = kernels.attention(q, kc, vc, slots, pos, span, max_len, w)
        return (kernels.linear(attn.reshape(1, 4, h * hd), w),)

    def reference(q):
        attn = Kernels.cache_attention(q, kc, vc, slots, pos, span, max_len)
        kernels._ready(q)
        return torch_gemm.splitk_linear(attn.reshape(4, h * hd), w, pre, kernels._counters[q.device]).view(1, 4, -1)

    fresh = lambda: torch.randn(1, 4, h, hd, device="cuda", generator=g).to(dt)  # noqa: E731
    inp = {"q": fresh()}
    assert torch.equal(chain(**inp)[0], reference(inp["q"]))
    graph, (out,) = ops.capture(chain, inp, None)
    for _ in range(30):
        q = fresh()
        inp["q"].copy_(q)
        graph.replay()
        want = reference(q)
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    del graph
    assert int(kernels._counters[torch.device("cuda:0")].abs().sum()) == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_qkv_projection_with_rope_and_the_cache_write_in_its_epilogue(dtype):
    """``Kernels.qkv_rope`` at the ~1B shapes (16 heads, 4 K/V heads, head dim 128, 1-16 rows):
    the bits of the split-K GEMM (a head a column tile) followed by ``rope_write_kv``, eager
    and captured with fresh inputs every replay, and within bf16 rounding of cuBLAS + RoPE."""
    from runtime.backends import torch_gemm

    kernels = Kernels()
    ops = TorchOps("cuda:0", "bfloat16", fused_kernels=True)
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(2)
    h, kvh, hd, k, slots, max_len = 16, 4, 128, 2048, 8, 512
    n = (h + 2 * kvh) * hd
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(dt)
    counters = kernels._counters

    def reference(x, cos, sin, rows, kc, vc, gemm=True):
        qkv = (torch_gemm.splitk_linear(x.reshape(-1, k), w, torch_gemm.plan(n, k, hd), counters[x.device])
               if gemm else x.reshape(-1, k) @ w.T)
        return Kernels.rope_write_kv(qkv.view(*x.shape[:2], h + 2 * kvh, hd), cos, sin, h, kvh, kc, vc, rows)

    worst = 0.0
    for b, t in ((1, 1), (1, 4), (4, 4)):
        fresh = lambda: {"x": torch.randn(b, t, k, device="cuda", generator=g).to(dt),  # noqa: E731
                         "cos": torch.rand(b, t, 1, hd, device="cuda", generator=g).to(dt),
                         "sin": torch.rand(b, t, 1, hd, device="cuda", generator=g).to(dt),
                         "rows": torch.randperm(slots * max_len, device="cuda", generator=g)[:b * t]}
        caches = lambda: (torch.zeros((slots + 1) * max_len, kvh, hd, device="cuda", dtype=dt),  # noqa: E731
                          torch.zeros((slots + 1) * max_len, kvh, hd, device="cuda", dtype=dt))
        inp = fresh()
        kernels._ready(inp["x"])
        (kc1, vc1), (kc2, vc2), (kc3, vc3) = caches(), caches(), caches()
        q1 = kernels.qkv_rope(inp["x"], w, inp["cos"], inp["sin"], h, kvh, kc1, vc1, inp["rows"])
        q2 = reference(inp["x"], inp["cos"], inp["sin"], inp["rows"], kc2, vc2)
        assert torch.equal(q1, q2) and torch.equal(kc1, kc2) and torch.equal(vc1, vc2), (b, t)
        kc4, vc4 = caches()
        kernels.rope_swap_in_regs = True             # RoPE's swapped halves from registers: the same bits
        q4 = kernels.qkv_rope(inp["x"], w, inp["cos"], inp["sin"], h, kvh, kc4, vc4, inp["rows"])
        del kernels.rope_swap_in_regs
        assert torch.equal(q4, q1) and torch.equal(kc4, kc1) and torch.equal(vc4, vc1), (b, t)
        q3 = reference(inp["x"], inp["cos"], inp["sin"], inp["rows"], kc3, vc3, gemm=False)
        worst = max(worst, _rel(q1, q3), _rel(kc1, kc3), _rel(vc1, vc3))
        kc, vc = caches()
        graph, (captured,) = ops.capture(
            lambda x, cos, sin, rows: (kernels.qkv_rope(x, w, cos, sin, h, kvh, kc, vc, rows),), inp, None)
        for _ in range(10):
            new = fresh()
            for key, v in new.items():
                inp[key].copy_(v)
            graph.replay()
            kr, vr = caches()
            want = reference(new["x"], new["cos"], new["sin"], new["rows"], kr, vr)
            torch.cuda.synchronize()
            live = new["rows"]
            assert torch.equal(captured, want) and torch.equal(kc[live], kr[live]) and torch.equal(vc[live], vr[live])
        del graph
    assert int(counters[torch.device("cuda:0")].abs().sum()) == 0
    print(f"\n[gpu kernels] q/k/v + RoPE + cache write {dtype}: worst relative difference from cuBLAS + "
          f"rope_write_kv {worst:.2e}")
    assert worst < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_projection_with_silu_mul_in_its_epilogue(dtype):
    """``Kernels.swiglu`` at the ~1B gate/up shape [2 x 5632, 2048] (64 and 32 weight rows a
    program) and an odd one that splits K:
    the bits of the split-K GEMM (the [2F, K] weight's plan) followed by ``silu_mul``, a row's
    bits independent of the other rows, eager and captured with fresh inputs, counters back at
    zero, and within bf16 rounding of cuBLAS + SiLU."""
    from runtime.backends import torch_gemm

    kernels = Kernels()
    ops = TorchOps("cuda:0", "bfloat16", fused_kernels=True)
    g = torch.Generator(device="cuda").manual_seed(4)
    worst = 0.0
    for f, k, block in ((5632, 2048, 64), (5632, 2048, 32), (700, 2048, 64)):
        kernels.swiglu_block_n = block
        w = (torch.randn(2 * f, k, device="cuda", generator=g) * 0.02).to(dtype)
        x16 = torch.randn(16, k, device="cuda", generator=g).to(dtype)
        assert kernels.fits_swiglu(x16, w, f)
        kernels._ready(x16)
        counters = kernels._counters[x16.device]
        p = torch_gemm.plan(2 * f, k, block)

        def reference(x):
            return Kernels.silu_mul(torch_gemm.splitk_linear(x, w, p, counters), f)

        y16 = kernels.swiglu(x16, w)
        assert torch.equal(y16, reference(x16)), (f, k)
        for rows in (1, 4, 7):
            assert torch.equal(kernels.swiglu(x16[:rows], w), y16[:rows]), (f, k, rows)
        gu = x16 @ w.T
        worst = max(worst, _rel(y16, F.silu(gu[:, :f]) * gu[:, f:]))
        inp = {"x": x16.clone()}
        graph, (captured,) = ops.capture(lambda x: (kernels.swiglu(x, w),), inp, None)
        for _ in range(10):
            new = torch.randn(16, k, device="cuda", generator=g).to(dtype)
            inp["x"].copy_(new)
            graph.replay()
            want = reference(new)
            torch.cuda.synchronize()
            assert torch.equal(captured, want), (f, k)
        del graph
    assert int(kernels._counters[torch.device("cuda:0")].abs().sum()) == 0
    print(f"\n[gpu kernels] gate/up + SiLU·mul {dtype}: worst relative difference from cuBLAS + SiLU {worst:.2e}")
    assert worst < 3e-2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_graphs_decodes_the_same_tokens_with_the_kernels(dtype, monkeypatch):
    from runtime.backends import torch_gemm

    # the bundled model's d=256 splits only below the default 512 of K a program
    monkeypatch.setattr(torch_gemm, "_MIN_SPLIT_K", 128)
    tok = ByteTokenizer()
    prompts = [tuple(tok.encode(p)) for p in json.loads((TINY / "heldout_prompts.json").read_text())[:6]]
    engine = SpecEngine(EngineConfig(str(TINY), runtime=RuntimeConfig(backend="torch", device="cuda:0", dtype=dtype),
                                     spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=8, max_len=512),
                                     graphs=GraphConfig(enabled=True, batch_buckets=(1, 4, 8))))
    assert engine.ops.kernels is not None
    linear_calls = [0]
    split_k = engine.ops.kernels.linear

    def counted(x, w):
        linear_calls[0] += 1
        return split_k(x, w)

    engine.ops.kernels.linear = counted
    engine.capture_graphs()

    def run(k):
        reqs = [GenRequest(f"p{i}", p, SamplingParams(max_tokens=64, ignore_eos=True), k) for i, p in enumerate(prompts)]
        return [r.tokens for r in engine.generate(reqs, max_batch=4)]

    fused = {k: run(k) for k in (0, 3)}
    replays = engine.target_registry.stats.replays
    assert replays > 0
    kernels, engine.ops.kernels = engine.ops.kernels, None
    engine.target_registry.clear()       # the plain ops run eagerly: the reference
    engine.draft_registry.clear()
    plain = {k: run(k) for k in (0, 3)}
    engine.ops.kernels = kernels
    same = sum(a == b for k in (0, 3) for a, b in zip(fused[k], plain[k]))
    print(f"\n[gpu kernels] bundled model {dtype}, graphs: fused == plain {fused == plain} ({same} of "
          f"{2 * len(prompts)} requests), target-only == speculative {fused[0] == fused[3]}, replays {replays}, "
          f"split-K GEMM launches captured {linear_calls[0]}")
    assert fused[0] == fused[3]
    if dtype == "float32":
        # NOTE: bitwise only in float32; bfloat16 rounds every projection's output, so cuBLAS
        # and the split-K GEMM can part at a near tie (reported above, not asserted)
        assert fused == plain
        assert linear_calls[0] == 0                   # float32 projections stay on cuBLAS
    else:
        assert linear_calls[0] > 0



@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_split_k_gemms_in_row_blocks_keep_each_blocks_bits(dtype):
    """``Kernels.gemm_row_blocks``: a launch of more than 16 rows runs a block of 16 a program
    row, each with its own partials and counters: its rows' bits are those of the block launched
    alone (the ~1B o, q/k/v + RoPE and gate/up + SiLU·mul shapes, compiled)."""
    from runtime.backends import torch_gemm

    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(5)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda").to(dt)  # noqa: E731
    kern = Kernels()
    kern.gemm_row_blocks = 3
    w, x = rnd(2048, 2048) * 0.02, rnd(40, 2048)
    assert kern.fits_linear(x, w) and not kern.fits_linear(rnd(49, 2048), w)
    y = kern.linear(x, w)
    for lo in (0, 16, 32):
        assert torch.equal(y[lo:lo + 16], kern.linear(x[lo:lo + 16], w)), lo
    h, kvh, hd, max_len = 16, 4, 128, 4096
    wq, xq = rnd((h + 2 * kvh) * hd, 2048) * 0.02, rnd(1, 20, 2048)
    cos_t, sin_t, pos = rnd(4096, hd), rnd(4096, hd), torch.arange(20, device="cuda") * 7
    rows = torch.arange(20, device="cuda") + 100
    kc, vc = (torch.zeros(2 * max_len, kvh, hd, device="cuda", dtype=dt) for _ in range(2))
    kc2, vc2 = kc.clone(), vc.clone()
    q = kern.qkv_rope(xq, wq, cos_t, sin_t, h, kvh, kc, vc, rows, table_rows=pos)
    for lo, hi in ((0, 16), (16, 20)):
        q2 = kern.qkv_rope(xq[:, lo:hi], wq, cos_t, sin_t, h, kvh, kc2, vc2, rows[lo:hi], table_rows=pos[lo:hi])
        assert torch.equal(q[:, lo:hi], q2), lo
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    wg, xg = rnd(2 * 5632, 2048) * 0.02, rnd(20, 2048)
    yg = kern.swiglu(xg, wg)
    assert torch.equal(yg[:16], kern.swiglu(xg[:16], wg)) and torch.equal(yg[16:], kern.swiglu(xg[16:], wg))
    torch.cuda.synchronize()
    assert int(kern._counters[torch.device("cuda:0")].abs().sum()) == 0

