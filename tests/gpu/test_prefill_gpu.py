"""Prefill graphs on a real GPU (Torch, the bundled model in fp32). Skipped without CUDA.

What is shown: with the prefill graphs captured (on by default on CUDA), prefills of every
width and a padded batch replay a graph, their first tokens equal the eager prefill's and
their hidden rows agree to fp32 rounding (fused kernels under the graphs, plain ops eagerly);
greedy speculative decoding through them equals target-only decoding without them.
The CPU path of the same code: tests/unit/test_prefill_graphs.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from core.params import SamplingParams  # noqa: E402
from runtime.batch_layout import prefill_width  # noqa: E402
from runtime.config import CacheConfig, EngineConfig, GraphConfig, RuntimeConfig, SpecConfig  # noqa: E402
from runtime.engine import GenRequest, SpecEngine  # noqa: E402
from runtime.tokenizer import ByteTokenizer  # noqa: E402
from runtime.types import PrefillRequest  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny"


def _engine(prefill_graphs: bool | None, use_draft: bool = True) -> SpecEngine:
    return SpecEngine(EngineConfig(str(TINY), runtime=RuntimeConfig(backend="torch", device="cuda:0"),
                                   spec=SpecConfig(max_k=3, default_k=3), cache=CacheConfig(max_slots=8, max_len=1024),
                                   graphs=GraphConfig(batch_buckets=(1, 2, 4, 8), prefill_graphs=prefill_graphs)),
                      use_draft=use_draft)


def test_prefill_graphs_equal_the_eager_prefill_on_gpu():
    eager, graphed = _engine(False), _engine(None)
    graphed.capture_graphs()
    widths = graphed.target._prefill_widths
    assert widths and graphed.draft._prefill_widths == widths                 # on by default on CUDA
    rng = np.random.default_rng(0)
    worst, n = 0.0, 0
    for lengths in ([5], [16], [17], [40], [100], [250], [30, 7, 19], [64] * 4, [300]):
        reqs = [PrefillRequest(f"r{n + i}", tuple(int(x) for x in rng.integers(0, 256, m)), SamplingParams())
                for i, m in enumerate(lengths)]
        n += len(lengths)
        before = graphed.target_registry.stats.replays
        want, got = eager.target.prefill(reqs), graphed.target.prefill(reqs)
        fits = prefill_width(widths, max(lengths), len(lengths)) is not None
        assert (graphed.target_registry.stats.replays > before) == fits, lengths
        for w, g in zip(want, got):
            assert g.first_token == w.first_token, lengths
            worst = max(worst, float(np.abs(g.hidden - w.hidden).max()))
        for eng in (eager, graphed):
            for r in reqs:
                eng.target.release(r.request_id)
    assert worst < 1e-3, worst
    print(f"\n[gpu prefill] graph vs eager prefill, worst hidden difference {worst:.2e} (fp32)")


def test_speculative_decoding_through_prefill_graphs_equals_target_only_on_gpu():
    tok = ByteTokenizer()
    prompts = [tuple(tok.encode(p)) for p in json.loads((TINY / "heldout_prompts.json").read_text())[:6]]
    reqs = [GenRequest(f"g{i}", p, SamplingParams(max_tokens=48, ignore_eos=True), k=3) for i, p in enumerate(prompts)]
    baseline = _engine(False, use_draft=False).generate(reqs)
    graphed = _engine(None)
    graphed.capture_graphs()
    before = graphed.draft_registry.stats.replays
    out = graphed.generate(reqs, max_batch=2)
    assert [r.tokens for r in out] == [r.tokens for r in baseline]
    assert graphed.draft_registry.stats.replays > before
    print(f"[gpu prefill] speculative through prefill graphs == target-only ({len(reqs)} prompts)")
