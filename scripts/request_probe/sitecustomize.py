"""Loaded by every Python process started with this folder on PYTHONPATH (scripts/request_timeline.py).

With ``REQUEST_PROBE_DIR`` set to a folder and ``REQUEST_PROBE_FUNCS`` to a comma-separated list of
``module:Class.method`` (or ``module:function``), each process wraps those it imports so that every
call records (name, start, end) with ``time.monotonic_ns`` (one clock for every process of the host)
and appends the calls recorded since the last time to ``<folder>/calls-<pid>.jsonl`` (one JSON list
a line) every half second (rewriting the whole log each time stalled the process it measured: see
scripts/round_probe). Functions looked up at call time are
seen; a gRPC servicer's methods are bound when its server starts, so they are not.
(Not SPECSPLIT_* variables: the services refuse environment variables of theirs they do not know.)
Nothing here is imported by the services themselves.
"""

import json
import os
import sys
import threading
import time

_DIR = os.environ.get("REQUEST_PROBE_DIR")
_FUNCS = [f for f in os.environ.get("REQUEST_PROBE_FUNCS", "").split(",") if f]


def _wrap(spec: str, log: list) -> bool:
    """Wrap ``spec`` if its module is imported and has it; False when not (yet)."""
    mod, _, attr = spec.partition(":")
    owner = sys.modules.get(mod)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part, None)
    fn = getattr(owner, name, None) if owner is not None else None
    if fn is None:
        return False

    def timed(*a, **kw):
        t0 = time.monotonic_ns()
        try:
            return fn(*a, **kw)
        finally:
            log.append((spec, t0, time.monotonic_ns()))

    setattr(owner, name, timed)
    return True


def _install() -> None:
    log: list = []
    pending, tick = list(_FUNCS), 0
    path, done = os.path.join(_DIR, f"calls-{os.getpid()}.jsonl"), 0
    while True:
        if pending and tick < 60_000:             # looked for during two minutes of start-up
            pending = [spec for spec in pending if not _wrap(spec, log)]
        time.sleep(0.002)
        tick += 1
        if tick % 250 == 0 and len(log) > done:
            new, done = log[done:], len(log)
            with open(path, "a") as f:
                f.write("".join(json.dumps(row) + "\n" for row in new))


if _DIR and _FUNCS:
    threading.Thread(target=_install, name="request-probe", daemon=True).start()
