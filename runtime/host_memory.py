"""Returning freed host memory to the operating system after large, rare operations.

Owns: ``pin_mmap_threshold()`` (each service process, at start) and ``trim()``
(after a weight load / release and after a reload has finished).

Why: glibc's malloc raises its mmap threshold (up to 32 MiB on 64-bit) each
time a large mmapped block is freed. After the first reload the next
checkpoint's host arrays (each tensor 0.1-100s of MiB) are therefore carved
out of the malloc arenas instead of fresh mmaps; freed, they leave free but
resident, fragmented pages in those arenas (one per thread that allocated:
gRPC handler threads, the device thread, the round loop). RSS then creeps up
reload after reload. Measured on the bundled model, 30 same-weight reloads
under traffic through the three services (Paddle, CPU), growth after the
first 5: target +5.9% without either fix (no traffic), +4.7% with ``trim``
alone, +0.9% / draft +0.8% / orchestrator +0.5% with the threshold pinned at
glibc's initial 128 KiB (``mallopt(M_MMAP_THRESHOLD)``, which also turns the
dynamic adjustment off): every large block is its own mmap and goes back to
the OS when freed. ``malloc_trim(0)`` then returns what small-block churn
leaves free in the arenas (madvise on whole free pages, not only the top).
An explicit ``MALLOC_MMAP_THRESHOLD_`` in the environment wins over the pin.

Must not know: models, gRPC. A no-op where glibc is not the allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3          # mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        _libc.malloc_trim.restype = ctypes.c_int
        _libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):   # musl and others: no malloc_trim
        _libc = None


def trim() -> bool:
    """Give free heap pages back to the OS; True when something was released."""
    return bool(_libc.malloc_trim(0)) if _libc is not None else False


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Blocks of at least ``nbytes`` are always mmapped (and unmapped when freed); True when set.
    Left alone when the environment sets MALLOC_MMAP_THRESHOLD_ (the operator's choice)."""
    if _libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return bool(_libc.mallopt(M_MMAP_THRESHOLD, nbytes))
