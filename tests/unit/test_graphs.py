"""Graph registry bookkeeping on CPU: the same code path the GPU runs, with an eager stand-in graph."""

import numpy as np
import pytest

from runtime.backends import make_ops
from runtime.checkpoint import save_safetensors, save_target
from core.params import SamplingParams
from runtime.config import CacheConfig, EngineConfig, GraphConfig, ModelConfig, RuntimeConfig, SpecConfig
from runtime.engine import GenRequest, SpecEngine
from runtime.graphs import GraphRegistry, InputSpec, StepKind
from runtime.model import init_params, mtp_tensor_shapes, target_tensor_shapes

CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("graphs_model")
    t = {k: v * (10 if v.ndim == 2 else 1) for k, v in init_params(CFG, 0, target_tensor_shapes(CFG)).items()}
    save_target(d, CFG, t)
    save_safetensors(d / "mtp.safetensors", init_params(CFG, 1, mtp_tensor_shapes(CFG)))
    return d


def _registry_with_counter():
    ops = make_ops(RuntimeConfig(backend="torch"))
    calls = []

    def step(x, idx):
        calls.append(ops.shape(x)[0])
        return (x * 2 + 1, idx + 100)

    reg = GraphRegistry(ops, (1, 4, 8))
    reg.register(StepKind("double", step, (InputSpec("x", (3,), "compute", -1.0), InputSpec("idx", (), "int64", 7))))
    return ops, reg, calls


def test_bucket_choice():
    _, reg, _ = _registry_with_counter()
    assert [reg.bucket_for(b) for b in (1, 2, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, None]


def test_capture_largest_first_then_pad_and_unpad():
    ops, reg, calls = _registry_with_counter()
    reg.capture_all(warmup=1)
    assert reg.stats.events == ["capture double@8", "capture double@4", "capture double@1"]
    assert [k for k in reg.keys()] == [(1, "double"), (4, "double"), (8, "double")]
    x = np.arange(9, dtype=np.float32).reshape(3, 3)
    (y, idx), replayed = reg.run("double", {"x": x, "idx": np.array([1, 2, 3])})
    assert replayed and ops.shape(y) == (3, 3)                      # 3 rows padded to bucket 4, unpadded back
    assert np.array_equal(ops.to_numpy(y), x * 2 + 1) and list(ops.to_numpy(idx)) == [101, 102, 103]
    assert calls[-1] == 4                                           # the step ran at bucket size
    (y, _), replayed = reg.run("double", {"x": np.zeros((9, 3), np.float32), "idx": np.zeros(9, np.int64)})
    assert not replayed and calls[-1] == 9                          # above the largest bucket: eager
    assert reg.stats.replays == 1 and reg.stats.eager_runs == 1


def test_static_buffers_never_rebound():
    """Regression guard for 'clone instead of copy_ -> CUDA error 700': addresses stay fixed."""
    _, reg, _ = _registry_with_counter()
    reg.capture_all(warmup=1)
    before = reg.static_addresses()
    rng = np.random.default_rng(0)
    for i in range(50):
        b = int(rng.integers(1, 9))
        reg.run("double", {"x": rng.standard_normal((b, 3)).astype(np.float32), "idx": np.arange(b)})
    assert reg.static_addresses() == before


def test_clear_and_register_rules():
    _, reg, _ = _registry_with_counter()
    reg.capture_all(warmup=1)
    with pytest.raises(RuntimeError, match="while graphs are live"):
        reg.register(StepKind("other", lambda: (), ()))
    with pytest.raises(RuntimeError, match="clear graphs"):
        reg.unregister_all()
    reg.clear()
    assert not reg.live and reg.keys() == [] and reg.static_addresses() == {}
    assert reg.stats.events[-1] == "clear"
    reg.clear()                                                     # idempotent
    assert reg.stats.clears == 1
    reg.unregister_all()


@pytest.mark.parametrize("backend", ["paddle", "torch"])
def test_engine_with_captured_graphs_matches_eager(model_dir, backend):
    cfg = EngineConfig(str(model_dir), runtime=RuntimeConfig(backend=backend), spec=SpecConfig(max_k=3, default_k=3),
                       cache=CacheConfig(max_slots=8, max_len=96), graphs=GraphConfig(batch_buckets=(1, 2, 4)))
    rng = np.random.default_rng(2)
    reqs = [GenRequest(f"r{i}", tuple(int(x) for x in rng.integers(0, 48, int(rng.integers(2, 12)))),
                       SamplingParams(max_tokens=int(rng.integers(5, 25))), k=int(rng.integers(1, 4))) for i in range(3)]
    eager = SpecEngine(cfg).generate(reqs)
    graphed_engine = SpecEngine(cfg)
    graphed_engine.capture_graphs()
    keys = graphed_engine.draft_registry.keys()
    assert {k for _, k in keys} == {"catchup4", "catchup16", "substep", "propose1", "propose2", "propose3"}   # no ahead
    assert {b for b, _ in keys} == {1, 2, 4}
    graphed = graphed_engine.generate(reqs)
    assert [r.tokens for r in graphed] == [r.tokens for r in eager]
    assert graphed_engine.target_registry.stats.replays > 0 and graphed_engine.draft_registry.stats.replays > 0


def test_propose_kinds_bookkeeping(model_dir):
    """propose1..max_k at every bucket and span, captured after catch-up and substep per bucket
    (their single warm-up relies on it); one replay per greedy propose; clear drops them all."""
    cfg = EngineConfig(str(model_dir), runtime=RuntimeConfig(backend="torch"), spec=SpecConfig(max_k=3, default_k=3),
                       cache=CacheConfig(max_slots=8, max_len=300), graphs=GraphConfig(batch_buckets=(1, 4)))
    eng = SpecEngine(cfg)
    reg = eng.draft_registry
    reg.capture_all()
    spans = (256, 300)
    kinds = ("catchup4", "catchup16", "substep", "propose1", "propose2", "propose3")
    assert reg.span_keys() == sorted([(b, k, s) for b in (1, 4) for k in kinds for s in spans],
                                     key=lambda x: (x[1], x[0], x[2]))
    assert reg.stats.captures == 2 * len(kinds) * len(spans)
    order = [e.split()[1].split("/")[0] for e in reg.stats.events]
    assert order == [f"{k}@{b}" for b in (4, 1) for k in kinds for _ in spans]
    assert [reg.can_replay("propose3", b, 10) for b in (1, 3, 4, 5)] == [True, True, True, False]
    assert not reg.can_replay("propose3", 1, 301) and not reg.can_replay("nope", 1, 1)
    rng = np.random.default_rng(5)
    reqs = [GenRequest(f"r{i}", tuple(int(x) for x in rng.integers(0, 48, 6)), SamplingParams(max_tokens=9), k=3)
            for i in range(3)]
    calls, propose = [], eng.draft.propose
    eng.draft.propose = lambda batch: calls.append(len(batch)) or propose(batch)
    before = reg.stats.replays
    eng.generate(reqs)
    assert calls and reg.stats.replays - before == len(calls) and reg.stats.eager_runs == 0   # one replay each
    reg.clear()
    assert reg.keys() == [] and not any(reg.can_replay(f"propose{k}", 1, 10) for k in (1, 2, 3))


def test_garbage_collector_paused_through_nested_and_concurrent_captures():
    # A collection inside a CUDA graph capture can free a dropped CUDAGraph, whose reset then
    # invalidates the capture (docs/gpu.md); TorchOps.capture runs under gc_paused.
    import gc
    import threading

    torch_ops = pytest.importorskip("runtime.backends.torch_ops")
    assert gc.isenabled()
    inside, release = threading.Event(), threading.Event()

    def other_capture():
        with torch_ops.gc_paused():
            inside.set()
            assert release.wait(10)

    t = threading.Thread(target=other_capture)
    try:
        with torch_ops.gc_paused():
            assert not gc.isenabled()
            t.start()
            assert inside.wait(10)
        assert not gc.isenabled(), "the collector came back while another capture still ran"
    finally:
        release.set()
        t.join(10)
    assert gc.isenabled()
    gc.disable()
    try:
        with torch_ops.gc_paused():
            pass
        assert not gc.isenabled(), "a collector switched off before the capture was switched on by it"
    finally:
        gc.enable()
