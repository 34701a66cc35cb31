"""``torch_host.FetchRing`` on a real GPU: pinned buffers, copies still in flight. Skipped without CUDA.

Run on a GPU host: ``python3 -m pytest -m gpu tests/gpu/test_fetch_ring_gpu.py -s``. What is shown:
a fetch's values are right when it is waited for, also with the GPU still busy when it was staged
and another fetch staged in between (the kept views and the skipped slot waits of session 25);
and a speculative engine decodes the same tokens with its engines' rings as without them, greedy
at batch 1 and 4 with decode ahead on (a fetch queued while the next step runs). The CPU test of
the same rules with injected events: ``tests/unit/test_fetch_ring.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from core.params import SamplingParams  # noqa: E402
from runtime.backends.torch_host import FetchRing  # noqa: E402
from runtime.engine import GenRequest  # noqa: E402
from tests.gpu.bundled import captured_engine, heldout_prompts  # noqa: E402
SPIN = 2_000_000          # GPU clock cycles of torch.cuda._sleep before each copy (~1 ms): copies in flight


def test_fetches_are_right_with_the_gpu_busy_and_waits_out_of_order():
    ring, stream = FetchRing(), torch.cuda.current_stream()
    pending = []                                  # (value, host tensors, wait) staged, not yet checked
    for n in range(24):
        x = torch.full((4, 8), n, dtype=torch.int64, device="cuda")
        y = torch.full((2, 3, 16), float(n), dtype=torch.bfloat16, device="cuda").view(torch.int16)
        torch.cuda._sleep(SPIN)
        hosts, wait = ring.stage([x, y], stream)
        pending.append((n, hosts, wait))
        # Wait every fetch before SLOTS more are staged, sometimes one call late (out of order with
        # its staging): its values must be there either way.
        if n % 3 != 1 or len(pending) == FetchRing.SLOTS:
            for value, got, w in pending:
                w()
                assert (got[0] == value).all().item()
                assert (got[1].view(torch.bfloat16).float() == float(value)).all().item()
            pending = []


@pytest.mark.parametrize("batch", [1, 4])
def test_a_speculative_engine_decodes_the_same_with_and_without_its_read_back_rings(batch):
    prompts = heldout_prompts(4)
    engine = captured_engine()
    rings = (engine.target._fetch_ring, engine.draft._fetch_ring)
    assert all(r is not None for r in rings)

    def run(k):
        params = SamplingParams(max_tokens=96, ignore_eos=True)
        reqs = [GenRequest(f"p{i}", p, params, k) for i, p in enumerate(prompts)]
        return [r.tokens for r in engine.generate(reqs, max_batch=batch)]

    with_rings = {k: run(k) for k in (0, 3)}
    engine.target._fetch_ring = engine.draft._fetch_ring = None      # a pinned allocation per fetch, as before
    try:
        without = {k: run(k) for k in (0, 3)}
    finally:
        engine.target._fetch_ring, engine.draft._fetch_ring = rings
    print(f"\n[gpu] fetch ring, batch {batch}: identical {with_rings == without}")
    assert with_rings == without
    assert with_rings[0] == with_rings[3]                              # speculative == target-only
