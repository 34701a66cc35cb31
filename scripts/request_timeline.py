"""Where one request's time goes through the services, across processes: ``python scripts/request_timeline.py``.

Starts the three services (bundled model, torch on CPU unless ``--device``, k=3) with
``scripts/request_probe`` on PYTHONPATH, so the workers and the orchestrator record calls of the
functions below with one host-wide clock, then sends requests one after another from one client
(its channel kept, as a user's is) and prints, per kind of request, the medians of: the first token's time
from the call, the client's
wall time, the compute (the target's prefill and verifies, the draft's prefill and proposals) and
what is left, the per-request cost of the split (calls, hops, thread wake-ups); then one-token
requests on the kept client against a new channel each; then the timeline of the last request
of each kind.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

COMPUTE = {                                          # name -> the compute it times
    "target_service.rounds:LocalTarget.prefill": "target prefill",
    "target_service.rounds:LocalTarget.verify": "target verify",
    "draft_service.worker:DraftWorker.prefill": "draft prefill",
    "draft_service.worker:DraftWorker.propose": "draft propose",
}
OTHER = [
    "orchestrator.round_client:RemoteRounds.submit", "orchestrator.round_client:RemoteHandle.next_event",
    "rounds.scheduler:Scheduler._admit", "rounds.scheduler:Scheduler._run_round", "rounds.scheduler:Scheduler._end",
    "rounds.draft_client:DraftClient.prefill", "rounds.draft_client:DraftClient.flush_releases",
    "target_service.decode_messages:_event_proto", "rounds.scheduler_types:RequestHandle.next_event",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=12, help="timed requests of each kind")
    args = ap.parse_args()
    from bench.engine import TINY, heldout_prompts
    from orchestrator.client import SpecsplitClient
    from specsplit.launcher import Stack, StackOptions

    out = tempfile.mkdtemp(prefix="request-timeline-")
    probe = {"REQUEST_PROBE_DIR": out, "REQUEST_PROBE_FUNCS": ",".join([*COMPUTE, *OTHER]),
             "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts" / "request_probe"), str(ROOT),
                                            os.environ.get("PYTHONPATH", "")])}
    kinds = [("short prompt, 1 token", "hello", 1), ("short prompt, 2 tokens", "hello", 2),
             ("held-out prompt, 9 tokens", heldout_prompts(1, TINY)[0], 9)]
    opts = StackOptions(model=str(TINY), backend="torch", draft_device=args.device, target_device=args.device, k=3,
                        max_batch=4, metrics=True, log_level="WARNING", extra_env=probe)
    marks: dict[str, list[tuple[int, int]]] = {}
    firsts: dict[str, list[float]] = {}             # ms from the call to the first token
    with Stack(opts) as stack, SpecsplitClient(stack.orchestrator_address, timeout=120) as client:
        for name, prompt, n in kinds:
            for _ in range(3):                       # warm-up
                client.generate_text(prompt, max_tokens=n, k=3, ignore_eos=True)
            for _ in range(args.requests):
                t0, first = time.monotonic_ns(), None
                for ev in client.generate(prompt, max_tokens=n, k=3, ignore_eos=True):
                    first = first or time.monotonic_ns()     # the first chunk (or the final event)
                marks.setdefault(name, []).append((t0, time.monotonic_ns()))
                firsts.setdefault(name, []).append((first - t0) / 1e6)
        # A channel per request (what a client that does not keep its channel pays) against the one above.
        channel = {"one client": [], "a channel each": []}
        for _ in range(args.requests):
            t0 = time.perf_counter()
            client.generate_text("hello", max_tokens=1, k=0, ignore_eos=True)
            channel["one client"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with SpecsplitClient(stack.orchestrator_address, timeout=120) as fresh:
                fresh.generate_text("hello", max_tokens=1, k=0, ignore_eos=True)
            channel["a channel each"].append(time.perf_counter() - t0)
        time.sleep(1.5)                              # the probes write every half second
        calls = [tuple(json.loads(line)) for f in glob.glob(os.path.join(out, "calls-*.jsonl"))
                 for line in open(f) if line.endswith("\n")]             # not a line being written
    print(f"one request at a time, k=3, {args.device}, bundled model; medians of {args.requests} requests (ms)")
    print(f"{'request':28s} {'first':>7s} {'wall':>7s} {'compute':>8s} {'left':>7s}   compute parts")
    for name, spans in marks.items():
        walls, comp, parts = [], [], {}
        for a, b in spans:
            inside = [c for c in calls if c[1] >= a and c[2] <= b]
            walls.append((b - a) / 1e6)
            per = {}
            for spec, t0, t1 in inside:
                if spec in COMPUTE:
                    per[COMPUTE[spec]] = per.get(COMPUTE[spec], 0.0) + (t1 - t0) / 1e6
            comp.append(sum(per.values()))
            for k, v in per.items():
                parts.setdefault(k, []).append(v)
        med = {k: statistics.median(v) for k, v in parts.items()}
        print(f"{name:28s} {statistics.median(firsts[name]):7.2f} {statistics.median(walls):7.2f} {statistics.median(comp):8.2f} "
              f"{statistics.median(w - c for w, c in zip(walls, comp)):7.2f}   "
              + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    print("one-token requests, k=0: " + ", ".join(f"{name} {1e3 * statistics.median(v):.2f} ms"
                                                   for name, v in channel.items()))
    for name, spans in marks.items():
        a, b = spans[-1]
        print(f"\n--- {name}: the last one, {(b - a) / 1e6:.2f} ms (ms from the client's call)")
        for spec, t0, t1 in sorted((c for c in calls if c[1] >= a and c[2] <= b), key=lambda c: c[1]):
            print(f"  {(t0 - a) / 1e6:7.2f} .. {(t1 - a) / 1e6:7.2f}  {(t1 - t0) / 1e6:6.2f}  {spec}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
