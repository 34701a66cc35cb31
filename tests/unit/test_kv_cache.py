"""KV cache: slots, capacity errors, rollback by length update, no cross-request corruption."""

import numpy as np
import pytest

from runtime.backends import make_ops
from runtime.config import CacheConfig, ModelConfig, RuntimeConfig
from runtime.graphs import GraphRegistry
from runtime.kv_cache import CapacityError, KVCache, UnknownRequestError
from runtime.model import init_params, target_tensor_shapes
from runtime.target_engine import TargetEngine
from runtime.types import PrefillRequest, VerifyRequest
from core.params import SamplingParams

CFG = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


def _engine(slots=3, max_len=32):
    ops = make_ops(RuntimeConfig(backend="paddle"))
    p = {k: ops.from_numpy(v * (8 if v.ndim == 2 else 1)) for k, v in init_params(CFG, 0, target_tensor_shapes(CFG)).items()}
    return TargetEngine(ops, CFG, p, CacheConfig(max_slots=slots, max_len=max_len), 4, GraphRegistry(ops, (1, 2, 4)))


def test_slots_are_reused_and_capacity_is_clean():
    ops = make_ops(RuntimeConfig(backend="paddle"))
    cache = KVCache(ops, 1, 2, 8, max_slots=2, max_len=16)
    a, b = cache.allocate("a"), cache.allocate("b")
    assert {a.slot, b.slot} == {0, 1} and cache.free_slots == 0
    with pytest.raises(CapacityError, match="all 2 request slots"):
        cache.allocate("c")
    assert cache.free("a") and not cache.free("a")
    assert cache.allocate("c").slot == a.slot
    with pytest.raises(UnknownRequestError, match="'zzz' is unknown"):
        cache.get("zzz")
    with pytest.raises(CapacityError, match="cache.max_len is 16"):
        cache.check_fits("b", 17)


def _greedy_decode(engine, rid, prompt, steps):
    out = [engine.prefill([PrefillRequest(rid, np.asarray(prompt), SamplingParams())])[0].first_token]
    for _ in range(steps):
        out.extend(engine.verify([VerifyRequest(rid, np.zeros(0, np.int64), None)])[0].tokens)
    return out


def test_rollback_leaves_later_tokens_identical_to_a_fresh_run():
    """Verify wrong drafts (forcing rejection) then continue: output equals a fresh, draft-free run."""
    prompt = [1, 5, 9, 2, 7]
    fresh = _greedy_decode(_engine(), "f", prompt, 12)
    eng = _engine()
    out = [eng.prefill([PrefillRequest("r", np.asarray(prompt), SamplingParams())])[0].first_token]
    rng = np.random.default_rng(0)
    while len(out) < 13:
        nxt = fresh[len(out)] if len(out) < len(fresh) else 0
        # first draft right, second deliberately wrong: rows past the accepted ones are stale
        drafts = np.asarray([nxt, (fresh[len(out) + 1] + 1) % CFG.vocab_size if len(out) + 1 < len(fresh) else 0,
                             int(rng.integers(0, CFG.vocab_size))])
        res = eng.verify([VerifyRequest("r", drafts, None)])[0]
        out.extend(res.tokens)
    assert out[:13] == fresh[:13]


def test_full_cache_never_corrupts_other_requests():
    eng = _engine(slots=2)
    ref = _greedy_decode(_engine(slots=2), "x", [3, 4, 5], 6)
    first = eng.prefill([PrefillRequest("a", np.asarray([3, 4, 5]), SamplingParams())])[0].first_token
    eng.prefill([PrefillRequest("b", np.asarray([9, 9]), SamplingParams())])
    with pytest.raises(CapacityError):
        eng.prefill([PrefillRequest("c", np.asarray([1]), SamplingParams())])
    with pytest.raises(CapacityError, match="max_len"):
        eng.prefill([PrefillRequest("d", np.arange(40) % 7, SamplingParams())])
    out = [first]
    for _ in range(6):
        out.extend(eng.verify([VerifyRequest("a", np.zeros(0, np.int64), None)])[0].tokens)
    assert out == ref
    assert eng.cache.used_slots == 2
