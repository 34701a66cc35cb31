"""Loaded by every Python process started with this folder on PYTHONPATH (scripts/round_host_probe.py
``--draft-profile``). (Not SPECSPLIT_* variables: the services refuse environment variables of
theirs they do not know.)

With ``DRAFT_PROFILE_OUT`` set to a file, a draft service process profiles what it does for each
round message of the data plane: ``DraftServicer.propose_frame`` (parse, the worker's propose, the
answer) runs under one ``cProfile.Profile``, enabled for the call only, on the thread that calls
it. Every second the file is rewritten with the calls so far, their mean wall time, and the
profile's top functions by own time (``DRAFT_PROFILE_TOP``, default 40). Nothing here is imported
by the services themselves.
"""

import cProfile
import io
import os
import pstats
import sys
import threading
import time

_OUT = os.environ.get("DRAFT_PROFILE_OUT")


def _wrap(prof: cProfile.Profile, calls: list, lock: threading.Lock) -> bool:
    mod = sys.modules.get("draft_service.server")
    cls = getattr(mod, "DraftServicer", None) if mod is not None else None
    if cls is None:
        return False
    frame = cls.propose_frame

    def profiled(self, body):
        with lock:                                   # never while the writer reads the profile
            t0 = time.perf_counter()
            prof.enable()
            try:
                return frame(self, body)
            finally:
                prof.disable()
                calls.append(time.perf_counter() - t0)

    cls.propose_frame = profiled
    return True


def _write(prof: cProfile.Profile, calls: list, top: int) -> None:
    buf = io.StringIO()
    n = len(calls)
    buf.write(f"draft propose_frame calls: {n}, mean wall {1e6 * sum(calls) / max(n, 1):.1f} us "
              "(under the profiler)\n")
    if n:
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    tmp = _OUT + ".tmp"
    with open(tmp, "w") as f:
        f.write(buf.getvalue())
    os.replace(tmp, _OUT)


def _install() -> None:
    prof, calls, top = cProfile.Profile(), [], int(os.environ.get("DRAFT_PROFILE_TOP", "40"))
    lock = threading.Lock()
    wrapped, tick = False, 0
    while not wrapped and tick < 60_000:             # looked for during two minutes of start-up
        wrapped = _wrap(prof, calls, lock)
        time.sleep(0.002)
        tick += 1
    # NOTE: the profile is read between two calls (the lock): reading it disables it, which
    # must not happen while the handler's thread has it enabled. That round waits for the
    # write (a few ms once a second).
    while wrapped:
        time.sleep(1.0)
        with lock:
            _write(prof, calls, top)


if _OUT:
    threading.Thread(target=_install, name="draft-profile", daemon=True).start()
