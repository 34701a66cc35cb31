"""Prefill graphs on CPU: the registry's eager stand-in runs the same padded path the GPU
replays (prompt padded to a captured width, batch to a bucket), so the choice of width, the
buckets each width is captured at and the equality with the eager prefill are tested here."""

import numpy as np
import pytest

from core.config import ConfigError
from core.params import SamplingParams
from runtime.backends import make_ops
from runtime.batch_layout import prefill_graph_widths, prefill_width
from runtime.config import CacheConfig, EngineConfig, GraphConfig, RuntimeConfig, SpecConfig
from runtime.engine import GenRequest, SpecEngine
from runtime.graphs import GraphRegistry, InputSpec, StepKind
from runtime.types import DraftPrefillRequest, PrefillRequest

from tests.unit.test_graphs import model_dir  # noqa: F401  (the same small model, a fixture)

WIDTHS, TOKENS = (4, 8, 16), 32          # width 16 at buckets 1, 2; width 8 up to 4; width 4 up to 4


def _cfg(model_dir, backend="torch", prefill_graphs=True):
    return EngineConfig(str(model_dir), runtime=RuntimeConfig(backend=backend), spec=SpecConfig(max_k=3, default_k=3),
                        cache=CacheConfig(max_slots=8, max_len=96),
                        graphs=GraphConfig(batch_buckets=(1, 2, 4), prefill_graphs=prefill_graphs,
                                           prefill_widths=WIDTHS, prefill_tokens=TOKENS))


def test_widths_and_their_buckets():
    plan = prefill_graph_widths(WIDTHS, TOKENS, 96, (1, 2, 4))
    assert plan == {4: 4, 8: 4, 16: 2}
    assert prefill_graph_widths((16, 64, 128), 64, 100, (1, 2, 4)) == {16: 4, 64: 1}   # 128: no bucket, > max_len
    assert [prefill_width(plan, n, 1) for n in (1, 4, 5, 16, 17)] == [4, 4, 8, 16, None]
    assert [prefill_width(plan, 12, b) for b in (1, 2, 3, 4)] == [16, 16, None, None]  # 3 rows of 16 > 32


def test_a_kind_is_captured_only_up_to_its_max_batch():
    ops = make_ops(RuntimeConfig(backend="torch"))
    calls = []

    def step(x):
        calls.append(ops.shape(x)[0])
        return (x + 1,)

    reg = GraphRegistry(ops, (1, 2, 4, 8))
    reg.register(StepKind("all", step, (InputSpec("x", (3,), "int64", 0),)))
    reg.register(StepKind("small", step, (InputSpec("x", (3,), "int64", 0),), max_batch=3))
    reg.register(StepKind("none", step, (InputSpec("x", (3,), "int64", 0),), max_batch=0))
    reg.capture_all(warmup=1)
    assert reg.keys() == [(1, "all"), (2, "all"), (4, "all"), (8, "all"), (1, "small"), (2, "small")]
    assert [reg.can_replay("small", b) for b in (1, 2, 3)] == [True, True, False]
    (y,), replayed = reg.run("small", {"x": np.ones((3, 3), np.int64)})
    assert not replayed and calls[-1] == 3 and np.array_equal(ops.to_numpy(y), np.full((3, 3), 2))
    (y,), replayed = reg.run("small", {"x": np.ones((2, 3), np.int64)})
    assert replayed and np.array_equal(ops.to_numpy(y), np.full((2, 3), 2))
    assert not reg.can_replay("none", 1)
    assert ops.shape(reg._static["small"]["x"]) == (2, 3) and ops.shape(reg._static["all"]["x"]) == (8, 3)
    assert reg.run("none", {"x": np.zeros((1, 3), np.int64)})[1] is False


def test_config_checks_and_the_device_default():
    assert GraphConfig().prefill_widths_on("cpu") == ()
    assert GraphConfig().prefill_widths_on("cuda:0") == (16, 32, 64, 128, 256, 512)
    assert GraphConfig(prefill_graphs=True).prefill_widths_on("cpu") == (16, 32, 64, 128, 256, 512)
    assert GraphConfig(prefill_graphs=False).prefill_widths_on("cuda:1") == ()
    assert GraphConfig(enabled=False).prefill_widths_on("cuda:0") == ()
    for bad in ((), (32, 16), (0, 8), (8, 8)):
        with pytest.raises(ConfigError, match="graphs.prefill_widths"):
            GraphConfig(prefill_widths=bad)
    with pytest.raises(ConfigError, match="graphs.prefill_tokens"):
        GraphConfig(prefill_tokens=0)


@pytest.mark.parametrize("backend", ["paddle", "torch"])
def test_prefill_through_the_graphs_equals_the_eager_prefill(model_dir, backend):
    """Each width, batch padding to a bucket, and the eager fallbacks (a prompt wider than every
    width, a batch above a width's buckets): first tokens, hidden rows and the KV cache rows equal
    the eager prefill's (ulp-level on the hidden, as the padded rows change the matmul shapes)."""
    eager = SpecEngine(_cfg(model_dir, backend, prefill_graphs=False))
    graphed = SpecEngine(_cfg(model_dir, backend))
    graphed.capture_graphs()
    keys = graphed.target_registry.keys()
    assert {(b, k) for b, k in keys if k.startswith("prefill")} == {
        (1, "prefill4"), (2, "prefill4"), (4, "prefill4"), (1, "prefill8"), (2, "prefill8"), (4, "prefill8"),
        (1, "prefill16"), (2, "prefill16")}
    rng = np.random.default_rng(3)
    batches = [[3], [4], [5, 2], [16], [11, 9], [7, 8, 1], [12, 14, 3], [20], [6, 30]]
    n = 0
    for lengths in batches:
        reqs = [PrefillRequest(f"r{n + i}", tuple(int(x) for x in rng.integers(0, 48, m)), SamplingParams())
                for i, m in enumerate(lengths)]
        n += len(lengths)
        before = graphed.target_registry.stats.replays
        want, got = eager.target.prefill(reqs), graphed.target.prefill(reqs)
        graphs_ran = graphed.target_registry.stats.replays > before
        fits = prefill_width(graphed.target._prefill_widths, max(lengths), len(lengths)) is not None
        assert graphs_ran == fits, lengths
        for w, g, r in zip(want, got, reqs):
            assert g.first_token == w.first_token
            np.testing.assert_allclose(g.hidden, w.hidden, rtol=2e-5, atol=2e-5)
            se, sg = eager.target.cache.get(r.request_id), graphed.target.cache.get(r.request_id)
            for (ke, ve), (kg, vg) in zip(eager.target.cache.layers, graphed.target.cache.layers):
                for a, b in ((ke, kg), (ve, vg)):
                    np.testing.assert_allclose(eager.ops.to_numpy(a)[se.slot, :, :len(r.prompt)],
                                               graphed.ops.to_numpy(b)[sg.slot, :, :len(r.prompt)],
                                               rtol=2e-5, atol=2e-5)
        # The draft's prefill of the same prompts' pairs, through its prefill graphs where they hold them.
        pairs = [DraftPrefillRequest(r.request_id, r.prompt[1:], w.hidden[:-1], SamplingParams())
                 for r, w in zip(reqs, want)]
        before = graphed.draft_registry.stats.replays
        eager.draft.prefill(pairs)
        graphed.draft.prefill(pairs)
        longest = max(len(p.tokens) for p in pairs)
        wide = longest > graphed.draft.catchup_width and prefill_width(
            graphed.draft._prefill_widths, longest, len(pairs)) is not None
        assert (graphed.draft_registry.stats.replays > before) == (wide or 0 < longest <= graphed.draft.catchup_width)
        de, dg = eager.draft.cache, graphed.draft.cache
        for p in pairs:
            ke, kg = eager.ops.to_numpy(de.layers[0][0]), graphed.ops.to_numpy(dg.layers[0][0])
            np.testing.assert_allclose(ke[de.get(p.request_id).slot, :, :len(p.tokens)],
                                       kg[dg.get(p.request_id).slot, :, :len(p.tokens)], rtol=2e-5, atol=2e-5)
        for eng in (eager, graphed):
            for r in reqs:
                eng.target.release(r.request_id)
                eng.draft.release(r.request_id)


def test_speculative_generation_with_prefill_graphs_equals_target_only(model_dir):
    """Greedy: speculative decoding with prefill graphs (target and draft) gives target-only's tokens."""
    rng = np.random.default_rng(4)
    reqs = [GenRequest(f"g{i}", tuple(int(x) for x in rng.integers(0, 48, int(m))), SamplingParams(max_tokens=12), k=3)
            for i, m in enumerate((2, 6, 9, 15, 19, 3))]
    baseline = SpecEngine(_cfg(model_dir, prefill_graphs=False), use_draft=False).generate(reqs)
    graphed = SpecEngine(_cfg(model_dir))
    graphed.capture_graphs()
    out = graphed.generate(reqs, max_batch=2)
    assert [r.tokens for r in out] == [r.tokens for r in baseline]
    prefill_kinds = {k for _, k in graphed.draft_registry.keys() if k.startswith("prefill")}
    assert prefill_kinds == {"prefill4", "prefill8", "prefill16"}


def test_batch_invariant_prefills_one_request_at_a_time_all_or_nothing(model_dir):
    """``runtime.batch_invariant`` (``Ops.batch_invariant``): a batch of prompts is prefilled one
    request at a time, so each one's first token, hidden rows and KV rows are those it gets
    alone (bit for bit, here on the CPU's plain ops); a request that fails releases the ones
    before it, as a batch's failure does."""
    eng = SpecEngine(_cfg(model_dir, prefill_graphs=False))
    target = eng.target
    rng = np.random.default_rng(5)
    prompts = [tuple(int(x) for x in rng.integers(0, 48, m)) for m in (5, 13, 2)]
    alone = {}
    for i, p in enumerate(prompts):
        alone[i] = target.prefill([PrefillRequest(f"a{i}", p, SamplingParams())])[0]
        target.release(f"a{i}")
    target.ops.batch_invariant = True
    runs = []
    target._run_prefill = (lambda run: lambda arrays, span: runs.append(len(arrays["tokens"]))
                           or run(arrays, span))(target._run_prefill)
    got = target.prefill([PrefillRequest(f"b{i}", p, SamplingParams()) for i, p in enumerate(prompts)])
    assert runs == [1, 1, 1]                            # three forwards of one row each
    for i, g in enumerate(got):
        assert g.first_token == alone[i].first_token and np.array_equal(g.hidden, alone[i].hidden)
    free = target.cache.free_slots
    with pytest.raises(ValueError, match="already active"):
        target.prefill([PrefillRequest("c0", prompts[0], SamplingParams()),
                        PrefillRequest("b1", prompts[1], SamplingParams())])   # b1 is active: c0 goes too
    assert target.cache.free_slots == free and not target.cache.has("c0") and "c0" not in target.requests
