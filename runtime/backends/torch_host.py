"""Pinned host buffers for Torch's host<->device copies (CUDA only).

Owns: the staging ring for small asynchronous uploads (``StageRing``), the chunked file-to-device
stream of checkpoint bytes (``FileFill``), the pinned host twin of one device buffer
(``PinnedMirror``) and the reused read-back buffers of the hot step outputs (``FetchRing``).
The rule they share: a pinned buffer is written again only after the event recorded behind its
last copy has completed (the host runs ahead of the GPU). Must not know models or requests.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

STAGE_SLOTS = 8            # pinned staging buffers in the ring (uploads in flight at once)
STAGE_BYTES = 1 << 20      # larger uploads (weights) take the plain synchronous path
FILL_CHUNK, FILL_SLOTS = 32 << 20, 3   # fill_from_files: pinned chunk buffers (96 MiB while it runs)


class StageRing:
    """Pinned host buffers for asynchronous host->device copies of small step inputs.

    NOTE: a buffer is reused only after the event recorded behind its last copy
    has completed: the host runs ahead of the GPU (a propose issues k substeps
    before its one sync), and overwriting a buffer whose copy has not run yet
    would feed a later step's inputs to an earlier one.
    """

    def __init__(self) -> None:
        self.bufs = [torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(STAGE_SLOTS)]
        self.events = [torch.cuda.Event() for _ in range(STAGE_SLOTS)]   # re-recorded, never re-created
        self.used = [False] * STAGE_SLOTS
        self.next = 0

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        i = self.next
        self.next = (i + 1) % STAGE_SLOTS
        if self.used[i]:
            self.events[i].synchronize()
        stage = self.bufs[i][: src.numel() * src.element_size()].view(src.dtype).view(src.shape)
        stage.copy_(src)
        dst.copy_(stage, non_blocking=True)
        self.events[i].record()
        self.used[i] = True


class FileFill:
    """Streams file bytes into device tensors through a few pinned chunk buffers.

    Each chunk is read from the file into a pinned buffer, then copied to the device
    asynchronously, so reading the next chunk overlaps the copy of this one (a
    checkpoint's in-place update costs about its read time).
    NOTE: a buffer is refilled only after the event behind its last copy completed
    (the copy reads it asynchronously).
    """

    def __init__(self) -> None:
        self.bufs = [torch.empty(FILL_CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(FILL_SLOTS)]
        self.views = [memoryview(b.numpy()) for b in self.bufs]
        self.events = [torch.cuda.Event() for _ in range(FILL_SLOTS)]
        self.used = [False] * FILL_SLOTS
        self.next = 0

    def fill(self, dst: torch.Tensor, f: Any, start: int, nbytes: int, name: str) -> None:
        flat = dst.view(-1).view(torch.uint8)
        f.seek(start)
        off = 0
        while off < nbytes:
            i = self.next
            self.next = (i + 1) % FILL_SLOTS
            if self.used[i]:
                self.events[i].synchronize()
            n = min(FILL_CHUNK, nbytes - off)
            if f.readinto(self.views[i][:n]) != n:
                raise ValueError(f"{name}: tensor data truncated")
            flat[off:off + n].copy_(self.bufs[i][:n], non_blocking=True)
            self.events[i].record()
            self.used[i] = True
            off += n


class PinnedMirror:
    """A pinned host twin of one device buffer, filled in place and uploaded asynchronously.

    The caller writes the array ``array()`` returns, then ``upload()`` starts
    its copy to the device buffer: no staging copy, two torch calls per upload.
    NOTE: two host twins alternate, and one is handed out again only after the
    event behind its last upload has completed (the host runs ahead of the GPU;
    writing a twin whose copy has not run yet would change a queued step's inputs).
    """

    def __init__(self, dst: torch.Tensor) -> None:
        self.dst = dst
        self.hosts = [torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True) for _ in range(2)]
        self.arrays = [h.numpy() for h in self.hosts]
        self.events = [torch.cuda.Event() for _ in range(2)]
        self.used = [False, False]
        self.i = 0

    def array(self) -> np.ndarray:
        if self.used[self.i]:
            self.events[self.i].synchronize()
        return self.arrays[self.i]

    def upload(self) -> None:
        i = self.i
        self.dst.copy_(self.hosts[i], non_blocking=True)
        self.events[i].record()
        self.used[i] = True
        self.i = 1 - i


def pinned_bytes(n: int) -> torch.Tensor:
    """A pinned host buffer of ``n`` bytes."""
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


class FetchRing:
    """Host buffers that one hot read-back reuses call after call (a verify's outputs, a
    propose's drafts), instead of a pinned allocation per tensor per call.

    Why: ``torch.empty(..., pin_memory=True)`` goes through the caching host allocator every
    time (its lock, an event recorded when the block is freed and queried when it is handed
    out again): on an H100 host two such calls a target-only round took ~23 µs under cProfile,
    in a round whose host work sets its pace (0.32 ms a round against 0.21 ms of GPU work;
    docs/performance.md § Session 24).

    NOTE: the host tensors ``stage`` returns (and the numpy arrays made from them) are the
    ring's buffers: valid until ``SLOTS`` more ``stage`` calls on the same ring. Callers copy
    what they keep. A slot is written again only after the copies into it have completed:
    known when a later fetch on the same stream was waited for (stream order), else by waiting
    on the slot's event. ``alloc`` (bytes -> uint8 host tensor) and ``event`` (-> an event with
    ``record(stream)`` and ``synchronize()``) are injectable so the rule is tested on CPU.
    """

    SLOTS = 2

    def __init__(self, alloc: Callable[[int], torch.Tensor] = pinned_bytes,
                 event: Callable[[], Any] = torch.cuda.Event) -> None:
        self._alloc, self._event = alloc, event
        self._bufs: list[list[torch.Tensor]] = [[] for _ in range(self.SLOTS)]
        # Per slot and output: (dtype, shape, the host view of the buffer at that dtype and shape).
        self._views: list[list[tuple | None]] = [[] for _ in range(self.SLOTS)]
        self._events: list[Any] = [None] * self.SLOTS
        self._next = 0
        self._fetches = 0                                  # stage calls so far
        self._slot_fetch: list[tuple[Any, int]] = [(None, 0)] * self.SLOTS   # (stream, fetch) last staged
        self._waited: tuple[Any, int] = (None, 0)          # the latest fetch waited for, and its stream

    def stage(self, xs: list[torch.Tensor], stream: Any) -> tuple[list[torch.Tensor], Callable[[], None]]:
        """Queue each x's copy into a host buffer of this ring (non-blocking, on ``stream``'s
        order); -> (the host tensors, ``wait``: returns once the copies are done)."""
        i = self._next
        self._next = (i + 1) % self.SLOTS
        self._fetches += 1
        done = self._events[i]
        if done is None:
            done = self._events[i] = self._event()
        else:
            # NOTE: the copies into this slot, SLOTS calls ago, must be done before new ones go
            # in. A fetch after them on the same stream that was waited for proves it without
            # another call into the driver (a verify waits for each of its fetches).
            slot_stream, slot_fetch = self._slot_fetch[i]
            waited_stream, waited = self._waited
            if not (waited >= slot_fetch and waited_stream == slot_stream):
                done.synchronize()
        self._slot_fetch[i] = (stream, self._fetches)
        bufs, views, out = self._bufs[i], self._views[i], []
        for j, x in enumerate(xs):
            # NOTE: the view of the last call at this slot and place is kept while its dtype and
            # shape repeat (a steady batch): slicing and viewing a buffer are three more tensor
            # ops a call, each a few µs of host time on the GPU host. A buffer that grows drops it.
            view = views[j] if j < len(views) else None
            if view is not None and view[0] == x.dtype and view[1] == x.shape:
                host = view[2]
            else:
                n = x.numel() * x.element_size()
                if j == len(bufs):
                    bufs.append(self._alloc(max(n, 64)))
                    views.append(None)
                elif bufs[j].numel() < n:
                    bufs[j] = self._alloc(max(n, 2 * bufs[j].numel()))
                host = bufs[j][:n].view(x.dtype).view(x.shape)
                views[j] = (x.dtype, x.shape, host)
            host.copy_(x, non_blocking=True)
            out.append(host)
        done.record(stream)
        fetch = (stream, self._fetches)

        def wait() -> None:
            done.synchronize()
            if fetch[1] > self._waited[1]:
                self._waited = fetch
        return out, wait
