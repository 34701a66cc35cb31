"""A seed means the same tokens: the in-process engine with counter-based randomness.

Sampled requests (both speculative sampling modes) on the byte model (its MTP
draft is partly accepted, so drafts are both accepted and rejected):
- a seeded request's tokens do not depend on what it is batched with;
- coupled mode: k = 3, k = 1 and k = 0 (target-only) and an engine without a
  draft give the same tokens for the same seed, on both backends;
- rejection mode: k = 0 equals target-only inverse-CDF sampling with the
  position-keyed draws, and different seeds give different outputs;
- a re-prefill of prompt + output[:-1] with the last token known (what a
  RECOMPUTE reload does) continues exactly as the uninterrupted request.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from core.params import SamplingParams
from runtime.config import CacheConfig, EngineConfig, RuntimeConfig, SpecConfig
from runtime.engine import GenRequest, SpecEngine
from tests.byte_model import write_byte_model

MAX_LEN = 256
N_TOK = 32


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("seeded_byte_model")
    write_byte_model(d, 3, MAX_LEN)
    return d


@pytest.fixture(scope="module")
def engines(byte_model):
    made = {}

    def get(backend: str, draft: bool = True) -> SpecEngine:
        if (backend, draft) not in made:
            made[(backend, draft)] = SpecEngine(EngineConfig(
                str(byte_model), runtime=RuntimeConfig(backend=backend), spec=SpecConfig(max_k=3, default_k=3),
                cache=CacheConfig(max_slots=8, max_len=MAX_LEN)), use_draft=draft)
        return made[(backend, draft)]
    return get


def prompt(i: int, n: int = 9) -> tuple[int, ...]:
    return (256, *(int(x) for x in np.random.default_rng(50 + i).integers(0, 256, n - 1)))


def params(mode: str, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=N_TOK, temperature=kw.pop("temperature", 1.0), seed=seed, ignore_eos=True,
                          sampling_mode=mode, **kw)


def run(engine: SpecEngine, reqs: list[GenRequest], max_batch: int = 8):
    return {r.request_id: r for r in engine.generate(reqs, max_batch=max_batch)}


@pytest.mark.parametrize("mode", ["rejection", "coupled"])
def test_same_tokens_whatever_the_batch(engines, mode):
    eng = engines("paddle")
    me = GenRequest("me", prompt(0), params(mode, 7, top_k=40), k=3)
    alone = run(eng, [me])["me"]
    others = [GenRequest(f"o{i}", prompt(i + 1, 3 + 5 * i), params(mode, 100 + i, temperature=0.7 + 0.2 * i),
                         k=i % 4) for i in range(5)]
    greedy = GenRequest("g", prompt(9), SamplingParams(max_tokens=N_TOK, ignore_eos=True), k=2)
    crowded = run(eng, [others[0], greedy, me, *others[1:]])["me"]
    pairs = run(eng, [others[3], me, others[4]], max_batch=2)["me"]      # joins a later batch
    assert alone.tokens == crowded.tokens == pairs.tokens
    assert alone.stats.drafted > 0 and 0 < alone.stats.accepted < alone.stats.drafted


@pytest.mark.parametrize("backend", ["paddle", "torch"])
def test_coupled_speculation_equals_target_only(engines, backend):
    eng, alone_eng = engines(backend), engines(backend, draft=False)
    seeds = range(4)
    for shape in (dict(), dict(temperature=0.7, top_k=20, top_p=0.9)):
        want = run(alone_eng, [GenRequest(f"t{s}", prompt(s), params("coupled", s, **shape), k=0) for s in seeds])
        for k in (0, 1, 3):
            got = run(eng, [GenRequest(f"t{s}", prompt(s), params("coupled", s, **shape), k=k) for s in seeds])
            for s in seeds:
                assert got[f"t{s}"].tokens == want[f"t{s}"].tokens, (shape, k, s)
            if k:
                drafted = sum(r.stats.drafted for r in got.values())
                accepted = sum(r.stats.accepted for r in got.values())
                assert drafted > 0 and 0 < accepted < drafted, "both outcomes must be exercised"
    outs = {want[f"t{s}"].tokens for s in seeds}
    assert len(outs) == len(seeds), "different seeds must give different samples"


def test_backends_agree_in_both_modes(engines):
    for mode in ("rejection", "coupled"):
        reqs = [GenRequest(f"b{s}", prompt(s), params(mode, 40 + s), k=3) for s in range(4)]
        torch_out, paddle_out = run(engines("torch"), reqs), run(engines("paddle"), reqs)
        assert {r: x.tokens for r, x in torch_out.items()} == {r: x.tokens for r, x in paddle_out.items()}, mode


def test_rejection_target_only_is_position_keyed_inverse_cdf(engines, byte_model):
    # k = 0 in rejection mode: the token at position p is sample_token(p, u(seed, p, SAMPLE)); the
    # draft is not involved, so a draft-less engine gives the very same tokens.
    eng, alone_eng = engines("paddle"), engines("paddle", draft=False)
    reqs = [GenRequest(f"r{s}", prompt(s), params("rejection", 900 + s), k=0) for s in range(4)]
    a, b = run(eng, reqs), run(alone_eng, reqs)
    assert {r: x.tokens for r, x in a.items()} == {r: x.tokens for r, x in b.items()}
    assert len({x.tokens for x in a.values()}) == 4


@pytest.mark.parametrize("mode", ["rejection", "coupled"])
def test_reprefill_with_the_last_token_continues_the_same_stream(engines, mode):
    """What RECOMPUTE does after a reload with the same weights: prefill prompt + output[:-1] with
    output[-1] as the known last token, then keep going. Driven through the round driver."""
    from runtime import round_driver as rd

    eng = engines("paddle")
    p = params(mode, 31)
    full = run(eng, [GenRequest("full", prompt(4), p, k=3)])["full"].tokens
    for cut in (1, 7, 20):
        seq = rd.Sequence("cut", np.asarray(prompt(4), dtype=np.int64), dataclasses.replace(p), 3)
        seq.output = list(full[:cut])
        target, draft = eng.target, eng.draft
        rd.admit(target, draft, [seq], resume=True)
        for _ in range(N_TOK):                                               # bounded
            if seq.finish_reason is not None:
                break
            rd.run_round(target, draft, [seq])
        rd.release(target, draft, seq)
        assert tuple(seq.output) == full, (mode, cut)
