"""Loaded by every Python process started with this folder on PYTHONPATH (scripts/round_trace.py).

With ``ROUND_PROBE_DIR`` set to a folder, a process that runs a round loop (the target service)
records every request-round the scheduler hands to its streams — the end time
(``time.monotonic_ns``), the request id, drafts proposed and accepted, and the round's draft,
target, overhead and wall seconds — and rewrites ``<folder>/rounds-<pid>.json`` every half
second. It wraps ``rounds.scheduler.Scheduler._push_tokens`` once that module is imported.
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
            log.append((time.monotonic_ns(), live.seq.request_id, drafted, accepted, timing.draft_s,
                        timing.target_s, timing.overhead_s, timing.wall_s, timing.batch, live.seq.drafting))
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
    while wrapped:
        time.sleep(0.5)
        if log:
            with open(os.path.join(_DIR, f"rounds-{os.getpid()}.json"), "w") as f:
                json.dump(log, f)


if _DIR:
    threading.Thread(target=_install, name="round-probe", daemon=True).start()
