"""One thread per worker for all device work.

Owns: running every model step, load, in-place copy, capture, clear and
release of a worker on a single dedicated thread, in submission order; the
hand-off to it (a queue and one lock per call, no futures); and the one
exception, ``run(fn, inline=True)``: a caller that asks for it may run ``fn``
on its own thread while the device thread is idle (see below).

Why: gRPC handlers run on a pool of threads, and frameworks keep per-thread
device state. Torch's cuBLAS keeps one workspace per (thread, stream): device
work arriving on 16 handler threads left up to 16 workspaces behind (seen on
an H200: +32 MiB steps after reloads until every pool thread had one), and
the current CUDA device is per thread too. A single device thread keeps one
handle, one workspace and one current device, and serializes the work (what
a lock did before) without letting the caller's thread touch the device.

Inline runs: a hop to the device thread and back is two thread wake-ups, the
largest part of a small step's cost outside its compute (issue 10). A caller
on the per-round path (the draft's Propose stream) may ask to run inline: when
nothing is queued or running, ``fn`` runs on the caller's thread under the
same lock the device thread holds for each job, so the work stays serialized
and in order. At most ``MAX_INLINE_THREADS`` distinct threads ever run inline
(each is set up with ``setup`` once and keeps its own per-thread framework
state, e.g. a cuBLAS workspace); other threads hop as before.

Must not know: models, lifecycle, gRPC.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Callable, TypeVar

T = TypeVar("T")

MAX_INLINE_THREADS = 2      # threads besides the device thread that may ever run device work inline


class _Call:
    """One job and its answer; ``done`` is held until the device thread has run it."""

    __slots__ = ("fn", "result", "error", "done")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.result, self.error = fn, None, None
        self.done = threading.Lock()
        self.done.acquire()


def _serve(jobs: queue.SimpleQueue, busy: threading.Lock, setup: Callable[[], None] | None,
           started: _Call, pending: list[int], count_lock: threading.Lock) -> None:
    try:
        if setup is not None:
            setup()
    except BaseException as exc:  # noqa: BLE001 - reported to the constructor
        started.error = exc
    started.done.release()
    while (call := jobs.get()) is not None:
        # NOTE: ``busy`` is held for the whole job and ``pending`` drops only after it, so an
        # inline caller (which needs both free) never overtakes a job submitted before it.
        with busy:
            try:
                call.result = call.fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                call.error = exc
        with count_lock:
            pending[0] -= 1
        call.done.release()


def _answer(call: _Call) -> Any:
    """Wait for ``call`` to have run; its result, or its exception raised here."""
    call.done.acquire()
    if call.error is not None:
        raise call.error
    return call.result


def _stop(jobs: queue.SimpleQueue, thread: threading.Thread) -> None:
    jobs.put(None)
    if threading.current_thread() is not thread:
        thread.join()                               # a job in flight (at exit) finishes first


class DeviceThread:
    def __init__(self, name: str, setup: Callable[[], None] | None = None) -> None:
        self._setup = setup
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._busy = threading.Lock()               # held by whoever runs device work
        self._pending = [0]                          # jobs submitted and not finished (under _count_lock)
        self._count_lock = threading.Lock()
        self._inline_threads = 0                    # threads ever allowed to run inline
        self._local = threading.local()             # .inline: this thread's answer, once decided
        self._inline_owner: int | None = None       # the thread running inline now (nested runs stay inline)
        started = _Call(lambda: None)
        thread = threading.Thread(target=_serve, args=(self._jobs, self._busy, setup, started, self._pending,
                                        self._count_lock),
                                  name=f"{name}_0", daemon=True)
        thread.start()
        self._ident = thread.ident
        # NOTE: the thread holds no reference to this object: it ends when the object is
        # collected, and at interpreter exit after its job in flight (as an executor's would).
        self._finalizer = weakref.finalize(self, _stop, self._jobs, thread)
        started.done.acquire()
        if started.error is not None:
            raise started.error

    def run(self, fn: Callable[[], T], inline: bool = False) -> T:
        """Run ``fn`` on the device thread and return its result (exceptions propagate).

        Called from the device thread itself (or from within an inline run) it runs
        inline, so device work may nest (e.g. close() -> clear_graphs() -> release_weights()).
        ``inline``: run on the calling thread instead when the device thread is idle and
        this thread may (module doc); otherwise hop as usual.
        """
        me = threading.get_ident()
        if me == self._ident or me == self._inline_owner:
            return fn()
        if inline and self._may_inline() and self._busy.acquire(blocking=False):
            if self._pending[0] == 0:
                return self._run_inline(me, fn)     # releases _busy
            self._busy.release()                    # jobs are queued: they go first, this one after them
        return self.submit(fn)()

    def try_run(self, fn: Callable[[], T]) -> T | None:
        """``fn()`` now, on the calling thread, when ``run(fn, inline=True)`` would run it there
        (the device thread idle, nothing queued, this thread allowed); else None, without
        running or waiting (work that is worth doing only at once: a round queued ahead)."""
        me = threading.get_ident()
        if me == self._ident or me == self._inline_owner:
            return fn()
        if self._may_inline() and self._busy.acquire(blocking=False):
            if self._pending[0] == 0:
                return self._run_inline(me, fn)     # releases _busy
            self._busy.release()
        return None

    def submit(self, fn: Callable[[], T]) -> Callable[[], T]:
        """Queue ``fn`` on the device thread and return at once; the returned function waits for
        it and returns its result (or raises its exception). Call that function exactly once.
        Jobs run in submission order, after every job submitted before (inline runs included).
        From the device thread itself ``fn`` runs now (a nested submit would wait on itself)."""
        call = _Call(fn)
        me = threading.get_ident()
        if me == self._ident or me == self._inline_owner:
            try:
                call.result = fn()
            except BaseException as exc:  # noqa: BLE001 - raised by the waiter, as a queued job's
                call.error = exc
            call.done.release()
            return lambda: _answer(call)
        with self._count_lock:
            self._pending[0] += 1
        self._jobs.put(call)
        return lambda: _answer(call)

    def _may_inline(self) -> bool:
        allowed = getattr(self._local, "inline", None)
        if allowed is None:
            with self._count_lock:
                allowed = self._inline_threads < MAX_INLINE_THREADS
                self._inline_threads += allowed
            if allowed and self._setup is not None:
                self._setup()                       # e.g. this thread's current CUDA device
            self._local.inline = allowed
        return allowed

    def _run_inline(self, me: int, fn: Callable[[], T]) -> T:
        """``fn`` on this thread; the caller holds ``_busy``, released here."""
        self._inline_owner = me
        try:
            return fn()
        finally:
            self._inline_owner = None
            self._busy.release()

    def shutdown(self) -> None:
        self._finalizer()
