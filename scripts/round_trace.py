"""What each kind of round costs in a served run: ``python scripts/round_trace.py DIR``.

Reads the request-rounds ``scripts/round_probe`` recorded (run anything with
``ROUND_PROBE_DIR=DIR`` and that folder on PYTHONPATH, e.g. ``bench adaptive``; one file per
target process, i.e. per stack) and prints, per process and per kind of request-round (drafts
proposed k; for k = 0 whether the draft holds the request, as adaptive k's target-only rounds
do): how many, the medians of the round's draft / target / overhead / wall milliseconds and of
the period (from the end of the request's round before to the end of this one, where that
leaves under 2 ms outside the round), and the draft time of the
first drafting round after a target-only one (a probe: its catch-up carries every skipped pair);
under adaptive k also what the cost model estimated (T(0), T(max k)) against the measured periods,
and the requests' estimated E(max k) in the rounds that did and did not draft.

    ROUND_PROBE_DIR=/tmp/rt PYTHONPATH=scripts/round_probe python -m specsplit bench adaptive ...
    python scripts/round_trace.py /tmp/rt [--groups warm:2,heldout:8,random:8,mix:8]

``--groups``: also the adaptive requests' rounds by kind and by the kind before, per group of
requests (``transitions``): target-only, drafting at k* and probes, and what a change costs.

Diagnostic only (docs/performance.md § Session 12); nothing imports it.
"""

from __future__ import annotations

import collections
import glob
import json
import math
import os
import statistics
import sys


def summarize(rows: list) -> list[str]:
    by_req: dict[str, list] = {}
    for r in rows:
        by_req.setdefault(r[1], []).append(r)
    kinds: dict[tuple[int, str], list[tuple]] = {}
    probes: list[float] = []
    for rounds in by_req.values():
        for prev, cur in zip([None] + rounds[:-1], rounds):
            period = (cur[0] - prev[0]) / 1e6 if prev is not None else None
            kinds.setdefault((cur[2], _holds(prev, cur)), []).append((*cur[4:8], period))
            if prev is not None and prev[2] == 0 and prev[9] and cur[2] > 0:
                probes.append(cur[4] * 1e3)
    out = [f"{'k':>2s} {'draft holds':>11s} {'rounds':>7s}  draft / target / overhead / wall ms   period ms"]
    med = lambda xs: statistics.median(xs) if xs else float("nan")   # noqa: E731
    for (k, held), xs in sorted(kinds.items()):
        parts = [med([x[i] * 1e3 for x in xs]) for i in range(4)]
        periods = [x[4] for x in xs if x[4] is not None and x[4] - x[3] * 1e3 < 2.0]   # not across a pause
        out.append(f"{k:2d} {held:>11s} {len(xs):7d}  {parts[0]:.3f} / {parts[1]:.3f} / {parts[2]:.3f} / "
                   f"{parts[3]:.3f}   {med(periods):.3f}")
    if probes:
        probes.sort()
        out.append(f"drafting rounds right after a target-only one: {len(probes)}, draft ms median "
                   f"{med(probes):.3f}, p90 {probes[math.ceil(0.9 * len(probes)) - 1]:.3f}, max {probes[-1]:.3f}")
    model = [r for r in rows if len(r) > 10]        # adaptive k: the model's T(0), T(max k), E(max k)
    if model:
        top = max(r[2] for r in rows)
        periods: dict[int, list[float]] = {}
        for (k, _), xs in kinds.items():
            periods.setdefault(k, []).extend(x[4] for x in xs if x[4] is not None and x[4] - x[3] * 1e3 < 2.0)
        realized = [r[3] + 1 for r in rows if r[2] == top]
        out.append(f"model (median over rounds): T(0) {med([r[10] * 1e3 for r in model]):.3f} ms (period at k=0 "
                   f"{med(periods.get(0, [])):.3f}), T({top}) {med([r[11] * 1e3 for r in model]):.3f} ms "
                   f"(period at k={top} {med(periods.get(top, [])):.3f}); E({top}) where the round drafted 0: "
                   f"{med([r[12] for r in model if r[2] == 0]):.2f}, drafted {top}: "
                   f"{med([r[12] for r in model if r[2] == top]):.2f} (tokens a k={top} round committed, mean "
                   f"{statistics.mean(realized) if realized else float('nan'):.2f})")
    return out


def _holds(prev: list | None, row: list) -> str:
    """Whether the draft holds the request ("True" / "False"); for a target-only round of a request
    it holds, "watched" where a watch probe ran beside it (the request's count of them grew)."""
    if row[2] > 0 or not row[9]:
        return str(row[2] > 0 or bool(row[9]))
    grew = len(row) > 14 and row[14] > (prev[14] if prev is not None and len(prev) > 14 else 0)
    return "watched" if grew else "True"


def _kind(row: list) -> str:
    """T: target-only; D: drafting at the model's k*; P: drafting as a probe (rows of adaptive k)."""
    return "T" if row[2] == 0 else ("P" if len(row) > 13 and row[13] else "D")


def transitions(rows: list, groups: list[tuple[str, int]]) -> list[str]:
    """Per group of adaptive requests (in the order they started; the first group once, then the
    others in turn, as ``bench adaptive`` sends them: warm-up, then heldout / random / mix per
    repeat): rounds by kind (``_kind``) and by the kind of the request's round before, with the
    median period (end to end, where that leaves under 2 ms outside the round): what a change of
    kind costs beside a round of the same kind in a row."""
    by_req: dict[str, list] = {}
    for r in rows:
        if len(r) > 10:
            by_req.setdefault(r[1], []).append(r)
    names, cycle = [], groups[1:] or groups
    while len(names) < len(by_req):
        for name, n in (groups[:1] if not names else cycle):
            names += [name] * n
    pairs: dict[str, dict[str, list[float]]] = {}
    kinds: dict[str, collections.Counter] = {}
    for name, rounds in zip(names, by_req.values()):
        for prev, cur in zip([None] + rounds[:-1], rounds):
            kinds.setdefault(name, collections.Counter())[_kind(cur)] += 1
            if prev is not None:
                period = (cur[0] - prev[0]) / 1e6
                if period - cur[7] * 1e3 < 2.0:
                    pairs.setdefault(name, {}).setdefault(_kind(prev) + _kind(cur), []).append(period)
    out = []
    for name, counts in kinds.items():
        total = sum(counts.values())
        cells = "  ".join(f"{p} {len(v)} {statistics.median(v):.3f}" for p, v in sorted(pairs.get(name, {}).items()))
        out.append(f"{name:>8s}: {total} rounds, " + " ".join(f"{k} {c / total:.2f}" for k, c in sorted(counts.items()))
                   + f"; by the kind before, count and median period ms: {cells}")
    return out


def main() -> int:
    args = sys.argv[1:]
    groups = []
    if "--groups" in args:          # e.g. --groups warm:2,heldout:8,random:8,mix:8
        spec = args.pop(args.index("--groups") + 1)
        args.remove("--groups")
        groups = [(g.split(":")[0], int(g.split(":")[1])) for g in spec.split(",")]
    folder = args[0] if args else os.environ.get("ROUND_PROBE_DIR", "")
    files = sorted(glob.glob(os.path.join(folder, "rounds-*.jsonl")))
    if not files:
        print(f"round_trace: no rounds-*.jsonl in {folder!r}")
        return 1
    for path in files:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.endswith("\n")]     # not a line being written
        print(f"{os.path.basename(path)}: {len(rows)} request-rounds")
        print("\n".join("  " + line for line in summarize(rows)))
        if groups:
            print("\n".join("  " + line for line in transitions(rows, groups)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
