"""scripts/round_trace.py's per-group summary of adaptive k's rounds (``transitions``), on made-up rows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "round_trace.py"


def _module():
    spec = importlib.util.spec_from_file_location("round_trace", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(t_ms: float, rid: str, drafted: int, probing: bool, wall_ms: float = 0.5) -> list:
    """A recorded request-round of adaptive k (scripts/round_probe/sitecustomize.py's layout)."""
    return [int(t_ms * 1e6), rid, drafted, 0, 0.0, 0.0, 0.0, wall_ms / 1e3, 1, True, 4e-4, 9e-4, 1.5, probing]


def test_rounds_by_kind_and_by_the_kind_before_per_group():
    rt = _module()
    rows = [_row(1.0, "w", 3, False), _row(2.0, "w", 3, False)]                  # the warm-up request
    t = 10.0
    for kinds in ("TTPT", "DDTT"):                                                  # a random one, a held-out one
        rid = kinds
        for kind in kinds:
            step = {"T": 0.4, "D": 0.9, "P": 1.3}[kind]
            t += step
            rows.append(_row(t, rid, 0 if kind == "T" else 3, kind == "P"))
    rows.append([0, "fixed", 3, 2, 0.0, 0.0, 0.0, 5e-4, 1, True])                 # a fixed-k request: no model
    out = rt.transitions(rows, [("warm", 1), ("random", 1), ("heldout", 1)])
    assert out[0].startswith("    warm: 2 rounds, D 1.00")
    assert out[1].startswith("  random: 4 rounds, P 0.25 T 0.75") and "PT 1 0.400" in out[1] and "TP 1 1.300" in out[1]
    assert out[2].startswith(" heldout: 4 rounds, D 0.50 T 0.50") and "DT 1 0.400" in out[2] and "DD 1 0.900" in out[2]


def test_target_only_rounds_beside_a_watch_probe_are_counted_apart():
    rt = _module()
    base = [0, "r", 0, 0, 0.0, 4e-4, 1e-4, 5e-4, 1, True, 4e-4, 9e-4, 1.5, False]
    rows = [[i * 1_000_000, *base[1:], watches] for i, watches in enumerate((0, 1, 1, 1, 2))]
    rows.append([0, "k0", 0, 0, 0.0, 4e-4, 0.0, 4e-4, 1, False])              # a k = 0 request the draft never held
    out = rt.summarize(rows)
    lines = {tuple(line.split()[:2]): int(line.split()[2]) for line in out[1:] if line.split()[0] == "0"}
    assert lines == {("0", "False"): 1, ("0", "True"): 3, ("0", "watched"): 2}
