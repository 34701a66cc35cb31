"""Trace simulation of adaptive k at batch 1 in the H200 regime, against every fixed k.

Owns: a seeded model of ``specsplit bench adaptive`` — the same sets (a
warm-up, then heldout, random and mix, 8 requests x 64 tokens each, served
by one loop in that order) — with round times of the bundled model on an
H200: by default session 5's (runtime/round_costs.py's doc: a target-only round
1.38 ms start to start; a k = 3 round 3.72 ms of which 1.28 ms draft, so T(k) =
2.44 ms + 0.43 ms * k), or ``--regime T0 FIXED TD VERIFY`` (docs/performance.md
§ Session 12 has that session's), a ``--wide`` penalty for a catch-up wider
than the captured width (a probe after a target-only stretch) and 5 % lognormal
noise. Drafts are accepted per position at the request's rate times (1 + decl)
for the first draft and (1 - decl) for the third; held-out requests alternate
easy (0.75-0.92) and hard (0.4-0.6) stretches, random ones sit at
``--random-rate`` (default 0.03-0.15).

It drives ``runtime.adaptive_k`` and ``runtime.adaptive_plan`` (``--code DIR``: another checkout's, e.g. a
``git worktree`` of the previous commit) exactly as the round driver does:
``request_ks`` (or ``choose_round_k`` where a checkout has no
``request_ks``), ``AdaptiveLoop.observe`` (``RoundCosts`` before it) and ``AdaptiveK.observe``. No
tensors, no services: what it measures is the policy, in a regime this
machine's CPU cannot show (there drafting almost always pays).

    python scripts/adaptive_sim.py [--code DIR] [--seeds 80] [--wide 1e-3] [--decl 0.1]
                                   [--regime T0 FIXED TD VERIFY] [--random-rate LO HI] [--max-tokens 64]
                                   [--entry SECONDS] [--leave SECONDS]

With rounds queued ahead on the device (H100, docs/performance.md § Session 29) the regime is about
``--regime 0.26e-3 0.62e-3 0.02e-3 0.27e-3 --entry 0.35e-3``: its figures did not predict the GPU's
there; ``--leave`` adds what the round a drafting round queued costs when the next one does not draft.

Must not know: how the policy decides.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import types

import numpy as np

T0, FIXED, TD, VERIFY, CAPTURED = 1.38e-3, 2.44e-3, 1.28e-3 / 3, 1.34e-3, 4


def load(code: str):
    """The checkout's ``runtime.adaptive_k`` (and whatever of its ``runtime`` it imports): the
    checkout first on the path, before anything of ``runtime`` was imported."""
    sys.path.insert(0, os.path.abspath(code))
    mod = importlib.import_module("runtime.adaptive_k")
    # The round's plan is a module of its own since session 33 (looked for in the checkout itself:
    # ``runtime`` is a namespace package, which would find this tree's too).
    if not os.path.exists(os.path.join(code, "runtime", "adaptive_plan.py")):
        return mod
    plan = importlib.import_module("runtime.adaptive_plan")
    return types.SimpleNamespace(**{**vars(mod), **vars(plan)})


def draws(rng, a: float, k: int, decl: float) -> int:
    """Drafts accepted of k at the request's rate a (the first draft's rate above a, later ones below)."""
    acc = 0
    while acc < k and rng.random() < min(1.0, a * (1.0 + decl * (1 - acc))):
        acc += 1
    return acc


PLANS = [0]        # full plans so far (round_k_star calls, counted by ``count_plans``)


def count_plans() -> None:
    """Count the checkout's full plans: its ``round_k_star`` as its round's plan calls it (in
    ``runtime.adaptive_plan`` where the checkout has one, else in ``runtime.adaptive_k``)."""
    owner = sys.modules.get("runtime.adaptive_plan") or sys.modules["runtime.adaptive_k"]
    k_star = owner.round_k_star

    def counted(*args, **kwargs):
        PLANS[0] += 1
        return k_star(*args, **kwargs)

    owner.round_k_star = counted


def run(policy, mod, sets, seed: int, wide: float, decl: float, max_tokens: int = 64, k_req: int = 3,
        regime: tuple[float, float, float, float] = (T0, FIXED, TD, VERIFY), watch: float | None = None,
        entry: float = 0.0, leave: float = 0.0, plan_host: float = 0.0) -> dict:
    """tokens/s per set for one policy (an int: fixed k; "adaptive": mod's). ``watch``: watch probes
    on (``round_plan``), each costing its target-only round that many seconds more; ``entry``: what a
    drafting round right after one that did not draft costs more (nothing queued ahead for it);
    ``leave``: what a target-only round right after a drafting one costs more (the round that one
    queued ahead still runs on the device first); a probe's round (``AdaptiveLoop.probing``) queues
    none, so the round after it pays no ``leave`` and, if it drafts, the ``entry``; ``plan_host``:
    what a round whose plan ran in full (``count_plans``) costs more on the host than one that
    kept the last plan (runtime/adaptive_plan.py's holds) or a fixed k's."""
    t0, fixed, td, verify = regime
    rng = np.random.default_rng(seed)
    costs = getattr(mod, "AdaptiveLoop", getattr(mod, "RoundCosts", None))() if policy == "adaptive" else None
    if costs is not None and watch is not None:
        costs.watch = True
    loop = getattr(costs, "loop", None)
    t, res = 0.0, {}
    for name, reqs in sets:
        t_start, toks = t, 0
        for easy, hard_rate in reqs:
            pol = None if costs is None else (loop.new_policy(k_req) if loop else mod.AdaptiveK(k_req))
            out, pending, hard, watched = 1, 1, False, None    # watched: [k, accepted, tokens until known]
            queued = False               # did the request's last round queue the next one ahead (it drafted, no probe)?
            while out < max_tokens:
                wk, plans = 0, PLANS[0]
                if costs is None:
                    k = policy
                elif watch is not None:
                    ks, wks = mod.round_plan([pol], costs, [watched is None])
                    k, wk = ks[0], min(wks[0], max_tokens - out - 1)
                elif hasattr(mod, "request_ks"):
                    k = mod.request_ks([pol], costs)[0]
                else:
                    k = mod.choose_round_k([pol], costs)
                k = min(k, max_tokens - out - 1)
                if hard_rate is not None:
                    hard = (rng.random() < (0.3 if hard else 0.06)) != hard     # ~20 % of rounds hard
                a = hard_rate if hard else easy
                acc = draws(rng, a, k, decl)
                noise = rng.lognormal(0, 0.05)
                if k == 0:
                    dur, draft_s, verify_s, over = t0 * noise, 0.0, verify * 0.87, t0 * 0.15
                    if queued:
                        dur, over = dur + leave, over + leave
                    if wk > 0:                      # the draft drafts on the side; the verdict comes later
                        got = draws(rng, a, wk, decl)
                        watched, pending = [wk, got, min(got + 1, wk)], 0
                        dur, over = dur + watch, over + watch
                else:
                    draft_s = (td * k + (wide if pending > CAPTURED else 0.0)) * noise
                    dur = fixed * noise + draft_s + (entry if not queued else 0.0)
                    verify_s, over, pending = verify, dur - draft_s - verify, 0
                if PLANS[0] > plans:                # the plan ran in full: its host time is the round's
                    dur, over = dur + plan_host, over + plan_host
                if costs is not None:
                    if wk > 0:
                        costs.observe(k, draft_s, verify_s, over, started=t, watched=True)
                    else:
                        costs.observe(k, draft_s, verify_s, over, started=t)
                    pol.observe(k, acc)
                    if watched is not None:
                        watched[2] -= acc + 1
                        if watched[2] <= 0:
                            pol.observe(watched[0], watched[1])
                            watched = None
                t += dur
                queued = k > 0 and not getattr(costs, "probing", False)
                out += acc + 1
                pending += acc + 1
            toks += min(out, max_tokens)
            t += 0.3e-3                                         # between requests
        res[name] = toks / (t - t_start)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--code", default=".", help="checkout whose runtime/adaptive_k.py to simulate")
    ap.add_argument("--seeds", type=int, default=80)
    ap.add_argument("--wide", type=float, default=1e-3, help="seconds a catch-up wider than captured costs more")
    ap.add_argument("--regime", type=float, nargs=4, default=[T0, FIXED, TD, VERIFY],
                    metavar=("T0", "FIXED", "TD", "VERIFY"),
                    help="seconds: a target-only round start to start; a drafting round's fixed part; one draft; "
                         "the verify inside a drafting round")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--random-rate", type=float, nargs=2, default=[0.03, 0.15], metavar=("LO", "HI"),
                    help="the random prompts' acceptance rates (uniform between)")
    ap.add_argument("--decl", type=float, default=0.1, help="per-position decline of the acceptance")
    ap.add_argument("--repeats", type=int, default=1,
                    help="the three sets served this many times in turn by one loop (as bench adaptive --repeats "
                         "does: the second heldout comes after the first mix); tokens/s per set over all")
    ap.add_argument("--entry", type=float, default=0.0, metavar="SECONDS",
                    help="a drafting round right after a target-only one costs this much more (with rounds queued "
                         "ahead on the device, runtime/round_ahead.py, nothing was queued for it)")
    ap.add_argument("--leave", type=float, default=0.0, metavar="SECONDS",
                    help="a target-only round right after a drafting one costs this much more (the round queued "
                         "ahead for the drafting loop still runs on the device first)")
    ap.add_argument("--watch", type=float, default=None, metavar="SECONDS",
                    help="watch probes on (runtime.adaptive_k.round_plan), each adding SECONDS to its round")
    ap.add_argument("--plan-host", type=float, default=0.0, metavar="SECONDS",
                    help="a round whose plan ran in full (not kept: runtime/adaptive_plan.py) costs this much "
                         "more on the host")
    args = ap.parse_args()
    mod = load(args.code)
    count_plans()
    rates: dict[str, dict[str, list[float]]] = {}
    for seed in range(args.seeds):
        rng = np.random.default_rng(1000 + seed)
        held = [(rng.uniform(0.75, 0.92), rng.uniform(0.4, 0.6)) for _ in range(8)]
        rand = [(rng.uniform(*args.random_rate), None) for _ in range(8)]
        mix = [held[i] if i % 2 == 0 else rand[i] for i in range(8)]
        sets = [("warm", held[:2])] + [(f"{n}#{r}", reqs) for r in range(args.repeats)
                                       for n, reqs in (("heldout", held), ("random", rand), ("mix", mix))]
        for p in (0, 1, 2, 3, "adaptive"):
            for name, r in run(p, mod, sets, seed, args.wide, args.decl, max_tokens=args.max_tokens,
                               regime=tuple(args.regime), watch=args.watch, entry=args.entry,
                               leave=args.leave, plan_host=args.plan_host).items():
                rates.setdefault(name.split("#")[0], {}).setdefault(f"k={p}" if p != "adaptive" else p, []).append(r)
    print(f"adaptive_sim: {args.code}, {args.seeds} seeds, wide={args.wide}, decl={args.decl}; tokens/s")
    for name in ("heldout", "random", "mix"):
        row = {c: statistics.mean(v) for c, v in rates[name].items()}
        best = max(v for c, v in row.items() if c != "adaptive")
        print(f"{name:>8s} " + " ".join(f"{c} {v:6.1f}" for c, v in row.items())
              + f"  adapt/best {row['adaptive'] / best:.3f} adapt/k=0 {row['adaptive'] / row['k=0']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
