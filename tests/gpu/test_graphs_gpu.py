"""CUDA-graph proofs on a real GPU (Torch backend). Skipped without CUDA.

Run on an H200 host: ``python3 -m pytest -m gpu tests/gpu -s`` (docs/gpu.md
records the command, date and output). What is shown:
- graph replay == eager for every bucket and step kind (draft catch-up,
  draft substep, target verify and its one-position step), with padded batches;
- static buffers are never rebound (addresses fixed over many steps);
- ClearGraphs gives the pool back: 10 capture/clear cycles, no growth;
- a whole engine run with graphs gives the same tokens as eager.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from runtime.backends import make_ops  # noqa: E402
from runtime.batch_layout import Row, layout_rows  # noqa: E402
from runtime.checkpoint import save_safetensors, save_target  # noqa: E402
from core.params import SamplingParams  # noqa: E402
from runtime.config import CacheConfig, EngineConfig, GraphConfig, ModelConfig, RuntimeConfig, SpecConfig  # noqa: E402
from runtime.draft_engine import SUBSTEP, DraftEngine  # noqa: E402
from runtime.engine import GenRequest, SpecEngine  # noqa: E402
from runtime.graphs import GraphRegistry  # noqa: E402
from runtime.model import init_params, mtp_tensor_shapes, target_tensor_shapes  # noqa: E402
from runtime.target_engine import TargetEngine  # noqa: E402

CFG = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2)
BUCKETS = (1, 4, 8)
K = 3
MAX_LEN = 128


def _engines(device="cuda:0"):
    ops = make_ops(RuntimeConfig(backend="torch", device=device))
    scale = lambda d: {k: ops.from_numpy(v * (6 if v.ndim == 2 else 1)) for k, v in d.items()}  # noqa: E731
    tparams = scale(init_params(CFG, 0, target_tensor_shapes(CFG)))
    dparams = {**scale(init_params(CFG, 1, mtp_tensor_shapes(CFG))),
               **{n: tparams[n] for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}}
    cache = CacheConfig(max_slots=8, max_len=MAX_LEN)
    t_reg, d_reg = GraphRegistry(ops, BUCKETS), GraphRegistry(ops, BUCKETS)
    return ops, TargetEngine(ops, CFG, tparams, cache, K, t_reg), DraftEngine(ops, CFG, dparams, cache, K, d_reg)


def _inputs(kind, b, rng, width):
    rows = [Row(i, 20 + 3 * i, rng.integers(0, CFG.vocab_size, int(rng.integers(1, width + 1)))) for i in range(b)]
    lay = layout_rows(rows, width, 8, MAX_LEN)
    out = {"tokens": lay.tokens, "write_slots": lay.write_slots, "positions": lay.positions, "read_slots": lay.read_slots}
    if kind != "verify":
        out["prev_hidden"] = rng.standard_normal((b, width, CFG.hidden_size)).astype(np.float32)
        out["last_index"] = lay.last_index
    return out


def test_graph_replay_equals_eager_for_every_bucket_and_kind():
    ops, target, draft = _engines()
    rng = np.random.default_rng(0)
    cases = [(draft.registry, draft._catchup_kind, "catchup", K + 1), (draft.registry, SUBSTEP, "substep", 1),
             (target.registry, target._verify_kind, "verify", K + 1),
             (target.registry, target._decode_kind, "verify", 1)]
    batches = {1: 1, 4: 3, 8: 7}   # padded: 3 rows in bucket 4, 7 in bucket 8
    eager_out = {}
    for reg, name, kind, width in cases:
        for bucket, b in batches.items():
            inp = _inputs(kind, b, rng, width)
            outs, replayed = reg.run(name, inp)
            assert not replayed
            eager_out[(name, bucket)] = (inp, [ops.to_numpy(o) for o in outs])
    target.registry.capture_all()
    draft.registry.capture_all()
    worst = 0.0
    for reg, name, kind, width in cases:
        for bucket, b in batches.items():
            inp, ref = eager_out[(name, bucket)]
            outs, replayed = reg.run(name, inp)
            assert replayed, f"{name}@{bucket} did not replay"
            got = [ops.to_numpy(o) for o in outs]
            for r, g in zip(ref, got):
                assert r.shape == g.shape
                rel = float(np.abs(r - g).max() / (np.abs(r).max() + 1e-12))
                worst = max(worst, rel)
                assert rel < 1e-4, f"{name}@{bucket}: relative difference {rel:.2e}"
            assert np.array_equal(ref[-1].argmax(-1), got[-1].argmax(-1)), f"{name}@{bucket}: argmax differs"
    print(f"\n[gpu] graph vs eager: worst relative difference {worst:.2e} over {len(eager_out)} (kind, bucket) cases")


def test_static_buffers_keep_their_addresses_over_many_steps():
    ops, target, draft = _engines()
    draft.registry.capture_all()
    target.registry.capture_all()
    before = {**draft.registry.static_addresses(), **target.registry.static_addresses()}
    rng = np.random.default_rng(1)
    for _ in range(200):
        b = int(rng.integers(1, 9))
        draft.registry.run(SUBSTEP, _inputs("substep", b, rng, 1))
        target.registry.run(target._verify_kind, _inputs("verify", b, rng, K + 1))
    after = {**draft.registry.static_addresses(), **target.registry.static_addresses()}
    assert after == before
    print(f"\n[gpu] {len(before)} static buffers kept their addresses over 400 steps")


def test_clear_returns_memory_and_cycles_do_not_grow():
    ops, target, draft = _engines()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    peaks, after = [], []
    for _ in range(10):
        target.registry.capture_all()
        draft.registry.capture_all()
        peaks.append(torch.cuda.memory_allocated())
        draft.registry.clear()
        target.registry.clear()
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
    growth = max(after) - base
    print(f"\n[gpu] allocated before capture {base / 2**20:.1f} MiB, with graphs {peaks[0] / 2**20:.1f} MiB, "
          f"after clear (10 cycles) {[round(a / 2**20, 1) for a in after]} MiB")
    assert peaks[0] > base, "capture should hold memory"
    assert growth <= 1 << 20, f"memory after clear exceeds the pre-capture level by {growth} bytes"
    assert max(after) - min(after) <= 1 << 20, "memory grows across capture/clear cycles"


def test_engine_generation_with_graphs_equals_eager(tmp_path):
    t = {k: v * (6 if v.ndim == 2 else 1) for k, v in init_params(CFG, 0, target_tensor_shapes(CFG)).items()}
    save_target(tmp_path, CFG, t)
    save_safetensors(tmp_path / "mtp.safetensors", init_params(CFG, 1, mtp_tensor_shapes(CFG)))
    cfg = EngineConfig(str(tmp_path), runtime=RuntimeConfig(backend="torch", device="cuda:0"),
                       spec=SpecConfig(max_k=K, default_k=K), cache=CacheConfig(max_slots=8, max_len=MAX_LEN),
                       graphs=GraphConfig(batch_buckets=BUCKETS))
    rng = np.random.default_rng(3)
    reqs = [GenRequest(f"r{i}", tuple(int(x) for x in rng.integers(0, CFG.vocab_size, int(rng.integers(3, 30)))),
                       SamplingParams(max_tokens=40, ignore_eos=True), k=int(rng.integers(0, K + 1))) for i in range(6)]
    reference = SpecEngine(cfg, use_draft=False).generate([GenRequest(r.request_id, r.prompt, r.params, 0) for r in reqs])
    eager = SpecEngine(cfg).generate(reqs)
    graphed_engine = SpecEngine(cfg)
    graphed_engine.capture_graphs()
    graphed = graphed_engine.generate(reqs)
    assert [r.tokens for r in graphed] == [r.tokens for r in eager] == [r.tokens for r in reference]
    assert graphed_engine.draft_registry.stats.replays > 0 and graphed_engine.target_registry.stats.replays > 0
    print(f"\n[gpu] engine with graphs == eager == target-only for {len(reqs)} requests; "
          f"replays draft={graphed_engine.draft_registry.stats.replays} target={graphed_engine.target_registry.stats.replays}")
