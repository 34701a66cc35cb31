"""Torch implementation of the ops layer (see ``base.py`` for semantics).

Owns: every ``torch`` call the model family makes, the read-back of step outputs
(one stream sync for several tensors), uploads and checkpoint bytes through the
pinned buffers of ``torch_host.py``, and the device sampler (``torch_sampling.py``).
Must not know models, requests or gRPC.
"""

from __future__ import annotations

import contextlib
import gc
import threading

import numpy as np
import torch
import torch.nn.functional as F

from core.config import ConfigError
from runtime.backends.base import HostMirror
from runtime.backends.torch_host import STAGE_BYTES, FetchRing, FileFill, PinnedMirror, StageRing
from runtime.backends.torch_sampling import TorchSampler

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}
_NAMES = {v: k for k, v in _DTYPES.items()}
_ST_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


_gc_lock = threading.Lock()
_gc_pauses = [0, False]     # captures running now, and whether the collector was on before the first


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off while the body runs (nested and concurrent uses count).

    NOTE: around every CUDA graph capture. A collection that runs inside a capture may free an
    unreachable ``CUDAGraph`` (an engine dropped without ``close``, a test's leftovers); its
    ``reset`` is then a CUDA call made while the stream is capturing, which invalidates the
    capture (seen on an H200: ``operation not permitted when stream is capturing (function
    reset)``, then cuBLAS failing inside the capture). Outside captures the collector runs as usual.
    """
    with _gc_lock:
        if _gc_pauses[0] == 0:
            _gc_pauses[1] = gc.isenabled()
            gc.disable()
        _gc_pauses[0] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses[0] -= 1
            if _gc_pauses[0] == 0 and _gc_pauses[1]:
                gc.enable()


def _triton_kernels():
    """The fused kernels when Triton is importable, else None (the model's plain ops)."""
    try:
        from runtime.backends.torch_kernels import Kernels
    except ImportError:
        return None
    return Kernels()


class TorchOps:
    name = "torch"

    def __init__(self, device: str, dtype: str, cpu_threads: int | None = None, compile_steps: bool = False,
                 fused_kernels: bool = False, batch_invariant: bool = False) -> None:
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"runtime.device={device!r} but torch sees no CUDA device")
        if cpu_threads is not None:
            torch.set_num_threads(cpu_threads)
        self.device = device
        self.dtype = dtype
        self._dev = torch.device(device)
        self._dt = _DTYPES[dtype]
        self._ring: StageRing | None = None
        self._compile = compile_steps and self._dev.type == "cuda"
        # Batched sampling / acceptance on the device (numpy runtime.sampling is its oracle).
        self.sampler = TorchSampler(self._dev)
        # Fused decoder-layer kernels (CUDA with Triton); with runtime.compile the compiler
        # fuses the plain ops itself, so the two are not combined.
        self._kernels = _triton_kernels() if fused_kernels and self._dev.type == "cuda" and not self._compile else None
        self._local = threading.local()
        if batch_invariant and self._kernels is None:
            raise ConfigError("runtime.batch_invariant needs the fused Triton kernels (Torch on CUDA with Triton "
                              "installed, runtime.fused_kernels on, runtime.compile off); they are not available here")
        self.batch_invariant = batch_invariant

    @property
    def kernels(self):
        kern = self._kernels
        # NOTE: a batch-invariant step keeps its kernels inside ``plain_ops`` too (an eager
        # verify outside the captured graphs): the plain ops' bits follow the batch.
        if kern is not None and getattr(self._local, "plain", False) and not kern.invariant:
            return None
        return kern

    @kernels.setter
    def kernels(self, value):
        self._kernels = value

    def invariant_steps(self):
        """The calling thread's steps batch-invariant inside the block when the runtime asked for
        it (``runtime.batch_invariant``; ``Kernels.invariant_steps``), else as they are."""
        return self._kernels.invariant_steps() if self.batch_invariant else contextlib.nullcontext()

    @contextlib.contextmanager
    def plain_ops(self):
        """This thread's steps run the plain ops (``kernels`` is None) inside the block."""
        before, self._local.plain = getattr(self._local, "plain", False), True
        try:
            yield
        finally:
            self._local.plain = before

    # --- host <-> device ---------------------------------------------------
    def from_numpy(self, arr, dtype=None):
        arr = np.ascontiguousarray(arr)
        if arr.dtype == np.uint16:  # bf16 bit patterns (runtime.checkpoint bf16_bits)
            t = torch.from_numpy(arr.view(np.int16)).to(self._dev).view(torch.bfloat16)
            return t.to(_DTYPES[dtype or self.dtype])
        if dtype is None:
            dtype = "int64" if arr.dtype.kind in "iu" else ("bool" if arr.dtype.kind == "b" else self.dtype)
        t = torch.from_numpy(arr.astype(np.int64) if arr.dtype.kind in "iu" else arr)
        return t.to(device=self._dev, dtype=_DTYPES[dtype])

    def to_numpy(self, x):
        x = x.detach()
        if x.is_floating_point():
            x = x.float()
        return x.cpu().numpy()

    def zeros(self, shape, dtype=None):
        return torch.zeros(shape, dtype=_DTYPES[dtype or self.dtype], device=self._dev)

    def arange(self, n):
        return torch.arange(n, dtype=torch.int64, device=self._dev)

    def clone(self, x):
        return x.clone()

    def copy_(self, dst, src):
        dst.copy_(src)

    def copy_from_numpy(self, dst, arr):
        arr = np.ascontiguousarray(arr)
        if arr.dtype == np.uint16:
            src = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        else:
            src = torch.from_numpy(arr)
        if self._dev.type == "cuda" and src.dtype == dst.dtype and arr.nbytes <= STAGE_BYTES:
            if self._ring is None:
                self._ring = StageRing()
            self._ring.upload(dst, src)
            return
        dst.copy_(src.to(dst.dtype), non_blocking=False)

    def fill_from_files(self, items):
        ok = [self._dev.type == "cuda" and dst.is_contiguous() and _ST_TORCH.get(dt) == dst.dtype
              and dst.numel() * dst.element_size() == end - start for dst, _, start, end, dt in items]
        if not any(ok):
            return ok
        ring, files = FileFill(), {}
        try:
            # NOTE: in file order, so the reads are sequential (the kernel's read-ahead works).
            for i in sorted((i for i, direct in enumerate(ok) if direct), key=lambda i: (items[i][1], items[i][2])):
                dst, path, start, end, _ = items[i]
                if path not in files:
                    files[path] = open(path, "rb", buffering=0)
                ring.fill(dst, files[path], start, end - start, path)
            torch.cuda.current_stream().synchronize()      # the pinned buffers go when this returns
        finally:
            for f in files.values():
                f.close()
        return ok

    def host_mirror(self, dst):
        if self._dev.type == "cuda" and dst.dtype in (torch.int64, torch.float32):
            return PinnedMirror(dst)
        return HostMirror(self, dst, np.int64 if dst.dtype == torch.int64 else np.float32)

    def to_numpy_many(self, xs, bf16_bits=False, ring=None):
        """Several tensors to the host with one stream sync (pinned, non-blocking copies).

        Floating tensors come back as float32, except bf16 ones with ``bf16_bits``:
        those come back as their uint16 bit patterns (half the bytes, exact)."""
        return self.to_numpy_many_async(xs, bf16_bits, ring)()

    def fetch_ring(self):
        return FetchRing() if self._dev.type == "cuda" else None

    def to_numpy_many_async(self, xs, bf16_bits=False, ring=None):
        """``to_numpy_many`` in two halves: the copies are queued now; the returned function
        waits for them (an event, not the whole stream: work queued after the copies may
        still run) and returns the arrays. With ``ring`` (``fetch_ring``) the copies land in
        its reused buffers: the arrays are valid until its next ``FetchRing.SLOTS`` fetches."""
        staged, bits = [], []
        for x in xs:
            if x.requires_grad:                 # a step's outputs never do (no_grad): no op a tensor
                x = x.detach()
            b = bf16_bits and x.dtype == torch.bfloat16
            if b:
                x = x.view(torch.int16)
            elif x.is_floating_point() and x.dtype != torch.float32:
                x = x.float()
            staged.append(x)
            bits.append(b)
        if self._dev.type != "cuda":
            # NOTE: copied now: a CPU tensor's numpy view would see later writes into it.
            arrays = [x.numpy().copy().view(np.uint16) if b else x.numpy().copy() for x, b in zip(staged, bits)]
            return lambda: arrays
        stream = torch.cuda.current_stream(self._dev)
        if ring is not None:
            hosts, copied = ring.stage(staged, stream)
        else:
            hosts = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in staged]
            for host, x in zip(hosts, staged):
                host.copy_(x, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
            copied = done.synchronize

        def wait():
            copied()
            return [h.numpy().view(np.uint16) if b else h.numpy() for h, b in zip(hosts, bits)]
        return wait

    def compile_step(self, fn):
        """``fn`` through torch.compile when the worker asked for it (CUDA only), else ``fn``.

        dynamic=True: one compile serves every batch bucket and context span (the
        registry captures each shape into its own CUDA graph afterwards); batch 1
        is specialised once more by the compiler."""
        if not self._compile:
            return fn
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        return torch.compile(fn, dynamic=True)

    def fuse_rows(self, xs):
        fused = torch.cat([x.detach() for x in xs], 0)
        return fused, list(fused.split([x.shape[0] for x in xs], 0))

    def data_ptr(self, x):
        return int(x.data_ptr())

    def cast(self, x, dtype):
        return x.to(_DTYPES[dtype])

    def dtype_name(self, x):
        return _NAMES[x.dtype]

    def shape(self, x):
        return tuple(x.shape)

    # --- math ----------------------------------------------------------------
    def linear(self, x, w):
        return F.linear(x, w)

    def rms_norm(self, x, w, eps):
        # One fused kernel on CUDA (float32 accumulation, result in x's dtype)
        # instead of the eight of the spelled-out upcast / mean / rsqrt / scale; with the
        # fused kernels on, Triton's (half the time of torch's at decode shapes).
        w, kern = w.to(x.dtype), self.kernels
        if kern is not None and kern.fits_rms_norm(x):
            return kern.rms_norm(x, w, eps)
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def silu(self, x):
        return F.silu(x)

    def embedding(self, w, ids):
        return F.embedding(ids, w)

    def cat(self, xs, axis):
        return torch.cat(xs, dim=axis)

    def reshape(self, x, shape):
        return x.reshape(shape)

    def transpose(self, x, perm):
        return x.permute(*perm)

    def index_select(self, x, index, axis):
        return torch.index_select(x, axis, index)

    def scatter_rows_(self, dst, index, src):
        dst.index_copy_(0, index, src.to(dst.dtype))

    def gather_context(self, cache, slots, span, max_len):
        # [(S+1)*L, KVH, D] viewed as [S+1, L, KVH, D]: a slot's prefix is contiguous,
        # so only span rows per batch row are read (not max_len).
        rows = cache.shape[0] // max_len
        return cache.view(rows, max_len, *cache.shape[1:])[:, :span].index_select(0, slots)

    def attention_mask(self, mask, groups):
        # [B, T, L] -> [B, 1, G*T, L]: the row of grouped query (g, t) is mask[:, t].
        b, t, la = mask.shape
        return mask[:, None, None, :, :].expand(b, 1, groups, t, la).reshape(b, 1, groups * t, la)

    def attention(self, q, k, v, mask):
        b, t, h, d = q.shape
        kvh = k.shape[2]
        g = h // kvh
        # Grouped queries as rows of one head: q [B, KVH, G*T, D] against k/v [B, KVH, L, D],
        # so no K/V head is repeated; ``mask`` is [B, 1, G*T, L] (attention_mask).
        qg = q.reshape(b, t, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * t, d)
        out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return out.reshape(b, kvh, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h, d)

    def less_equal(self, a, b):
        return a <= b

    def argmax(self, x, axis):
        kern = self.kernels
        if kern is not None and kern.fits_argmax(x, axis):
            return kern.argmax(x)
        return torch.argmax(x, dim=axis)

    def float_argmax(self, x):
        kern = self.kernels
        if kern is not None and kern.fits_float_argmax(x):
            return kern.float_argmax(x)
        y = x.float()
        return y, self.argmax(y, -1)

    def clip(self, x, lo, hi):
        return torch.clamp(x, lo, hi)

    def minimum(self, a, b):
        return torch.minimum(a, b)

    def where(self, cond, a, b):
        return torch.where(cond, a, b)

    def leading_equal(self, a, b):
        return (a == b).cumprod(-1).sum(-1)             # bool -> int64 running product: 3 kernels

    # --- memory / device ---------------------------------------------------
    def bind_thread(self):
        """Make this ops object's device the calling thread's current device."""
        if self._dev.type == "cuda":
            torch.cuda.set_device(self._dev)

    def synchronize(self):
        if self._dev.type == "cuda":
            torch.cuda.synchronize(self._dev)

    def memory_allocated(self):
        return int(torch.cuda.memory_allocated(self._dev)) if self._dev.type == "cuda" else 0

    def empty_cache(self):
        if self._dev.type == "cuda":
            # cuBLAS keeps a workspace per (handle, stream); handles are per
            # thread, so captures run from different gRPC threads each leave a
            # workspace behind (seen on H200: +32 MiB steps after reloads,
            # bounded by the thread count). Free them with the cache.
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()

    def no_grad(self):
        return torch.no_grad()

    # --- device graphs (runtime.graphs keeps the buckets and buffers) -------
    @property
    def graphs_mode(self):
        return "cuda" if self._dev.type == "cuda" else "eager (cpu)"

    def graph_pool(self):
        return torch.cuda.graph_pool_handle() if self._dev.type == "cuda" else None

    def capture(self, fn, inputs, pool):
        if self._dev.type != "cuda":
            return None, tuple(fn(**inputs))
        if self._kernels is not None:
            self._kernels.reserve(self._dev)         # NOTE: before the capture (Kernels.reserve)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls other threads make meanwhile (another
        # worker serving eagerly) neither fail nor invalidate this capture.
        with gc_paused(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            outputs = tuple(fn(**inputs))
        return graph, outputs
