"""End-to-end losslessness of speculative *sampling* through the real engines.

A random small-vocabulary model (V=8) decodes 20,000 seeded requests with
k=2 drafts. The 2nd and 3rd generated tokens come out of a speculative
round (draft + rejection sampling); their marginals must match the target's
own distribution, computed exactly from target-only forward passes:
P(t2) = sum_t1 p(t1) p(t2|t1), P(t3) = sum_{t1,t2} p(t1) p(t2|t1) p(t3|t1,t2).
A chi-square test (fixed seeds, so deterministic) must not reject at 1e-3.
Both speculative sampling modes run: rejection (greedy or sampled drafts)
and coupled, whose tokens must moreover equal target-only decoding's (k=0)
seed for seed.
"""

import itertools

import numpy as np
import pytest
from scipy.stats import chisquare

from runtime.backends import make_ops
from runtime.checkpoint import save_safetensors, save_target
from core.params import SamplingParams
from runtime.config import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig, SpecConfig
from runtime.engine import GenRequest, SpecEngine
from runtime.model import (Rope, init_params, lm_head, mtp_tensor_shapes, target_forward, target_tensor_shapes)
from runtime.sampling import process_logits

V = 8
CFG = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)
PROMPT = (3, 1, 4)
N = 20_000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("small_vocab")
    t = init_params(CFG, 11, target_tensor_shapes(CFG))
    t = {k: v * (40 if v.ndim == 2 else 1) for k, v in t.items()}   # peaked but not degenerate
    save_target(d, CFG, t)
    m = init_params(CFG, 12, mtp_tensor_shapes(CFG))
    save_safetensors(d / "mtp.safetensors", {k: v * (40 if v.ndim == 2 else 1) for k, v in m.items()})
    return d


def _target_probs(model_dir, contexts, params):
    """Exact processed target distribution after each context (no cache, float32)."""
    from runtime.weights import check_target, read_arrays, to_device

    ops = make_ops(RuntimeConfig(backend="paddle"))
    p = to_device(ops, read_arrays(check_target(model_dir)))
    rope = Rope(ops, CFG, 16)
    out = {}
    for ctx in contexts:
        t = len(ctx)
        pos = ops.from_numpy(np.arange(t)[None], "int64")
        mask = ops.from_numpy(np.tril(np.ones((t, t), bool))[None], "bool")
        with ops.no_grad():
            h = target_forward(ops, p, CFG, ops.from_numpy(np.asarray(ctx)[None], "int64"), None, None,
                               train_mask=mask, cos_sin=rope.tables(ops, pos))
            logits = ops.to_numpy(lm_head(ops, p, CFG, h))[0, -1]
        out[ctx] = process_logits(logits, params.temperature, params.top_k, params.top_p)
    return out


def _expected(model_dir, params):
    c1 = [PROMPT]
    c2 = [PROMPT + (a,) for a in range(V)]
    c3 = [PROMPT + (a, b) for a, b in itertools.product(range(V), range(V))]
    p = _target_probs(model_dir, c1 + c2 + c3, params)
    p1 = p[PROMPT]
    p2 = sum(p1[a] * p[PROMPT + (a,)] for a in range(V))
    p3 = sum(p1[a] * p[PROMPT + (a,)][b] * p[PROMPT + (a, b)] for a, b in itertools.product(range(V), range(V)))
    return p1, p2, p3


@pytest.mark.slow
@pytest.mark.parametrize("mode", [dict(draft_sampling=False), dict(draft_sampling=True),
                                  dict(sampling_mode="coupled")], ids=["greedy-draft", "sampled-draft", "coupled"])
@pytest.mark.parametrize("shape", [dict(temperature=0.8), dict(temperature=1.0, top_k=5, top_p=0.9)],
                         ids=["temperature", "topk-topp"])
def test_speculative_sampling_preserves_target_distribution(model_dir, mode, shape):
    base = SamplingParams(max_tokens=3, ignore_eos=True, **mode, **shape)
    engine = SpecEngine(EngineConfig(str(model_dir), runtime=RuntimeConfig(backend="paddle"),
                                     spec=SpecConfig(max_k=2, default_k=2), cache=CacheConfig(max_slots=512, max_len=16)))
    reqs = [GenRequest(f"s{i}", PROMPT, SamplingParams(**{**base.__dict__, "seed": i}), k=2) for i in range(N)]
    results = engine.generate(reqs, max_batch=512)
    toks = np.asarray([r.tokens for r in results])                    # [N, 3]
    drafted = sum(r.stats.drafted for r in results)
    accepted = sum(r.stats.accepted for r in results)
    assert drafted >= N and 0 < accepted < drafted, "the draft must be exercised, with both outcomes"
    p1, p2, p3 = _expected(model_dir, base)
    for j, p in enumerate((p1, p2, p3)):
        counts = np.bincount(toks[:, j], minlength=V)
        support = p > 0
        assert counts[~support].sum() == 0, f"token {j + 1}: sampled outside the target's support"
        exp = p[support] * N
        stat, pval = chisquare(counts[support], exp / exp.sum() * counts[support].sum())
        assert pval > 1e-3, f"token {j + 1}: chi2={stat:.1f} p={pval:.2e} counts={counts} expected={np.round(p * N)}"
    if base.coupled:
        # The same seeds decoded target-only give the same tokens, request for request.
        alone = engine.generate([GenRequest(r.request_id + "t", PROMPT, r.params, k=0) for r in reqs[:500]],
                                max_batch=512)
        assert [list(r.tokens) for r in alone] == toks[:500].tolist()


@pytest.mark.slow
def test_chi_square_catches_a_lossy_acceptance_rule(model_dir, monkeypatch):
    """Negative control: accepting every draft (q one-hot, no rejection) must be detected."""
    from runtime import acceptance, target_engine

    def always_accept(drafts, draft_probs, target_probs, u_accept, u_token):
        return acceptance.Acceptance(len(drafts), tuple(int(d) for d in drafts) +
                                     (int(np.argmax(target_probs[len(drafts)])),))

    monkeypatch.setattr(target_engine.acceptance, "accept_rejection", always_accept)
    base = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.8)
    engine = SpecEngine(EngineConfig(str(model_dir), runtime=RuntimeConfig(backend="paddle"),
                                     spec=SpecConfig(max_k=2, default_k=2), cache=CacheConfig(max_slots=512, max_len=16)))
    results = engine.generate([GenRequest(f"s{i}", PROMPT, SamplingParams(**{**base.__dict__, "seed": i}), k=2)
                               for i in range(N)], max_batch=512)
    toks = np.asarray([r.tokens for r in results])
    _, p2, _ = _expected(model_dir, base)
    counts = np.bincount(toks[:, 1], minlength=V)
    support = p2 > 0
    _, pval = chisquare(counts[support], p2[support] / p2[support].sum() * counts[support].sum())
    assert pval < 1e-6
