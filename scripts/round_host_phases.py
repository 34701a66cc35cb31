"""Where a round's host time goes, by part.

    python scripts/round_host_phases.py MODEL cpu BATCH TOKENS [round_host_probe flags]

Runs ``scripts/round_host_probe.py`` with the same arguments (e.g. ``--outbox --colocated --round-ahead``)
and times, exclusive of one another, the parts of the rounds of BATCH requests: the scheduler and
the round driver, each port's call layers (guard, local port, worker, device thread, metrics), the
engines' checks, propose and verify, the round-ahead queues, and the graph registry's host side of a
replay; the graphs' eager stand-ins (the steps' compute on a CPU) are left out. Prints microseconds
a round for each part, largest first. On a GPU host the replays are asynchronous and their launch
is host work too: there use the probe's ``--torch-profile``.

Diagnostic only (docs/performance.md § Session 30); nothing imports it.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import round_host_probe as probe  # noqa: E402
from rounds import guards  # noqa: E402
from runtime import draft_engine, graphs, round_ahead, target_engine  # noqa: E402
from worker import base  # noqa: E402

STEPS = "steps"                                      # the eager stand-ins: left out of the table
_spent: dict[str, float] = collections.defaultdict(float)
_open: list[list[Any]] = []                          # [part, seconds of nested parts]
_active = [False]                                    # inside a round of the batch


def _timed(part: str, fn: Callable) -> Callable:
    def run(*args, **kwargs):
        if not _active[0]:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        _open.append([part, 0.0])
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - t0
            _, nested = _open.pop()
            _spent[part] += took - nested
            if _open:
                _open[-1][1] += took
    return run


PARTS = [
    (graphs._EagerGraph, "replay", STEPS),
    (graphs.GraphRegistry, "_eager", STEPS),
    (graphs.GraphRegistry, "_replay", "graph registry: a replay's host side"),
    (draft_engine.DraftEngine, "propose", "draft engine: propose"),
    (draft_engine.DraftEngine, "check_propose", "draft engine: check_propose"),
    (target_engine.TargetEngine, "verify", "target engine: verify"),
    (target_engine.TargetEngine, "check_verify", "target engine: check_verify"),
    (round_ahead.RoundChain, "queue", "round ahead: the target's queue"),
    (round_ahead.DraftChain, "queue", "round ahead: the draft's queue"),
    (guards.GuardedDraft, "propose", "draft port: call layers"),
    (guards.GuardedTarget, "verify", "target port: call layers"),
    (base.Worker, "_answered", "worker: step metrics"),
]


def main() -> int:
    batch = int(sys.argv[3])
    for owner, name, part in PARTS:
        setattr(owner, name, _timed(part, getattr(owner, name)))
    run_round = probe.scheduler_mod.Scheduler._run_round
    rounds = [0]

    def counted(sched, live):
        if len(live) != batch:                   # a round of the batch only (not a wave's edges)
            return run_round(sched, live)
        rounds[0] += 1
        _active[0] = True
        try:
            return _timed("scheduler and round driver", run_round)(sched, live)
        finally:
            _active[0] = False
    probe.scheduler_mod.Scheduler._run_round = counted
    _spent.clear()
    rc = probe.main()
    n = max(rounds[0], 1)
    host = {k: v for k, v in _spent.items() if k != STEPS}
    print(f"batch {batch}: {n} rounds, host {1e6 * sum(host.values()) / n:.0f} us a round outside the steps "
          "(exclusive parts, us a round; the timers' own cost included):")
    for part, s in sorted(host.items(), key=lambda kv: -kv[1]):
        print(f"  {1e6 * s / n:7.1f}  {part}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
