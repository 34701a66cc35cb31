"""A serving process's settled heap: its long-lived objects out of the cyclic collector's walks.

Owns: whether this process settles its heap (``enable``, called by a service's main, never
by a library: the policy is process-wide), ``settle`` (collect, then ``gc.freeze()`` what
survives) and ``thaw`` (``gc.unfreeze()`` before a collection that must see those objects).

Why: Python's full collection walks every tracked object, and a worker process holds many
long-lived ones once it serves (the frameworks, gRPC, the engine, its graphs: ~187,000 in a
target worker with the bundled model on CPU, where one full collection took 52–93 ms on 2
cores). The collector runs one whenever enough new objects have survived, so now and then a
round of a serving loop waits for it: on an H100 one target-only round in ~1,600 took 99 ms
among rounds of 0.7 ms (docs/performance.md § Session 23). Frozen objects are not walked;
a full collection then costs what the objects made since cost. Serving engines do the same
after start-up (vLLM freezes its heap once the engine is built).

What a frozen object gives up: the collector never frees it. Reference counting still does,
so only frozen objects in reference cycles that become garbage would stay; the worker's
teardown paths (graphs cleared, weights released) ``thaw`` before their ``gc.collect()`` so
the old engine's and graphs' cycles are found, and the next ``settle`` freezes the survivors.

Must not know: workers, engines, frameworks.
"""

from __future__ import annotations

import gc

_enabled = False


def enable() -> None:
    """This process settles its heap from now on (a service's main, before it starts serving)."""
    global _enabled
    _enabled = True


def settle() -> None:
    """Collect, then freeze what survives (no-op unless ``enable``d): call once serving state is built."""
    if _enabled:
        gc.collect()
        gc.freeze()


def thaw() -> None:
    """Unfreeze (no-op unless ``enable``d): call before a collection that must reach the settled objects."""
    if _enabled:
        gc.unfreeze()
