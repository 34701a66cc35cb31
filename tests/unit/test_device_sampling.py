"""Device sampling and acceptance (Torch, run here on CPU) against the numpy oracle.

``runtime/backends/torch_sampling.py`` must reproduce ``runtime.sampling`` and
``runtime.acceptance`` exactly given the same uniforms: the same processed
distributions (to float64 rounding), the same sampled tokens, the same
acceptance counts and correction/bonus tokens; the Gumbel noise of the
coupled mode from bit-identical uniforms and the same coupled choices.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from runtime import acceptance, random_stream, sampling  # noqa: E402
from runtime.backends.torch_sampling import (accept_rows, coupled_rows, gumbel_rows,  # noqa: E402
                                             gumbel_uniform_rows, process_probs, sample_rows)

V = 12


def _params(rng, n):
    temperature = rng.choice([0.0, 0.3, 0.8, 1.0, 2.5], n)
    top_k = rng.choice([0, 1, 3, 7, V, V + 5], n)
    top_p = rng.choice([1.0, 0.9, 0.5, 0.05], n)
    return temperature, top_k, top_p


def _logits(rng, n):
    x = rng.standard_normal((n, V)) * rng.choice([0.5, 3.0, 20.0], (n, 1))
    x[rng.random((n, V)) < 0.1] = -np.inf          # masked tokens
    x[:, 0] = np.where(rng.random(n) < 0.2, x[:, 1], x[:, 0])   # exact ties
    x[np.isneginf(x).all(-1), 0] = 0.0
    return x


def _t(a, dtype=None):
    return torch.as_tensor(np.asarray(a, dtype=dtype))


@pytest.mark.parametrize("filtered", [False, True])
def test_process_probs_matches_process_logits(filtered):
    rng = np.random.default_rng(0)
    n = 400
    x = _logits(rng, n)
    temperature, top_k, top_p = _params(rng, n)
    if not filtered:
        top_k, top_p = np.zeros(n, np.int64), np.ones(n)
    got = process_probs(_t(x), _t(temperature, np.float64), _t(top_k, np.int64), _t(top_p, np.float64),
                        filtered).numpy()
    for i in range(n):
        want = sampling.process_logits(x[i], temperature[i], int(top_k[i]), top_p[i])
        np.testing.assert_allclose(got[i], want, rtol=0, atol=1e-12, err_msg=f"row {i}")
        assert np.array_equal(got[i] > 0, want > 0), f"row {i}: support differs"


def test_sample_rows_matches_sample_token():
    rng = np.random.default_rng(1)
    n = 2000
    p = rng.random((n, V)) * (rng.random((n, V)) < 0.6)
    p[p.sum(-1) == 0, 3] = 1.0
    u = rng.random(n)
    u[:5] = [0.0, 1 - 1e-17, 0.5, 0.999999999999, 1e-300]
    got = sample_rows(_t(p), _t(u)).numpy()
    want = [sampling.sample_token(p[i], u[i]) for i in range(n)]
    assert got.tolist() == want


@pytest.mark.parametrize("kmax", [0, 1, 3])
def test_accept_rows_matches_accept_rejection(kmax):
    rng = np.random.default_rng(2 + kmax)
    b = 3000
    temperature, top_k, top_p = _params(rng, b)
    temperature = np.where(temperature == 0.0, 1.0, temperature)        # sampled requests
    x = _logits(rng, b * (kmax + 1)).reshape(b, kmax + 1, V)
    p = np.stack([sampling.process_logits(x[i], temperature[i], int(top_k[i]), top_p[i]) for i in range(b)])
    ks = rng.integers(0, kmax + 1, b)
    drafts = np.zeros((b, kmax), np.int64)
    q = np.zeros((b, kmax, V))
    draft_probs = []
    for i in range(b):
        if rng.random() < 0.5:                                          # a sampled draft: q from its own logits
            qi = np.stack([sampling.process_logits(row, 1.0, 0, 1.0) for row in _logits(rng, max(ks[i], 1))])[: ks[i]]
            if rng.random() < 0.3:                                      # q = p: every draft is accepted
                qi = p[i, : ks[i]]
            for j in range(ks[i]):
                drafts[i, j] = sampling.sample_token(qi[j], rng.random())
            draft_probs.append(qi)
        else:                                                           # a greedy draft: q = one_hot(d)
            drafts[i, : ks[i]] = rng.integers(0, V, ks[i])
            qi = None
            draft_probs.append(None)
        q[i, np.arange(kmax), drafts[i]] = 1.0
        if qi is not None:
            q[i, : ks[i]] = qi
    u_acc, u_tok = rng.random((b, kmax)), rng.random((b, kmax + 1))
    a, tok = accept_rows(_t(p), _t(drafts), _t(ks), _t(q) if kmax else None, _t(u_acc), _t(u_tok))
    outcomes = set()
    for i in range(b):
        k = int(ks[i])
        want = acceptance.accept_rejection(list(drafts[i, :k]), draft_probs[i], p[i, : k + 1], u_acc[i, :k],
                                           u_tok[i, : k + 1])
        assert int(a[i]) == want.num_accepted, f"row {i}"
        assert tuple(int(d) for d in drafts[i, : int(a[i])]) + (int(tok[i]),) == want.tokens, f"row {i}"
        outcomes.add((k, want.num_accepted == k))
    if kmax:
        assert (kmax, True) in outcomes and (kmax, False) in outcomes, "both outcomes must be exercised"


def test_gumbel_uniforms_bit_identical_to_numpy():
    seeds = np.array([0, 1, 2**63 - 1, 123456789, 2**62 + 17], dtype=np.int64)
    pos = np.array([0, 5, (1 << 40) - 1, 77, 1 << 20], dtype=np.int64)
    got = gumbel_uniform_rows(_t(seeds), _t(pos), 5000).numpy()
    want = random_stream.gumbel_uniforms(seeds[:, None], pos[:, None], 5000)[:, 0]
    assert got.view(np.uint64).tolist() == want.view(np.uint64).tolist()       # every bit
    assert 0.0 < got.min() and got.max() < 1.0
    np.testing.assert_allclose(gumbel_rows(_t(seeds), _t(pos), 5000).numpy(),
                               random_stream.gumbel(seeds[:, None], pos[:, None], 5000)[:, 0], rtol=0, atol=1e-14)


def test_coupled_rows_match_coupled_token():
    rng = np.random.default_rng(9)
    n = 3000
    temperature, top_k, top_p = _params(rng, n)
    temperature = np.where(temperature == 0.0, 1.0, temperature)
    x = _logits(rng, n)
    seeds, pos = rng.integers(0, 2**63 - 1, n), rng.integers(0, 4096, n)
    p = process_probs(_t(x), _t(temperature, np.float64), _t(top_k, np.int64), _t(top_p, np.float64), True)
    got = coupled_rows(p, gumbel_rows(_t(seeds), _t(pos), V)).numpy()
    want = [sampling.coupled_token(sampling.process_logits(x[i], temperature[i], int(top_k[i]), top_p[i]),
                                   random_stream.gumbel(int(seeds[i]), int(pos[i]), V)) for i in range(n)]
    assert got.tolist() == want


def test_engine_device_path_equals_oracle_path(tiny_model_dir):
    """One prefill + one verify round of mixed greedy / sampled / sampled-draft / coupled requests:
    the Torch engine with its device sampler gives what the numpy oracle path gives."""
    from runtime.backends import make_ops
    from core.params import SamplingParams
    from runtime.config import CacheConfig, RuntimeConfig
    from runtime.graphs import GraphRegistry
    from runtime.target_engine import TargetEngine
    from runtime.types import PrefillRequest, VerifyRequest
    from runtime.weights import check_target, read_arrays, to_device

    ck = check_target(tiny_model_dir)
    vocab = ck.cfg.vocab_size
    runs = []
    for device_sampler in (True, False):
        ops = make_ops(RuntimeConfig(backend="torch"))
        if not device_sampler:
            ops.sampler = None
        eng = TargetEngine(ops, ck.cfg, to_device(ops, read_arrays(ck)), CacheConfig(max_slots=64, max_len=64), 3,
                           GraphRegistry(ops, (1, 4)))
        rng = np.random.default_rng(5)
        reqs, verifies = [], []
        for i in range(48):
            params = SamplingParams(temperature=[0.0, 0.7, 1.3][i % 3], top_k=[0, 5][i % 2],
                                    top_p=[1.0, 0.8][(i // 2) % 2], seed=i,
                                    sampling_mode=["rejection", "coupled"][(i // 6) % 2])
            reqs.append(PrefillRequest(f"r{i}", rng.integers(0, vocab, 1 + i % 7), params))
        first = [r.first_token for r in eng.prefill(reqs)]
        for i, r in enumerate(reqs):
            k = i % 4
            drafts = rng.integers(0, vocab, k)
            q = None
            if i % 5 == 0 and k and not r.params.greedy:
                q = rng.dirichlet(np.ones(vocab), k).astype(np.float32)
                drafts = np.asarray([int(np.argmax(row)) for row in q])
            verifies.append(VerifyRequest(r.request_id, drafts, q))
        res = eng.verify(verifies)
        runs.append((first, [(v.num_accepted, v.tokens) for v in res], [v.hidden for v in res]))
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]
    assert all(np.array_equal(x, y) for x, y in zip(runs[0][2], runs[1][2]))
    assert any(a > 0 for a, _ in runs[0][1]) and any(a == 0 for a, _ in runs[0][1])
