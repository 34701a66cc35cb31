"""Greedy rounds queued ahead (runtime/round_ahead.py) under real CUDA graphs, bundled model. Skipped without CUDA.

Run on a GPU host: ``python3 -m pytest -m gpu tests/gpu/test_round_ahead_gpu.py -s``. What is shown, at
batch 1 and 4 (k = 3, greedy, the in-process engine: draft and target on one device, drafts on the
device): with rounds queued ahead the tokens are target-only's and the drafts those of a run
without (the same acceptance, position by position); most rounds take the round queued for
them; prompts whose context crosses the 256-row span boundary are among them (a round whose
span would depend on its accepted counts is not queued). The tokens/s of both runs are printed
(information, not a claim: ``bench`` measures).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from core.params import SamplingParams  # noqa: E402
from runtime.config import CacheConfig, EngineConfig, GraphConfig, RuntimeConfig, SpecConfig  # noqa: E402
from runtime.engine import GenRequest, SpecEngine  # noqa: E402
from runtime.tokenizer import ByteTokenizer  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"


@pytest.fixture(scope="module")
def engine():
    cfg = EngineConfig(str(TINY), runtime=RuntimeConfig(backend="torch", device="cuda:0"),
                       spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=8, max_len=1024),
                       graphs=GraphConfig(batch_buckets=(1, 2, 4, 8)))
    eng = SpecEngine(cfg)
    eng.capture_graphs()
    return eng


def _prompts():
    tok = ByteTokenizer()
    texts = json.loads((TINY / "heldout_prompts.json").read_text())[:8]
    # Two long ones: prompt + output cross the 256-row context span.
    texts[6], texts[7] = texts[6] + texts[0], texts[7] + texts[1]
    return [tuple(tok.encode(t)) for t in texts]


def _run(engine, k, batch, ahead):
    engine.target.round_ahead = ahead
    reqs = [GenRequest(f"p{i}", p, SamplingParams(max_tokens=96, ignore_eos=True), k) for i, p in enumerate(_prompts())]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(reqs, max_batch=batch)
    dt = time.perf_counter() - t0
    return [(r.tokens, r.stats.accepted, tuple(r.stats.pos_accepted)) for r in out], sum(len(r.tokens) for r in out) / dt


@pytest.mark.parametrize("batch", [1, 4])
def test_rounds_queued_ahead_are_exact_and_taken_under_graphs(engine, batch):
    assert max(len(p) for p in _prompts()) + 96 > 256
    ref, _ = _run(engine, 0, batch, False)
    _run(engine, 3, batch, True)                                  # warm: every graph and span once
    plain, plain_rate = _run(engine, 3, batch, False)
    st, taken = engine.target.round_stats, engine.draft.next_taken
    before = (st.launched, st.used, st.dropped)
    got, rate = _run(engine, 3, batch, True)
    assert got == plain
    assert [t for t, _, _ in got] == [t for t, _, _ in ref]
    launched, used, dropped = st.launched - before[0], st.used - before[1], st.dropped - before[2]
    rounds = sum(len(t) for t, _, _ in got) / 3.3 / batch
    assert used > 0.5 * rounds and engine.draft.next_taken - taken == used and engine.target.rounds.errors == 0
    print(f"\n[gpu round ahead] batch {batch}: identical to target-only and to the plain run; {used} of "
          f"{launched} queued rounds taken ({dropped} dropped); tok/s plain {plain_rate:.0f}, ahead {rate:.0f} "
          f"(x{rate / plain_rate:.2f})")
