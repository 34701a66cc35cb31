"""Torch implementation of the ops layer (see ``base.py`` for semantics).

Owns: every ``torch`` call the model family makes. Must not know models,
requests or gRPC.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}
_NAMES = {v: k for k, v in _DTYPES.items()}


class TorchOps:
    name = "torch"

    def __init__(self, device: str, dtype: str, cpu_threads: int | None = None) -> None:
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"runtime.device={device!r} but torch sees no CUDA device")
        if cpu_threads is not None:
            torch.set_num_threads(cpu_threads)
        self.device = device
        self.dtype = dtype
        self._dev = torch.device(device)
        self._dt = _DTYPES[dtype]

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

    def copy_(self, dst, src):
        dst.copy_(src)

    def copy_from_numpy(self, dst, arr):
        if arr.dtype == np.uint16:
            dst.copy_(torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16))
            return
        dst.copy_(torch.from_numpy(np.ascontiguousarray(arr)).to(dst.dtype), non_blocking=False)

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
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * w.float()).to(x.dtype)

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

    def attention(self, q, k, v, mask):
        b, t, h, d = q.shape
        kvh = k.shape[2]
        g = h // kvh
        # [B, KVH, G*T, D] x [B, KVH, D, L]: every query head of a group shares one K/V head.
        qg = q.reshape(b, t, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * t, d)
        kt = k.permute(0, 2, 3, 1)                                   # [B, KVH, D, L]
        scores = torch.matmul(qg.float(), kt.float()) / math.sqrt(d)  # [B, KVH, G*T, L]
        m = mask[:, None, None, :, :].expand(b, kvh, g, t, mask.shape[-1]).reshape(b, kvh, g * t, -1)
        scores = scores.masked_fill(~m, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v.permute(0, 2, 1, 3).float())    # [B, KVH, G*T, D]
        return out.reshape(b, kvh, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h, d).to(q.dtype)

    def less_equal(self, a, b):
        return a <= b

    def argmax(self, x, axis):
        return torch.argmax(x, dim=axis)

    def clip(self, x, lo, hi):
        return torch.clamp(x, lo, hi)

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
