"""Fused Triton kernels for the Torch backend's decoder layer (CUDA).

Owns: the kernels that each replace a chain of small framework ops of one
decoder layer, equal to those ops up to rounding (every kernel computes in
float32 and rounds once where the plain ops round after each op):
  - ``add_rms_norm``:  the residual add and the RMSNorm that follows it
  - ``silu_mul``:      SwiGLU's silu(gate) * up over the fused gate/up output
  - ``rope_write_kv``: RoPE on the q and k heads of the fused q/k/v output, the
                       k and v heads written into their KV-cache rows, the
                       rotated q returned
  - ``attention``:     the attention over the flat KV cache (its kernels and
                       launch plans: ``torch_attention.py``), with the o
                       projection after it allowed to start early
  - ``argmax``:        the greedy argmax over the vocabulary, split over programs
                       (``float_argmax``: also writing half-precision logits as float32
                       from the same loads, the output head's cast)
  - ``rms_norm``:      the RMSNorms outside the fused layers (torch's takes twice as long)
and when a projection at decode shapes goes to the split-K GEMM of
``torch_gemm.py`` (``fits_linear`` / ``linear``), whose counters it keeps;
there the GEMM also takes over ``rope_write_kv`` (the q/k/v projection's
epilogue, ``fits_qkv_rope`` / ``qkv_rope``, with the same bits) and
``silu_mul`` (the gate/up projection's epilogue, ``fits_swiglu`` / ``swiglu``,
same bits), and the o projection runs as a programmatic dependent launch that
reads its weight while the attention runs (``preload``, ``attention``).
Why: the plain layer runs ~33 kernels at decode shapes, most of them a few
microseconds of elementwise work (see docs/performance.md § Fused kernels);
this layer runs 8 (§ Session 17).

Must not know: models, checkpoints, requests. The model (``runtime/model.py``)
decides where each kernel applies (``Kernels.fits_attention``) and keeps the
plain path as the reference and for every other case (per-head q/k norms, a
head dim that is not a power of two, Paddle). The engines run every step
outside their captured CUDA graphs (prefills, wide catch-ups) on the plain
ops (``Ops.plain_ops``), so Triton compiles only what the captures use.

Every launch is shape-static given its inputs' shapes (the split count too),
so a step using them is captured into a CUDA graph like any other. With
``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (how CI tests them).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch
import triton
import triton.language as tl

from runtime.backends import torch_attention, torch_gemm
from runtime.backends.torch_attention import MAX_QUERY_ROWS, pow2



@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, s_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):
    # s = x + d (rounded to x's dtype, as the plain add), y = s / rms(s) * w.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=m, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * n + cols, mask=m, other=0.0).to(tl.float32)
    s = (x + d).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + row * n + cols, s, mask=m)
    _store_rms_norm(s.to(tl.float32), w_ptr, y_ptr, row, cols, m, n, eps)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):
    # y = x / rms(x) * w, float32 inside, rounded once to y's dtype.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    _store_rms_norm(tl.load(x_ptr + row * n + cols, mask=m, other=0.0).to(tl.float32), w_ptr, y_ptr, row, cols, m,
                    n, eps)


@triton.jit
def _store_rms_norm(x, w_ptr, y_ptr, row, cols, m, n, eps):
    # y[row] = x / rms(x) * w for the float32 row x (masked columns 0), rounded once.
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + cols, (x * inv * w).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, f, BLOCK: tl.constexpr):
    # out = silu(gate) * up, gate/up = the two halves of one row of the fused output;
    # silu's result is rounded to the output dtype first, as the plain ops do.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < f
    g = tl.load(gu_ptr + row * 2 * f + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * f + f + cols, mask=m, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * f + cols, (a * u).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, trow_ptr, widx_ptr, q_ptr, kc_ptr, vc_ptr,
                          H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                          HP: tl.constexpr, KP: tl.constexpr, INDEXED: tl.constexpr):
    # One token: its q/k heads rotated, x*cos + [x2, x1]*sin with the sign-folded sin
    # table (runtime/model.py Rope), q to q_ptr, k and v to cache row widx[token]. cos/sin
    # hold a row a token, or (INDEXED) are the tables, read at row trow[token].
    tok = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    sw = (d + D // 2) % D
    tr = tl.load(trow_ptr + tok) if INDEXED else tok
    c = tl.load(cos_ptr + tr * D + d).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + tr * D + d).to(tl.float32)[None, :]
    base = qkv_ptr + tok * (H + 2 * KVH) * D
    hq = tl.arange(0, HP)[:, None]
    mq = hq < H
    x = tl.load(base + hq * D + d[None, :], mask=mq, other=0.0).to(tl.float32)
    xs = tl.load(base + hq * D + sw[None, :], mask=mq, other=0.0).to(tl.float32)
    tl.store(q_ptr + tok * H * D + hq * D + d[None, :], (x * c + xs * s).to(q_ptr.dtype.element_ty), mask=mq)
    row = tl.load(widx_ptr + tok)
    hk = tl.arange(0, KP)[:, None]
    mk = hk < KVH
    k = tl.load(base + (H + hk) * D + d[None, :], mask=mk, other=0.0).to(tl.float32)
    ks = tl.load(base + (H + hk) * D + sw[None, :], mask=mk, other=0.0).to(tl.float32)
    tl.store(kc_ptr + row * KVH * D + hk * D + d[None, :], (k * c + ks * s).to(kc_ptr.dtype.element_ty), mask=mk)
    v = tl.load(base + (H + KVH + hk) * D + d[None, :], mask=mk, other=0.0)
    tl.store(vc_ptr + row * KVH * D + hk * D + d[None, :], v.to(vc_ptr.dtype.element_ty), mask=mk)


@triton.jit
def _argmax_kernel(x_ptr, f32_ptr, val_ptr, idx_ptr, count_ptr, out_ptr, V, CHUNK: tl.constexpr,
                   NCHUNK: tl.constexpr, NCHUNK_P: tl.constexpr, CAST: tl.constexpr):
    # Program (row, chunk): the largest value of x[row, chunk*CHUNK : (chunk+1)*CHUNK] and its
    # first index; the last program of the row to finish (an atomic counter, as in the split-K
    # GEMM) takes the first chunk holding the row's largest value. Ties go to the lowest index,
    # as torch.argmax's do: within a chunk tie_break_left, across chunks the lowest chunk.
    # CAST: x (half precision) is also written to f32_ptr as float32, from the same loads; the
    # argmax of the exact float32 values is x's.
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * V + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
    if CAST:
        tl.store(f32_ptr + row * V + cols, x, mask=cols < V)
    v, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * NCHUNK + c, v)
    tl.store(idx_ptr + row * NCHUNK + c, c * CHUNK + i)
    tl.debug_barrier()                                       # NOTE: as in torch_gemm._arrive
    if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == NCHUNK - 1:
        cs = tl.arange(0, NCHUNK_P)
        ok = cs < NCHUNK
        vs = tl.load(val_ptr + row * NCHUNK + cs, mask=ok, other=-float("inf"), cache_modifier=".cg")
        best = tl.max(vs, 0)
        first = tl.min(tl.where(ok & (vs == best), cs, NCHUNK_P), 0)
        tl.store(out_ptr + row, tl.load(idx_ptr + row * NCHUNK + first, cache_modifier=".cg").to(tl.int64))
        tl.atomic_xchg(count_ptr + row, 0, sem="relaxed")     # NOTE: as in torch_gemm's kernels


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _gdc(t: torch.Tensor) -> bool:
    """Whether launches on t's device can be programmatic dependent launches: CUDA, compute
    capability 9.0 and up, not Triton's interpreter."""
    return t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1" and _hopper(t.device.index or 0)


def _rows(x: torch.Tensor) -> int:
    """Rows of x [..., K]."""
    return x.numel() // max(1, x.shape[-1])


class Kernels:
    """The launch wrappers; ``TorchOps.kernels`` holds one when they are on (CUDA with
    Triton), None otherwise. Tensor layouts are the model's (``runtime/model.py``)."""

    # Weight dtypes the split-K GEMM takes: the half-precision ones, where a decode-shaped
    # projection is a weight read (float32 projections of the bundled model are launch-bound
    # and stay on cuBLAS; the interpreter test adds float32).
    linear_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
    # RoPE and the KV-cache write as the q/k/v projection's epilogue on the split-K GEMM
    # (``qkv_rope``). NOTE: measured (``bench graphs``, docs/performance.md § Session 14): the
    # ~1B verify at batch 1 ×2.16 the weight floor against ×2.21 without (SwiGLU made in the
    # down projection's loads was tried the same way and made it slower: ×2.36; not kept).
    fuse_rope: bool = True
    # RoPE's swapped halves in that epilogue taken from the head's own sum in registers instead
    # of a second read of the split partials (``torch_gemm.splitk_qkv_rope``'s ``swap_in_regs``;
    # the same bits, tested). NOTE: measured (``bench graphs``, docs/performance.md § Session 18):
    # the ~1B verify at batch 1 0.812 ms against 0.820 at context 256, 0.850 against 0.857 at
    # 2,048 (equal at batch 8 and 32).
    rope_swap_in_regs: bool = True
    # A projection that ``torch_gemm.preload_plan`` takes (the o projection) runs as a
    # programmatic dependent launch after the attention (``attention``), each program reading
    # its whole weight slice before it waits for the attention's end. NOTE: measured as
    # above: ×2.15 against ×2.21 without, ×2.10 with ``fuse_rope`` too.
    preload: bool = True
    # The greedy argmax over the vocabulary split over programs (``argmax``). NOTE: measured
    # (``bench graphs``, docs/performance.md § Session 16): the ~1B verify at batch 1 6-8 us
    # faster than with torch's argmax (a thread block a row), the draft's substeps too.
    split_argmax: bool = True
    # SwiGLU's gate/up projection on the split-K GEMM with silu(gate) * up as its epilogue
    # (``swiglu``) instead of cuBLAS and a silu_mul launch. NOTE: measured (``bench graphs``,
    # docs/performance.md § Session 17): the ~1B verify at batch 1 12 us faster (0.856 against
    # 0.868 ms, and 0.826 against 0.836 in the final run).
    fuse_swiglu: bool = True
    # Weight rows one ``swiglu`` program reduces (half gate, half up): 32 -> 352 programs for the
    # ~1B gate/up [11264, 2048] on 132 SMs, 64 -> 176. NOTE: measured as above: the ~1B verify at
    # batch 1 0.821 ms with 32 against 0.826 with 64 (equal at batch 8 and 32).
    swiglu_block_n: int = 32
    # The RMSNorms outside the fused layers (the draft's input norms, the final norm, a
    # layer's first input norm) on a Triton kernel (``rms_norm``) instead of torch's (3.6 us a
    # launch at decode shapes, § Session 16). NOTE: measured as above: the ~1B draft substep at
    # batch 1 0.112 ms against 0.121 (verify 0.826 against 0.831).
    triton_norm: bool = True
    # Two launches fewer at the target's output head: its last residual add with the final
    # RMSNorm (one ``add_rms_norm``, ``runtime/model.py`` ``target_forward(final_norm=True)``),
    # and the logits' cast to float32 written by the split argmax from its own loads
    # (``float_argmax``). NOTE: measured (``bench graphs``, docs/performance.md § Session 18): the
    # ~1B verify at batch 1 ~4 us faster (0.798 against 0.802 ms), at batch 8 and 32 ~70 us
    # (0.917 against 0.987, 1.100 against 1.176).
    fuse_head: bool = True
    # Row blocks of ``torch_gemm.MAX_ROWS`` the split-K GEMMs take (``_fits_gemm``) outside a
    # batch-invariant step: at 1, a step of more than 16 rows (a k=3 verify of 8 requests: 32)
    # runs its projections on cuBLAS and RoPE and SiLU·mul in kernels of their own. NOTE:
    # measured (``bench graphs``' ``row-blocks`` column, docs/performance.md § Session 19): at 4
    # the ~1B verify at batch 8 took 1.157 ms against 0.918 (each block reads the weights again).
    gemm_row_blocks: int = 1
    # Rows one split-K GEMM program holds in a batch-invariant step (``invariant``): the same
    # tile for every launch, whatever its rows, so 32 (a k=3 verify of 8 requests) read each
    # weight once; more rows run in blocks of it, each reading the weight again.
    invariant_rows: int = 32
    _COUNTERS = 16384

    def __init__(self) -> None:
        # device -> the split-K GEMM's int32 counters (``torch_gemm.splitk_linear``).
        # NOTE: one buffer for every launch on a device: launches of one process run in
        # stream order (every step and replay is on the current stream of the one device
        # thread), and each launch leaves its counters at zero before the next starts.
        self._counters: dict[torch.device, torch.Tensor] = {}
        self._scope = threading.local()

    # --- batch invariance ---------------------------------------------------------------
    # Inside ``invariant_steps`` (the target's decode and verify steps with
    # ``runtime.batch_invariant``), a row's bits depend on the row alone, never on how many
    # rows the step has or what they hold: every projection and the output head run on the
    # split-K GEMM in row blocks of ``invariant_rows`` with a plan that follows the weight's
    # shape only (float32 too, as IEEE float32), and the attention on a plan that follows the model and max_len
    # only (``invariant_attention_plan``). Each kernel otherwise picks its launch from the
    # row count, and other tiles round differently: in bf16 a greedy near-tie then goes the
    # other way in a verify of 32 rows than in a decode of 8 (docs/performance.md § Session 19).
    @property
    def invariant(self) -> bool:
        """Whether the calling thread is inside ``invariant_steps``."""
        return getattr(self._scope, "on", False)

    @contextlib.contextmanager
    def invariant_steps(self):
        """The calling thread's launches batch-invariant inside the block (see above)."""
        before, self._scope.on = self.invariant, True
        try:
            yield
        finally:
            self._scope.on = before

    def reserve(self, device: torch.device) -> None:
        """Allocate this device's counters now. NOTE: called before a CUDA graph capture
        (``TorchOps.capture``): allocated inside one, the buffer would live in that graph's
        pool and go with the graph at a teardown while later captures still used it."""
        if device not in self._counters:
            self._counters[device] = torch.zeros(self._COUNTERS, dtype=torch.int32, device=device)

    def _fits_gemm(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """What every split-K GEMM launch needs: at most ``gemm_row_blocks`` blocks of
        ``torch_gemm.MAX_ROWS`` rows of x [..., K] (any number ``invariant``), a contiguous 2-D
        weight of a ``linear_dtypes`` dtype (or float32 ``invariant``), x of the same dtype."""
        if self.invariant:
            return w.dtype in (*self.linear_dtypes, torch.float32) and x.dtype == w.dtype and w.dim() == 2 \
                and w.is_contiguous()
        return (_rows(x) <= torch_gemm.MAX_ROWS * self.gemm_row_blocks and w.dtype in self.linear_dtypes
                and x.dtype == w.dtype and w.dim() == 2 and w.is_contiguous())

    def fits_linear(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether ``linear`` takes x [..., K] @ w [N, K]^T: ``_fits_gemm``, and a weight shape
        ``torch_gemm.pays`` for (any ``invariant``)."""
        return self._fits_gemm(x, w) and (self.invariant or torch_gemm.pays(*w.shape))

    def fits_qkv_rope(self, x: torch.Tensor, w: torch.Tensor, head_dim: int) -> bool:
        """Whether ``qkv_rope`` takes x [..., K] @ w^T for the fused q/k/v weight w [(H + 2 KVH) D, K]:
        ``_fits_gemm`` (whatever the weight's width: a head a program fills the SMs), D a power
        of two from 16, a column tile's counter for every head."""
        return (self.fuse_rope and self._fits_gemm(x, w) and self.fits(head_dim) and w.shape[0] % head_dim == 0
                and (self.invariant or w.shape[0] // head_dim * torch_gemm.row_blocks(_rows(x)) <= self._COUNTERS))

    def qkv_rope(self, x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                 kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, write_index: torch.Tensor,
                 table_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``rope_write_kv`` of the q/k/v projection x [B, T, K] @ w^T in one launch (``fits_qkv_rope``
        holds): returns the rotated q [B, T, H, D], writes k and v to cache rows ``write_index``;
        cos/sin as ``rope_write_kv`` takes them."""
        b, t, k = x.shape
        d = cos.shape[-1]
        rows = self._block_rows()
        self._check_counters(w.shape[0] // d * torch_gemm.row_blocks(b * t, rows), "the q/k/v projection")
        self._ready(x)
        q = torch_gemm.splitk_qkv_rope(x.reshape(-1, k), w, cos.reshape(-1, d), sin.reshape(-1, d), heads,
                                       kv_heads, k_cache, v_cache, write_index, self._counters[x.device],
                                       swap_in_regs=self.rope_swap_in_regs, table_rows=table_rows, block_rows=rows)
        return q.view(b, t, heads, -1)

    def fits_swiglu(self, x: torch.Tensor, w: torch.Tensor, ffn: int) -> bool:
        """Whether ``swiglu`` takes x [..., K] and the fused gate/up weight w [2 ffn, K]:
        ``_fits_gemm`` (whatever the weight's width), a counter for every column tile when K
        splits."""
        if not (self.fuse_swiglu and self._fits_gemm(x, w) and w.shape[0] == 2 * ffn > 0):
            return False
        p = torch_gemm.plan(2 * ffn, w.shape[1], self.swiglu_block_n)
        return self.invariant or torch_gemm.counters_needed(2 * ffn, p, _rows(x)) <= self._COUNTERS

    def swiglu(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of x [..., K] @ w^T (``fits_swiglu`` holds) in one launch -> [..., ffn]."""
        n, rows = w.shape[0], self._block_rows()
        self._check_counters(torch_gemm.counters_needed(n, torch_gemm.plan(n, w.shape[1], self.swiglu_block_n),
                                                        _rows(x), rows), "the gate/up projection")
        self._ready(x)
        y = torch_gemm.splitk_swiglu(x.reshape(-1, x.shape[-1]), w, self._counters[x.device], self.swiglu_block_n,
                                     block_rows=rows)
        return y.view(*x.shape[:-1], w.shape[0] // 2)

    def fits_rms_norm(self, x: torch.Tensor) -> bool:
        """Whether ``rms_norm`` takes x: a floating-point row of at most 16,384 (one program a row)."""
        return self.triton_norm and x.dim() >= 1 and 0 < x.shape[-1] <= 16384 and x.is_floating_point()

    @staticmethod
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(x) * w over the last axis, shaped and typed like x."""
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        y = torch.empty_like(x2)
        if x2.shape[0]:
            _rms_norm_kernel[(x2.shape[0],)](x2, w, y, n, eps, BLOCK=pow2(n))
        return y.view(x.shape)

    def _ready(self, x: torch.Tensor) -> None:
        """The split-K GEMM's counters on x's device (allocated now when outside a capture)."""
        if x.device not in self._counters:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("Kernels.reserve(device) must run before a capture that uses the split-K GEMM")
            self.reserve(x.device)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ w[N, K]^T -> [..., N] on the split-K GEMM (``fits_linear`` holds); a
        weight that ``torch_gemm.preload_plan`` takes runs as a dependent launch with ``preload``."""
        n, k = w.shape
        # NOTE: ``invariant``, the plan may not follow the row count: never the preload plan
        # (which the one-block launches take), and row blocks of ``invariant_rows``.
        pdl, rows = self._preloads(x, w), self._block_rows()
        p = torch_gemm.preload_plan(n, k) if pdl else torch_gemm.plan(n, k)
        self._check_counters(torch_gemm.counters_needed(n, p, _rows(x), rows), f"a [{n}, {k}] projection")
        self._ready(x)
        y = torch_gemm.splitk_linear(x.reshape(-1, k), w, p, self._counters[x.device], pdl=pdl, block_rows=rows)
        return y.view(*x.shape[:-1], n)

    def _block_rows(self) -> int:
        """Rows a split-K GEMM program holds: ``invariant_rows`` ``invariant``, else 16."""
        return self.invariant_rows if self.invariant else torch_gemm.MAX_ROWS

    def _check_counters(self, needed: int, what: str) -> None:
        if needed > self._COUNTERS:
            raise ValueError(f"{what} needs {needed} split-K counters, more than {self._COUNTERS}")

    def _preloads(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether x @ w^T runs as a dependent launch reading its weight early (``preload``):
        on the split-K GEMM in one row block (the plan fills one wave), with a weight
        ``torch_gemm.preload_plan`` takes; never in a batch-invariant step."""
        return (self.preload and not self.invariant and _gdc(x) and _rows(x) <= torch_gemm.MAX_ROWS
                and self.fits_linear(x, w) and torch_gemm.preload_plan(*w.shape) is not None)

    def fits_argmax(self, x: torch.Tensor, axis: int) -> bool:
        """Whether ``argmax`` takes x: float32 over its last axis, a counter for every row."""
        return x.dtype == torch.float32 and x.dim() >= 1 and axis in (-1, x.dim() - 1) and self._fits_split_argmax(x)

    def _fits_split_argmax(self, x: torch.Tensor) -> bool:
        """What every split argmax launch needs: the switch on, a non-empty last axis, a
        counter for every row."""
        return self.split_argmax and x.dim() >= 1 and x.shape[-1] > 0 and _rows(x) <= self._COUNTERS

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, -1) (``fits_argmax`` holds), split over the last axis: torch's
        reduction runs a thread block a row (~10 us for 4 rows of a 32,000-token vocabulary on
        an H200, docs/performance.md § Session 16). Same indices, ties included; a row holding
        NaN is not torch's answer (NaN logits are a broken model either way)."""
        return self._split_argmax(x, None)

    def fits_float_argmax(self, x: torch.Tensor) -> bool:
        """Whether ``float_argmax`` takes x: as ``fits_argmax``, of a half-precision dtype too."""
        return self.fuse_head and x.dtype in (torch.float32, *self.linear_dtypes) and self._fits_split_argmax(x)

    def float_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x as float32, its argmax over the last axis) in one launch (``fits_float_argmax``
        holds): the output head's cast to float32 written by the split argmax from its own loads."""
        if x.dtype == torch.float32:
            return x, self._split_argmax(x, None)
        f32 = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        return f32, self._split_argmax(x, f32)

    def _split_argmax(self, x: torch.Tensor, f32: torch.Tensor | None) -> torch.Tensor:
        v = x.shape[-1]
        rows = x.numel() // v
        self._ready(x)
        chunk = min(4096, pow2(v))
        nchunk = triton.cdiv(v, chunk)
        vals = torch.empty((rows, nchunk), dtype=torch.float32, device=x.device)
        idx = torch.empty((rows, nchunk), dtype=torch.int32, device=x.device)
        out = torch.empty(x.shape[:-1], dtype=torch.int64, device=x.device)
        _argmax_kernel[(rows, nchunk)](x.contiguous(), x if f32 is None else f32, vals, idx, self._counters[x.device],
                                       out, v, CHUNK=chunk, NCHUNK=nchunk, NCHUNK_P=pow2(nchunk),
                                       CAST=f32 is not None)
        return out

    @staticmethod
    def fits(head_dim: int) -> bool:
        """RoPE and attention tiles span the head dim: a power of two from 16."""
        return head_dim >= 16 and head_dim & (head_dim - 1) == 0

    def fits_attention(self, groups: int, tokens: int) -> bool:
        """Whether one program holds a step's query rows (decode and verify, not long prefills),
        or ``invariant`` one token's (the tokens then go in blocks)."""
        return groups * (1 if self.invariant else tokens) <= MAX_QUERY_ROWS

    @staticmethod
    def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float):
        """(x + delta, rms_norm(x + delta) * w), both shaped and typed like x."""
        n = x.shape[-1]
        x2, d2 = x.reshape(-1, n).contiguous(), delta.reshape(-1, n).contiguous()
        s, y = torch.empty_like(x2), torch.empty_like(x2)
        _add_rms_norm_kernel[(x2.shape[0],)](x2, d2, w, s, y, n, eps, BLOCK=pow2(n))
        return s.view(x.shape), y.view(x.shape)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor, ffn: int) -> torch.Tensor:
        """gate_up [..., 2*ffn] -> silu(gate_up[..., :ffn]) * gate_up[..., ffn:]."""
        gu = gate_up.reshape(-1, 2 * ffn).contiguous()
        out = torch.empty((gu.shape[0], ffn), dtype=gu.dtype, device=gu.device)
        block = min(1024, pow2(ffn))
        _silu_mul_kernel[(gu.shape[0], triton.cdiv(ffn, block))](gu, out, ffn, BLOCK=block)
        return out.view(*gate_up.shape[:-1], ffn)

    @staticmethod
    def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, write_index: torch.Tensor,
                      table_rows: torch.Tensor | None = None) -> torch.Tensor:
        """qkv [B, T, H+2KVH, D] (the fused projection), cos/sin [B, T, 1, D] -> rotated q
        [B, T, H, D]; rotated k and v written to cache rows ``write_index`` [B*T]. With
        ``table_rows`` [B*T]: cos/sin are the tables [P, D], read at those rows (no gather launch)."""
        b, t, _, d = qkv.shape
        q = torch.empty((b, t, heads, d), dtype=qkv.dtype, device=qkv.device)
        # NOTE: indexed as dense [B*T] (a strided view of positions would read other rows: see
        # torch_gemm.splitk_qkv_rope).
        write_index = write_index.contiguous()
        rows = write_index if table_rows is None else table_rows.contiguous()
        _rope_write_kv_kernel[(b * t,)](qkv.contiguous(), cos.contiguous(), sin.contiguous(), rows, write_index, q,
                                        k_cache, v_cache, H=heads, KVH=kv_heads, D=d,
                                        HP=pow2(heads), KP=pow2(kv_heads), INDEXED=table_rows is not None)
        return q

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, read_slots: torch.Tensor,
                  positions: torch.Tensor, span: int, max_len: int, w_o: torch.Tensor) -> torch.Tensor:
        """``cache_attention`` as the model runs it: letting the o projection after it (weight
        ``w_o``) start at once (``early``) when that one is a dependent launch (``_preloads``).
        NOTE: measured (``bench graphs``, docs/performance.md § Session 18): early with the o
        projection on cuBLAS (a verify of 32 rows) made the ~1B verify at batch 8 ~60 us slower."""
        b, t, h, d = q.shape
        return self.cache_attention(q, k_cache, v_cache, read_slots, positions, span, max_len,
                                    early=self._preloads(q.view(b, t, h * d), w_o), invariant=self.invariant)
    cache_attention = staticmethod(torch_attention.cache_attention)
