"""The fused greedy propose under real CUDA graphs (Torch backend). Skipped without CUDA.

Run on an H200 host: ``python3 -m pytest -m gpu tests/gpu/test_propose_gpu.py -s``. What is shown:
- a propose{k} replay gives the same drafts as the catch-up graph + k-1 substep
  graphs (batch 1, and 3 rows padded to bucket 4 with mixed k), and writes the
  same draft KV rows;
- one graph replay per fused propose (k replays on the per-substep path);
- a catch-up longer than the catch-up graph (the draft sat out target-only rounds) runs
  as head passes of the catchup{4(k+1)} graph, never eagerly, with the drafts of one
  eager pass over the whole width (its time against that pass printed);
- a whole engine run with the fused propose equals target-only decoding.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from runtime.backends import make_ops  # noqa: E402
from runtime.checkpoint import save_safetensors, save_target  # noqa: E402
from core.params import SamplingParams  # noqa: E402
from runtime.config import CacheConfig, EngineConfig, GraphConfig, ModelConfig, RuntimeConfig, SpecConfig  # noqa: E402
from runtime.draft_engine import DraftEngine  # noqa: E402
from runtime.engine import GenRequest, SpecEngine  # noqa: E402
from runtime.graphs import GraphRegistry  # noqa: E402
from runtime.model import init_params, mtp_tensor_shapes, target_tensor_shapes  # noqa: E402
from runtime.types import DraftPrefillRequest, ProposeRequest  # noqa: E402

CFG = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2)
BUCKETS = (1, 4, 8)
K = 3
MAX_LEN = 128


def _drafts(fused_flags=(True, False)):
    out = []
    for fused in fused_flags:
        ops = make_ops(RuntimeConfig(backend="torch", device="cuda:0"))
        scale = lambda d: {k: ops.from_numpy(v * (6 if v.ndim == 2 else 1)) for k, v in d.items()}  # noqa: E731
        tparams = scale(init_params(CFG, 0, target_tensor_shapes(CFG)))
        dparams = {**scale(init_params(CFG, 1, mtp_tensor_shapes(CFG))),
                   **{n: tparams[n] for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}}
        draft = DraftEngine(ops, CFG, dparams, CacheConfig(max_slots=8, max_len=MAX_LEN), K,
                            GraphRegistry(ops, BUCKETS), fused_propose=fused)
        draft.registry.capture_all()
        out.append(draft)
    return out


def _live_kv(draft):
    k, v = draft.cache.layers[0]
    rows = draft.cache.max_slots * draft.cache.max_len
    return draft.ops.to_numpy(k)[:rows], draft.ops.to_numpy(v)[:rows]


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_propose_equals_per_substep_under_graphs(batch):
    fused, plain = _drafts()
    rng = np.random.default_rng(batch)
    lens = {}
    for i in range(batch):
        m = int(rng.integers(5, 20))
        req = DraftPrefillRequest(f"r{i}", rng.integers(0, CFG.vocab_size, m),
                                  rng.standard_normal((m, CFG.hidden_size)).astype(np.float32), SamplingParams())
        fused.prefill([req])
        plain.prefill([req])
        lens[f"r{i}"] = m
    worst_kv = 0.0
    for rnd in range(8):
        reqs = []
        for i, rid in enumerate(lens):
            m, k = int(rng.integers(1, K + 2)), 1 + (i + rnd) % K
            reqs.append(ProposeRequest(rid, lens[rid], rng.integers(0, CFG.vocab_size, m),
                                       rng.standard_normal((m, CFG.hidden_size)).astype(np.float32), k))
            lens[rid] += m
        before = (fused.registry.stats.replays, plain.registry.stats.replays)
        got, want = fused.propose(reqs), plain.propose(reqs)
        assert fused.registry.stats.replays - before[0] == 1, "a fused propose is one replay"
        assert plain.registry.stats.replays - before[1] == max(r.k for r in reqs)
        assert [p.drafts.tolist() for p in got] == [p.drafts.tolist() for p in want], rnd
        for a, b in zip(_live_kv(fused), _live_kv(plain)):
            worst_kv = max(worst_kv, float(np.abs(a - b).max()))
    assert fused.fused_proposes == 8 and fused.registry.stats.eager_runs == 0
    # Same kernels at the same shapes in the same order: expected bit-identical; printed either way.
    print(f"\n[gpu] fused propose == per-substep drafts over 8 rounds at batch {batch}; "
          f"max |KV difference| {worst_kv:.3e}")
    assert worst_kv <= 1e-5


def test_a_long_catch_up_runs_as_head_passes_under_graphs():
    import time
    (passes,) = _drafts((True,))
    eager = DraftEngine(passes.ops, CFG, passes.params, CacheConfig(max_slots=8, max_len=MAX_LEN), K,
                        GraphRegistry(passes.ops, BUCKETS))                      # nothing captured: one eager pass
    rng = np.random.default_rng(9)
    times = {"passes": [], "eager": []}
    for trial in range(6):
        rid = f"w{trial}"
        m = int(rng.integers(3, 8))
        req = DraftPrefillRequest(rid, rng.integers(0, CFG.vocab_size, m),
                                  rng.standard_normal((m, CFG.hidden_size)).astype(np.float32), SamplingParams())
        for d in (passes, eager):
            d.prefill([req])
        wide = int(rng.integers(20, 60))                  # a probe after a 20-60 round target-only stretch
        prop = ProposeRequest(rid, m, rng.integers(0, CFG.vocab_size, wide),
                              rng.standard_normal((wide, CFG.hidden_size)).astype(np.float32), K)
        got = {}
        for name, d in (("passes", passes), ("eager", eager)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got[name] = d.propose([prop])[0].drafts.tolist()
            times[name].append(time.perf_counter() - t0)
            d.release(rid)
        assert got["passes"] == got["eager"], trial
    assert passes.registry.stats.eager_runs == 0
    med = {k: 1e3 * float(np.median(v[1:])) for k, v in times.items()}      # the first pays new shapes
    print(f"\n[gpu] a 20-60 pair catch-up + k={K} propose: head passes {med['passes']:.3f} ms, one eager pass "
          f"{med['eager']:.3f} ms (median of 5; first eager {1e3 * times['eager'][0]:.1f} ms)")


def test_engine_with_fused_propose_equals_target_only(tmp_path):
    t = {k: v * (6 if v.ndim == 2 else 1) for k, v in init_params(CFG, 0, target_tensor_shapes(CFG)).items()}
    save_target(tmp_path, CFG, t)
    save_safetensors(tmp_path / "mtp.safetensors", init_params(CFG, 1, mtp_tensor_shapes(CFG)))
    cfg = EngineConfig(str(tmp_path), runtime=RuntimeConfig(backend="torch", device="cuda:0"),
                       spec=SpecConfig(max_k=K, default_k=K), cache=CacheConfig(max_slots=8, max_len=MAX_LEN),
                       graphs=GraphConfig(batch_buckets=BUCKETS))
    rng = np.random.default_rng(4)
    reqs = [GenRequest(f"r{i}", tuple(int(x) for x in rng.integers(0, CFG.vocab_size, int(rng.integers(3, 30)))),
                       SamplingParams(max_tokens=40, ignore_eos=True), k=1 + i % K) for i in range(6)]
    reference = SpecEngine(cfg, use_draft=False).generate([GenRequest(r.request_id, r.prompt, r.params, 0) for r in reqs])
    eng = SpecEngine(cfg)
    eng.capture_graphs()
    out = eng.generate(reqs, max_batch=4)
    assert [r.tokens for r in out] == [r.tokens for r in reference]
    assert eng.draft.fused_proposes > 0
    assert eng.target.device_draft_verifies > 0                  # the drafts reached the verify on the device
    print(f"\n[gpu] engine with fused propose == target-only for {len(reqs)} requests; "
          f"{eng.draft.fused_proposes} fused proposes, draft replays {eng.draft_registry.stats.replays}, "
          f"{eng.target.device_draft_verifies} verifies of drafts on the device")
