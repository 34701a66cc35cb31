"""The per-framework ops layer the model family is written against.

Owns: the list of tensor operations the Llama target and the MTP head need,
with their shapes and semantics. Paddle and Torch implement it in
``paddle_ops.py`` and ``torch_ops.py``; the model code (``runtime/model.py``)
calls only these methods, so both frameworks run the same model definition.

Must not know: models, requests, gRPC. Every method is shape-static given
its inputs' shapes (no host synchronisation), so the same calls can be
captured into a CUDA graph.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

Tensor = Any  # a paddle.Tensor or torch.Tensor, opaque to callers


class HostMirror:
    """A plain host twin of a device buffer (see ``Ops.host_mirror``): ``upload`` is one
    ``copy_from_numpy``. Backends without pinned asynchronous copies use it as is."""

    def __init__(self, ops: "Ops", dst: Tensor, dtype: type) -> None:
        self.ops, self.dst = ops, dst
        self.host = np.empty(tuple(ops.shape(dst)), dtype=dtype)

    def array(self) -> np.ndarray:
        return self.host

    def upload(self) -> None:
        self.ops.copy_from_numpy(self.dst, self.host)


class Ops(Protocol):
    name: str          # "paddle" | "torch"
    device: str        # "cpu" | "cuda:N"
    dtype: str         # compute dtype of weights/activations: float32 | float16 | bfloat16
    # Batched sampling/acceptance on the device (see torch_sampling.TorchSampler), or
    # None: the engines then run the numpy functions of runtime.sampling/acceptance.
    sampler: Any
    # The fused decoder-layer kernels (``torch_kernels.Kernels``), or None: the model then
    # runs its plain ops, which are the reference for the kernels.
    kernels: Any

    # --- host <-> device ---------------------------------------------------
    def from_numpy(self, arr: np.ndarray, dtype: str | None = None) -> Tensor:
        """Copy a numpy array to the device. dtype None keeps int arrays as int64
        and casts float arrays to the compute dtype."""
    def to_numpy(self, x: Tensor) -> np.ndarray:
        """Copy to host; floating tensors come back as float32."""
    def to_numpy_many(self, xs: list[Tensor], bf16_bits: bool = False, ring: Any = None) -> list[np.ndarray]:
        """Several tensors to the host with one synchronisation. Floating tensors come back
        as float32, or (bf16 tensors, ``bf16_bits``) as uint16 bf16 bit patterns."""
    def to_numpy_many_async(self, xs: list[Tensor], bf16_bits: bool = False, ring: Any = None) -> Any:
        """``to_numpy_many`` split in two: the copies are queued now (the values are those
        of this point in the stream), the returned function waits for them and returns the
        arrays; device work queued in between may run on. ``ring``: what ``fetch_ring`` gave
        (None: none); the arrays may then be that ring's reused host buffers, valid until its
        next few fetches (callers copy what they keep)."""
    def fetch_ring(self) -> Any:
        """Reused host buffers for one hot read-back (a verify's outputs, a propose's drafts),
        or None where the backend has none (each read-back then allocates its own)."""
    def zeros(self, shape: tuple[int, ...], dtype: str | None = None) -> Tensor: ...
    def arange(self, n: int) -> Tensor:
        """int64 [n] = 0..n-1"""
    def copy_(self, dst: Tensor, src: Tensor) -> None:
        """In-place copy (dst keeps its address). Shapes must match."""
    def clone(self, x: Tensor) -> Tensor:
        """A new tensor with x's values (one device copy, queued in stream order)."""
    def copy_from_numpy(self, dst: Tensor, arr: np.ndarray) -> None:
        """Host array straight into an existing device tensor (one copy, address kept)."""
    def fill_from_files(self, items: list[tuple[Tensor, str, int, int, str]]) -> list[bool]:
        """Stream raw checkpoint bytes straight into existing tensors: each item is (dst, file,
        start, end, safetensors dtype). Returns, per item, whether it was filled here (True:
        bytes [start, end) of the file are now ``dst``, address kept); items this backend has
        no direct path for (another dtype, a CPU device) are left to the caller."""
    def host_mirror(self, dst: Tensor) -> Any:
        """A host twin of an int64 / float32 device buffer: ``.array()`` -> the numpy array to
        fill, ``.upload()`` copies it into ``dst`` (asynchronously from pinned memory on CUDA;
        a twin is never handed out while its previous upload may still be reading it)."""
    def data_ptr(self, x: Tensor) -> int: ...
    def plain_ops(self) -> Any:
        """A context in which the calling thread's steps run the plain ops (``kernels`` None)."""
    batch_invariant: bool       # runtime.batch_invariant (see ``invariant_steps``)
    def invariant_steps(self) -> Any:
        """A context in which the calling thread's steps are batch-invariant when
        ``batch_invariant`` (a row's bits depend on that row alone), else a no-op."""
    def compile_step(self, fn: Any) -> Any:
        """A step function, compiled when the runtime asked for it (Torch on CUDA), else as is."""
    def fuse_rows(self, xs: list[Tensor]) -> tuple[Tensor, list[Tensor]] | None:
        """One new buffer holding ``xs`` stacked along axis 0, and views of it in their
        place (a write into a view lands in the buffer), or None when this backend's
        slices are copies rather than views (the model then keeps separate tensors)."""
    def cast(self, x: Tensor, dtype: str) -> Tensor: ...
    def dtype_name(self, x: Tensor) -> str: ...
    def shape(self, x: Tensor) -> tuple[int, ...]: ...

    # --- math ----------------------------------------------------------------
    def linear(self, x: Tensor, w: Tensor) -> Tensor:
        """x [..., in] @ w[out, in]^T -> [..., out]"""
    def rms_norm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        """x * rsqrt(mean(x^2, -1) + eps) * w, computed in float32, returned in x's dtype"""
    def silu(self, x: Tensor) -> Tensor: ...
    def embedding(self, w: Tensor, ids: Tensor) -> Tensor:
        """w [V, d], ids int64 [...] -> [..., d]"""
    def cat(self, xs: list[Tensor], axis: int) -> Tensor: ...
    def reshape(self, x: Tensor, shape: tuple[int, ...]) -> Tensor: ...
    def transpose(self, x: Tensor, perm: tuple[int, ...]) -> Tensor: ...
    def index_select(self, x: Tensor, index: Tensor, axis: int) -> Tensor: ...
    def scatter_rows_(self, dst: Tensor, index: Tensor, src: Tensor) -> None:
        """dst[index[i]] = src[i] along axis 0, in place. index int64 [N]."""
    def gather_context(self, cache: Tensor, slots: Tensor, span: int, max_len: int) -> Tensor:
        """cache [(S+1)*max_len, KVH, D] (slot s owns rows s*max_len ...), slots int64 [B]
        -> [B, span, KVH, D]: the first ``span`` rows of each slot (its real context)."""
    def attention_mask(self, mask: Tensor, groups: int) -> Tensor:
        """mask bool [B, T, L] (True = may attend) -> the form ``attention`` takes for
        queries grouped ``groups`` per K/V head (made once per forward, shared by its layers)."""
    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """q [B, T, H, D], k/v [B, L, KVH, D] (H % KVH == 0), mask from ``attention_mask``
        -> [B, T, H, D]. Softmax in float32."""
    def less_equal(self, a: Tensor, b: Tensor) -> Tensor: ...
    def argmax(self, x: Tensor, axis: int) -> Tensor: ...
    def float_argmax(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(x cast to float32, its argmax over the last axis): an output head's logits and the
        greedy token, in one pass where the backend has a kernel for it. The argmax of the
        cast values is the argmax of x (the cast is exact and keeps the order, ties too)."""
    def clip(self, x: Tensor, lo: int, hi: int) -> Tensor: ...
    def minimum(self, a: Tensor, b: Tensor) -> Tensor:
        """Elementwise min (broadcasting)."""
    def where(self, cond: Tensor, a: Tensor, b: Tensor | float | int) -> Tensor:
        """a where cond else b (broadcasting; ``b`` may be a Python number of a's dtype)."""
    def leading_equal(self, a: Tensor, b: Tensor) -> Tensor:
        """int64 [...]: how many leading positions of the last axis have a == b (a, b [..., n])."""

    # --- memory / device ---------------------------------------------------
    def bind_thread(self) -> None:
        """Called once on a worker's device thread (e.g. sets the current CUDA device)."""
    def synchronize(self) -> None: ...
    def memory_allocated(self) -> int:
        """Bytes held by the framework allocator on this device (0 on CPU)."""
    def empty_cache(self) -> None: ...
    def no_grad(self) -> Any:
        """Context manager disabling autograd."""

    # --- device graphs -------------------------------------------------------
    # The framework half of graph capture; runtime.graphs keeps the buckets, the
    # static buffers and the replay bookkeeping and imports no framework.
    graphs_mode: str
    """What capture means here, as GetStatus reports it: "cuda", or "eager (cpu)"."""
    def graph_pool(self) -> Any:
        """A new device memory pool for the graphs of one capture pass (None without device graphs)."""
    def capture(self, fn: Any, inputs: dict[str, Tensor], pool: Any) -> tuple[Any, tuple]:
        """Record ``fn(**inputs)`` into a device graph allocating from ``pool``: (graph, outputs);
        the graph has ``replay()`` and ``reset()``, the outputs are the tensors each replay
        rewrites. Without device graphs: (None, the outputs of one eager run)."""
