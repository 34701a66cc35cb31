"""Returning freed host memory to the operating system after large, rare operations.

Owns: ``pin_mmap_threshold()`` (each service process, at start), ``loading()`` (the
window a checkpoint's host arrays are allocated and freed in) and ``trim()`` (after a
weight load / release and after a reload has finished).

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

But a threshold of 128 KiB for the whole process also maps and unmaps every step's larger
host buffers, each time paying fresh pages: on the CPU backend a 128-token prefill of the
bundled model took 28.6 ms instead of 19.7 with it pinned there (SpecEngine alone, 2-core
CPU), and the colocated services' request ran ~12 ms behind the in-process engine's for
it. So the threshold is 128 KiB only while a checkpoint's host arrays are made
(``loading()``: reading a checkpoint, installing or copying it in), where the growth came
from, and ``SERVING_THRESHOLD_BYTES`` otherwise (glibc's own ceiling for its dynamic
threshold, kept fixed: no freed block moves it): a step's buffers are reused from the
arenas as they were before any pin.

Must not know: models, gRPC. A no-op where glibc is not the allocator.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
import threading
from typing import Iterator

M_MMAP_THRESHOLD = -3          # mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024          # while a checkpoint's host arrays are made (``loading``)
SERVING_THRESHOLD_BYTES = 32 * 1024 * 1024  # otherwise (glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)

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


_pinned = False                # this process pins its threshold (``pin_mmap_threshold``)
_serving = SERVING_THRESHOLD_BYTES   # ... at this outside ``loading`` windows
_loads = 0                     # ``loading`` windows open now (threads may overlap them)
_lock = threading.Lock()


def pin_mmap_threshold(nbytes: int = SERVING_THRESHOLD_BYTES) -> bool:
    """Fix the threshold at ``nbytes`` (no dynamic adjustment), and at ``MMAP_THRESHOLD_BYTES``
    inside ``loading`` windows; True when set. Left alone when the environment sets
    MALLOC_MMAP_THRESHOLD_ (the operator's choice)."""
    global _pinned, _serving
    if _libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    with _lock:
        _pinned, _serving = True, nbytes
        return bool(_libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES if _loads else nbytes))


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """A window in which a checkpoint's host arrays are allocated (and freed): every block of at
    least ``MMAP_THRESHOLD_BYTES`` is its own mapping, given back to the OS when freed, whatever
    the threshold is then. A no-op unless ``pin_mmap_threshold`` pinned it. Windows may overlap
    (a preload beside an apply): the threshold goes back up when the last one closes."""
    global _loads
    with _lock:
        _loads += 1
        if _pinned and _loads == 1:
            _libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    try:
        yield
    finally:
        with _lock:
            _loads -= 1
            if _pinned and _loads == 0:
                _libc.mallopt(M_MMAP_THRESHOLD, _serving)
