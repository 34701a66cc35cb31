"""Loaded by every Python process started with this folder on PYTHONPATH (scripts/exchange_latency.py).
(Not SPECSPLIT_* variables: the services refuse environment variables of theirs they do not know.)

With ``EXCHANGE_PROBE_DIR`` set to a folder, each process that imports ``core.frames`` records
every data-plane frame it sends and receives — (kind, start, end, bytes), ``time.monotonic_ns``,
one clock for every process of the host — and appends the frames recorded since the last time
to ``<folder>/frames-<pid>.jsonl`` (one JSON list a line) every second (rewriting the whole log
each time stalled the process it measured: see scripts/round_probe). With ``EXCHANGE_PROBE_HOLD_TOKENS`` also set, the round loop hands a request's token
events to its stream only when the request ends (a diagnostic: no chunk relay during rounds).
Nothing here is imported by the services themselves.
"""

import json
import os
import sys
import threading
import time

_DIR = os.environ.get("EXCHANGE_PROBE_DIR")


def _patch_frames(log: list) -> None:
    import core.frames as frames

    send, recv = frames.FrameSocket.send, frames.FrameSocket.recv

    def timed_send(self, body, timeout=None):
        t0 = time.monotonic_ns()
        try:
            return send(self, body, timeout)
        finally:
            log.append(("s", t0, time.monotonic_ns(), len(body)))

    def timed_recv(self, deadline=None):
        t0 = time.monotonic_ns()
        out = recv(self, deadline)
        log.append(("r", t0, time.monotonic_ns(), len(out)))
        return out

    frames.FrameSocket.send, frames.FrameSocket.recv = timed_send, timed_recv


def _hold_tokens() -> None:
    import rounds.scheduler as scheduler

    push = scheduler.Scheduler._push_tokens
    held: dict[int, list] = {}

    def holding_push(self, live, tokens, accepted, drafted, timing=None):
        held.setdefault(id(live), []).append((tokens, accepted, drafted, timing))
        if live.seq.finish_reason is not None or len(live.seq.output) <= 1:
            for args in held.pop(id(live)):
                push(self, live, *args)

    scheduler.Scheduler._push_tokens = holding_push


def _install() -> None:
    log: list = []
    for _ in range(6000):                       # the module is imported once the service starts
        if "core.frames" in sys.modules:
            _patch_frames(log)
            break
        time.sleep(0.005)
    else:
        return
    path, done = os.path.join(_DIR, f"frames-{os.getpid()}.jsonl"), 0
    while True:
        time.sleep(1.0)
        if len(log) > done:
            new, done = log[done:], len(log)
            with open(path, "a") as f:
                f.write("".join(json.dumps(row) + "\n" for row in new))


def _install_hold() -> None:
    for _ in range(6000):                       # only the target's process has a round loop
        if "rounds.scheduler" in sys.modules:
            _hold_tokens()
            return
        time.sleep(0.005)


if _DIR:
    threading.Thread(target=_install, name="frame-probe", daemon=True).start()
    if os.environ.get("EXCHANGE_PROBE_HOLD_TOKENS"):
        threading.Thread(target=_install_hold, name="frame-probe-hold", daemon=True).start()
