"""Batch-invariant steps (``runtime.batch_invariant``, ``Kernels.invariant``) compiled on a GPU.
Skipped without CUDA.

What is shown (docs/gpu.md records the run):
- kernel by kernel, in bfloat16 and float32: a row's bits are the same in a launch of 1, 3 or
  40 rows (two row blocks: the ~1B o projection, its output head, its q/k/v + RoPE and gate/up
  + SiLU·mul, the bundled model's K = 256 projections that never split), and a query row's
  attention output is the same alone at a short span and inside a batch of four-token rows at
  a long one (several splits, one split);
- the bundled model in bfloat16 at batch 8 under CUDA graphs: with the switch on, every
  request's greedy tokens are the same target-only and speculative (k=3), at batch 8 and alone,
  in an engine verifying 4 tokens a row and in one decoding a token a row. With it off the same
  counts are printed, not asserted (they depend on near-ties).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from core.params import SamplingParams  # noqa: E402
from runtime.backends.torch_kernels import Kernels  # noqa: E402
from runtime.config import CacheConfig, EngineConfig, GraphConfig, RuntimeConfig, SpecConfig  # noqa: E402
from runtime.engine import GenRequest, SpecEngine  # noqa: E402
from runtime.tokenizer import ByteTokenizer  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_invariant_launches_keep_each_rows_bits(dtype):
    g = torch.Generator(device="cuda").manual_seed(11)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda").to(dtype)  # noqa: E731
    kern = Kernels()
    for n, k in ((2048, 2048), (32000, 2048), (258, 256), (256, 256), (1408, 256)):
        w, x = rnd(n, k) * 0.02, rnd(40, k)
        with kern.invariant_steps():
            assert kern.fits_linear(x, w)
            y = kern.linear(x, w)
            for lo, hi in ((0, 1), (5, 8), (17, 18), (24, 40)):
                assert torch.equal(kern.linear(x[lo:hi], w), y[lo:hi]), (n, k, lo, hi)
        ref = x.float() @ w.float().T
        assert (y.float() - ref).abs().max().item() <= (3e-2 if dtype == torch.bfloat16 else 1e-4) * ref.abs().max()
    h, kvh, hd, slots, max_len = 16, 4, 128, 4, 4096
    if dtype == torch.bfloat16:                      # the ~1B q/k/v + RoPE + cache write and gate/up + SiLU
        wq, wg, x = rnd((h + 2 * kvh) * hd, 2048) * 0.02, rnd(2 * 5632, 2048) * 0.02, rnd(1, 40, 2048)
        cos_t, sin_t, pos = rnd(4096, hd), rnd(4096, hd), torch.arange(40, device="cuda") * 9
        caches = [torch.zeros(2 * max_len, kvh, hd, device="cuda", dtype=dtype) for _ in range(4)]
        wr = torch.arange(40, device="cuda") + 100
        with kern.invariant_steps():
            q = kern.qkv_rope(x, wq, cos_t, sin_t, h, kvh, caches[0], caches[1], wr, table_rows=pos)
            y = kern.swiglu(x, wg)
            for lo, hi in ((0, 1), (24, 40)):
                q2 = kern.qkv_rope(x[:, lo:hi], wq, cos_t, sin_t, h, kvh, caches[2], caches[3], wr[lo:hi],
                                   table_rows=pos[lo:hi])
                assert torch.equal(q2, q[:, lo:hi]) and torch.equal(kern.swiglu(x[:, lo:hi], wg), y[:, lo:hi]), lo
        done = torch.cat([wr[0:1], wr[24:40]])
        assert torch.equal(caches[0][done], caches[2][done]) and torch.equal(caches[1][done], caches[3][done])
    if dtype == torch.bfloat16:                      # printed: whether the tile's width alone moves a row's bits
        from runtime.backends import torch_gemm

        w, x, cnt = rnd(2048, 2048) * 0.02, rnd(32, 2048), kern._counters[torch.device("cuda:0")]
        p = torch_gemm.plan(2048, 2048)
        y16, y32 = (torch_gemm.splitk_linear(x, w, p, cnt, block_rows=r) for r in (16, 32))
        print(f"\n[gpu invariant] split-K rows on 16- and 32-row tiles bit-equal: {torch.equal(y16, y32)}")
    torch.cuda.synchronize()
    assert int(kern._counters[torch.device("cuda:0")].abs().sum()) == 0

    kc, vc = rnd((slots + 1) * max_len, kvh, hd), rnd((slots + 1) * max_len, kvh, hd)
    q = rnd(3, 4, h, hd)
    read_slots = torch.tensor([1, 3, 0], device="cuda")
    positions = torch.tensor([[900, 901, 902, 903], [5, 6, 7, 8], [2500, 2501, 2502, 2503]], device="cuda")
    same = {}
    for invariant in (True, False):
        big = Kernels.cache_attention(q, kc, vc, read_slots, positions, 3072, max_len, invariant=invariant)
        alone = Kernels.cache_attention(q[:1, 1:2], kc, vc, read_slots[:1], positions[:1, 1:2], 1024, max_len,
                                        invariant=invariant)
        short = Kernels.cache_attention(q[1:2], kc, vc, read_slots[1:2], positions[1:2], 256, max_len,
                                        invariant=invariant)
        same[invariant] = (torch.equal(alone[0, 0], big[0, 1]), torch.equal(short[0], big[1]))
    assert same[True] == (True, True), same
    print(f"\n[gpu invariant {dtype}] attention row bits alone == in a batch: invariant plan {same[True]}, "
          f"batch-dependent plan {same[False]}")


def _tokens(batch_invariant: bool, max_k: int, k: int, batch: int, prompts) -> list[tuple[int, ...]]:
    engine = SpecEngine(EngineConfig(
        str(TINY), runtime=RuntimeConfig(backend="torch", device="cuda:0", dtype="bfloat16",
                                         batch_invariant=batch_invariant),
        spec=SpecConfig(max_k=max_k, default_k=min(3, max_k)), cache=CacheConfig(max_slots=8, max_len=512),
        graphs=GraphConfig(enabled=True, batch_buckets=(1, 8))))
    engine.capture_graphs()
    reqs = [GenRequest(f"p{i}", p, SamplingParams(max_tokens=96, ignore_eos=True), k) for i, p in enumerate(prompts)]
    if batch == 1:
        return [engine.generate([r])[0].tokens for r in reqs]
    return [r.tokens for r in engine.generate(reqs, max_batch=batch)]


def test_bundled_bf16_requests_get_the_same_tokens_whatever_the_batch():
    tok = ByteTokenizer()
    texts = json.loads((TINY / "heldout_prompts.json").read_text())
    prompts = [tuple(tok.encode(texts[i % len(texts)]))[: 48 + i] for i in range(16)]
    counts = {}
    for invariant in (True, False):
        runs = {"k=3 b8": _tokens(invariant, 3, 3, 8, prompts), "k=0 b8": _tokens(invariant, 3, 0, 8, prompts),
                "k=0 b8 width 1": _tokens(invariant, 0, 0, 8, prompts),
                "k=0 alone": _tokens(invariant, 3, 0, 1, prompts)}
        ref = runs["k=0 alone"]
        counts[invariant] = {name: sum(a == b for a, b in zip(ref, got)) for name, got in runs.items()}
    print(f"\n[gpu invariant] bundled bf16, requests of {len(prompts)} equal to k=0 alone: "
          f"batch_invariant on {json.dumps(counts[True])}, off {json.dumps(counts[False])}")
    assert all(c == len(prompts) for c in counts[True].values()), counts
