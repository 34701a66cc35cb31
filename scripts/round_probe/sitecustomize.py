"""Loaded by every Python process started with this folder on PYTHONPATH (scripts/round_trace.py).

With ``ROUND_PROBE_DIR`` set to a folder, a process that runs a round loop (the target service)
records every request-round the scheduler hands to its streams — the end time
(``time.monotonic_ns``), the request id, drafts proposed and accepted, the round's draft,
target, overhead and wall seconds, its batch size and whether the draft holds the request, and
under adaptive k the cost model's T(0) and T(max k), the request's E(max k) after the round and
whether the round drafted as a probe (``AdaptiveLoop.probing``) and the request's watch probes so far —
and appends the rows recorded since the last time to ``<folder>/rounds-<pid>.jsonl`` (one JSON list
a line) every half second. It wraps ``rounds.scheduler.Scheduler._push_tokens`` once that module is imported.
(Not SPECSPLIT_* variables: the services refuse environment variables of theirs they do not know.)
Nothing here is imported by the services themselves.
"""

import json
import os
import sys
import threading
import time

_DIR = os.environ.get("ROUND_PROBE_DIR")


def _wrap(log: list) -> bool:
    mod = sys.modules.get("rounds.scheduler")
    cls = getattr(mod, "Scheduler", None) if mod is not None else None
    if cls is None:
        return False
    push = cls._push_tokens

    def recorded(self, live, tokens, accepted, drafted, timing=None, last=False):
        if timing is not None:
            costs, policy = getattr(self, "costs", None), getattr(live.seq, "adaptive", None)
            model = ()
            if costs is not None and policy is not None:     # adaptive k: what the model believed
                model = (costs.cost(0), costs.cost(policy.max_k), policy.expected(policy.max_k),
                         bool(getattr(costs, "probing", False)), live.seq.stats.watch_probes)
            log.append((time.monotonic_ns(), live.seq.request_id, drafted, accepted, timing.draft_s,
                        timing.target_s, timing.overhead_s, timing.wall_s, timing.batch, live.seq.drafting,
                        *model))
        return push(self, live, tokens, accepted, drafted, timing, last)

    cls._push_tokens = recorded
    return True


def _install() -> None:
    log: list = []
    wrapped, tick = False, 0
    while not wrapped and tick < 60_000:             # looked for during two minutes of start-up
        wrapped = _wrap(log)
        time.sleep(0.002)
        tick += 1
    # NOTE: only the new rows each time: rewriting the whole log held the GIL for ~110 ms every
    # half second by the end of a 22,000-round run, which slowed the very rounds it recorded
    # (the traced stack with more rounds ran slow on average, its medians unchanged).
    path, done = os.path.join(_DIR, f"rounds-{os.getpid()}.jsonl"), 0
    while wrapped:
        time.sleep(0.5)
        new, done = log[done:], len(log)
        if new:
            with open(path, "a") as f:
                f.write("".join(json.dumps(row) + "\n" for row in new))


if _DIR:
    threading.Thread(target=_install, name="round-probe", daemon=True).start()
