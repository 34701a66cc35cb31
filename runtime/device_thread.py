"""One thread per worker for all device work.

Owns: running every model step, load, in-place copy, capture, clear and
release of a worker on a single dedicated thread, in submission order.

Why: gRPC handlers run on a pool of threads, and frameworks keep per-thread
device state. Torch's cuBLAS keeps one workspace per (thread, stream): device
work arriving on 16 handler threads left up to 16 workspaces behind (seen on
an H200: +32 MiB steps after reloads until every pool thread had one), and
the current CUDA device is per thread too. A single device thread keeps one
handle, one workspace and one current device, and serializes the work (what
a lock did before) without letting the caller's thread touch the device.

Must not know: models, lifecycle, gRPC.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


class DeviceThread:
    def __init__(self, name: str, setup: Callable[[], None] | None = None) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._ident: int | None = None

        def start() -> None:
            self._ident = threading.get_ident()
            if setup is not None:
                setup()

        self._executor.submit(start).result()

    def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the device thread and return its result (exceptions propagate).

        Called from the device thread itself it runs inline, so device work may
        nest (e.g. close() -> clear_graphs() -> release_weights()).
        """
        if threading.get_ident() == self._ident:
            return fn()
        return self._executor.submit(fn).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
