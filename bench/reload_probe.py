"""A pytest plugin that times the parts of graph clears and weight releases (diagnostic, GPU).

    python3 -m pytest -p bench.reload_probe -m gpu tests/gpu/test_reload_gpu.py -s

Owns: wrapping ``gc.collect``, ``TorchOps.synchronize`` / ``empty_cache``,
``GraphRegistry.clear`` and ``Worker._drop_engine`` with host timers for the length
of the session, and printing per wrapped call the count, median and worst seconds at
the end. Why: test_reload_gpu's RECAPTURE phases (clear ~1.6 s, release ~1.2 s) are
an order of magnitude slower than the same worker calls made outside the services
(scripts/recapture_ab.py: ~0.1 s each); this says which part takes the time.

Must not know: what the tests do.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time

_TIMES: dict[str, list[float]] = {}


def _timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            _TIMES.setdefault(name, []).append(time.perf_counter() - t0)
    return wrapper


def pytest_configure(config):
    from runtime.backends.torch_ops import TorchOps
    from runtime.graphs import GraphRegistry
    from worker.base import Worker

    gc.collect = _timed("gc.collect", gc.collect)
    for cls, names in ((TorchOps, ("synchronize", "empty_cache")), (GraphRegistry, ("clear",)),
                       (Worker, ("_drop_engine", "clear_graphs", "release_weights"))):
        for n in names:
            setattr(cls, n, _timed(f"{cls.__name__}.{n}", getattr(cls, n)))


def pytest_unconfigure(config):
    print("\n[reload probe] host seconds per call: count, median, max")
    for name, ts in sorted(_TIMES.items()):
        print(f"  {name:32s} {len(ts):5d} {statistics.median(ts):8.4f} {max(ts):8.4f}")
