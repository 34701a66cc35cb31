"""Target-only steps queued ahead (runtime/decode_ahead.py) under real CUDA graphs. Skipped without CUDA.

Run on an H200 host: ``python3 -m pytest -m gpu tests/gpu/test_decode_ahead_gpu.py -s``. What is
shown: greedy target-only decoding of the bundled model with the next step queued ahead gives
the same tokens as without, at batch 1 and 4; how many steps were taken; tokens/s of both in
the same process (printed, not asserted: a timing is a benchmark's business).
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from core.params import SamplingParams  # noqa: E402
from runtime.engine import GenRequest  # noqa: E402
from tests.gpu.bundled import captured_engine, heldout_prompts  # noqa: E402


@pytest.mark.parametrize("batch", [1, 4])
def test_queued_ahead_target_only_equals_plain(batch):
    prompts = heldout_prompts(4)
    engine = captured_engine()
    assert engine.target.decode_ahead                      # on by default on CUDA

    def run(ahead):
        engine.target.decode_ahead = ahead
        reqs = [GenRequest(f"p{i}", p, SamplingParams(max_tokens=128, ignore_eos=True), 0)
                for i, p in enumerate(prompts)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = [r.tokens for r in engine.generate(reqs, max_batch=batch)]
        return out, sum(len(o) for o in out) / (time.perf_counter() - t0)

    run(True)                                              # warm
    before = engine.target.ahead_stats.used
    ahead, ahead_tps = run(True)
    used = engine.target.ahead_stats.used - before
    plain, plain_tps = run(False)
    print(f"\n[gpu] decode ahead, batch {batch}: tokens identical {ahead == plain}; steps taken {used}; "
          f"tok/s ahead {ahead_tps:.0f} vs plain {plain_tps:.0f} (x{ahead_tps / plain_tps:.2f})")
    assert ahead == plain
    assert used > 0
