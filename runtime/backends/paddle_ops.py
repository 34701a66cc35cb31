"""Paddle implementation of the ops layer (see ``base.py`` for semantics).

Owns: every ``paddle`` call the model family makes, and undoing Paddle's
import-time side effects (it sets the root logger to INFO). Plain ops only:
Paddle's fused CPU kernels (``fused_rms_norm``) die with SIGILL on some CPUs;
``matmul(..., transpose_y=True)`` is used instead of ``.T``.

Must not know models, requests or gRPC.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings

import numpy as np

_root_level = logging.getLogger().level
# Paddle warns at import that ccache (for building C++ extensions) is missing; specsplit builds none.
warnings.filterwarnings("ignore", message="No ccache found")
import paddle  # noqa: E402
import paddle.nn.functional as F  # noqa: E402

from runtime.backends.base import HostMirror  # noqa: E402

# NOTE: restore the root logger after the import; Paddle raises it to INFO,
# which would make every library's debug chatter appear in service logs.
logging.getLogger().setLevel(_root_level)

_DTYPES = {"float32": paddle.float32, "float16": paddle.float16, "bfloat16": paddle.bfloat16,
           "int64": paddle.int64, "int32": paddle.int32, "bool": paddle.bool}


_NP = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32, "bool": np.bool_,
       "bfloat16": np.float32}


def _dtype_name(dt) -> str:
    for k, v in _DTYPES.items():
        if dt == v:
            return k
    raise ValueError(f"unsupported paddle dtype {dt}")


class PaddleOps:
    name = "paddle"

    def __init__(self, device: str, dtype: str, cpu_threads: int | None = None) -> None:
        # Paddle's CPU kernels follow OMP_NUM_THREADS, which its import sets
        # to 1 unless the environment already set it; cpu_threads is advisory.
        self.cpu_threads = cpu_threads
        if device.startswith("cuda"):
            if not paddle.device.is_compiled_with_cuda():
                raise RuntimeError(f"runtime.device={device!r} but this Paddle build has no CUDA")
            self._place = paddle.CUDAPlace(int(device.split(":")[1]))
            paddle.device.set_device(device.replace("cuda", "gpu"))
        else:
            self._place = paddle.CPUPlace()
            paddle.device.set_device("cpu")
        self.device = device
        self.dtype = dtype
        self.sampler = None  # no device sampler: the engines use the numpy path (runtime.sampling)
        self.kernels = None  # no fused kernels: the model runs its plain ops

    # --- host <-> device ---------------------------------------------------
    def from_numpy(self, arr, dtype=None):
        arr = np.ascontiguousarray(arr)
        if arr.dtype == np.uint16:  # bf16 bit patterns: Paddle takes uint16 arrays as bfloat16 (no host widening)
            t = paddle.to_tensor(arr, place=self._place)
            want = _DTYPES[dtype or self.dtype]
            return t if t.dtype == want else t.astype(want)
        if dtype is None:
            dtype = "int64" if arr.dtype.kind in "iu" else ("bool" if arr.dtype.kind == "b" else self.dtype)
        if arr.dtype.kind in "iu":
            arr = arr.astype(np.int64)
        t = paddle.to_tensor(arr, place=self._place)
        return t if t.dtype == _DTYPES[dtype] else t.astype(_DTYPES[dtype])

    def to_numpy(self, x):
        if x.dtype in (paddle.float16, paddle.bfloat16):
            x = x.astype(paddle.float32)
        return x.numpy()

    def to_numpy_many(self, xs, bf16_bits=False, ring=None):
        # bf16 comes back widened to float32 (bf16 -> float32 is exact); no bit-pattern path here.
        return [self.to_numpy(x) for x in xs]

    def to_numpy_many_async(self, xs, bf16_bits=False, ring=None):
        arrays = self.to_numpy_many(xs, bf16_bits)        # synchronous here: nothing to overlap
        return lambda: arrays

    def fetch_ring(self):
        return None                                       # every read-back makes its own arrays

    def zeros(self, shape, dtype=None):
        return paddle.zeros(list(shape), dtype=_DTYPES[dtype or self.dtype])

    def arange(self, n):
        return paddle.arange(n, dtype="int64")

    def clone(self, x):
        return x.clone()

    def copy_(self, dst, src):
        paddle.assign(src.astype(dst.dtype) if src.dtype != dst.dtype else src, output=dst)

    def copy_from_numpy(self, dst, arr):
        if arr.dtype == np.uint16:  # bf16 bit patterns
            self.copy_(dst, paddle.to_tensor(np.ascontiguousarray(arr), place=self._place))
            return
        paddle.assign(np.ascontiguousarray(arr).astype(_NP[self.dtype_name(dst)]), output=dst)

    def compile_step(self, fn):
        return fn  # no compiler here: the plain ops run as they are

    def fill_from_files(self, items):
        return [False] * len(items)          # no direct path: the caller reads and copies

    def host_mirror(self, dst):
        return HostMirror(self, dst, np.int64 if dst.dtype == paddle.int64 else np.float32)

    def fuse_rows(self, xs):
        # NOTE: not fused. An in-place weight update writes the per-name tensors;
        # unless every slice were a view, a fused copy would go stale silently.
        return None

    def data_ptr(self, x):
        return int(x.data_ptr())

    def cast(self, x, dtype):
        return x.astype(_DTYPES[dtype])

    def dtype_name(self, x):
        return _dtype_name(x.dtype)

    def shape(self, x):
        return tuple(x.shape)

    # --- math ----------------------------------------------------------------
    def linear(self, x, w):
        return paddle.matmul(x, w, transpose_y=True)

    def rms_norm(self, x, w, eps):
        xf = x.astype(paddle.float32)
        xf = xf * paddle.rsqrt(paddle.mean(xf * xf, axis=-1, keepdim=True) + eps)
        return (xf * w.astype(paddle.float32)).astype(x.dtype)

    def silu(self, x):
        return F.silu(x)

    def embedding(self, w, ids):
        return F.embedding(ids, w)

    def cat(self, xs, axis):
        return paddle.concat(xs, axis=axis)

    def reshape(self, x, shape):
        return paddle.reshape(x, list(shape))

    def transpose(self, x, perm):
        return paddle.transpose(x, list(perm))

    def index_select(self, x, index, axis):
        return paddle.index_select(x, index, axis=axis)

    def scatter_rows_(self, dst, index, src):
        paddle.scatter_(dst, index, src.astype(dst.dtype), overwrite=True)

    def gather_context(self, cache, slots, span, max_len):
        # Plain ops: flat row index slot * max_len + j for j < span, one index_select.
        b = slots.shape[0]
        idx = paddle.reshape(paddle.reshape(slots, [b, 1]) * max_len + paddle.reshape(paddle.arange(span, dtype="int64"), [1, span]), [b * span])
        out = paddle.index_select(cache, idx, axis=0)
        return paddle.reshape(out, [b, span, *cache.shape[1:]])

    def attention_mask(self, mask, groups):
        return mask          # [B, T, L] as is: attention below expands it per K/V head group

    def attention(self, q, k, v, mask):
        b, t, h, d = q.shape
        kvh = k.shape[2]
        g = h // kvh
        L = k.shape[1]
        # [B, KVH, G*T, D] x [B, KVH, L, D]^T: every query head of a group shares one K/V head.
        qg = paddle.reshape(paddle.transpose(paddle.reshape(q, [b, t, kvh, g, d]), [0, 2, 3, 1, 4]), [b, kvh, g * t, d])
        kt = paddle.transpose(k, [0, 2, 1, 3]).astype(paddle.float32)   # [B, KVH, L, D]
        scores = paddle.matmul(qg.astype(paddle.float32), kt, transpose_y=True) / math.sqrt(d)
        m = paddle.expand(mask.unsqueeze(1).unsqueeze(1), [b, kvh, g, t, L])
        m = paddle.reshape(m, [b, kvh, g * t, L])
        scores = paddle.where(m, scores, paddle.full_like(scores, float("-inf")))
        probs = F.softmax(scores, axis=-1)
        out = paddle.matmul(probs, paddle.transpose(v, [0, 2, 1, 3]).astype(paddle.float32))
        out = paddle.transpose(paddle.reshape(out, [b, kvh, g, t, d]), [0, 3, 1, 2, 4])
        return paddle.reshape(out, [b, t, h, d]).astype(q.dtype)

    def less_equal(self, a, b):
        return paddle.less_equal(a, b)

    def argmax(self, x, axis):
        return paddle.argmax(x, axis=axis)

    def float_argmax(self, x):
        y = paddle.cast(x, "float32")
        return y, paddle.argmax(y, axis=-1)

    def clip(self, x, lo, hi):
        return paddle.clip(x, lo, hi)

    def minimum(self, a, b):
        return paddle.minimum(a, b)

    def where(self, cond, a, b):
        if not isinstance(b, paddle.Tensor):
            b = paddle.full([1], b, dtype=a.dtype)
        return paddle.where(cond, a, b)

    def leading_equal(self, a, b):
        return paddle.cumprod(paddle.cast(paddle.equal(a, b), "int64"), dim=-1).sum(-1)

    # --- memory / device ---------------------------------------------------
    def bind_thread(self):
        """Paddle's device choice is process-wide (set in __init__): nothing per thread."""

    def synchronize(self):
        if self.device.startswith("cuda"):
            paddle.device.synchronize()

    def memory_allocated(self):
        if self.device.startswith("cuda"):
            return int(paddle.device.cuda.memory_allocated(self._place.get_device_id()))
        return 0

    def empty_cache(self):
        if self.device.startswith("cuda"):
            paddle.device.cuda.empty_cache()

    def no_grad(self):
        return paddle.no_grad()

    def plain_ops(self):
        return contextlib.nullcontext()      # the plain ops are all there is here

    batch_invariant = False                  # runtime.batch_invariant is refused for Paddle (RuntimeConfig)

    def invariant_steps(self):
        return contextlib.nullcontext()

    # --- device graphs (runtime.graphs keeps the buckets and buffers) -------
    @property
    def graphs_mode(self):
        return "cuda" if self.device.startswith("cuda") else "eager (cpu)"

    def graph_pool(self):
        if not self.device.startswith("cuda"):
            return None
        from paddle.base import core

        return core.CUDAGraph.gen_new_memory_pool_id()

    def capture(self, fn, inputs, pool):
        if not self.device.startswith("cuda"):
            return None, tuple(fn(**inputs))
        from paddle.device.cuda.graphs import CUDAGraph

        paddle.device.synchronize()
        graph = CUDAGraph(pool_id=pool)
        graph.capture_begin()
        outputs = tuple(fn(**inputs))
        graph.capture_end()
        return graph, outputs
