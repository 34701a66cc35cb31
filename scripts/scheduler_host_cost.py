"""What the target's round loop costs its own thread per round: ``python scripts/scheduler_host_cost.py``.

Runs ``rounds.scheduler.Scheduler`` (admission, the round driver, commits, events) over a target
port that answers at once (one token a round, no model, no device) and one ``EventOutbox`` reader
thread, as a DecodeStream reads, and prints the microseconds a round; ``--profile N`` adds a
cProfile of the scheduler thread (top N by own time). What is left is the loop's own Python:
on the GPU host it runs ~3× slower and paces a target-only round (docs/performance.md § Session 24).

    python scripts/scheduler_host_cost.py [--rounds 4000] [--batch 1] [--profile 30]

Diagnostic only; nothing imports it.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from core.params import SamplingParams  # noqa: E402
from round_host_probe import _profile_scheduler  # noqa: E402  (the same scheduler-thread cProfile)
from rounds.scheduler import EventOutbox, FinalEvent, GenerationRequest, Scheduler  # noqa: E402
from runtime.types import PrefillResult, VerifyResult  # noqa: E402

HIDDEN = 8


class InstantTarget:
    """A target port that answers every call at once: token 7 each round, a hidden row when asked."""

    def prefill(self, reqs):
        return [PrefillResult(r.request_id, 5, np.zeros((len(r.prompt), HIDDEN), np.float32)) for r in reqs]

    def verify(self, reqs):
        return [VerifyResult(r.request_id, 0, (7,), np.zeros((1, HIDDEN), np.float32) if r.hidden else None)
                for r in reqs]

    def release(self, request_id: str) -> bool:
        return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4000, help="tokens each request decodes (one a round)")
    ap.add_argument("--batch", type=int, default=1, help="requests decoding at once")
    ap.add_argument("--profile", type=int, default=0, help="print the scheduler thread's cProfile, top N")
    a = ap.parse_args()
    if a.profile:
        _profile_scheduler(a.profile)
    sched = Scheduler(InstantTarget(), None, max_batch=max(8, a.batch), max_queue=16, eos_token_id=257,
                      weights_version="v0").start()
    box, done, left = EventOutbox(), threading.Event(), [a.batch]

    def reader() -> None:
        while not done.is_set():
            for _who, ev in box.take(0.5):
                if isinstance(ev, FinalEvent):
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()
    threading.Thread(target=reader, daemon=True).start()
    params = SamplingParams(max_tokens=a.rounds, ignore_eos=True)
    t0 = time.perf_counter()
    for i in range(a.batch):
        sched.submit(GenerationRequest(f"r{i}", (1, 2, 3), params, 0), outbox=box)
    finished = done.wait(300)
    dt = time.perf_counter() - t0
    rounds = sched.round
    sched.stop()
    if not finished:
        print("the requests did not finish within 300 s")
        return 1
    print(f"batch {a.batch}: {dt / max(rounds, 1) * 1e6:.1f} us a round over {rounds} rounds (an instant target)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
