"""The next greedy round queued on the device (``runtime/round_ahead.py``), on the CPU.

On a CPU the registry's graphs are the eager stand-in, so a round queued ahead runs at once;
which verify and propose may take it, what drops it, and the tokens are the same code as on a
GPU (where it is on by default; these tests switch it on). What is shown: the device-built
inputs of the next propose and verify are the host layout's arrays for every accepted count,
on both backends; the accepted counts are the host's; an engine run with rounds queued ahead
gives target-only's tokens and the very drafts of a run without (same acceptance, position by
position), and takes most queued rounds; anything between two rounds drops the queued one; a
draft that declines, or a queue that fails, leaves the rounds as they were; a queued round whose
counts disagree with the host's is never taken and its requests' next verify fails loudly; the
chain step's glue around its propose stays about twenty device kernels; a propose the queued
round answers is checked by that match alone.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from core.params import SamplingParams
from runtime import round_ahead
from runtime.acceptance import accept_greedy_ids
from runtime.backends import make_ops
from runtime.batch_layout import Row, layout_rows
from runtime.config import RuntimeConfig
from runtime.decode_ahead import AheadGate
from runtime.device_thread import DeviceThread
from runtime.engine import GenRequest
from runtime.fused_propose import substep_places
from runtime.types import ProposeRequest
from tests.unit.test_engine_bundled import _engine, _prompts

SCRATCH, WIDTH, K, D = 9, 4, 3, 5


@pytest.fixture(scope="module", params=["torch", "paddle"])
def ops(request):
    return make_ops(RuntimeConfig(backend=request.param))


def _case(ops, a_rows):
    """A verify of len(a_rows) rows whose drafts match the target's argmax for a_i positions."""
    rng = np.random.default_rng(len(a_rows))
    best = rng.integers(1, 50, (len(a_rows), WIDTH)).astype(np.int64)
    tokens = np.zeros_like(best)
    tokens[:, 0] = 7
    for i, a in enumerate(a_rows):
        tokens[i, 1:K + 1] = best[i, :K]
        if a < K:
            tokens[i, 1 + a] = best[i, a] + 1                 # the first mismatch
    hidden = rng.standard_normal((len(a_rows), WIDTH, D)).astype(np.float32)
    return tokens, best, hidden


def _np(ops, x):
    return x if isinstance(x, np.ndarray) else ops.to_numpy(x)


def test_the_accepted_counts_are_the_hosts(ops):
    a_rows = [0, 1, 2, 3, 3, 0]
    tokens, best, _ = _case(ops, a_rows)
    got = _np(ops, round_ahead.accepted_counts(ops, ops.from_numpy(tokens), ops.from_numpy(best), K))
    host = [accept_greedy_ids(list(tokens[i, 1:K + 1]), best[i, :K + 1]).num_accepted for i in range(len(a_rows))]
    assert got.tolist() == host == a_rows


def _ints(ops, xs):
    return ops.from_numpy(np.asarray(xs, dtype=np.int64))


def test_the_next_propose_inputs_are_the_host_layouts(ops):
    """For every accepted count: the catch-up rows (committed tokens, hidden rows, positions from
    the pair count P, padding as ``layout_rows`` pads) and the substeps' places."""
    a_rows = [0, 1, 2, 3]
    tokens, best, hidden = _case(ops, a_rows)
    slots, pairs = [2, 0, 5, 3], [10, 0, 33, 7]
    a = round_ahead.accepted_counts(ops, ops.from_numpy(tokens), ops.from_numpy(best), K)
    got = round_ahead.catchup_inputs(ops, a, ops.from_numpy(best), ops.from_numpy(hidden), _ints(ops, slots),
                                     _ints(ops, pairs), K, WIDTH, SCRATCH)
    rows = [Row(s, p, best[i, : a_rows[i] + 1]) for i, (s, p) in enumerate(zip(slots, pairs))]
    lay = layout_rows(rows, WIDTH, SCRATCH, 1024)
    want_hidden = np.zeros_like(hidden)
    for i, n in enumerate(a_rows):
        want_hidden[i, : n + 1] = hidden[i, : n + 1]
    sub_w, sub_p = substep_places(slots, [p + n + 1 for p, n in zip(pairs, a_rows)], [K] * 4, K, SCRATCH)
    want = {"tokens": lay.tokens, "write_slots": lay.write_slots, "positions": lay.positions,
            "read_slots": lay.read_slots, "last_index": lay.last_index, "sub_write_slots": sub_w,
            "sub_positions": sub_p}
    for name, value in want.items():
        assert _np(ops, got[name]).tolist() == value.tolist(), name
    np.testing.assert_array_equal(_np(ops, got["prev_hidden"]), want_hidden)


def test_the_next_verify_inputs_are_the_host_layouts(ops):
    """Row i verifies [best_{a_i}, d'_1..d'_k] from n_i + a_i + 1, at k = 3 and k = 2 (padded)."""
    a_rows = [0, 3, 1]
    tokens, best, _ = _case(ops, a_rows)
    slots, lengths = [1, 4, 2], [20, 3, 100]
    a = round_ahead.accepted_counts(ops, ops.from_numpy(tokens), ops.from_numpy(best), K)
    drafts = np.array([[31, 32, 33], [41, 42, 43], [51, 52, 53]], np.int64)
    for k in (K, 2):
        toks, pos = round_ahead.next_verify(ops, a, ops.from_numpy(best), ops.from_numpy(drafts),
                                            _ints(ops, [n + 1 for n in lengths]), k, WIDTH)
        write, read = round_ahead.verify_places(slots, k, WIDTH, SCRATCH)
        rows = [Row(s, n + x + 1, np.concatenate([[best[i, x]], drafts[i, :k]]))
                for i, (s, n, x) in enumerate(zip(slots, lengths, a_rows))]
        lay = layout_rows(rows, WIDTH, SCRATCH, 1024)
        got = {"tokens": _np(ops, toks), "positions": _np(ops, pos), "write_slots": write, "read_slots": read}
        for name, value in got.items():
            assert value.tolist() == getattr(lay, name).tolist(), (k, name)


def test_the_chain_glue_is_a_score_of_kernels():
    """The chain step around its propose (counts, catch-up, next verify rows) is ~20 device
    kernels at any batch (its constants made once, not at each replay: every kernel of a
    captured graph is a launch, and a batch-1 round's device time is mostly launches); 38
    before session 30. Counted as Torch dispatches them on the CPU, views aside."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.kernels: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in {"slice", "view", "alias", "select", "scalar_tensor", "_unsafe_view", "expand"}:
                self.kernels.append(name)
            return func(*args, **(kwargs or {}))

    ops = make_ops(RuntimeConfig(backend="torch"))
    tokens, best, hidden = _case(ops, [0, 1, 2, 3, 3, 0, 1, 2])
    c = round_ahead.chain_consts(ops, K, WIDTH)
    t, b, h = torch.from_numpy(tokens), torch.from_numpy(best), torch.from_numpy(hidden)
    slots, ints = torch.arange(8), torch.full((8,), 40)
    with Count() as count:
        a = round_ahead.accepted_counts(ops, t, b, K)
        inputs = round_ahead.catchup_inputs(ops, a, b, h, slots, ints, K, WIDTH, SCRATCH, c)
        round_ahead.next_verify(ops, a, b, t[:, 1:], ints, K, WIDTH, c, inputs["last_index"])
    assert len(count.kernels) <= 20, count.kernels


# --- the engine -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("torch")
    eng = _engine("torch", max_k=3, round_ahead=True)      # the draft's chain kinds: on every device
    eng.capture_graphs()                 # CPU: the eager stand-in, so steps "replay"
    return eng


def _generate(engine, prompts, k, max_batch, ahead, max_tokens=24, stops=None):
    engine.target.round_ahead = ahead
    engine.target.rounds._gate = AheadGate()     # each run starts unpaused (a test before may have dropped many)
    stops = stops or {}
    reqs = [GenRequest(f"p{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                  stop_token_ids=(stops[i],) if i in stops else ()), k)
            for i, p in enumerate(prompts)]
    return [(r.tokens, r.stats.accepted, r.stats.pos_accepted) for r in engine.generate(reqs, max_batch=max_batch)]


@pytest.mark.parametrize("max_batch", [1, 3])
def test_rounds_queued_ahead_give_the_same_drafts_and_tokens(engine, max_batch):
    prompts = [p[:40] for p in _prompts(3)]
    target_only = [t for t, _, _ in _generate(engine, prompts, 0, max_batch, ahead=False)]
    plain = _generate(engine, prompts, 3, max_batch, ahead=False)
    st, taken = engine.target.round_stats, engine.draft.next_taken
    before = (st.launched, st.used, st.dropped)
    got = _generate(engine, prompts, 3, max_batch, ahead=True)
    assert got == plain                                       # the very drafts: same acceptance per position
    assert [t for t, _, _ in got] == target_only
    launched, used, dropped = st.launched - before[0], st.used - before[1], st.dropped - before[2]
    rounds = sum(len(t) for t in target_only) / 3.3 / max_batch
    assert used > 0.5 * rounds and launched == used + dropped and engine.draft.next_taken - taken == used
    assert engine.target.rounds.errors == 0


def test_anything_between_two_rounds_drops_the_queued_one(engine):
    """A target prefill (a request joining) between two rounds drops the queued round; the
    rounds after it queue again; the tokens stay target-only's. The first request ends at a stop
    token (its end unforeseen: a request's end by length queues nothing, the next test)."""
    prompts = [p[:40] for p in _prompts(4)]
    ref = [t for t, _, _ in _generate(engine, prompts, 0, 3, ahead=False)]
    stop = ref[0][10]
    end = ref[0].index(stop) + 1
    st = engine.target.round_stats
    dropped = st.dropped
    got = _generate(engine, prompts, 3, 3, ahead=True, stops={0: stop})   # the 4th joins when the first ends
    assert [t for t, _, _ in got] == [ref[0][:end]] + ref[1:] and st.dropped > dropped
    assert engine.target.rounds.pending is None or engine.target.rounds.pending.lengths is not None


@pytest.mark.parametrize("max_batch", [1, 3])
def test_a_request_near_its_end_queues_nothing(engine, max_batch):
    """Within 2k + 1 tokens of its max_tokens a request may end this round or draft fewer the
    next: its round queues nothing ahead (a queued round the next verify does not take still
    runs on the device first). Requests that all end by length then drop no queued round."""
    prompts = [p[:40] for p in _prompts(4)]
    st = engine.target.round_stats
    before = (st.launched, st.used, st.dropped)
    _generate(engine, prompts, 3, max_batch, ahead=True)
    assert st.dropped == before[2] and st.used - before[1] == st.launched - before[0] > 0


def test_a_propose_the_queued_round_answers_is_checked_by_that_match(engine):
    """``DraftEngine.check_propose``: a batch the queued propose answers (the very requests, pair
    counts, k and catch-up tokens, the device's counts the host's) passes on that match alone;
    any other batch gets every item check (here: an id out of the vocabulary, a request never
    prefilled). The match is judged again once the host has settled the round."""
    chain, d = engine.draft.chain, engine.draft.cfg.hidden_size
    nxt = round_ahead.NextPropose(("q0",), (5,), 2, None, None, None, lambda: [1])
    saved, chain.pending = chain.pending, nxt
    try:
        good = [ProposeRequest("q0", 5, np.array([7, 8]), np.zeros((2, d), np.float32), 2, on_device=True)]
        assert not nxt.matches(good)                           # not settled yet
        nxt.expected = ((7, 8),)                               # the host accepted: 1 draft + bonus
        assert nxt.matches(good) and chain.answers(good)
        assert engine.draft.check_propose([(0, good[0])]) == ([(0, good[0])], {})
        bad = ProposeRequest("q0", 5, np.array([7, 10**6]), np.zeros((2, d), np.float32), 2, on_device=True)
        ok, refused = engine.draft.check_propose([(0, bad)])
        assert not ok and "unknown here" in str(refused[0])
    finally:
        chain.pending = saved


def test_a_round_whose_counts_are_not_the_hosts_fails_loudly(monkeypatch):
    """The device's counts are the host's by construction. Were they not (a bug), the round queued
    on them wrote its verify's KV from the wrong length, possibly over committed rows: the draft
    does not take its drafts, and the next verify of those requests raises rather than decode on
    (never a silently wrong token). A fresh engine: this one is left with requests in its caches."""
    eng = _engine("torch", max_k=3, round_ahead=True)
    eng.capture_graphs()
    prompts = [p[:40] for p in _prompts(2)]
    real = round_ahead.accepted_counts
    # Counts in range (0..k), but never the host's.
    monkeypatch.setattr(round_ahead, "accepted_counts", lambda ops, t, b, k: (real(ops, t, b, k) + 1) % (k + 1))
    with pytest.raises(RuntimeError, match="accepted counts"):
        _generate(eng, prompts, 3, 2, ahead=True)
    assert eng.draft.next_taken == 0 and eng.target.round_stats.used == 0


def test_try_run_runs_only_on_an_idle_device_thread():
    dev = DeviceThread("try-run", lambda: None)
    try:
        assert dev.try_run(lambda: 5) == 5                     # idle: runs here, now
        started, release = threading.Event(), threading.Event()
        wait = dev.submit(lambda: (started.set(), release.wait(10)))
        assert started.wait(10)
        assert dev.try_run(lambda: 6) is None                  # busy: neither runs nor waits
        release.set()
        wait()
        assert dev.try_run(lambda: 7) == 7
    finally:
        dev.shutdown()


def test_a_draft_that_declines_queues_nothing(engine):
    """The draft's owner declines (its device thread busy, its weights not serving): no round is
    queued, and the rounds run as without."""
    prompts = [p[:40] for p in _prompts(2)]
    plain = _generate(engine, prompts, 3, 2, ahead=False)
    launched = engine.target.round_stats.launched
    guard, engine.draft.chain.guard = engine.draft.chain.guard, lambda fn: None
    try:
        assert _generate(engine, prompts, 3, 2, ahead=True) == plain
    finally:
        engine.draft.chain.guard = guard
    assert engine.target.round_stats.launched == launched


def test_a_queue_that_fails_leaves_the_round_alone(engine):
    """Queuing the next round raises (a draft engine's bug, say): counted, and the rounds go on
    without queuing, with target-only's tokens."""
    prompts = [p[:40] for p in _prompts(2)]
    plain = _generate(engine, prompts, 3, 2, ahead=False)
    errors, launched = engine.target.rounds.errors, engine.target.round_stats.launched

    def broken(*_a, **_k):
        raise RuntimeError("queue_next failed")
    real, engine.draft.queue_next = engine.draft.queue_next, broken
    try:
        assert _generate(engine, prompts, 3, 2, ahead=True) == plain
    finally:
        engine.draft.queue_next = real
    assert engine.target.rounds.errors > errors and engine.target.round_stats.launched == launched


def test_where_rounds_are_queued_ahead():
    """``graphs.round_ahead``: unset = CUDA only, true = every device, false = off; a target's
    colocated draft captures the chain kinds only on the target's own device with its drafts
    left there (``draft_service.worker.chains_rounds``)."""
    import dataclasses

    from draft_service.worker import chains_rounds
    from runtime.config import GraphConfig
    from tests.integration.test_round_loop import _cfg

    assert GraphConfig().round_ahead_on("cuda:0") and not GraphConfig().round_ahead_on("cpu")
    assert GraphConfig(round_ahead=True).round_ahead_on("cpu")
    assert not GraphConfig(round_ahead=False).round_ahead_on("cuda:0")
    base = _cfg("target")
    on_gpu = dataclasses.replace(base, colocated_draft=True, runtime=dataclasses.replace(base.runtime, device="cuda:0"))
    assert chains_rounds(on_gpu)
    assert not chains_rounds(dataclasses.replace(on_gpu, draft_device="cuda:1"))       # another device
    assert not chains_rounds(dataclasses.replace(on_gpu, colocated_device_drafts=False))
    assert not chains_rounds(dataclasses.replace(on_gpu, graphs=GraphConfig(round_ahead=False)))
    assert not chains_rounds(dataclasses.replace(on_gpu, runtime=base.runtime))          # CPU, unset
    assert chains_rounds(dataclasses.replace(on_gpu, runtime=base.runtime, graphs=GraphConfig(round_ahead=True)))
