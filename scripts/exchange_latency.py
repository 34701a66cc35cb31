"""Where a round's draft exchange spends its time, across processes: ``python scripts/exchange_latency.py``.

Runs ``specsplit bench services`` (torch on CPU, batch 1, k=3; ``--`` passes other arguments)
with ``scripts/exchange_probe`` on PYTHONPATH, so the target and the draft record every
data-plane frame with one host-wide clock, then prints medians and 90th percentiles of:
the target's send until the draft has the frame, the draft's handling, the draft's send
until the target has the answer, and the whole exchange as the target sees it.
``--hold-tokens``: the round loop hands tokens to the streams only when a request ends, so
no chunk is relayed to the orchestrator and the client during rounds (a diagnostic).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def summarize(target: list, draft: list) -> dict[str, tuple[float, float]]:
    """(median, p90) in microseconds of each part, frame i of the target matched with frame i of the draft."""
    ts, tr = [e for e in target if e[0] == "s"], [e for e in target if e[0] == "r"]
    dr, ds = [e for e in draft if e[0] == "r"], [e for e in draft if e[0] == "s"]
    n = min(len(ts), len(tr), len(dr), len(ds))
    parts = {
        "target send -> draft has the frame": [dr[i][2] - ts[i][1] for i in range(n)],
        "target's send call": [ts[i][2] - ts[i][1] for i in range(n)],
        "draft: frame in -> answer out": [ds[i][1] - dr[i][2] for i in range(n)],
        "draft send -> target has the answer": [tr[i][2] - ds[i][1] for i in range(n)],
        "whole exchange (target's view)": [tr[i][2] - ts[i][1] for i in range(n)],
    }
    return {k: (statistics.median(v) / 1e3, sorted(v)[int(0.9 * (len(v) - 1))] / 1e3) for k, v in parts.items() if v}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hold-tokens", action="store_true")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="after --: more bench services arguments")
    args = ap.parse_args()
    extra = [a for a in args.rest if a != "--"]
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "EXCHANGE_PROBE_DIR": out,
               "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts" / "exchange_probe"), str(ROOT),
                                              os.environ.get("PYTHONPATH", "")])}
        if args.hold_tokens:
            env["EXCHANGE_PROBE_HOLD_TOKENS"] = "1"
        cmd = [sys.executable, "-m", "specsplit", "bench", "services", "--backend", "torch", "--device", "cpu",
               "--batch", "1", "--prompts", "4", "--max-tokens", "128", "--k", "3", *extra]
        bench = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
        print("\n".join(line for line in bench.stdout.splitlines() if line.strip()))
        if bench.returncode != 0:
            print(bench.stderr[-4000:], file=sys.stderr)
            return bench.returncode
        time.sleep(1.5)                           # the probes append to their logs every second
        logs = [[json.loads(line) for line in open(f) if line.endswith("\n")]
                for f in glob.glob(os.path.join(out, "frames-*.jsonl"))]
    senders = [g for g in logs if g and g[0][0] == "s"]           # the target writes first, the draft reads first
    readers = [g for g in logs if g and g[0][0] == "r"]
    if len(senders) != 1 or len(readers) != 1:
        print(f"expected one target and one draft frame log, found {len(senders)} and {len(readers)}", file=sys.stderr)
        return 1
    print(f"\ndata-plane exchange, {'tokens held until each request ends' if args.hold_tokens else 'as served'}:")
    for name, (med, p90) in summarize(senders[0], readers[0]).items():
        print(f"  {name:38s} median {med:8.1f} us   p90 {p90:8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
