"""What adaptive k's policy costs the round loop's thread per round: ``python scripts/policy_host_cost.py``.

Runs the calls the round loop makes around one batch-1 round under adaptive k with watch
probes (``round_plan``, the request's ``AdaptiveK.observe``, the loop's ``AdaptiveLoop.observe``)
in a hot loop, steady at k = 3 (80 % of rounds accept all three drafts), and prints the mean
microseconds per round, then a cProfile of a shorter stretch. No workers, no tensors: the
policy alone (docs/performance.md § Session 24).

Diagnostic only; nothing imports it.
"""

from __future__ import annotations

import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.adaptive_k import AdaptiveLoop  # noqa: E402
from runtime.adaptive_plan import round_plan  # noqa: E402

ROUNDS, WARM = 20_000, 2_000


def main() -> int:
    loop = AdaptiveLoop(watch=True)
    policy = loop.loop.new_policy(3)
    rng = random.Random(0)
    clock = [0.0]

    def one_round() -> int:
        ks, _ = round_plan([policy], loop, [True])
        k = ks[0]
        accepted = 3 if rng.random() < 0.8 else rng.randint(0, 2)
        if k:
            policy.observe(k, min(accepted, k))
        clock[0] += 1.5e-3 if k else 0.5e-3
        loop.observe(k, 0.5e-3 if k else 0.0, 0.65e-3, 0.25e-3, clock[0], frozenset(["r"]))
        return k

    for _ in range(WARM):
        one_round()
    t0 = time.perf_counter()
    ks = [one_round() for _ in range(ROUNDS)]
    dt = time.perf_counter() - t0
    print(f"{dt / ROUNDS * 1e6:.1f} us a round (plan + observes); share of rounds at k > 0: "
          f"{sum(1 for k in ks if k) / ROUNDS:.2f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5_000):
        one_round()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
