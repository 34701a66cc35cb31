"""The fused greedy propose (runtime/fused_propose.py) against the per-substep path, on CPU.

Both engines load the bundled model and capture graphs (the registry's eager
stand-in on CPU, the code path the GPU replays); one replays ``propose{k}``, the
other the catch-up graph and k-1 substep graphs. They compute the same numbers,
so drafts, the draft KV cache of every live slot and the kept ends (ahead
drafting) must be identical, in fp32.
"""

from __future__ import annotations

import numpy as np
import pytest

from core.params import SamplingParams
from runtime.config import CacheConfig, EngineConfig, GraphConfig, RuntimeConfig, SpecConfig
from runtime.engine import SpecEngine
from runtime.batch_layout import VECTOR_ROWS
from runtime.fused_propose import substep_places
from runtime.types import DraftPrefillRequest, ProposeRequest
from tests.unit.test_engine_bundled import TINY

MAX_K = 3
D = 256                       # the bundled model's hidden size


def _draft(fused: bool, buckets=(1, 2, 4), capture=True):
    eng = SpecEngine(EngineConfig(str(TINY), runtime=RuntimeConfig(backend="torch"),
                                  spec=SpecConfig(max_k=MAX_K, default_k=MAX_K),
                                  cache=CacheConfig(max_slots=8, max_len=512),
                                  graphs=GraphConfig(batch_buckets=buckets)), fused_propose=fused)
    if capture:
        eng.draft_registry.capture_all()
    return eng.draft


def _prefill(engines, rng, n, prompt_len=(5, 30), params=SamplingParams()):
    lens = {}
    for i in range(n):
        m = int(rng.integers(*prompt_len))
        req = DraftPrefillRequest(f"r{i}", rng.integers(0, 256, m), rng.standard_normal((m, D)).astype(np.float32),
                                  params)
        for e in engines:
            e.prefill([req])
        lens[f"r{i}"] = m
    return lens


def _round(rng, lens, ks, keep_tail=False):
    """One propose batch: 1..k+1 new pairs per request (what a verify commits)."""
    reqs = []
    for rid, k in ks.items():
        m = int(rng.integers(1, MAX_K + 2))
        reqs.append(ProposeRequest(rid, lens[rid], rng.integers(0, 256, m),
                                   rng.standard_normal((m, D)).astype(np.float32), k, keep_tail=keep_tail))
        lens[rid] += m
    return reqs


def _live_kv(draft):
    """The draft KV rows of every live slot (the scratch slot excluded)."""
    k, v = draft.cache.layers[0]
    rows = draft.cache.max_slots * draft.cache.max_len
    return draft.ops.to_numpy(k)[:rows], draft.ops.to_numpy(v)[:rows]


def _propose_both(fused, plain, reqs):
    before_f, before_p = fused.registry.stats.replays, plain.registry.stats.replays
    got, want = fused.propose(reqs), plain.propose(reqs)
    kmax = max(r.k for r in reqs)
    assert fused.registry.stats.replays - before_f == 1, "a fused propose is one replay"
    assert plain.registry.stats.replays - before_p == kmax, "the per-substep path: catch-up + k-1 substeps"
    for g, w, r in zip(got, want, reqs):
        assert g.request_id == w.request_id == r.request_id and len(g.drafts) == r.k
        assert np.array_equal(g.drafts, w.drafts), (r.request_id, g.drafts, w.drafts)
    for a, b in zip(_live_kv(fused), _live_kv(plain)):
        assert np.array_equal(a, b), "the fused propose wrote different draft KV rows"
    return got


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_drafts_equal_per_substep_drafts(batch):
    """Batch 1, and 3 rows padded to bucket 4 with mixed k (rows with k < kmax run their
    remaining substeps on the scratch slot; the padding row never touches a live slot)."""
    fused, plain = _draft(True), _draft(False)
    rng = np.random.default_rng(batch)
    lens = _prefill([fused, plain], rng, batch)
    for rnd in range(6):
        ks = {rid: (MAX_K if batch == 1 else 1 + (i + rnd) % MAX_K) for i, rid in enumerate(lens)}
        if batch == 1:
            ks = {rid: 1 + rnd % MAX_K for rid in lens}          # k = 1, 2, 3: propose1..propose3
        _propose_both(fused, plain, _round(rng, lens, ks))
    assert fused.registry.stats.eager_runs == plain.registry.stats.eager_runs == 0


def test_a_propose_across_a_context_span_boundary_takes_the_per_substep_path():
    """253 pairs held, 2 new: the catch-up reads 255 cache rows (span 256), the substeps write
    positions 255 and 256 (spans 256, 384). One graph reads one span, and span 384 for the
    whole propose rounds differently (~1e-7 in g on CPU), so this propose is not fused; the
    next one, inside span 384, is."""
    fused, plain = _draft(True, buckets=(1,)), _draft(False, buckets=(1,))
    rng = np.random.default_rng(7)
    lens = _prefill([fused, plain], rng, 1, prompt_len=(253, 254))
    req = ProposeRequest("r0", 253, rng.integers(0, 256, 2), rng.standard_normal((2, D)).astype(np.float32), MAX_K)
    before = fused.registry.stats.replays
    assert [p.drafts.tolist() for p in fused.propose([req])] == [p.drafts.tolist() for p in plain.propose([req])]
    assert fused.registry.stats.replays - before == MAX_K and fused.registry.stats.last_span == 384
    for a, b in zip(_live_kv(fused), _live_kv(plain)):
        assert np.array_equal(a, b)
    lens["r0"] = 255
    _propose_both(fused, plain, _round(rng, lens, {"r0": MAX_K}))
    assert fused.registry.stats.last_span == 384


def test_keep_tail_and_ahead_after_a_fused_propose():
    """The end a fused propose keeps (g, last draft, position) continues into the same ahead drafts."""
    fused, plain = _draft(True), _draft(False)
    rng = np.random.default_rng(11)
    lens = _prefill([fused, plain], rng, 3)
    _propose_both(fused, plain, _round(rng, lens, {"r0": 3, "r1": 2, "r2": 3}, keep_tail=True))
    ends, plain_ends = fused._ends, plain._ends
    assert set(ends.positions) == set(plain_ends.positions) == {"r0", "r2"}      # only rows with k == kmax
    assert ends.positions == plain_ends.positions
    assert np.array_equal(fused.ops.to_numpy(ends._g), plain.ops.to_numpy(plain_ends._g))
    assert np.array_equal(fused.ops.to_numpy(ends._tok), plain.ops.to_numpy(plain_ends._tok))
    ahead = [ProposeRequest(rid, 0, np.zeros(0, np.int64), np.zeros((0, D), np.float32), MAX_K + 1, ahead=True,
                            keep_tail=True) for rid in ("r0", "r2")]
    got, want = fused.propose(ahead), plain.propose(ahead)
    assert [p.drafts.tolist() for p in got] == [p.drafts.tolist() for p in want]


def test_fused_propose_falls_back_where_it_cannot_replay():
    """Sampled rows, graphs not live and batches above the largest bucket take today's path."""
    rng = np.random.default_rng(3)
    sampled = _draft(True)
    lens = _prefill([sampled], rng, 1, params=SamplingParams(temperature=0.8, draft_sampling=True, seed=1))
    before = sampled.registry.stats.replays
    (p,) = sampled.propose(_round(rng, lens, {"r0": 3}))
    assert p.draft_probs is not None and sampled.registry.stats.replays - before == 3   # catch-up + 2 substeps

    eager_f, eager_p = _draft(True, capture=False), _draft(False, capture=False)
    lens = _prefill([eager_f, eager_p], rng, 2)
    reqs = _round(rng, lens, {"r0": 3, "r1": 2})
    assert [x.drafts.tolist() for x in eager_f.propose(reqs)] == [x.drafts.tolist() for x in eager_p.propose(reqs)]
    assert eager_f.registry.stats.eager_runs == eager_p.registry.stats.eager_runs == 3   # nothing fused

    small = _draft(True, buckets=(1, 2))
    lens = _prefill([small], rng, 3)
    small.propose(_round(rng, lens, {"r0": 3, "r1": 3, "r2": 3}))
    assert small.registry.stats.replays == 0 and small.registry.stats.eager_runs == 3


def test_a_wide_catch_up_runs_as_catch_up_graph_passes():
    """A catch-up wider than the catch-up graph (the draft sat out target-only rounds) writes
    its head in passes of the head graph (16 pairs a pass), then proposes as usual (here: one
    fused replay), never eagerly; the drafts and the draft KV equal one eager pass over the
    whole width."""
    passes, plain = _draft(True), _draft(True, capture=False)
    rng = np.random.default_rng(5)
    lens = _prefill([passes, plain], rng, 3)
    widths = {"r0": 40, "r1": 9, "r2": 2}         # heads of 36 and 5 pairs (16 a pass), and none
    reqs = [ProposeRequest(rid, lens[rid], rng.integers(0, 256, m), rng.standard_normal((m, D)).astype(np.float32),
                           MAX_K) for rid, m in widths.items()]
    before = passes.registry.stats.replays
    got, want = passes.propose(reqs), plain.propose(reqs)
    assert passes.registry.stats.eager_runs == 0
    assert passes.registry.stats.replays - before == 3 + 1, "ceil(36 / 16) head passes, then one fused propose"
    assert [p.drafts.tolist() for p in got] == [p.drafts.tolist() for p in want]
    for a, b in zip(_live_kv(passes), _live_kv(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for rid, m in widths.items():
        lens[rid] += m
        assert passes.cache.get(rid).length == plain.cache.get(rid).length == lens[rid]
    # The next (narrow) round goes on from the same state on both.
    nxt = _round(rng, lens, {"r0": 3, "r1": 1, "r2": 2})
    assert [p.drafts.tolist() for p in passes.propose(nxt)] == [p.drafts.tolist() for p in plain.propose(nxt)]


def test_substep_places_scratch_for_finished_rows():
    write, pos = substep_places([0, 5, 2], [10, 20, 30], [3, 1, 2], 3, scratch_slot=8)
    assert write.tolist() == [[0, 0], [8, 8], [2, 8]]
    assert pos.tolist() == [[10, 11], [0, 0], [30, 0]]


def test_substep_places_of_many_rows_equal_the_row_loop():
    """From VECTOR_ROWS rows on the places come from whole-array calls: the same as row by row."""
    rng = np.random.default_rng(5)
    for b in (VECTOR_ROWS, 11):
        slots, pairs = list(range(b)), [int(x) for x in rng.integers(5, 90, b)]
        ks = [int(x) for x in rng.integers(1, 5, b)]
        write, pos = substep_places(slots, pairs, ks, 4, scratch_slot=50)
        for i in range(b):
            live = [s for s in range(1, 4) if ks[i] > s]          # substep s writes (slot, pairs + s - 1)
            assert write[i].tolist() == [slots[i] if s in live else 50 for s in range(1, 4)]
            assert pos[i].tolist() == [pairs[i] + s - 1 if s in live else 0 for s in range(1, 4)]
        assert write.dtype == pos.dtype == np.int64 and write.shape == (b, 3)
